"""Parameter grouping, training progress and state round trip (training.md §1.4, §11)."""

import copy
import io

import pytest
import torch

from dsv41 import config
from dsv41.model.transformer import Transformer
from dsv41.optim import GROUP_OPTIMIZER, Muon, OptimConfig, SinkMomentum, build_optimizers, classify_param

OPT_CLASS = {"muon": Muon, "sink": SinkMomentum, "adamw": torch.optim.AdamW}

EXPECTED = {
    "embed.weight": "sink",
    "head.weight": "sink",
    "norm.weight": "adamw",
    "layers.0.attn.attn_sink": "adamw",
    "layers.0.attn.wq_a.weight": "muon",
    "layers.0.attn.wq_b.weight": "muon_q",
    "layers.0.attn.wkv.weight": "muon",
    "layers.0.attn.wo_a.weight": "muon_wo_a",
    "layers.0.attn.wo_b.weight": "muon",
    "layers.0.attn.q_norm.weight": "adamw",
    "layers.0.hc_attn_fn": "muon",
    "layers.0.hc_attn_base": "adamw",
    "layers.0.hc_ffn_scale": "adamw",
    "layers.0.ffn.gate.weight": "muon",
    "layers.0.ffn.experts.0.w1.weight": "muon",
    "layers.0.ffn.shared_experts.w2.weight": "muon",
    "layers.1.engram.wkv.weight": "muon",
    "layers.1.engram.q_weight": "adamw",
    "layers.1.engram.k_weight": "adamw",
}


@pytest.fixture(scope="module", params=["tiny", "small"])
def model(request):
    torch.manual_seed(0)
    return Transformer(getattr(config, request.param)()).float()


def names_of(opt_set):
    out = {}
    for group in opt_set.param_groups:
        for name in group["param_names"]:
            out.setdefault(name, []).append(group["name"])
    return out


def test_every_trainable_param_in_exactly_one_group(model):
    opts = build_optimizers(model)
    in_groups = names_of(opts)
    assert all(len(v) == 1 for v in in_groups.values())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(in_groups) == trainable
    ids = [id(p) for g in opts.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    # each group sits in the optimizer its kind names
    for key, opt in opts.optimizers.items():
        assert isinstance(opt, OPT_CLASS[key])
        for g in opt.param_groups:
            assert GROUP_OPTIMIZER[g["name"]] == key


# group sizes by kind for Transformer(tiny()) (training.md §1.4 audit); update when the model changes
TINY_GROUP_SIZES = {"muon": 344, "muon_q": 10, "muon_index_q": 4, "muon_wo_a": 10, "sink": 2, "adamw": 101}


def test_tiny_group_sizes():
    torch.manual_seed(0)
    opts = build_optimizers(Transformer(config.tiny()).float())
    assert {g["name"]: len(g["params"]) for g in opts.param_groups} == TINY_GROUP_SIZES


def test_representative_names(model):
    cfg = model.cfg
    groups = {n: g[0] for n, g in names_of(build_optimizers(model)).items()}
    for name, kind in EXPECTED.items():
        assert groups[name] == kind, name
    idx = [n for n in groups if n.endswith("indexer.wq_b.weight")]
    assert idx and all(groups[n] == "muon_index_q" for n in idx)
    assert all(groups[n] == "muon" for n in groups if n.endswith("indexer.wk.weight"))
    opts = build_optimizers(model)
    assert opts.group("muon_q")["heads"] == cfg.n_heads
    assert opts.group("muon_index_q")["heads"] == cfg.index_n_heads
    assert opts.group("muon_wo_a")["heads"] == cfg.o_groups
    assert opts.group("muon")["heads"] == 1
    # frozen fp8/quantised tables and the balancing bias are not optimised
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "layers.0.ffn.gate.bias" in frozen and not frozen & set(groups)


def test_defaults_and_engram_lr():
    cfg = OptimConfig()
    table = torch.nn.Parameter(torch.zeros(10, 4))
    assert classify_param("layers.1.engram.embed.weight", table, cfg) == "sink_engram"
    m = torch.nn.Module()
    m.embed = torch.nn.Embedding(10, 4)
    m.engram = torch.nn.Module()
    m.engram.embed = torch.nn.Embedding(20, 4)
    m.w = torch.nn.Linear(4, 4)
    opts = build_optimizers(m, cfg)
    assert opts.group("sink_engram")["lr"] == pytest.approx(5 * opts.group("sink")["lr"])
    assert opts.group("sink")["weight_decay"] == 0.0
    assert opts.group("muon")["weight_decay"] == 0.1
    assert opts.group("adamw")["betas"] == (0.9, 0.95)
    assert opts.group("adamw")["eps"] == 1e-20
    opts.set_lr_scale(0.5)
    assert opts.group("sink_engram")["lr"] == pytest.approx(2.5 * cfg.lr)


def test_ablation_switches(model):
    plain = names_of(build_optimizers(model, OptimConfig(headwise=False, grouped_wo_a=False, hc_fn_muon=False)))
    assert plain["layers.0.attn.wq_b.weight"] == ["muon"]
    assert plain["layers.0.hc_attn_fn"] == ["adamw"]
    adam = build_optimizers(model, OptimConfig(use_muon=False, use_sink=False))
    assert list(adam.optimizers) == ["adamw"]


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)
        self.proj = torch.nn.Linear(16, 24)
        self.wq_b = torch.nn.Linear(24, 8, bias=False)
        self.head = torch.nn.Linear(8, 4, bias=False)

    def forward(self, ids):
        return self.head(self.wq_b(torch.tanh(self.proj(self.embed(ids)))))


def toy_problem():
    torch.manual_seed(0)
    model = Toy()
    ids = torch.randint(0, 32, (64,))
    target = torch.randn(32, 4)[ids]  # a function of the ids, so the loss can reach 0
    return model, ids, target


def loss_of(model, ids, target):
    return (model(ids) - target).pow(2).mean()


def test_toy_least_squares_loss_falls():
    model, ids, target = toy_problem()
    opts = build_optimizers(model, OptimConfig(lr=0.02))
    assert set(opts.optimizers) == {"muon", "sink", "adamw"}
    first = loss_of(model, ids, target).item()
    for _ in range(40):
        opts.zero_grad()
        loss_of(model, ids, target).backward()
        opts.step()
    last = loss_of(model, ids, target).item()
    assert last < 0.5 * first, (first, last)


def test_plain_muon_least_squares():
    torch.manual_seed(1)
    a = torch.randn(32, 32)
    w_true = torch.randn(16, 32)
    y = w_true @ a
    w = torch.nn.Parameter(torch.zeros(16, 32))
    opt = Muon([w], lr=0.5, weight_decay=0.0)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = (w @ a - y).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0]


def test_state_dict_round_trip_bit_identical():
    model, ids, target = toy_problem()
    opts = build_optimizers(model, OptimConfig(lr=0.02))

    def train(m, o, n):
        for _ in range(n):
            o.zero_grad()
            loss_of(m, ids, target).backward()
            o.step()

    train(model, opts, 3)
    saved_model = copy.deepcopy(model.state_dict())
    buffer = io.BytesIO()
    torch.save(opts.state_dict(), buffer)  # as a checkpoint would; must load with weights_only=True
    buffer.seek(0)
    saved_opt = torch.load(buffer, weights_only=True)
    train(model, opts, 2)
    reference = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(123)
    model2 = Toy()
    model2.load_state_dict(saved_model)
    opts2 = build_optimizers(model2, OptimConfig(lr=0.02))
    opts2.load_state_dict(saved_opt)
    train(model2, opts2, 2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, reference[k]), k
