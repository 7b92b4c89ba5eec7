"""A deterministic engine (issue 10): identical requests give identical tokens alone, batched, in any
chunking, after preemption and from a prefix-cache hit, on a model built so that EVERY selection is an
exact tie (indexer scores, candidate blocks and router scores all equal). Then the tie-break alone decides
each selection, so any layout dependence shows up at once."""

import torch

from dsv41.config import tiny
from dsv41.engine import SamplingParams
from dsv41.generate import generate
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.ops import topk_canonical
from tests.conftest import tie_every_selection
from tests.engine.helpers import make, prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def tied_model(seed: int = 1) -> Transformer:
    """Random weights, except that all top-k choices (index entries, candidate blocks, experts) tie."""
    return tie_every_selection(init_random_weights(Transformer(tiny()), seed=seed).eval())


def test_the_model_really_ties_everywhere():
    model = tied_model()
    trace = {}
    with torch.inference_mode():
        model(torch.tensor(prompts([40])), trace=trace)
    scores = model.layers[2].ffn.gate.scores(torch.randn(5, model.cfg.dim, dtype=torch.bfloat16))
    assert (scores == scores[0, 0]).all()  # every expert scores the same
    # with every entry tied, the canonical rule takes the lowest visible positions
    top = trace["debug.layers.2.topk_idxs"][0, -1]
    assert top.tolist() == list(range(top.numel()))


def test_alone_batched_and_any_chunking_give_the_same_tokens():
    model = tied_model()
    batch = prompts([30, 5, 47, 12, 64, 9, 17], seed=3)
    alone = [make(model).generate([p], GREEDY)[0].token_ids for p in batch]
    together = [o.token_ids for o in make(model).generate(batch, GREEDY)]
    assert together == alone
    for chunk in (7, 64):  # chunk boundaries elsewhere, and a one-shot prefill of every prompt
        chunked = [o.token_ids for o in make(model, prefill_chunk_size=chunk).generate(batch, GREEDY)]
        assert chunked == alone, chunk
    # and the plain model's own greedy loop (prefill then one token at a time) agrees, full prefill
    with model.numerics(16):
        reference = [generate(model, torch.tensor([p]), 6)[0].tolist() for p in batch[:3]]
    assert [o.token_ids for o in make(model, prefill_mode="full").generate(batch[:3], GREEDY)] == reference


def test_preemption_and_prefix_hits_repeat_the_first_run():
    model = tied_model()
    batch = prompts([40, 33, 51, 27], seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [make(model).generate([p], params)[0].token_ids for p in batch]
    # a pool too small for all four: the newest requests are preempted and recomputed from their tokens
    tight = make(model, kv_pool_tokens=160)
    assert [o.token_ids for o in tight.generate(batch, params)] == alone
    assert tight.counters["preemptions_total"] > 0
    # the prefix cache on: the same requests again (whole-prompt snapshots), then follow-up turns that
    # resume from a snapshot, equal to the same follow-ups computed from scratch
    cached = make(model, enable_prefix_caching=True)
    assert [o.token_ids for o in cached.generate(batch, params)] == alone
    assert [o.token_ids for o in cached.generate(batch, params)] == alone
    follow_ups = [p + a + q for p, a, q in zip(batch, alone, prompts([3, 30, 9, 12], seed=5))]
    hit = [o.token_ids for o in cached.generate(follow_ups, GREEDY)]
    assert cached.stats.hit_tokens > sum(len(p) for p in batch)  # it did resume
    assert hit == [make(model).generate([f], GREEDY)[0].token_ids for f in follow_ups]


def test_the_engine_leaves_the_callers_model_as_it_was():
    model = init_random_weights(Transformer(tiny()), seed=2)
    model.set_reference_numerics(True)
    model.train()
    ids = torch.tensor(prompts([20], seed=7))
    with torch.inference_mode():
        before = model(ids)
    settings = {
        name: [getattr(m, name) for m in model.modules() if hasattr(m, name)]
        for name in ("row_chunk", "canonical_ties", "reference_numerics")
    }
    make(model).generate(prompts([15, 9]), GREEDY)
    assert model.training
    assert settings == {name: [getattr(m, name) for m in model.modules() if hasattr(m, name)] for name in settings}
    with torch.inference_mode():
        assert torch.equal(model(ids), before)


def test_topk_canonical_matches_a_brute_force_rule():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 40, (1,), generator=g))
        k = int(torch.randint(1, n + 1, (1,), generator=g))
        scores = torch.randint(-3, 4, (3, n), generator=g).float()
        scores[scores == -3] = -torch.inf
        want = torch.tensor([sorted(range(n), key=lambda i: (-row[i].item(), i))[:k] for row in scores])
        assert torch.equal(topk_canonical(scores, k), want)
        perm = torch.stack([torch.randperm(n, generator=g) for _ in range(3)])  # a gathered layout
        assert torch.equal(perm.gather(-1, topk_canonical(scores.gather(-1, perm), k, positions=perm)), want)
