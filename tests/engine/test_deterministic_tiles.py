"""`deterministic` numerics with the compiled tiles (dsv41.engine.tiles.CompiledTiles): the engine's
determinism guarantees (alone = batched = chunked = preempted = prefix-cached = speculatively verified =
handed off, bit for bit) hold when the token-wise regions run as graphs compiled at one tile shape.

The engine scenarios of the eager mode's tests are collected here a second time (imported below) with every
deterministic engine that `tests.engine.helpers.make` builds compiling its tiles. The eager tests that compare
the engine with the plain model's own forward do not apply: the plain forward runs eager ops, which round
differently from the tiles (that comparison is the eager mode's, kept in its own tests)."""

import pytest
import torch

from dsv41.config import tiny
from dsv41.engine import SamplingParams
from dsv41.engine import compiled as compiled_module
from dsv41.engine import tiles as tiles_module
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops import attn_cpu, linear_cpu
from tests.engine.helpers import make, prompts

# the scenarios, collected in this module too (pytest runs them here under the fixture below)
from tests.engine.test_batch_invariance import (  # noqa: F401
    _run,
    test_logprobs_alone_equal_logprobs_in_a_batch,
)
from tests.engine.test_determinism import (  # noqa: F401
    test_preemption_and_prefix_hits_repeat_the_first_run,
    tied_model,
)
from tests.engine.test_handoff import (  # noqa: F401
    test_disaggregated_equals_colocated,
    test_seeded_sampling_and_logprobs_match,
)
from tests.engine.test_speculative import (  # noqa: F401
    model,
    plain_greedy,
    test_batched_verify_gives_the_bits_of_per_request_verify,
    test_greedy_speculative_equals_plain_decoding,
    test_mixed_acceptance_in_one_batch_and_late_arrivals,
    test_rollback_leaves_every_cache_as_plain_decoding_does,
)

pytestmark = pytest.mark.slow  # each model shape compiles its tiles once (~30 s cold, seconds warm)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def compiled_tiles():
    """Every deterministic engine of this module compiles its tiles (before module-scoped fixtures run)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSV41_TEST_TILES", "1")
        yield


def _logprobs(engine, batch, params) -> list[tuple[list[int], list[float]]]:
    """Each request's (tokens, log-probabilities of its sampled tokens)."""
    return _run(engine, batch, [params] * len(batch))


def test_the_tiles_serve_every_forward_and_change_the_bits(monkeypatch):
    net = init_random_weights(Transformer(tiny()), seed=5).eval()
    engine = make(net)
    assert engine.runner.tiles is not None, "the tiles were not built on this machine"
    calls: list[tuple[str, int]] = []
    run = tiles_module._TiledRegions._run

    def counting(self, name, module, tokens, extra=()):
        calls.append((name, tokens[0][0].size(tokens[0][1])))
        return run(self, name, module, tokens, extra)

    monkeypatch.setattr(tiles_module._TiledRegions, "_run", counting)
    joined = tiles_module._TiledRegions._run_joined

    def counting_joined(self, name, module, tokens, extra=(), batch_first=0):
        calls.append((name if isinstance(name, str) else name[0], tokens[0][0].size(tokens[0][1])))
        return joined(self, name, module, tokens, extra, batch_first)

    monkeypatch.setattr(tiles_module._TiledRegions, "_run_joined", counting_joined)
    attention = tiles_module._TiledAttention.window_attention
    monkeypatch.setattr(
        tiles_module._TiledAttention,
        "window_attention",
        lambda self, q, *a: calls.append(("window_attention", q.size(0))) or attention(self, q, *a),
    )
    in_place = attn_cpu.decode_ring_attn_cpu  # the C++ kernel over the state pool, where it is built
    monkeypatch.setattr(
        attn_cpu,
        "decode_ring_attn_cpu",
        lambda q, *a: calls.append(("window_attention", q.size(0))) or in_place(q, *a),
    )
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    batch = prompts([37, 5])
    tiled = _logprobs(engine, batch, params)
    token_counts = {n for name, n in calls if name == "pre_attention"}
    assert max(token_counts) >= 16, token_counts  # prefill chunks went through the tiles
    # and the decode steps of the two requests, each block as two graphs around its sequence mixing where the
    # build's check passed them (every GEMM by the few-row kernel: the same calls in either kind of graph), else
    # region by region
    tiles = engine.runner.tiles
    assert tiles.joined is not None or not linear_cpu.available(), tiles.joined_differs
    decode_steps = ("enter", "leave") if tiles.joined is not None else ("pre_attention",)
    assert 2 in {n for name, n in calls if name in decode_steps}, calls
    assert {name for name, _ in calls} >= {"pre_attention", "project", "output", *decode_steps}
    # the decode steps' attention too, every layer of them, at the tile shape (dense, DecodeBatch.dense) or by the
    # C++ kernel
    assert 2 in {n for name, n in calls if name == "window_attention"}, calls
    monkeypatch.delenv("DSV41_TEST_TILES")
    eager = _logprobs(make(net), batch, params)
    assert tiled != eager  # the tiles' own roundings: they, not the eager ops, computed the tokens


def test_alone_batched_and_any_chunking_give_the_same_tokens_and_logprobs():
    net = tied_model()
    batch = prompts([30, 5, 47, 12, 64, 9, 17], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    alone = [_logprobs(make(net), [p], params)[0] for p in batch]
    assert _logprobs(make(net, max_num_seqs=8), batch, params) == alone
    for chunk in (7, 64):  # chunk boundaries elsewhere (tiles cut elsewhere too), and a one-shot prefill
        assert _logprobs(make(net, max_num_seqs=8, prefill_chunk_size=chunk), batch, params) == alone, chunk


def test_prompt_logprobs_survive_preemption_mid_prefill():
    net = init_random_weights(Transformer(tiny()), seed=2).eval()
    batch = prompts([60, 52, 44], seed=3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    roomy = [o.prompt_logprobs for o in make(net).generate(batch, params)]
    tight = make(net, kv_pool_tokens=96)
    assert [o.prompt_logprobs for o in tight.generate(batch, params)] == roomy
    assert tight.counters["preemptions_total"] > 0


def test_a_region_that_mixes_rows_is_refused(monkeypatch):
    """The build's check: a pre_attention region whose rows see each other (here through their mean) keeps
    the engine eager, with the guarantees of the eager mode."""
    net = init_random_weights(Transformer(tiny()), seed=7).eval()
    pre_attention = compiled_module.pre_attention

    def mixing(block, h, pre_mix):
        mixes, x = pre_attention(block, h, pre_mix)
        return mixes, x + 1e-2 * x.mean(dim=1, keepdim=True)

    monkeypatch.setattr(compiled_module, "pre_attention", mixing)
    engine = make(net, row_chunk=8)  # a tile size of its own: the model keeps one set of tiles per size
    assert engine.runner.tiles is None
    monkeypatch.setattr(compiled_module, "pre_attention", pre_attention)
    # the same shapes, the region as it is: built (a fresh model: the refused one keeps its verdict for this size)
    assert make(init_random_weights(Transformer(tiny()), seed=7).eval(), row_chunk=8).runner.tiles is not None


def test_one_row_graphs_that_differ_from_their_tile_are_not_used(monkeypatch):
    """A one-token call runs the one-row graphs only where each row alone gives the bits of its full tile: an
    `output` region that rounds differently at one row keeps the tiles but pads one-token calls, which then
    give the tile's bits. (With the decode steps' two-graph blocks switched off: where their one-row graphs
    serve, the one-row `output` is neither checked nor used.)"""
    net = init_random_weights(Transformer(tiny()), seed=7).eval()
    output = compiled_module.output

    def no_two_graphs(self, rand):
        self.joined = self.joined_differs = None

    monkeypatch.setattr(tiles_module.CompiledTiles, "_check_joined", no_two_graphs)

    def other_at_one_row(attn, o, freqs):
        y = output(attn, o, freqs)
        return y * (1 + 2**-6) if y.size(1) == 1 else y

    monkeypatch.setattr(compiled_module, "output", other_at_one_row)
    engine = make(net, row_chunk=8)
    tiles = engine.runner.tiles
    assert tiles is not None and not tiles.one_row and tiles.one_row_differs.startswith("output"), tiles.one_row_differs
    regions, attn = tiles.regions(), net.layers[2].attn
    g = torch.Generator().manual_seed(1)
    o = torch.randn(1, 8, attn.n_heads, attn.head_dim, generator=g).bfloat16()
    freqs = attn.rope.at(torch.arange(8), o.device)
    with engine.runner.numerics(), torch.inference_mode():
        whole = regions.output(attn, o, freqs)
        assert torch.equal(regions.output(attn, o[:, 3:4], freqs[3:4]), whole[:, 3:4])


def test_a_decode_steps_two_graphs_give_the_regions_bits_or_are_refused(monkeypatch):
    """A decode step's blocks run as two graphs (`enter`, `leave`) at the tile and at one row only where the
    build's check finds them giving every row the bits of the regions one after the other. A `leave` that rounds
    otherwise in a tile is refused: the engine then steps region by region, and gives alone (one-row graphs)
    and batched (a tile) the log-probs an engine with the two graphs gave, bit for bit."""
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    batch = prompts([23, 9, 40], seed=4)

    def run() -> tuple:
        engine = make(init_random_weights(Transformer(tiny()), seed=6).eval(), row_chunk=8)
        alone = [_logprobs(engine, [p], params)[0] for p in batch]
        return engine.runner.tiles, alone, _logprobs(engine, batch, params)

    tiles, *joined = run()
    if linear_cpu.available():  # every GEMM by the few-row kernel: the same calls in either kind of graph
        assert tiles.joined is not None and set(tiles.joined) == {1, 8}, tiles.joined_differs
    leave = tiles_module.leave

    def other_in_a_tile(block, o, *args):
        h, ffn_pre = leave(block, o, *args)
        return (h * (1 + 2**-6) if o.size(1) > 1 else h), ffn_pre

    monkeypatch.setattr(tiles_module, "leave", other_in_a_tile)
    tiles, *by_regions = run()
    assert tiles.joined is None and tiles.joined_differs.startswith("the tile's two graphs"), tiles.joined_differs
    assert by_regions == joined


@pytest.mark.parametrize("path", ["compiled region", "C++ kernel", "C++ kernel over the state pool"])
def test_a_decode_attention_that_mixes_rows_is_refused(monkeypatch, path):
    """The build's check covers the decode attention too, on every path it runs by (the tile graph, or the C++
    kernel where it is built, on gathered rings and over the state pool): one whose rows see each other keeps the
    engine eager."""
    net = init_random_weights(Transformer(tiny()), seed=7).eval()
    if path.startswith("C++ kernel"):
        if not attn_cpu.available():
            pytest.skip("the C++ decode attention serves only where the CPU has bf16 dot products")
        owner, name = attn_cpu, "decode_ring_attn_cpu" if path.endswith("pool") else "decode_attn_cpu"
    else:
        monkeypatch.setattr(attn_cpu, "available", lambda *a, **k: False)
        owner, name = compiled_module, "window_attention"
    attend = getattr(owner, name)

    def mixing(q, *args):
        out = attend(q, *args)
        o = out if name == "decode_ring_attn_cpu" else out[0]
        o = o + 1e-2 * o.mean(dim=0, keepdim=True)
        return o if name == "decode_ring_attn_cpu" else (o, *out[1:])

    monkeypatch.setattr(owner, name, mixing)
    assert make(net, row_chunk=8).runner.tiles is None


def test_a_full_tile_and_a_padded_one_give_a_row_the_same_bits():
    """Below the engine: one row's output is the same run alone (a padded tile), in a full tile, and split
    across two tiles' boundary."""
    net = init_random_weights(Transformer(tiny()), seed=4).eval()
    engine = make(net)
    tiles = engine.runner.tiles
    assert tiles is not None
    regions, block, cfg = tiles.regions(), net.layers[3], net.cfg
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 40, cfg.hc_mult, cfg.dim, generator=g).bfloat16()
    mix = torch.rand(1, 40, cfg.hc_mult, generator=g)
    with engine.runner.numerics(), torch.inference_mode():
        whole = regions.pre_attention(block, h, mix)[1]
        for a, b in ((0, 1), (13, 14), (5, 21), (17, 40)):
            assert torch.equal(regions.pre_attention(block, h[:, a:b], mix[:, a:b])[1], whole[:, a:b]), (a, b)
