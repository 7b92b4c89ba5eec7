"""The engine's `fast` numerics against the reference, on the shipped trained checkpoint and held-out text
(tests/data/shakespeare-chat-val: the validation split `dsv41 data --format chat` makes, which the
checkpoint never trained on): perplexity within 0.5%, >= 99% top-1 agreement, mean KL <= 2e-3 nats, at
batch 1 and batch 8 with mixed lengths, prefill and paged decode with prefix-cache hits. And the same checks
fail when a fast kernel is broken: they can tell."""

import os

import numpy as np
import pytest
import torch

import dsv41.ops
import dsv41.ops.gemm
import dsv41.ops.paged
from dsv41.checkpoints import checkpoint_path
from dsv41.engine import EngineConfig
from dsv41.engine.batched import DecodeBatch
from dsv41.engine.build import build_engine
from dsv41.eval.agreement import compare, decode_agreement, held_out_windows, prefill_agreement
from dsv41.model.layers import Linear
from dsv41.ops import attn_cpu

VAL = os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare-chat-val", "val.bin")


@pytest.fixture(scope="module")
def held_out() -> np.ndarray:
    return np.fromfile(VAL, dtype=np.uint16)


@pytest.fixture(scope="module")
def memo() -> dict:
    """Reference logits by token sequence, shared by the tests (the reference forward is the costly side)."""
    return {}


@pytest.fixture(scope="module")
def engine():
    # the C++ attention of fast prefill chunks (those of 256 queries or more) built before anything is timed
    attn_cpu.available()
    return build_engine(checkpoint_path(), EngineConfig(numerics="fast", kv_pool_tokens=16384, fused_kernels="off"))


def test_the_held_out_text_is_in_the_checkpoints_vocabulary_and_readable(held_out, engine):
    assert len(held_out) > 30_000 and held_out.max() < engine.model_config.vocab_size
    text = engine.tokenizer.decode([int(t) for t in held_out[:200]])
    assert sum(c.isalpha() for c in text) > 0.5 * len(text)


def test_compare_measures_what_it_says():
    torch.manual_seed(0)
    logits = torch.randn(50, 30)
    same = compare(logits, logits, logits.argmax(-1))
    assert same.kl_mean == 0 and same.top1 == 1 and same.ppl_ratio == 1
    flat = compare(torch.zeros(50, 30), logits, logits.argmax(-1))  # fast says: uniform
    assert flat.nll_fast == pytest.approx(np.log(30)) and flat.kl_mean > 0.1 and flat.ppl_ratio > 1


LENGTHS = [96, 128, 160, 192, 224, 256, 288, 320]  # a batch of 8 with mixed lengths


def test_fast_prefill_agrees_with_reference_alone_and_in_a_mixed_batch(engine, held_out, memo):
    alone = prefill_agreement(engine, engine.model, held_out_windows(held_out, [384]), memo)
    batch = prefill_agreement(engine, engine.model, held_out_windows(held_out[384:], LENGTHS), memo)
    for result in (alone, batch):
        assert result.meets(), result.as_dict()
        # a trained model on its own kind of text: the reference itself is far better than chance
        assert result.nll_reference < 0.8 * np.log(engine.model_config.vocab_size)
    assert batch.positions == sum(LENGTHS) - len(LENGTHS)


# decode prompts: some end inside the first window (the ring still has unused rows), most past it
DECODE_LENGTHS = [8, 24, 48, 64, 96, 112, 128, 160]


def test_fast_decode_agrees_with_reference_batched_paged_and_prefix_cached(engine, held_out, memo):
    prompts = held_out_windows(held_out[4000:], DECODE_LENGTHS, stride=200)
    hits_before = engine.stats.hit_tokens
    result = decode_agreement(engine, engine.model, prompts, new_tokens=12, passes=2, memo=memo)
    # the tokens scored are fast's own argmaxes; both sides score the same ones, so perplexity compares too
    assert result.meets(), result.as_dict()
    assert result.positions == 2 * 8 * 12
    assert engine.stats.hit_tokens > hits_before, "the second pass found nothing in the prefix cache"


def _gemm_without_its_tail(real):
    """A fast GEMM gone wrong the classic way: its remainder loop is lost, so the last 8 of the K products
    never reach the sum."""

    def broken(x, weight, chunk):
        return real(x[..., :-8], weight[:, :-8], chunk)

    return broken


def _attention_with_a_wrong_scale(real):
    """A fast attention kernel gone wrong: its softmax scale is 10% off (the reference path is untouched)."""

    def broken(q, kv, sink, indices, scale, reference=False, heads_per_call=0):
        return real(q, kv, sink, indices, scale if reference else scale * 1.1, reference, heads_per_call)

    return broken


@pytest.mark.parametrize("breakage", ["gemm", "attention"])
def test_a_broken_fast_kernel_fails_the_checks(engine, held_out, memo, monkeypatch, breakage):
    if breakage == "gemm":
        monkeypatch.setattr(dsv41.ops.gemm, "invariant_matmul", _gemm_without_its_tail(dsv41.ops.invariant_matmul))
    else:
        broken = _attention_with_a_wrong_scale(dsv41.ops.sparse_attn)
        monkeypatch.setattr(dsv41.ops, "sparse_attn", broken)
        monkeypatch.setattr(dsv41.ops.paged, "sparse_attn", broken)
        real = attn_cpu.sparse_attn_cpu  # the C++ prefill attention, where it serves
        monkeypatch.setattr(
            attn_cpu, "sparse_attn_cpu", lambda q, kv, sink, idx, scale: real(q, kv, sink, idx, scale * 1.1)
        )
    # the first windows of the mixed batch: their reference logits are already known
    result = prefill_agreement(engine, engine.model, held_out_windows(held_out[384:], LENGTHS[:4]), memo)
    assert not result.meets(), result.as_dict()


def _decode_attention_with_a_wrong_scale(real):
    def broken(q, rows, valid, sink, scale):
        return real(q, rows, valid, sink, scale * 1.1)

    return broken


def _window_that_reads_every_ring_row(real):
    """A window mask gone wrong: the ring's rows outside the window (unused ones, and the one the new token
    replaces) are attended too."""

    def broken(self, layer, window):
        return torch.ones_like(real(self, layer, window))

    return broken


@pytest.mark.parametrize("breakage", ["attention", "window"])
def test_a_broken_fast_decode_kernel_fails_the_checks(engine, held_out, memo, monkeypatch, breakage):
    if breakage == "attention":
        monkeypatch.setattr(
            dsv41.ops, "dense_decode_attn", _decode_attention_with_a_wrong_scale(dsv41.ops.dense_decode_attn)
        )
    else:
        monkeypatch.setattr(DecodeBatch, "window_valid", _window_that_reads_every_ring_row(DecodeBatch.window_valid))
    prompts = held_out_windows(held_out[4000:], DECODE_LENGTHS[:4], stride=200)
    result = decode_agreement(engine, engine.model, prompts, new_tokens=12, passes=1, memo=memo)
    assert not result.meets(), result.as_dict()


def test_fast_with_fp32_decode_gemms_agrees_with_reference(held_out, memo, monkeypatch):
    """Where the probe picks fp32 GEMMs for small calls (CPUs without bf16 instructions), the decode path runs
    its bf16 layers over fp32 weight copies: held to the same targets."""
    import dsv41.engine.llm_engine as llm_engine

    monkeypatch.setattr(llm_engine, "fp32_rows", lambda shapes, device: 8)
    engine = build_engine(checkpoint_path(), EngineConfig(numerics="fast", kv_pool_tokens=16384, fused_kernels="off"))
    assert engine.runner.fp32_rows == 8
    calls = []
    real = Linear._refresh_fp32
    monkeypatch.setattr(Linear, "_refresh_fp32", lambda self: calls.append(self) or real(self))
    prompts = held_out_windows(held_out[4000:], DECODE_LENGTHS, stride=200)
    result = decode_agreement(engine, engine.model, prompts, new_tokens=12, passes=1, memo=memo)
    assert result.top1 >= 0.99 and result.kl_mean <= 2e-3, result.as_dict()
    assert len(calls) >= 12 * 8 * engine.model_config.n_layers  # the decode steps' bf16 layers ran in fp32
