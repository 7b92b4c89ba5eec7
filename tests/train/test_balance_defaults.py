"""Defaults that balance (issue 33, item 5): `dsv41 train --preset tiny|mini|small` trains with the
balancing recipe of docs/moe-balancing.md unless told otherwise, `--balance release` (and the flash preset)
keeps V4.1's rule, and flags a user gives win over either. Loads are read from metrics.jsonl, which
test_routing_stats.py checks against a direct count of the routers' picks."""

import json

import pytest
import torch

from dsv41.cli import main
from dsv41.train import TrainConfig, Trainer
from dsv41.train.config import BALANCE_RULES

RECIPE = {"embed_init_std": 1.0, "bias_update": "lookahead", "decorrelate_router": True, "capacity_factor": 1.5}
RELEASE = {"embed_init_std": 0.02, "bias_update": "sign", "decorrelate_router": False, "capacity_factor": 0.0}
RELEASE_FLAGS = [
    "--embed-init-std",
    "0.02",
    "--bias-update",
    "sign",
    "--no-decorrelate-router",
    "--capacity-factor",
    "0",
]  # the release's rule spelled out, as the defaults were before


def chosen(cfg: TrainConfig) -> dict:
    return {name: getattr(cfg, name) for name in RECIPE}


def test_each_preset_gets_its_rule_and_given_options_win():
    # written out here, not read from BALANCE_RULES, so a changed table shows up as a failure
    assert BALANCE_RULES == {"recipe": RECIPE, "release": RELEASE}
    for name in ("tiny", "mini", "nano", "small"):
        cfg = TrainConfig(preset=name).resolved()
        assert cfg.balance == "recipe" and chosen(cfg) == RECIPE, name
    flash = TrainConfig(preset="flash").resolved()
    assert flash.balance == "release" and chosen(flash) == RELEASE
    assert chosen(TrainConfig(preset="tiny", balance="release").resolved()) == RELEASE
    assert chosen(TrainConfig(preset="flash", balance="recipe").resolved()) == RECIPE
    mixed = TrainConfig(preset="tiny", balance="release", capacity_factor=1.25, decorrelate_router=True).resolved()
    assert chosen(mixed) == dict(RELEASE, capacity_factor=1.25, decorrelate_router=True)
    # an explicit value equal to the other rule's is still the user's: False is not "not given"
    assert TrainConfig(preset="tiny", decorrelate_router=False, capacity_factor=0.0).resolved().capacity_factor == 0.0
    assert TrainConfig(preset="tiny", decorrelate_router=False).resolved().decorrelate_router is False
    with pytest.raises(ValueError, match="balance"):
        TrainConfig(balance="auto").validate()
    with pytest.raises(ValueError, match="capacity_factor"):  # validation sees the resolved values
        TrainConfig(balance="release", capacity_factor=0.5).validate()


def capture(monkeypatch) -> list:
    """Stop `dsv41 train` after the Trainer is built; keep its config and initial embedding."""
    seen = []

    def run(self):
        seen.append((self.cfg, float(self.model.embed.weight.detach().std())))
        return {}

    monkeypatch.setattr(Trainer, "run", run)
    return seen


@pytest.mark.parametrize(
    "flags, want",
    [
        ([], RECIPE),
        (["--balance", "release"], RELEASE),
        (
            ["--balance", "release", "--embed-init-std", "1.0", "--capacity-factor", "1.25"],
            dict(RELEASE, embed_init_std=1.0, capacity_factor=1.25),
        ),
        (
            ["--no-decorrelate-router", "--bias-update", "sign", "--capacity-factor", "0"],
            dict(RECIPE, decorrelate_router=False, bias_update="sign", capacity_factor=0.0),
        ),
        (
            ["--bias-update", "proportional", "--embed-init-std", "0.02"],
            dict(RECIPE, bias_update="proportional", embed_init_std=0.02),
        ),
    ],
)
def test_the_cli_passes_the_default_and_the_users_flags_to_the_trainer(tiny_corpus, tmp_path, monkeypatch, flags, want):
    seen = capture(monkeypatch)
    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--data",
                tiny_corpus,
                "--out",
                str(tmp_path),
                "--steps",
                "2",
                "--threads",
                "1",
                *flags,
            ]
        )
        == 0
    )
    cfg, embed_std = seen[0]
    assert chosen(cfg) == want
    assert embed_std == pytest.approx(want["embed_init_std"], rel=0.05)  # the model was built with it


def test_a_run_saved_under_one_rule_does_not_resume_under_the_other(tiny_corpus, tmp_path):
    """The trainer saves the resolved values, so a run begun under the old defaults (the release's rule)
    refuses to continue under the new ones instead of silently mixing the two."""
    base = dict(
        preset="tiny",
        data=tiny_corpus,
        out=str(tmp_path),
        steps=2,
        batch_size=2,
        seq_len=32,
        warmup=1,
        eval_every=100,
        eval_batches=1,
        save_every=1,
        threads=1,
    )
    trainer = Trainer(TrainConfig(**base, balance="release"))
    trainer.train_step()
    trainer.save()
    with pytest.raises(ValueError, match="bias_update: sign -> lookahead"):
        Trainer(TrainConfig(**base))
    assert Trainer(TrainConfig(**base, balance="release")).step == 1


def routing(out) -> list[dict]:
    return [json.loads(line) for line in open(out / "metrics.jsonl") if '"load_ratio"' in line]


def worst_per_layer(rows: list[dict], key: str) -> list[float]:
    return [max(r[key][layer] for r in rows) for layer in range(len(rows[0][key]))]


FAST_STEPS, FAST_TAIL = 10, 5


@pytest.mark.slow  # a whole training/planning run (~15-50 s); the slow tier, which CI runs
def test_a_default_run_balances_and_the_release_rule_still_collapses(tiny_corpus, tmp_path):
    """The default-tier version of the issue's bar (the slow test below runs the issue's own command):
    tiny on the test corpus, 10 steps of 8 x 64 tokens. Default flags keep every MoE layer's max/mean load,
    as processed and as the routers picked it before the capacity bound, <= 1.5 over the last 5 steps
    (measured: <= 1.24); `--balance release` still sends most layers to the ceiling of 8/3 within 5
    steps, as the old defaults did."""
    runs = {}
    for name, flags in (("default", []), ("release", ["--balance", "release"])):
        out = tmp_path / name
        assert (
            main(
                [
                    "train",
                    "--preset",
                    "tiny",
                    "--data",
                    tiny_corpus,
                    "--out",
                    str(out),
                    "--steps",
                    str(FAST_STEPS),
                    "--batch-size",
                    "8",
                    "--seq-len",
                    "64",
                    "--eval-every",
                    str(FAST_STEPS),
                    "--eval-batches",
                    "1",
                    "--save-every",
                    str(FAST_STEPS),
                    "--threads",
                    "1",
                    *flags,
                ]
            )
            == 0
        )
        runs[name] = routing(out)[-FAST_TAIL:]
    default, release = runs["default"], runs["release"]
    assert [r["step"] for r in default] == list(range(FAST_STEPS - FAST_TAIL + 1, FAST_STEPS + 1))
    assert len(default[0]["load_ratio"]) == 10
    assert max(worst_per_layer(default, "load_ratio")) <= 1.5
    assert max(worst_per_layer(default, "load_ratio_natural")) <= 1.5  # the routers' own picks, not the bound
    assert "load_ratio_natural" not in release[0]  # no capacity bound under the release's rule
    assert sum(w >= 2.4 for w in worst_per_layer(release, "load_ratio")) >= 5, worst_per_layer(release, "load_ratio")


@pytest.mark.slow
def test_the_issues_default_tiny_run_keeps_every_layer_balanced(tmp_path):
    """Issue 33's bar, with its command: `dsv41 train --preset tiny --steps 60` (default data, batch, length
    and balancing) keeps every MoE layer's max/mean load <= 1.5 over its last 20 steps, bounded and as the
    routers picked it. Several minutes on 2 cores."""
    out = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--steps", "60", "--out", str(out)]) == 0
    rows = routing(out)
    assert [r["step"] for r in rows] == list(range(1, 61))
    tail = rows[-20:]
    assert max(worst_per_layer(tail, "load_ratio")) <= 1.5
    assert max(worst_per_layer(tail, "load_ratio_natural")) <= 1.5


def test_newton_schulz_precision_follows_the_device():
    """--ns-dtype's default: fp32 on CPU (bf16 matmuls without AVX512-bf16 are ~17x slower there), bf16
    on CUDA; a given value wins, and the resolved value is what the run saves (so resumes compare it)."""
    assert TrainConfig(preset="tiny", device="cpu").resolved().ns_dtype == "fp32"
    assert TrainConfig(preset="tiny", device="cuda").resolved().ns_dtype == "bf16"
    assert TrainConfig(preset="tiny", device="cpu", ns_dtype="bf16").resolved().ns_dtype == "bf16"
    auto = TrainConfig(preset="tiny").resolved().ns_dtype
    assert auto == ("bf16" if torch.cuda.is_available() else "fp32")
