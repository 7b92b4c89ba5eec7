"""`fast` numerics attend the tokens of speculative verify chunks in one set of ops
(dsv41.engine.batched.chunk_decode_attend) instead of one decode step per draft position. Checked here against
the decode steps it replaces, layer by layer inside real engine forwards: from the same state and the same
inputs, the attention output and everything written (the FP8 window rings, the ratio-2 compressors' partial
groups, the packed compressed entries and index keys, the rows a rollback keeps) must agree."""

import os

import pytest
import torch

from dsv41.engine import SamplingParams, batched
from dsv41.engine.paged_attention import PagedAttention
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR
from tests.engine.helpers import make, prompts
from tests.engine.test_speculative import oracle

DSPARK = os.path.join(GOLDEN_DIR, "v41-dspark-fp8")  # window 8, ratios 2 and 1, Reuse and Reindex layers


@pytest.fixture(scope="module")
def model():
    return load_model(DSPARK)


def _state(backend) -> dict:
    """Every tensor a forward's attention may write: the window rings, partial groups, the paged pool (of the
    engine whose forward this backend serves)."""
    cache = backend.steps[0][1][0].cache
    states, pool = cache.states, cache.pool
    out = {"codes": states.window_codes.view(torch.uint8), "scale": states.window_scale}
    for name in ("group_kv", "group_score"):
        out |= {(name, k): t for k, t in getattr(states, name).items()}
    for name in ("kv_codes", "kv_scale", "key_codes", "key_scale"):
        out |= {(name, k): t for k, t in getattr(pool, name).items()}
    return out


def _kept_rows(backend, layer) -> dict:
    """The ratio-2 rows each verify chunk of the forward kept for a rollback at this layer."""
    out = {}
    for i, c in enumerate(backend.steps[0][1]):
        rows = getattr(c.cache, "_group_rows", {}).get(layer.layer_id)
        if rows is not None:
            out[i] = tuple(t.clone() if torch.is_tensor(t) else t for t in rows)
    return out


def test_chunked_verify_attention_equals_the_decode_steps(model, monkeypatch):
    """Speculative decoding of 5 sequences in `fast` numerics with drafts accepted to different lengths (so
    chunks of 1 to 5 tokens share forwards, groups complete inside and across chunks, rings wrap, and decode
    tokens run beside other requests' prefill chunks). For every layer of every forward with decode steps
    (other than a decode-only batch, which has one path), the attention runs both ways from one saved state: output,
    rings, partial groups and pool entries must match. Token-wise ops are made batch-invariant for the test
    (the runner's `fast` context swapped for row-chunked GEMMs), so what remains to differ is the order of
    the softmax sums (and the indexer breaks ties by position, as the deterministic mode does: FP4 scores
    tie often, and torch.topk breaks them by place in a row whose width differs between the two paths)."""
    batch = prompts([13, 30, 5, 19, 21], seed=3)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    plain = make(model, numerics="fast").generate(batch, params)  # the oracle's drafts
    engine = make(model, numerics="fast", speculative=True, kv_pool_tokens=4096)
    engine.runner.numerics = lambda: model.numerics(16)  # batch-invariant GEMMs under the `fast` paths
    real_attend = PagedAttention.attend
    seen = {"layers": 0, "longest": 0, "mixed": 0, "kept": 0, "with_prefill": 0}
    errors: list[str] = []

    def both(self, layer, x):
        if not self.steps or (len(self.steps) == 1 and len(self.steps[0][1]) == x.size(1)):
            return real_attend(self, layer, x)  # no decode step, or decode only (one batched step, no chunks)
        live = _state(self)
        before = {k: t.clone() for k, t in live.items()}
        self.chunk_steps = False
        stepped = real_attend(self, layer, x)
        after_steps = {k: t.clone() for k, t in live.items()}
        kept = _kept_rows(self, layer)
        for k, t in live.items():
            t.copy_(before[k])
        self.chunk_steps = True
        chunked = real_attend(self, layer, x)
        try:  # the engine turns a forward's exception into failed requests: keep it for the test's end
            rows, a = [], 0  # the decode and verify tokens' rows (a prefill chunk's run the same code both times)
            for c in self.chunks:
                rows += list(range(a, a + len(c.tokens))) if c.decode or c.stepped else []
                a += len(c.tokens)
            # the softmax sums in another order can move a bf16 attention value by one step, which the output
            # projection spreads over the row (~0.01 seen): a tolerance of that size; a wrong row is far larger
            torch.testing.assert_close(chunked[:, rows], stepped[:, rows], rtol=2e-2, atol=2e-2)
            for k, t in live.items():
                if k[0] in ("group_kv", "group_score"):
                    torch.testing.assert_close(t, after_steps[k], rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(t, after_steps[k])
            again = _kept_rows(self, layer)  # what a rollback rebuilds partial groups from
            assert again.keys() == kept.keys()
            for k, (first, kv, score) in kept.items():
                assert again[k][0] == first
                torch.testing.assert_close(again[k][1:], (kv, score), rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            errors.append(f"layer {layer.layer_id}: {err}")
            raise
        seen["layers"] += 1
        seen["kept"] += len(kept)
        seen["longest"] = max(seen["longest"], len(self.steps))
        seen["mixed"] = max(seen["mixed"], len({len(c.tokens) for c in self.steps[0][1]}))
        seen["with_prefill"] += any(not (c.decode or c.verify) for c in self.chunks)
        return chunked

    monkeypatch.setattr(PagedAttention, "attend", both)
    real_select = batched._select

    def select_ties_by_position(attn, x, qr, batch, pool):
        # FP4 index scores tie often, and torch.topk breaks ties by where an entry sits in the scored row,
        # whose width differs between the two paths: pick as the deterministic mode does (ties by position)
        batch.fast = False
        try:
            return real_select(attn, x, qr, batch, pool)
        finally:
            batch.fast = True

    monkeypatch.setattr(batched, "_select", select_ties_by_position)
    oracle(monkeypatch, {tuple(p): o.token_ids for p, o in zip(batch, plain)}, 0.2, seed=2)
    outputs = engine.generate(batch, params)
    assert not errors, errors[0]
    assert all(o.finish_reason == "length" for o in outputs)
    assert seen["layers"] >= 6 * model.cfg.n_layers  # many forwards, every layer compared
    assert seen["longest"] == model.cfg.dspark_block_size + 1  # whole drafts verified
    assert seen["mixed"] >= 2  # chunks of different lengths in one forward
    assert seen["kept"]  # rollback rows compared
    assert seen["with_prefill"]  # decode or verify tokens beside other requests' prefill chunks


def test_fast_speculative_decoding_verifies_through_the_chunked_attention(model, monkeypatch):
    """`fast` numerics verify every forward's drafts through the chunked path by default, at batch 1 too
    (where `batched_verify="auto"` would otherwise attend a lone draft as a prefill chunk). Its tokens are
    not compared with plain decoding: on these random weights, plain `fast` decoding itself changes tokens
    with the batch (near-ties), which is what `fast` allows."""
    calls = []
    real = PagedAttention._chunked

    def spy(self, *args):
        used = real(self, *args)
        calls.append(used)
        return used

    monkeypatch.setattr(PagedAttention, "_chunked", spy)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for batch in (prompts([11], seed=6), prompts([11, 26, 7], seed=6)):
        calls.clear()
        engine = make(model, numerics="fast", speculative=True)
        outputs = engine.generate(batch, params)
        assert all(len(o.token_ids) == 8 for o in outputs)
        assert engine.metrics()["spec_decode_mean_emitted_per_step"] >= 1
        assert engine.counters["spec_decode_steps_total"] >= 2  # drafts were verified, not only decoded
        assert calls and all(calls)
