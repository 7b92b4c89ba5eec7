"""Compiled decode regions (dsv41.engine.compiled): under `fast` numerics a decode batch runs its token-wise
work as compiled graphs, padded to a bucket, and is judged as `fast` is: against the reference numerics on
the shipped trained checkpoint (dsv41.eval.agreement)."""

import os

import numpy as np
import pytest
import torch

import dsv41.engine.batched as batched
import dsv41.engine.compiled as compiled
from dsv41.checkpoints import checkpoint_path
from dsv41.engine import EngineConfig
from dsv41.engine.build import build_engine
from dsv41.engine.paged_attention import PagedAttention
from dsv41.eval.agreement import decode_agreement, held_out_windows
from dsv41.model.block import Block
from dsv41.ops import attn_cpu, linear_cpu, moe_cpu

VAL = os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare-chat-val", "val.bin")


@pytest.mark.slow
def test_compiled_regions_serve_decode_batches_and_agree_with_the_reference(monkeypatch):
    # the decode steps' attention by the C++ kernel (dsv41.ops.attn_cpu) over the state pool, where it is built
    attended = []
    real_attend = attn_cpu.decode_ring_attn_cpu
    monkeypatch.setattr(
        attn_cpu, "decode_ring_attn_cpu", lambda q, *a: attended.append(q.size(0)) or real_attend(q, *a)
    )
    engine = build_engine(
        checkpoint_path(),
        EngineConfig(numerics="fast", compile_decode="now", max_num_seqs=4, kv_pool_tokens=8192, fused_kernels="off"),
    )
    assert engine.runner.compiled.ready == {1, 2, 4}
    attended.clear()  # (the build warmed it at each bucket)
    used, calls, kinds = [], {}, set()
    real = compiled._Regions.run_block

    def run_block(self, block, *a):  # a decode step's block as its two graphs (`enter`, `leave`)
        out = real(self, block, *a)
        if out is not None:
            used.append(self.rows)
            kinds.add(compiled.enter_kind(block.attn))
        return out

    monkeypatch.setattr(compiled._Regions, "run_block", run_block)
    names = ("engram", "window_attention", "compress_group")
    for name in (*names, "final_logits"):
        fn = getattr(compiled._Regions, name)
        monkeypatch.setattr(
            compiled._Regions, name, lambda self, *a, fn=fn, name=name: calls.update({name: 1}) or fn(self, *a)
        )
    tokens = np.fromfile(VAL, dtype=np.uint16)
    prompts = held_out_windows(tokens[2000:], [40, 72, 104], stride=150)  # 3 decode tokens a step: bucket 4
    # the C++ kernels inside the graphs, seen by the profiler (a Python counter traced into a graph would be a side
    # effect the graph replays, and its guards would recompile the graph at every call)
    with torch.profiler.profile(record_shapes=True) as prof:
        result = decode_agreement(engine, engine.model, prompts, new_tokens=16, passes=1)
    rows_of = lambda op: {e.input_shapes[0][0] for e in prof.events() if e.name == op}  # noqa: E731
    traced, rows_traced = rows_of("dsv41::gathered_experts_cpu"), rows_of("dsv41::rows_linear_cpu")
    assert result.top1 >= 0.99 and result.kl_mean <= 2e-3, result.as_dict()
    # the steps decoding all three ran compiled, padded to 4 rows (and those decoding fewer, at their buckets)
    assert used.count(4) >= 10 * engine.model_config.n_layers and set(used) <= {1, 2, 4}, used
    # Engram, the window attention (where the C++ kernel does not serve) and the ratio-2 compressors ran compiled
    # too; the indexer's query and the ratio-1 compressors inside the blocks' `enter` graphs
    assert set(calls) == set(names) - ({"window_attention"} if attn_cpu.available() else set()), calls
    assert any(index for index, _ in kinds) and any(latent for _, latent in kinds), kinds
    assert engine.runner.compiled.attn_kernel == attn_cpu.available()
    if attn_cpu.available():  # the attention of every step by the kernel, at the step's own batch (no padding)
        assert 3 in attended and set(attended) <= {1, 2, 3}, attended
    else:
        assert not attended
    # the blocks' graphs served every step as built: no recompilation (a guard failing) after the build, so each
    # is called without Dynamo's guards (`compiled._direct`)
    calls_of = engine.runner.compiled._calls
    for bucket in (1, 2, 4):
        for name in ("leave", *(("enter", *kind) for kind in kinds)):
            assert not hasattr(calls_of[bucket][name], "_torchdynamo_orig_callable"), (bucket, name)
    if moe_cpu.available():  # in the graphs, at the bucket's rows (every step here decodes three sequences)
        assert traced == {4}, traced
    else:
        assert not traced
    # the few-row kernel likewise, where it serves; and the logits of a step of 3 sequences (3 rows, eager)
    if linear_cpu.available():
        assert {3, 4} <= rows_traced, rows_traced
    else:
        assert not rows_traced
    # one sequence alone: bucket 1, whose logits come from the compiled head over its bf16 copy
    with torch.profiler.profile(record_shapes=True) as prof:
        alone = decode_agreement(engine, engine.model, prompts[:1], new_tokens=24, passes=1)
    assert alone.top1 >= 0.99 and alone.kl_mean <= 2e-3, alone.as_dict()
    if moe_cpu.available():
        assert rows_of("dsv41::gathered_experts_cpu") == {1}
    assert "final_logits" in calls and 1 in used


def _compiled_agreement():
    """Three held-out prompts (3 decode tokens a step: bucket 4) decoded by a compiled `fast` engine over the
    shipped checkpoint, against the reference (dsv41.eval.agreement)."""
    engine = build_engine(
        checkpoint_path(),
        EngineConfig(numerics="fast", compile_decode="now", max_num_seqs=4, kv_pool_tokens=8192, fused_kernels="off"),
    )
    assert engine.runner.compiled.ready == {1, 2, 4}
    tokens = np.fromfile(VAL, dtype=np.uint16)
    prompts = held_out_windows(tokens[2000:], [40, 72, 104], stride=150)
    return decode_agreement(engine, engine.model, prompts, new_tokens=16, passes=1)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["compiled reference", "C++ kernel"])
def test_a_broken_compiled_moe_fails_the_agreement_check(monkeypatch, path):
    """The compiled MoE without its shared expert (the last gathered pick dropped) must fail the same check,
    on either path the decode step runs its experts by (dsv41.ops.moe_cpu where it is built)."""
    import dsv41.ops.moe as moe_ops

    if path == "C++ kernel":
        if not moe_cpu.available():
            pytest.skip("the C++ expert kernel serves only where the CPU has bf16 dot products")
        real = moe_cpu.gathered_experts_cpu  # the shared expert's pick has weight 1: dropped
        monkeypatch.setattr(moe_cpu, "gathered_experts_cpu", lambda x, w, *rest: real(x, w * (w < 1), *rest))
    else:
        monkeypatch.setattr(moe_cpu, "available", lambda: False)
        real = moe_ops.gathered_experts
        monkeypatch.setattr(moe_ops, "gathered_experts", lambda x, w, i, *rest: real(x, w[:, :-1], i[:, :-1], *rest))
    result = _compiled_agreement()
    assert not (result.top1 >= 0.99 and result.kl_mean <= 2e-3), result.as_dict()


@pytest.mark.slow
def test_one_thread_graphs_agree_with_the_reference():
    """The graphs as the engine builds them (their generated kernels on one thread up to ONE_THREAD_ROWS rows),
    with nothing traced into them but the engine's own code: the same check."""
    assert compiled._options(4)["cpp.threads"] == 1 and "cpp.threads" not in compiled._options(256)
    result = _compiled_agreement()
    assert result.top1 >= 0.99 and result.kl_mean <= 2e-3, result.as_dict()


@pytest.mark.slow
def test_a_broken_decode_attention_kernel_fails_the_agreement_check(monkeypatch):
    """The C++ decode attention reading none of the selected compressed rows (only the window) must fail the
    same check the compiled regions pass."""
    if not attn_cpu.available():
        pytest.skip("the C++ decode attention serves only where the CPU has bf16 dot products")
    real, in_place = attn_cpu.decode_attn_cpu, attn_cpu.decode_ring_attn_cpu

    def window_only(q, codes, scale, kv, valid, selected, *rest):
        return real(q, codes, scale, kv, valid * (torch.arange(valid.size(1)) <= codes.size(1)), selected, *rest)

    def window_only_in_place(q, codes, scale, slots, layer, rows, kv, valid, *rest):
        keep = torch.arange(valid.size(1)) <= codes.size(2)
        return in_place(q, codes, scale, slots, layer, rows, kv, valid * keep, *rest)

    monkeypatch.setattr(attn_cpu, "decode_attn_cpu", window_only)
    monkeypatch.setattr(attn_cpu, "decode_ring_attn_cpu", window_only_in_place)
    result = _compiled_agreement()
    assert not (result.top1 >= 0.99 and result.kl_mean <= 2e-3), result.as_dict()


def test_padding_rows_to_a_bucket_and_cutting_them_back():
    t = torch.arange(6.0).view(1, 3, 2)
    padded = compiled._pad_rows(t, 4)
    assert padded.shape == (1, 4, 2) and torch.equal(padded[:, :3], t) and not padded[:, 3].any()
    assert compiled._cut((padded, (padded, padded)), 3)[1][0].shape == (1, 3, 2)
    regions = compiled._Regions({}, 3, 4)
    freqs = torch.polar(torch.ones(3, 5), torch.rand(3, 5))
    assert torch.equal(regions._freqs(freqs)[3], torch.ones(5, dtype=torch.complex64))  # the identity rotation


def test_the_window_attention_region_reads_and_writes_the_rings_format():
    """`window_attention` (run eager here: the compiler keeps its math) decodes the FP8 ring from its UE8M0
    bits, attends like ops.dense_decode_attn over ring + new row + selected rows, and hands back the new
    row's codes and scale bits exactly as fp8_quant and a float8_e8m0fnu cast would store them."""
    from dsv41 import ops
    from dsv41.ops.quant import fp8_dequant, fp8_quant

    g = torch.Generator().manual_seed(0)
    b, w, d, h, k = 3, 8, 128, 2, 4
    ring_codes, ring_scale = fp8_quant(torch.randn(b, w, d, generator=g).bfloat16() * 4)
    bits = ring_scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    kv = torch.randn(b, 1, d, generator=g).bfloat16() * 1e-3  # small: a scale far from the ring's
    q = torch.randn(b, 1, h, d, generator=g).bfloat16()
    selected = torch.randn(b, k, d, generator=g).bfloat16()
    valid = torch.rand(b, w + 1 + k, generator=g) > 0.3
    sink = torch.randn(h, generator=g)
    o, codes, new_bits = batched.window_attention(q, ring_codes, bits, kv, valid, selected, sink, d**-0.5)

    ring = fp8_dequant(ring_codes, ring_scale).bfloat16()
    want = ops.dense_decode_attn(q, torch.cat([ring, kv, selected], dim=1), valid, sink, d**-0.5)
    want_codes, want_scale = fp8_quant(kv[:, 0])
    assert torch.equal(o, want)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(new_bits, want_scale.to(torch.float8_e8m0fnu).view(torch.uint8))
    o2, _, _ = batched.window_attention(q[:, :, :1], ring_codes, bits, kv, valid[:, : w + 1], None, sink[:1], 0.1)
    assert o2.shape == (b, 1, 1, d)


def test_a_forward_larger_than_the_built_buckets_runs_in_pieces():
    """A decode or verify forward with more tokens than the largest built bucket (a speculative verify of 8
    sequences x 6 tokens) runs each token-wise region as pieces of the built buckets, the last padded, and
    joins them: with the regions' own functions eager and batch-invariant GEMMs, every output equals the
    whole call's bit for bit. The decode attention's regions serve only a step its bucket holds."""
    from dsv41.config import tiny
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    model = init_random_weights(Transformer(tiny()), seed=1, std=0.1).eval()  # its own: the regions stack experts
    decode = compiled.CompiledDecode(model, (1, 2, 4))  # torch.compile is lazy: nothing is traced here
    eager = decode._functions()
    decode._compiled = decode._calls = {b: eager for b in (1, 2, 4)}
    decode.ready = {1, 2}
    split = decode.regions(5)
    assert [(p.n, p.rows) for p in split.pieces] == [(2, 2), (2, 2), (1, 1)]
    decode.ready = {1, 2, 4}
    assert [(p.n, p.rows) for p in decode.regions(7).pieces] == [(4, 4), (3, 4)]
    assert isinstance(decode.regions(3), compiled._Regions) and decode.regions(3).rows == 4
    assert decode.attention_regions(4).rows == 4 and decode.attention_regions(5) is None
    regions = decode.regions(7)
    cfg, g = model.cfg, torch.Generator().manual_seed(0)
    block, attn = model.layers[2], model.layers[2].attn
    h = torch.randn(1, 7, cfg.hc_mult, cfg.dim, generator=g).bfloat16()
    mix = torch.rand(1, 7, cfg.hc_mult, generator=g).softmax(-1)
    post, comb = torch.rand(1, 7, cfg.hc_mult, generator=g), torch.rand(1, 7, cfg.hc_mult, cfg.hc_mult, generator=g)
    x = torch.randn(1, 7, cfg.dim, generator=g).bfloat16()
    o = torch.randn(1, 7, attn.n_heads, attn.head_dim, generator=g).bfloat16()
    freqs = attn.rope.at(torch.arange(7) + 30, "cpu")
    calls = {
        "pre_attention": (block, h, mix),
        "project": (attn, x, freqs),
        "output": (attn, o, freqs),
        "post_attention": (block, x, h, post, comb, mix),
    }
    with torch.inference_mode(), model.numerics(16):
        for name, args in calls.items():
            got, want = getattr(regions, name)(*args), eager[name](*args)
            assert all(torch.equal(a, b) for a, b in zip(compiled._flat(got), compiled._flat(want))), name


def test_the_regions_are_traced_under_the_runners_numerics(monkeypatch):
    """The graphs keep the settings the modules had when they were traced (their guards are dropped), so an
    engine builds its buckets inside its runner's numerics: where the GEMM probe chose fp32 GEMMs for small calls
    (a CPU without native bf16), the compiled layers read the fp32 copies as the eager ones do. Run with the
    regions' own functions eager (what the tracer sees), recording each Linear's setting."""
    import dsv41.engine.llm_engine as llm_engine
    from dsv41.config import tiny
    from dsv41.engine import LLMEngine
    from dsv41.model.init import init_random_weights
    from dsv41.model.layers import Linear
    from dsv41.model.transformer import Transformer
    from dsv41.tokenizer import ByteTokenizer

    monkeypatch.setattr(llm_engine, "fp32_rows", lambda shapes, device: 8)  # as the probe answers on such a CPU
    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: fn)  # the regions' functions, eager
    seen = []
    real = Linear.forward
    monkeypatch.setattr(Linear, "forward", lambda self, x: seen.append(self.fp32_rows) or real(self, x))
    model = init_random_weights(Transformer(tiny()), seed=1).eval()
    config = EngineConfig(numerics="fast", fast_gemm="auto", compile_decode="now", max_num_seqs=2, fused_kernels="now")
    engine = LLMEngine(model, ByteTokenizer(model.cfg.vocab_size), config)
    assert engine.runner.fp32_rows == 8 and engine.runner.compiled.ready == {1, 2}
    assert seen and set(seen) == {8}, set(seen)  # every traced layer under the fp32 choice
    assert {lin.fp32_rows for lin in model.modules() if isinstance(lin, Linear)} == {0}  # restored after


def test_the_engram_region_reads_the_tables_scales_from_their_bits():
    """`engram` (run eager here: the compiler keeps its math) reads the FP8 table's UE8M0 scales from their uint8
    bits (inductor takes no float8_e8m0fnu tensor) and gives Engram's own output, bit for bit."""
    from dsv41.config import tiny
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    cfg = tiny()
    model = init_random_weights(Transformer(cfg), seed=1, std=0.1).eval()
    block = next(b for b in model.layers if b.engram is not None)
    table = block.engram.embed
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # scales of many binades, so that a wrong power of two shows
        bits = torch.randint(110, 140, table.scale.shape, generator=g, dtype=torch.uint8)
        table.scale.copy_(bits.view(torch.float8_e8m0fnu))
    h = torch.randn(1, 3, cfg.hc_mult, cfg.dim, generator=g).bfloat16()
    ids = torch.randint(0, table.weight.size(0), (1, 3, cfg.n_hash_columns), generator=g)
    with torch.inference_mode():
        got = compiled.engram(block.engram, h, ids, table.scale.view(torch.uint8))
        want = block.engram(h, ids)
    assert got.dtype == torch.bfloat16 and got.shape == h.shape
    assert torch.equal(got, want) and not torch.equal(got, h)


def test_the_compressor_region_pools_the_group_its_token_completes():
    """`compress_group` (run eager here: the compiler keeps its math) gives each row's fp32 rows and the entry of
    its group with the token written into its slot: for a row whose token completes the group, what the eager
    decode path stores (the state updated, pooled, normed, RoPE'd at the group's first position, packed)."""
    from dsv41.config import tiny
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    model = init_random_weights(Transformer(tiny()), seed=3, std=0.1).eval()
    attn = next(b.attn for b in model.layers if b.attn.compressor is not None and b.attn.ratio > 1)
    comp, ratio, d = attn.compressor, attn.ratio, attn.head_dim
    g = torch.Generator().manual_seed(0)
    b = 4
    x = torch.randn(b, 1, model.cfg.dim, generator=g).bfloat16()
    group_kv = torch.randn(b, ratio, d, generator=g)
    group_score = torch.randn(b, ratio, d, generator=g)
    pos = torch.tensor([5, 8, 13, 2])  # slots 1, 0, 1, 0 of groups starting at 4, 8, 12, 2
    slot = pos % ratio
    freqs = attn.rope.at(pos // ratio * ratio, "cpu")
    with torch.inference_mode():
        kv, score, (packed, keys) = batched.compress_group(attn, x, group_kv, group_score, slot, freqs)
        want_kv, want_score = comp.wkv(x.float())[:, 0], comp.wgate(x.float())[:, 0]
        assert torch.equal(kv, want_kv) and torch.equal(score, want_score)
        state_kv, state_score = group_kv.clone(), group_score.clone()
        state_kv[torch.arange(b), slot] = want_kv
        state_score[torch.arange(b), slot] = want_score
        latent = comp.norm((state_kv * state_score.softmax(dim=1)).sum(dim=1).to(x.dtype))
        want_packed, want_keys = batched.pack_entries(attn, latent, freqs)
    for got, want in zip(packed + (keys or ()), want_packed + (want_keys or ())):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_batch_first_padding_of_the_attention_regions():
    regions = compiled._Regions({}, 3, 4)
    t = torch.ones(3, 2, dtype=torch.bool)
    assert regions._pad0(t).shape == (4, 2) and not regions._pad0(t)[3].any()
    freqs = torch.polar(torch.ones(3, 5), torch.rand(3, 5))
    assert torch.equal(regions._pad0(freqs, 1)[3], torch.ones(5, dtype=torch.complex64))
    assert regions._pad0(None) is None


@pytest.mark.parametrize("kernel", [False, True])
def test_the_one_token_head_reads_a_bf16_copy_and_keeps_fp32_logits(tiny_model, kernel):
    """`final_logits` (run eager here: the compiler keeps its math) gives the logits of the bf16 copy of the
    head, summed in fp32 and not rounded to bf16 (rounded, ~0.7% of the top-1 picks flip against the
    reference), by inductor's loop or by the few-row C++ kernel; the copy follows the head when its weight
    changes."""
    if kernel and not linear_cpu.available():
        pytest.skip("the few-row kernel serves only where the CPU has bf16 dot products")
    model = tiny_model
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 1, model.cfg.hc_mult, model.cfg.dim, generator=g).bfloat16()
    pre = torch.rand(1, 1, model.cfg.hc_mult, generator=g)
    assert model.head_bf16() is None
    model.keep_bf16_head()
    try:
        head = model.head_bf16()
        assert head.dtype == torch.bfloat16 and torch.equal(head, model.head.weight.bfloat16())
        got = compiled.final_logits(model.norm, h, pre, head, kernel)
        x = model.norm(Block.hc_pre(h, pre))[0]
        want = x.float() @ model.head.weight.bfloat16().float().t()
        assert got.dtype == torch.float32 and got.shape == (1, model.cfg.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got != got.bfloat16().float()).any()  # fp32 logits, not bf16 ones
        # within bf16 rounding of the weights of the fp32 head's logits
        torch.testing.assert_close(got, model.logits(x), rtol=0, atol=2e-2 * model.logits(x).abs().max().item())
        with torch.no_grad():
            model.head.weight.mul_(2)
        try:
            assert torch.equal(model.head_bf16(), model.head.weight.bfloat16())
        finally:
            with torch.no_grad():
                model.head.weight.div_(2)
    finally:
        model.__dict__.pop("_head_bf16", None)  # the shared model as it was


def _scaled(x, w):
    return (x * w.weight).sum(-1)


def test_a_warmed_graph_is_called_without_guards_only_when_nothing_else_needs_them():
    """`compiled._direct`: a function with one graph that only calls it runs Dynamo's output code as a plain
    function, with the graph's bits; one with a Python side effect traced in (replayed by the output code) or
    with two graphs (chosen between by the guards) keeps its guarded call."""
    w = torch.nn.Linear(8, 1)
    x = torch.randn(3, 8)
    pure = torch.compile(compiled._own_code(_scaled), backend="eager", dynamic=False)
    want = pure(x, w)
    direct = compiled._direct(pure)
    assert direct is not pure and not hasattr(direct, "_torchdynamo_orig_callable")
    assert torch.equal(direct(x, w), want)
    assert torch.equal(direct(x * 2, w), pure(x * 2, w))  # reads its inputs, no value kept from the trace

    seen = []

    def counted(x, w):
        seen.append(1)
        return (x * w.weight).sum(-1)

    side = torch.compile(counted, backend="eager", dynamic=False)
    side(x, w)
    assert compiled._direct(side) is side

    two = torch.compile(compiled._own_code(_scaled), backend="eager", dynamic=False)
    two(x, w), two(torch.randn(5, 8), w)  # a second shape: a second graph
    assert compiled._direct(two) is two


def test_a_decode_steps_blocks_as_two_graphs_give_the_regions_bits(monkeypatch):
    """A decode step's blocks run as `enter` and `leave` around the sequence mixing (`_Regions.run_block`), the
    indexer's query and a ratio-1 compressor's entries handed on from `enter` (`DecodeBatch.given`). With the
    regions' functions eager (what the tracer sees) that is the same computation as the region-by-region step:
    the same logits bit for bit, at a batch of one and of three (padded to 4)."""
    from dsv41.config import tiny
    from dsv41.engine import LLMEngine, SamplingParams
    from dsv41.eval.agreement import _run
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer
    from dsv41.tokenizer import ByteTokenizer

    monkeypatch.setattr(compiled.torch, "compile", lambda fn, **kw: fn)  # the regions' functions, eager
    model = init_random_weights(Transformer(tiny()), seed=1, std=0.1).eval()
    config = EngineConfig(numerics="fast", compile_decode="now", max_num_seqs=4, fused_kernels="off")
    engine = LLMEngine(model, ByteTokenizer(model.cfg.vocab_size), config)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (41, 23, 57)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    blocks, handed = [], []
    real_block, real_mix = compiled._Regions.run_block, PagedAttention.decode_mix
    monkeypatch.setattr(
        compiled._Regions,
        "run_block",
        lambda self, b, *a: (out := real_block(self, b, *a)) is not None and blocks.append(self.rows) or out,
    )
    monkeypatch.setattr(
        PagedAttention,
        "decode_mix",
        lambda self, attn, *a: handed.append(tuple(t is not None for t in a[-2:])) or real_mix(self, attn, *a),
    )
    for batch in ([prompts[0]], prompts):
        blocks.clear()
        fused = [torch.stack(s.logits) for s in _run(engine, batch, params)]
        assert set(blocks) == {len(batch) if len(batch) == 1 else 4}, set(blocks)
        with monkeypatch.context() as m:
            m.setattr(compiled._Regions, "run_block", lambda self, *a: None)  # region by region
            regions = [torch.stack(s.logits) for s in _run(engine, batch, params)]
        for a, b in zip(fused, regions):
            assert torch.equal(a, b)
    assert {(True, False), (True, True)} <= set(handed)  # index queries and latents handed on
