"""Resume safety (issue 11): a kill at any point of a save loses nothing, a resume does not keep the metrics
of redone steps nor train under changed flags unasked, the training state does not grow, and the default
warm-up fits short runs."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dsv41.train import TrainConfig, Trainer
from dsv41.train.trainer import lr_scale


class Killed(BaseException):
    """A kill: not an Exception, so nothing on its way catches it."""


def config(data, out, **kw):
    base = dict(
        preset="tiny",
        data=data,
        out=str(out),
        steps=4,
        batch_size=2,
        seq_len=32,
        warmup=1,
        eval_every=100,
        eval_batches=1,
        save_every=2,
        threads=1,
    )
    base.update(kw)
    return TrainConfig(**base)


def weights_of(trainer):
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def steps_in(path):
    return [json.loads(line)["step"] for line in open(path)]


def train_and_save(trainer, steps):
    for _ in range(steps):
        trainer.train_step()
    trainer.save()


# ---------------------------------------------------------------- defect 3: a kill during a save
def test_a_kill_between_the_swap_renames_resumes_from_the_new_state(tiny_corpus, tmp_path, monkeypatch):
    trainer = Trainer(config(tiny_corpus, tmp_path))
    train_and_save(trainer, 2)
    for _ in range(2):
        trainer.train_step()
    real = os.replace

    def kill_before_the_second_rename(src, dst, *args, **kw):
        if str(src).endswith("train_state.tmp"):  # train_state -> train_state.old is done
            raise Killed
        return real(src, dst, *args, **kw)

    monkeypatch.setattr(os, "replace", kill_before_the_second_rename)
    with pytest.raises(Killed):
        trainer.save()
    monkeypatch.undo()
    assert {"train_state.old", "train_state.tmp"} <= set(os.listdir(tmp_path))
    assert "train_state" not in os.listdir(tmp_path)

    resumed = Trainer(config(tiny_corpus, tmp_path))
    assert resumed.step == 4  # the finished .tmp, not a silent restart from step 0
    expected = weights_of(trainer)
    assert all(torch.equal(p, expected[name]) for name, p in resumed.model.named_parameters())
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".tmp", ".old"))]
    # the kill came before checkpoint/ was written at step 4: the resume rewrote it from the state
    assert json.load(open(tmp_path / "checkpoint" / "dsv41_train.json"))["train_step"] == 4


def test_a_tmp_without_its_marker_is_not_taken_for_a_state(tiny_corpus, tmp_path):
    trainer = Trainer(config(tiny_corpus, tmp_path))
    train_and_save(trainer, 2)
    at_two = weights_of(trainer)
    shutil.copytree(tmp_path / "train_state", tmp_path / "step2")
    train_and_save(trainer, 2)
    # as if killed while the step-4 state was being written, after the step-2 one was moved aside:
    # all its files there, the weights cut short, no completion marker
    os.replace(tmp_path / "train_state", tmp_path / "train_state.tmp")
    os.replace(tmp_path / "step2", tmp_path / "train_state.old")
    (tmp_path / "train_state.tmp" / "COMPLETE").unlink(missing_ok=True)
    cut = tmp_path / "train_state.tmp" / "weights.safetensors"
    os.truncate(cut, cut.stat().st_size // 2)

    resumed = Trainer(config(tiny_corpus, tmp_path))
    assert resumed.step == 2
    assert all(torch.equal(p, at_two[name]) for name, p in resumed.model.named_parameters())
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("train_state")) == ["train_state"]


def test_a_checkpoint_behind_the_state_is_reported_and_rewritten(tiny_corpus, tmp_path, monkeypatch, capsys):
    from dsv41.train import trainer as trainer_module
    from dsv41.train.checkpoint import inference_state

    trainer = Trainer(config(tiny_corpus, tmp_path))
    train_and_save(trainer, 2)

    def killed(*args, **kw):
        raise Killed

    monkeypatch.setattr(trainer_module, "save_checkpoint", killed)  # killed between the two writes
    with pytest.raises(Killed):
        train_and_save(trainer, 2)
    monkeypatch.undo()
    capsys.readouterr()

    resumed = Trainer(config(tiny_corpus, tmp_path))
    assert resumed.step == 4
    log = capsys.readouterr().err
    assert "checkpoint is from step 2, the training state from step 4" in log
    info = json.load(open(tmp_path / "checkpoint" / "dsv41_train.json"))
    assert info["train_step"] == 4
    saved = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    now = inference_state(resumed.model, resumed.model_cfg)
    assert set(saved) == set(now) and all(torch.equal(saved[k], now[k]) for k in now)


def test_the_checkpoint_is_named_after_its_run(tiny_corpus, tmp_path):
    from dsv41.engine import build_engine

    Trainer(config(tiny_corpus, tmp_path / "smoke", steps=1)).run()
    info = json.load(open(tmp_path / "smoke" / "checkpoint" / "dsv41_train.json"))
    assert info["name"] == "dsv41-tiny-smoke" and info["train_step"] == 1
    assert build_engine(str(tmp_path / "smoke" / "checkpoint")).model_name == "dsv41-tiny-smoke"


def test_saves_fsync_before_renaming_and_the_folder_after(tiny_corpus, tmp_path, monkeypatch):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name fsynced descriptors")
    trainer = Trainer(config(tiny_corpus, tmp_path, steps=1))
    trainer.train_step()
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.realpath(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def replace(src, dst, *args, **kw):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return real_replace(src, dst, *args, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    trainer.save()
    monkeypatch.undo()
    root = os.path.realpath(tmp_path)
    for name in ("train_state", "checkpoint"):
        tmp = os.path.join(root, name + ".tmp")
        rename = events.index(("replace", tmp, os.path.join(root, name)))
        synced = {e[1] for e in events[:rename] if e[0] == "fsync"}
        for file in os.listdir(os.path.join(root, name)):
            assert os.path.join(tmp, file) in synced, (name, file)
        assert ("fsync", root) in events[rename:], name


# ---------------------------------------------------------------- defect 4: metrics and flags on resume
def test_a_resume_drops_the_metrics_of_redone_steps_and_plots_the_whole_run(tiny_corpus, tmp_path, monkeypatch):
    from dsv41.train import trainer as trainer_module

    cfg = config(tiny_corpus, tmp_path, steps=6, save_every=4)
    first = Trainer(cfg)
    step = first.train_step

    def step_or_die():
        if first.step == 5:  # killed during step 6: metrics for 1..5 written, the last save at 4
            raise Killed
        return step()

    first.train_step = step_or_die
    with pytest.raises(Killed):
        first.run()
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]

    resumed = Trainer(cfg)
    assert resumed.step == 4
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    plotted = []
    monkeypatch.setattr(trainer_module, "plot_losses", lambda history, path: plotted.extend(history))
    resumed.run()
    assert steps_in(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert [h["step"] for h in plotted] == [1, 2, 3, 4, 5, 6]


def test_a_resume_refuses_flags_that_change_the_run(tiny_corpus, tmp_path):
    Trainer(config(tiny_corpus, tmp_path, steps=2)).run()
    with pytest.raises(ValueError) as err:
        Trainer(config(tiny_corpus, tmp_path, steps=3, lr=1e-3, kl_weight=0.5, eval_every=1, log_every=2))
    text = str(err.value)
    assert "steps: 2 -> 3" in text and "lr: 0.003 -> 0.001" in text and "kl_weight: 1.0 -> 0.5" in text
    assert "eval_every" not in text and "log_every" not in text
    assert "--allow-config-change" in text and "extending --steps" in text
    assert Trainer(config(tiny_corpus, tmp_path, steps=2, eval_every=1, log_every=2)).step == 2  # harmless flags
    assert Trainer(config(tiny_corpus, tmp_path, steps=3, lr=1e-3, allow_config_change=True)).step == 2


def test_run_changes_compares_shared_fields_and_counts_new_ones():
    from dsv41.cli import build_parser
    from dsv41.train.config import run_changes

    saved = {"lr": 1.0, "eval_every": 1, "gone": 1, "new_knob": 1, "steps": 30, "warmup": None, "batch_size": 4}
    now = {"lr": 1.0, "eval_every": 5, "new_knob": 2, "added": 3, "steps": 30, "warmup": 3, "batch_size": 2}
    assert run_changes(saved, now, saved_world=1, world=2) == ["new_knob: 1 -> 2"]  # same global batch
    assert run_changes(saved, now) == ["new_knob: 1 -> 2", "batch_size: 4 -> 2"]
    args = build_parser().parse_args(["train", "--allow-config-change"])
    assert args.train_allow_config_change is True


# ---------------------------------------------------------------- defect 5: the training state stays small
def test_the_train_state_keeps_no_metrics_history(tiny_corpus, tmp_path):
    trainer = Trainer(config(tiny_corpus, tmp_path, steps=3, save_every=1))
    trainer.run()
    state = json.load(open(tmp_path / "train_state" / "state.json"))
    assert state["step"] == 3 and "history" not in state


# ---------------------------------------------------------------- defect 6: warm-up scaled to the run
def test_the_default_warmup_scales_with_the_run():
    smoke = TrainConfig(preset="tiny", steps=30)  # the README smoke run
    assert lr_scale(2, smoke) == 1.0  # peak lr at the end of its 3-step warm-up
    assert lr_scale(0, smoke) == pytest.approx(1 / 3)
    assert smoke.warmup_steps == 3
    assert TrainConfig(steps=5000).warmup_steps == 100 and TrainConfig(steps=5).warmup_steps == 1
    explicit = TrainConfig(steps=30, warmup=20)  # --warmup N still wins
    assert explicit.warmup_steps == 20 and lr_scale(2, explicit) == pytest.approx(3 / 20)
