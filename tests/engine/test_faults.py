"""One request cannot take others down (issue 9, items 1, 7 and 9): near-zero temperatures are greedy, a
request whose sampling or forward pass fails ends alone with finish_reason "error" while the rest of its
batch finishes with the tokens it would have had alone, sampling caps, and burst admission."""

import asyncio

import pytest

from dsv41.engine import AsyncEngine, EngineBusy, SamplingParams
from tests.conftest import poison_sampling
from tests.engine.test_engine import make as make_engine
from tests.engine.test_engine import prompts

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def make(model, **overrides):
    return make_engine(model, **{"enable_prefix_caching": False, **overrides})


def run_all(engine, requests):
    """requests: {id: (prompt, params)} -> {id: final output}"""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if len(final) == len(requests):
            return final
    raise AssertionError(f"unfinished: {set(requests) - set(final)}")


def test_near_zero_temperatures_are_greedy(model):
    (prompt,) = prompts([9])
    greedy = make(model).generate([prompt], GREEDY)[0].token_ids
    for t in (1e-39, 5e-324, 1e-6):
        params = SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, seed=3)
        assert make(model).generate([prompt], params)[0].token_ids == greedy


def test_a_failing_sample_fails_its_request_alone(model, monkeypatch):
    healthy = prompts([11, 20, 7])
    alone = [make(model).generate([p], GREEDY)[0].token_ids for p in healthy]
    poison_sampling(monkeypatch, seed=666, message="poisoned sampler")
    engine = make(model)
    requests = {f"ok{k}": (p, GREEDY) for k, p in enumerate(healthy)}
    requests["bad"] = (prompts([13], seed=5)[0], SamplingParams(temperature=1.0, max_tokens=6, seed=666))
    final = run_all(engine, requests)
    assert final["bad"].finish_reason == "error" and "poisoned sampler" in final["bad"].error
    assert [final[f"ok{k}"].token_ids for k in range(3)] == alone
    assert all(final[f"ok{k}"].finish_reason == "length" and final[f"ok{k}"].error is None for k in range(3))
    assert engine.allocator.num_used() == 0 and not engine.requests
    assert engine.metrics()["requests_failed_total"] == 1


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_failing_forward_is_found_and_fails_alone(model, when):
    """The forward raises whenever the poisoned request is in the batch (at its prefill, or at its third
    decode step): the batch is retried one suspect at a time, the culprit fails alone, the others finish
    with the same tokens as alone (they were preempted and recomputed from their tokens)."""
    healthy = prompts([11, 20, 7])
    alone = [make(model).generate([p], GREEDY)[0].token_ids for p in healthy]
    bad_prompt = prompts([13], seed=5)[0]
    engine = make(model)
    real_forward = engine.runner.forward

    def forward(chunks):
        bad = engine.requests.get("bad")
        for chunk in chunks:
            if (
                bad is not None
                and chunk.cache is bad.cache
                and (when == "prefill" or (chunk.decode and chunk.start >= len(bad_prompt) + 2))
            ):
                raise RuntimeError("poisoned forward")
        return real_forward(chunks)

    engine.runner.forward = forward
    requests = {f"ok{k}": (p, GREEDY) for k, p in enumerate(healthy)}
    requests["bad"] = (bad_prompt, GREEDY)
    final = run_all(engine, requests)
    assert final["bad"].finish_reason == "error" and "poisoned forward" in final["bad"].error
    for k in range(3):
        assert final[f"ok{k}"].finish_reason == "length"
        if when == "prefill":  # the failure came before any token, so the recompute is the same work
            assert final[f"ok{k}"].token_ids == alone[k]
        else:
            assert len(final[f"ok{k}"].token_ids) == GREEDY.max_tokens
    assert engine.allocator.num_used() == 0 and not engine.requests and not engine.running
    assert engine.metrics()["requests_failed_total"] == 1 and engine.metrics()["failed_steps_total"] >= 2


def test_stop_caps():
    SamplingParams(stop=["a", "b", "c", "d"], stop_token_ids=list(range(256))).validate(1024)
    with pytest.raises(ValueError, match="stop accepts at most 4"):
        SamplingParams(stop=["x"] * 5).validate(1024)
    with pytest.raises(ValueError, match="at most 1024 characters"):
        SamplingParams(stop=["x" * 1025]).validate(1024)
    with pytest.raises(ValueError, match="stop_token_ids accepts at most 256"):
        SamplingParams(stop_token_ids=[5] * 300_000).validate(1024)


def test_requests_that_can_start_now_do_not_count_against_the_queue(model):
    """160 requests at once on an idle engine with 32 run slots and a 64-deep queue: 96 are taken (32
    start, 64 wait), 64 refused. The engine thread is not started, so every request is still pending."""
    engine = make(model, max_num_seqs=32, kv_pool_tokens=4096)
    front = AsyncEngine(engine, max_waiting=64)

    async def burst():
        streams = [front.generate(f"r{k}", [5, 6, 7], GREEDY) for k in range(160)]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.sleep(0.2)
        refused = sum(1 for f in firsts if f.done() and isinstance(f.exception(), EngineBusy))
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        return refused

    assert asyncio.run(burst()) == 64
