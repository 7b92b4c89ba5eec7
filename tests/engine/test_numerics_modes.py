"""The engine's three numerics modes (EngineConfig.numerics, docs/numerics.md): one switch, `fast` by default,
`--deterministic` as vLLM/SGLang users spell it, and `reference` giving the plain loop's canonical bits."""

import pytest
import torch

from dsv41.cli import build_parser
from dsv41.config import tiny
from dsv41.engine import EngineConfig, SamplingParams
from dsv41.engine.runner import ModelRunner
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from tests.engine.helpers import make, prompts


@pytest.fixture(scope="module")
def model():
    return init_random_weights(Transformer(tiny()), seed=3).eval()


def test_fast_is_the_default_and_a_bad_mode_is_refused():
    assert EngineConfig().numerics == "fast"
    with pytest.raises(ValueError, match="numerics must be one of"):
        EngineConfig(numerics="exact").validate()
    with pytest.raises(ValueError, match="row_chunk must be > 0"):
        EngineConfig(numerics="deterministic", row_chunk=0).validate()
    with pytest.raises(ValueError, match="numerics must be"):
        ModelRunner(init_random_weights(Transformer(tiny()), seed=0), "exact")


@pytest.mark.parametrize(
    "argv, mode",
    [
        ([], None),
        (["--deterministic"], "deterministic"),
        (["--numerics", "reference"], "reference"),
        (["--numerics", "fast", "--deterministic"], "deterministic"),
    ],
)
def test_the_command_line_switch(argv, mode):
    for command in ("serve", "chat", "generate"):
        args = build_parser().parse_args([command, *argv])
        assert args.engine_numerics == mode, command


def test_each_mode_sets_the_model_only_inside_the_runner(model):
    """The runner enters its mode around a forward and leaves the model's own settings as they were."""
    model.set_batch_invariant(7)
    seen = {}
    real = model.logits

    def spy(x):
        seen["row_chunk"], seen["reference"] = model.layers[0].attn.wq_a.row_chunk, model.norm.reference_numerics
        return real(x)

    model.logits = spy
    try:
        for mode, expected in [("fast", (0, False)), ("deterministic", (16, False)), ("reference", (0, True))]:
            make(model, numerics=mode).generate(prompts([9]), SamplingParams(temperature=0, max_tokens=2))
            assert (seen["row_chunk"], seen["reference"]) == expected, mode
    finally:
        del model.logits
    assert model.layers[0].attn.wq_a.row_chunk == 7 and not model.norm.reference_numerics
    model.set_batch_invariant(0)


def test_reference_mode_gives_the_plain_loops_canonical_bits(model):
    """Prefill and decode through the paged engine under `reference` equal the plain loop under reference
    numerics bit for bit, also batched with other requests (a mode for parity checks). The prompt is
    prefilled in one chunk, as the plain loop does: the reference's top-k keeps torch.topk's tie order,
    and ties among FP4-rounded index scores can then fall differently when the candidates come in chunks."""
    (tokens,) = prompts([150], seed=5)
    steps = 8
    with torch.inference_mode(), model.numerics(0, reference=True):
        cache = model.new_cache(1, 192)
        logits = [model(torch.tensor([tokens]), 0, cache)[0, -1]]
        out = [int(logits[-1].argmax())]
        for i in range(steps - 1):
            logits.append(model(torch.tensor([[out[-1]]]), len(tokens) + i, cache)[0, -1])
            out.append(int(logits[-1].argmax()))
    engine = make(model, numerics="reference", prefill_mode="full", prefill_chunk_size=256, max_num_batched_tokens=512)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    others = prompts([12, 50], seed=6)
    for i, p in enumerate([tokens, *others]):
        engine.add_request(str(i), p, params, capture_logits=i == 0)
    seq = engine.requests["0"]
    while engine.has_unfinished():
        engine.step()
    got = seq.logits
    assert len(got) == steps
    for step, (a, b) in enumerate(zip(got, logits)):
        assert torch.equal(a, b.float()), f"step {step}: max diff {(a - b).abs().max()}"


def test_fast_drafts_read_the_head_the_fast_forwards_read(model):
    """A `fast` runner whose forwards run the few-row kernel (`rows_kernel`) hands the drafter that kernel over the
    bf16 copy of the head (what its compiled forwards' logits read); the other modes, or no kernel, keep
    `Transformer.logits`."""
    from dsv41.ops import linear_cpu

    if not linear_cpu.available():
        pytest.skip("the few-row kernel is not built here")
    model.keep_bf16_head()
    x = torch.randn(2, 5, model.cfg.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    runner = ModelRunner(model, numerics="fast")
    assert runner._fast_logits() is None  # the engine sets rows_kernel when its forwards run compiled
    runner.rows_kernel = True
    head = runner._fast_logits()
    got = head(x)
    assert got.shape == (2, 5, model.cfg.vocab_size) and got.dtype == torch.float32
    assert torch.equal(got, linear_cpu.rows_linear(x, model.head_bf16()))
    torch.testing.assert_close(got, model.logits(x), rtol=2e-2, atol=2e-2)  # a bf16 head against the fp32 one
    for mode in ("deterministic", "reference"):
        other = ModelRunner(model, numerics=mode)
        other.rows_kernel = True
        assert other._fast_logits() is None
