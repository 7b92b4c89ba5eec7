"""Prefill/decode disaggregation at the engine level (issue 32 item 2): a prompt prefilled by one engine,
exported, serialised, checked and imported into another engine decodes bit for bit what one engine gives
(greedy; seeded sampling too), across the window, partial compressor groups, the tiny preset's Engram
layers, different block sizes on the two sides, and DSpark speculation. A corrupted, truncated or
incomplete hand-off is refused with an error naming the block, and never imported."""

import dataclasses
import os

import pytest
import torch

from dsv41.engine import SamplingParams
from dsv41.engine.handoff import HandoffError, KVHandoff
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR
from tests.engine.helpers import make as _make
from tests.engine.helpers import prompts


def make(model, **overrides):
    """The shared test engine without the fused kernels (bit-identical to the eager ops; their build is
    tens of seconds per process on a busy machine, paid by the first test that needs them)."""
    return _make(model, **{"fused_kernels": "off", **overrides})


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def prefill(engine, prompt, rid="p") -> KVHandoff:
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1), export_handoff=True)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert out.finish_reason == "handoff" and out.token_ids == [], out
    assert engine.allocator.num_used() == 0 and not engine.running  # released at once
    return out.handoff


def decode(engine, prompt, data: bytes, params, rid="d"):
    engine.add_request(rid, prompt, params, handoff=KVHandoff.from_bytes(data, engine.identity()))
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final = o
    return final


def _lp(out):
    return [(x.token_id, x.logprob, [t[0] for t in x.top]) for x in out.new_logprobs] if out else []


@pytest.mark.parametrize(
    "prefill_mode,lengths", [("bounded", [5, 23]), pytest.param("full", [5, 23, 40], marks=pytest.mark.slow)]
)
def test_disaggregated_equals_colocated(model, prefill_mode, lengths):
    """Prompts of 5 (shorter than the 8-slot window, odd: a partial ratio-2 group), 23 (past the window,
    odd, two prefill chunks) and 40 tokens; the tiny preset has Engram at layers 1 and 4. Decode runs
    block_size 16 against prefill's 8 and prefix caching on: the hand-off is laid out by entry, not by
    block."""
    cfg = model.cfg
    assert cfg.window_size == 8 and 2 in cfg.compress_ratios and cfg.engram_layer_ids
    batch = prompts(lengths, seed=3)
    colocated = make(model, prefill_mode=prefill_mode)
    want = colocated.generate(batch, GREEDY)
    p_engine = make(model, prefill_mode=prefill_mode, enable_prefix_caching=True)
    d_engine = make(model, prefill_mode=prefill_mode, block_size=16, enable_prefix_caching=True)
    for k, (prompt, ref) in enumerate(zip(batch, want)):
        data = prefill(p_engine, prompt, f"p{k}").to_bytes()
        got = decode(d_engine, prompt, data, GREEDY, f"d{k}")
        assert got.token_ids == ref.token_ids
        assert got.finish_reason == ref.finish_reason == "length"
    # both sides count every prompt as admitted (usage.prompt_tokens does too); the decode side also counts
    # the tokens it imported, none of which it prefilled, and it sampled every generated token
    tokens = sum(len(p) for p in batch)
    assert d_engine.counters["handoffs_imported_total"] == len(batch)
    assert d_engine.counters["prompt_tokens_total"] == d_engine.counters["handoff_imported_tokens_total"] == tokens
    assert (
        p_engine.counters["prompt_tokens_total"] == tokens and p_engine.counters["handoff_imported_tokens_total"] == 0
    )
    assert d_engine.counters["generation_tokens_total"] == len(batch) * GREEDY.max_tokens
    assert p_engine.counters["generation_tokens_total"] == 0


def test_seeded_sampling_and_logprobs_match(model):
    """The first token is sampled on the decode side from the handed-off logits, so a seeded request draws
    the same tokens, with the same logprobs, as on one engine."""
    prompt = prompts([19], seed=5)[0]
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=6, ignore_eos=True, logprobs=3)
    one = make(model)
    one.add_request("a", prompt, dataclasses.replace(params))
    want = []
    while one.has_unfinished():
        want += one.step()
    data = prefill(make(model), prompt).to_bytes()
    d_engine = make(model)
    d_engine.add_request("b", prompt, dataclasses.replace(params), handoff=KVHandoff.from_bytes(data))
    got = []
    while d_engine.has_unfinished():
        got += d_engine.step()
    assert got[-1].token_ids == want[-1].token_ids
    assert [x for o in got for x in _lp(o)] == [x for o in want for x in _lp(o)]


def test_every_block_is_checksummed(model):
    """One flipped byte in any block, or in the header, is caught by its crc32 and named; truncation,
    trailing bytes, a missing block and a handoff for another prompt or another model are refused too."""
    prompt = prompts([21], seed=7)[0]
    engine = make(model)
    handoff = prefill(engine, prompt)
    data = handoff.to_bytes()
    header_end = data.index(b"}]}") + 3  # the header JSON ends with the block list
    offsets, at = {}, header_end + 4
    for name, t in handoff.tensors.items():
        offsets[name] = at
        at += t.numel() * t.element_size()
    assert at == len(data)
    for name in ("logits", "kv2.kv_codes", "kv6.key_scale", "window_codes", "group4.score"):
        bad = bytearray(data)
        bad[offsets[name] + 3] ^= 0x40
        with pytest.raises(HandoffError, match=f"block '{name}' checksum mismatch"):
            KVHandoff.from_bytes(bytes(bad))
    bad = bytearray(data)
    bad[20] ^= 0x01
    with pytest.raises(HandoffError, match="header"):
        KVHandoff.from_bytes(bytes(bad))
    with pytest.raises(HandoffError, match="truncated"):
        KVHandoff.from_bytes(data[:-5])
    with pytest.raises(HandoffError, match="truncated"):
        KVHandoff.from_bytes(data[:30])
    with pytest.raises(HandoffError, match="past its last block"):
        KVHandoff.from_bytes(data + b"\0")
    partial = KVHandoff(dict(handoff.meta), {k: v for k, v in handoff.tensors.items() if k != "group2.kv"})
    with pytest.raises(HandoffError, match="lacks block.*group2.kv"):
        engine.add_request("m", prompt, SamplingParams(), handoff=KVHandoff.from_bytes(partial.to_bytes()))
    with pytest.raises(HandoffError, match="another prompt"):
        engine.add_request("x", prompt[:-1] + [prompt[-1] + 1], SamplingParams(), handoff=handoff)
    other = make(load_model(os.path.join(GOLDEN_DIR, "v41-dspark-fp8")))
    with pytest.raises(HandoffError, match="other config"):
        other.add_request("y", prompt, SamplingParams(), handoff=handoff)
    assert not engine.requests and engine.allocator.num_used() == 0  # nothing was admitted


@pytest.mark.parametrize("spec_prefill", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_speculative_decode_side_keeps_greedy_output(spec_prefill):
    """With a DSpark drafter on both sides the hand-off carries the drafter rings (and their readable span);
    greedy output equals plain colocated decoding. A plain prefill worker feeding a speculative decode
    worker works too (the rings then start afresh)."""
    model = load_model(os.path.join(GOLDEN_DIR, "v41-dspark-fp8"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    batch = prompts([13], seed=2)
    want = make(model).generate(batch, params)
    if True:
        p_engine = make(model, speculative=spec_prefill)
        d_engine = make(model, speculative=True)
        for k, (prompt, ref) in enumerate(zip(batch, want)):
            handoff = prefill(p_engine, prompt, f"p{k}")
            assert (handoff.meta["rows_end"] == len(prompt)) == spec_prefill
            got = decode(d_engine, prompt, handoff.to_bytes(), params, f"d{k}")
            assert got.token_ids == ref.token_ids
        assert d_engine.counters["spec_decode_steps_total"] > 0


@pytest.mark.slow
def test_handoff_waits_for_room_and_survives_preemption(model):
    """A decode pool of 8 blocks of 8 tokens: each 22-24 token prompt takes 3 blocks, so two imports are
    admitted and the third waits; growing to 36 tokens (5 blocks each) they run out, the newer is preempted
    and recomputes from its tokens (its hand-off was consumed; the same decoder start), and every output
    still equals one engine's."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    batch = prompts([24, 23, 22], seed=11)
    want = make(model).generate(batch, params)
    p_engine = make(model)
    datas = [prefill(p_engine, p, f"p{k}").to_bytes() for k, p in enumerate(batch)]
    d_engine = make(model, kv_pool_tokens=64)
    for k, (prompt, data) in enumerate(zip(batch, datas)):
        d_engine.add_request(f"d{k}", prompt, params, handoff=KVHandoff.from_bytes(data))
    final, most_running = {}, 0
    while d_engine.has_unfinished():
        for o in d_engine.step():
            if o.finished:
                final[o.request_id] = o
        most_running = max(most_running, len(d_engine.running))
    assert [final[f"d{k}"].token_ids for k in range(3)] == [w.token_ids for w in want]
    assert d_engine.counters["handoffs_imported_total"] == 3 and most_running == 2
    assert d_engine.counters["preemptions_total"] > 0


def test_handoff_size_matches_the_pool_layout(model):
    """The hand-off's growing part is exactly the pool's packed bytes for the prompt's entries; the rest is
    the fixed per-sequence state plus the logits."""
    engine = make(model)
    prompt = prompts([40], seed=1)[0]
    handoff = prefill(engine, prompt)
    expect = sum(engine.pool.stored_bytes(layer, 40 // lay.ratio) for layer, lay in engine.pool.sources.items())
    assert handoff.kv_bytes() == expect
    fixed = handoff.nbytes() - handoff.kv_bytes() - model.cfg.vocab_size * 4
    assert fixed == engine.states.slot_bytes()
    assert len(handoff.to_bytes()) > handoff.nbytes()
    assert torch.equal(handoff.tensors["logits"], handoff.tensors["logits"].float())
