"""The differentiable training forward (dsv41.model.training; training.md §4, §5, §7, spec §2.1)."""

import pytest
import torch
import torch.nn.functional as F

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.training import TrainOptions, _indexer_kl, forward_train, prepare_for_training
from dsv41.model.transformer import Transformer
from tests.conftest import pin_routing


@pytest.fixture(scope="module")
def trainable():
    return prepare_for_training(init_random_weights(Transformer(tiny()), seed=1, std=0.1))


def batch(b=2, s=40, seed=0):
    return torch.randint(3, 1000, (b, s), generator=torch.Generator().manual_seed(seed))


def test_matches_the_inference_forward_when_everything_is_selected():
    """With top-k and the candidate pool covering every entry, selection is not in play (MoE routing
    pinned too) and the training formulation (one masked softmax, fp32) must give the inference model's
    logits up to bf16 rounding: measured rms 2.2% of the logits. Without QAT the cache roundings of
    inference are missing and the gap doubles (4.5%), so the metric sees formulation differences."""
    cfg = tiny().replace(index_topk=64, candidate_topk_blocks=64)
    model = pin_routing(init_random_weights(Transformer(cfg), seed=1))
    ids = batch()
    with torch.no_grad():
        ref = model(ids)
        got = forward_train(model, ids).logits
        no_qat = forward_train(model, ids, TrainOptions(qat=False)).logits

    def rel(x):
        return float((x - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())

    assert rel(got) < 0.035 and rel(no_qat) > 1.5 * rel(got)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_causal_through_compressor_indexer_and_topk(trainable):
    ids = batch()
    t = 23
    changed = ids.clone()
    changed[:, t + 1 :] = torch.randint(3, 1000, changed[:, t + 1 :].shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = forward_train(trainable, ids).logits
        b = forward_train(trainable, changed).logits
    # up to float reassociation: other tokens change the per-expert GEMM sizes (and so the blocking);
    # a leak from the future would move earlier logits as much as later ones
    before, after = (a[:, : t + 1] - b[:, : t + 1]).abs().max(), (a[:, t + 1 :] - b[:, t + 1 :]).abs().max()
    assert before < 1e-4 and after > 1e-2, (before, after)


def test_indexer_learns_only_from_the_kl_and_the_model_only_from_the_lm_loss(trainable):
    ids = batch()
    out = forward_train(trainable, ids)
    lm = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    indexer = {n: p for n, p in trainable.named_parameters() if ".indexer." in n}
    main = {n: p for n, p in trainable.named_parameters() if ".indexer." not in n and p.requires_grad}
    assert indexer and out.indexer_kl > 0
    g_lm = torch.autograd.grad(lm, list(indexer.values()), retain_graph=True, allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in g_lm)
    g_kl = torch.autograd.grad(out.indexer_kl, list(main.values()), retain_graph=True, allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in g_kl)
    g_idx = torch.autograd.grad(out.indexer_kl, list(indexer.values()), allow_unused=True)
    assert any(g is not None and torch.count_nonzero(g) > 0 for g in g_idx)


def test_indexer_kl_is_zero_when_the_indexer_matches_the_attention():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(1, 3, 2, 5, generator=g)
    selected = torch.tensor([True, True, False, True, False]).expand(1, 3, 5)
    target = probs.sum(dim=2).masked_fill(~selected, 0)
    matching = torch.log(target / target.sum(-1, keepdim=True)).masked_fill(~selected, -5.0)
    assert _indexer_kl(probs, matching, selected).abs() < 1e-6
    assert _indexer_kl(probs, torch.randn(1, 3, 5, generator=g), selected) > 0


def test_bounded_replay_simulation_changes_only_decoder_queries_after_the_start(trainable):
    ids = batch(s=40)
    start = 30
    with torch.no_grad():
        full = forward_train(trainable, ids).logits
        replay = forward_train(trainable, ids, TrainOptions(replay_start=start)).logits
    assert torch.equal(full[:, :start], replay[:, :start])
    assert not torch.equal(full[:, start:], replay[:, start:])
    assert trainable.cfg.decoder_boundary == max(trainable.cfg.kv_source_layers)


def test_qat_switch_and_moe_statistics(trainable):
    ids = batch()
    with torch.no_grad():
        on = forward_train(trainable, ids, TrainOptions(qat=True))
        off = forward_train(trainable, ids, TrainOptions(qat=False))
    assert not torch.equal(on.logits, off.logits)
    cfg = trainable.cfg
    assert sorted(on.expert_load) == list(range(cfg.n_layers))
    for load in on.expert_load.values():  # every token picks k experts
        assert load.sum() == ids.numel() * cfg.n_activated_experts
    assert torch.isfinite(on.balance_loss) and on.balance_loss > 0


def test_engram_tables_become_trainable_with_the_same_rows():
    model = init_random_weights(Transformer(tiny()), seed=1)
    ids = torch.tensor([[5, 17, 400]])
    layer = tiny().engram_layer_ids[0]
    table = model.layers[layer].engram.embed
    before = table(ids).float()
    table.make_trainable()
    assert table.weight.requires_grad and table.weight.dtype == torch.float32
    assert torch.equal(table(ids), before)


def test_image_tokens_route_with_their_own_bias_and_are_counted_apart():
    """Image-span tokens pick experts with `gate.bias_vl` and are counted in `expert_load_vl`; the
    training forward must agree with the inference forward on the same spans (VL bias, Engram shut)."""
    cfg = tiny().replace(vision_n_layers=1, index_topk=64, candidate_topk_blocks=64)
    model = pin_routing(init_random_weights(Transformer(cfg), seed=1))  # selection cannot flip
    for layer in model.layers:
        layer.ffn.gate.bias_vl.data[0] = 100.0  # image tokens must all pick expert 0
    ids = batch()
    image = torch.zeros_like(ids, dtype=torch.bool)
    image[:, 10:20] = True
    n_image, k = int(image.sum()), cfg.n_activated_experts
    with torch.no_grad():
        out = forward_train(model, ids, token_types=image)
        ref = model(ids, token_types=image)
        plain = forward_train(model, ids)
    assert sorted(out.expert_load_vl) == list(range(cfg.n_layers))
    for layer in range(cfg.n_layers):
        assert out.expert_load_vl[layer][0] == n_image and out.expert_load_vl[layer].sum() == n_image * k
        assert out.expert_load[layer].sum() == (ids.numel() - n_image) * k
        assert plain.expert_load_vl[layer].sum() == 0 and plain.expert_load[layer].sum() == ids.numel() * k
    rel = (out.logits - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert rel < 0.035 and (out.logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    assert not torch.equal(out.logits[:, 10:], plain.logits[:, 10:])
    assert (out.logits[:, :10] - plain.logits[:, :10]).abs().max() < 1e-4  # causal: nothing moves before the span
