"""Router replay (R3, training.md §8): the learner's forward uses the rollout's expert ids and chunk
spans and recomputes the gate weights from the current router. With the rollout's weights its
log-probabilities equal the engine's bit for bit; the routers get gradient; other ids change the output."""

import pytest
import torch

from dsv41.config import tiny
from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.optim.groups import OptimConfig, build_optimizers
from dsv41.rl.policy import ReplayPolicy, sequence_logprobs
from dsv41.rl.rollout import RolloutRequest, RolloutWorker, rollout_engine_config
from dsv41.tokenizer import ByteTokenizer
from tests.engine.helpers import prompts

# a window and a selection of 64 (two 64-wide attention blocks, where a lone decode's narrower selection
# list sums differently from the batched decode's padded one), 16 experts, every tiny block type
WIDE = tiny().replace(
    window_size=64, index_topk=64, candidate_topk_blocks=20, n_routed_experts=16, n_activated_experts=2
)


def _old(rollouts):
    width = max(len(r.logprobs) for r in rollouts)
    out = torch.zeros(len(rollouts), width)
    for i, r in enumerate(rollouts):
        out[i, : len(r.logprobs)] = torch.tensor(r.logprobs)
    return out


@pytest.fixture(scope="module")
def setup():
    model = init_random_weights(Transformer(WIDE), seed=7).eval()
    tok = ByteTokenizer(WIDE.vocab_size)
    worker = RolloutWorker(model, tok, rollout_engine_config(256, max_num_seqs=16, prefill_chunk_size=32))
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12)
    requests = [RolloutRequest(p, 3, params, k) for k, p in enumerate(prompts([5, 40, 75, 100], seed=4))]
    return model, worker, requests, worker.generate(requests, seed=11)


def test_rollouts_carry_routing_spans_and_supports(setup):
    model, _, requests, rollouts = setup
    cfg = model.cfg
    assert len(rollouts) == 12 and [r.tag for r in rollouts[::3]] == [0, 1, 2, 3]
    for r in rollouts:
        n = len(r.prompt_ids) + len(r.completion_ids) - 1
        assert r.routed_experts.shape == (n, cfg.n_layers, cfg.n_activated_experts)
        assert int(r.routed_experts.max()) < cfg.n_routed_experts
        assert r.spans[0][0] == 0 and r.spans[-1][1] == n
        assert all(a == b for (_, a), (b, _) in zip(r.spans, r.spans[1:]))
        assert len(r.logprobs) == len(r.supports) == len(r.completion_ids)
        assert all(s is not None for s in r.supports)  # top_p 0.9 cuts the tail at every step
        for token, support in zip(r.completion_ids, r.supports):
            assert token in support.tolist()
    # the samples of one request differ (their own seeds), the requests' prompts are their own
    assert len({tuple(r.completion_ids) for r in rollouts[:3]}) > 1


def test_replayed_logprobs_equal_the_rollouts_bit_for_bit(setup):
    model, _, _, rollouts = setup
    policy = ReplayPolicy(model)
    logp, mask = policy([r.sample() for r in rollouts])
    assert torch.equal(logp.detach()[mask], _old(rollouts)[mask])
    # a plain full-sequence forward is not the engine's computation: the replay is not trivially equal
    plain, _ = sequence_logprobs(model, [_one_chunk(r.sample()) for r in rollouts])
    assert not torch.equal(plain[mask], _old(rollouts)[mask])


def _one_chunk(sample):
    sample.spans = None  # the whole sequence as one prefill chunk
    return sample


def test_after_an_update_engine_and_learner_still_agree(setup):
    """The update's backward reaches every layer's router and no indexer (frozen in RL), and replaying other
    experts changes the output; after the step the rollouts are off-policy, and fresh rollouts of the
    updated engine replay bit for bit."""
    model, worker, requests, rollouts = setup
    policy = ReplayPolicy(model)
    opt = build_optimizers(policy.master, OptimConfig(lr=1e-3))
    logp, mask = policy([r.sample() for r in rollouts])
    (-(logp * mask).sum() / mask.sum()).backward()
    masters = dict(policy.master.named_parameters())
    for i in range(model.cfg.n_layers):
        grad = masters[f"layers.{i}.ffn.gate.weight"].grad
        assert grad is not None and grad.abs().sum() > 0, f"layer {i}: no router gradient"
    assert all(masters[n].grad is None for n in masters if ".indexer." in n)  # frozen in RL
    # replaying other experts (each id moved by one) changes the log-probabilities
    others = [r.sample() for r in rollouts]
    for s in others:
        s.routed_experts = (s.routed_experts.long() + 1) % model.cfg.n_routed_experts
    with torch.no_grad():
        other, _ = policy(others)
    assert not torch.equal(other[mask], logp.detach()[mask])
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    policy.sync_policy()  # the rollout engine shares this model
    try:
        with torch.no_grad():
            moved, _ = policy([r.sample() for r in rollouts])
        assert not torch.equal(moved[mask], logp.detach()[mask])  # the old rollouts are now off-policy
        fresh = worker.generate(requests[:2], seed=12)
        with torch.no_grad():
            new, new_mask = policy([r.sample() for r in fresh])
        assert torch.equal(new[new_mask], _old(fresh)[new_mask])
    finally:
        model.load_state_dict(before)


def test_record_routing_needs_a_replayable_engine():
    model = init_random_weights(Transformer(tiny()), seed=1)
    tok = ByteTokenizer(tiny().vocab_size)
    for bad, match in (
        (dict(prefill_mode="bounded", enable_prefix_caching=False), "prefill_mode"),
        (dict(prefill_mode="full", enable_prefix_caching=True), "prefix_caching"),
    ):
        with pytest.raises(ValueError, match=match):
            LLMEngine(model, tok, EngineConfig(record_routing=True, **bad))
    with pytest.raises(ValueError, match="record_routing"):
        RolloutWorker(model, tok, EngineConfig(prefill_mode="full", enable_prefix_caching=False))


@pytest.mark.slow  # the `small` preset's model (~8 s on one core); CI runs -m slow
def test_small_preset_rollouts_replay_bit_for_bit():
    """The CPU presets' own shapes, where tiny ones do not reach: 64-entry windows and top-64 selections
    with prompts shorter and longer than both, sharing decode steps and 16-token prefill chunks."""
    from dsv41.config import small

    cfg = small()
    model = init_random_weights(Transformer(cfg), seed=3).eval()
    tok = ByteTokenizer(cfg.vocab_size)
    worker = RolloutWorker(model, tok, rollout_engine_config(256, max_num_seqs=16, prefill_chunk_size=16))
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=8)
    requests = [RolloutRequest(p, 3, params, k) for k, p in enumerate(prompts([20, 37, 150], seed=5))]
    rollouts = worker.generate(requests, seed=2)
    logp, mask = ReplayPolicy(model)([r.sample() for r in rollouts])
    assert torch.equal(logp.detach()[mask], _old(rollouts)[mask])
