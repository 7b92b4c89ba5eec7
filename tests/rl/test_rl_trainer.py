"""The RL loop end to end on `tiny`: one process, a resumed run, two learner processes (torchrun, gloo)
against one, and the rollout + sandbox side on two Ray workers."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dsv41.rl.trainer import RLConfig, RLTrainer, parse_teachers
from dsv41.weights import load_model

FAST = dict(
    model="tiny",
    steps=2,
    prompts_per_step=2,
    efforts="25,100",
    group_size=2,
    max_new_tokens=6,
    eval_every=2,
    eval_prompts=2,
    eval_samples=1,
    grader="local",
    max_num_seqs=16,
    minibatches=2,
    threads=1,
)


def _rows(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


@pytest.mark.slow  # a whole training/planning run (~15-50 s); the slow tier, which CI runs
def test_a_grpo_run_writes_its_folder_and_resumes(tmp_path):
    out = str(tmp_path / "run")
    RLTrainer(RLConfig(out=out, **FAST)).run()
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        # the first minibatch of a step is on-policy: the learner's ratio is exactly 1 (bit-exact replay)
        assert r["first_ratio_max_deviation"] == 0.0
        assert r["rollouts"] == 2 * 2 * 2
        assert {f"train_length_{b}" for b in (25, 100)} <= set(r)
    assert {"eval_accuracy_25", "eval_length_100"} <= set(rows[-1])
    # every effort has the same number of eval samples: the overall grade is the mean of the per-effort ones
    assert rows[-1]["eval_grade"] == pytest.approx((rows[-1]["eval_grade_25"] + rows[-1]["eval_grade_100"]) / 2)
    for name in ("effort.md", "effort.png", "checkpoint/config.json", "train_state/state.json"):
        assert os.path.exists(os.path.join(out, name)), name
    served = load_model(os.path.join(out, "checkpoint"))
    assert served.cfg.n_layers == 10
    # resume: the state says step 2; asking for 3 steps runs exactly one more
    RLTrainer(RLConfig(out=out, **{**FAST, "steps": 3})).run()
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3]


def _reverse_kl(student, teacher, ids) -> float:
    """Mean over positions of KL(pi_s || pi_T) over the whole vocabulary, by plain forwards."""
    with torch.no_grad():
        log_s = torch.log_softmax(student(ids).float(), -1)
        log_t = torch.log_softmax(teacher(ids).float(), -1)
    return float((log_s.exp() * (log_s - log_t)).sum(-1).mean())


@pytest.mark.slow  # a whole training/planning run (~15-50 s); the slow tier, which CI runs
def test_a_distillation_run_lowers_nothing_it_should_not(tmp_path):
    """A student (seed 0) distilled from a teacher of another initialisation (seed 7): the teacher is left
    as it was, in the trainer and on disk; the student's weights moved; and its reverse KL to the teacher
    on fixed task prompts (computed here from plain forwards) is lower after the run than before."""
    from dsv41.engine.build import build_model
    from dsv41.rl.rollout import chat_prompt
    from dsv41.rl.tasks import make_task

    teacher_dir = tmp_path / "teacher"
    RLTrainer(RLConfig(out=str(teacher_dir), **{**FAST, "steps": 1, "seed": 7})).run()
    ckpt = teacher_dir / "checkpoint"
    on_disk = {f: (ckpt / f).read_bytes() for f in sorted(os.listdir(ckpt)) if (ckpt / f).is_file()}
    teacher = load_model(str(ckpt)).eval()
    student0, tokenizer, _ = build_model("tiny", seed=0)
    student0.eval()
    prompts = [chat_prompt(tokenizer, make_task("arithmetic", "eval", 3, i).messages(), 25) for i in range(4)]
    width = min(len(p) for p in prompts)
    ids = torch.tensor([p[:width] for p in prompts])
    kl_before = _reverse_kl(student0, teacher, ids)

    out = str(tmp_path / "distill")
    trainer = RLTrainer(RLConfig(out=out, algorithm="distill", teachers=f"arithmetic={ckpt}", **{**FAST, "steps": 2}))
    trainer.run()
    rows = _rows(out)
    assert [r["step"] for r in rows[1:]] == [1, 2] and all(r["distill_kl"] > 0 for r in rows[1:])
    (used,) = trainer.teachers.values()
    for (name, a), b in zip(used.state_dict().items(), teacher.state_dict().values()):
        assert torch.equal(a, b), name  # the teacher in the trainer did not train
    assert {f: (ckpt / f).read_bytes() for f in on_disk} == on_disk
    student = trainer.policy.policy.eval()
    moved = [
        n
        for (n, a), b in zip(student.state_dict().items(), student0.state_dict().values())
        if a.is_floating_point() and not torch.equal(a, b)
    ]
    assert len(moved) > 10
    kl_after = _reverse_kl(student, teacher, ids)
    assert kl_after < kl_before, (kl_before, kl_after)  # 0.0262 -> 0.0253
    assert parse_teachers("arithmetic=a,program=b") == {"arithmetic": "a", "program": "b"}
    assert parse_teachers("x/y") == {"*": "x/y"}


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="teachers"):
        RLConfig(algorithm="distill").validate()
    with pytest.raises(ValueError, match="grader sandbox"):
        RLConfig(task="program", grader="local").validate()
    with pytest.raises(ValueError, match="efforts"):
        RLConfig(efforts="25,x").validate()


def _cli(out, nproc, prompts, model="tiny", steps=2, extra=()):
    args = [
        "rl",
        "grpo",
        "--model",
        str(model),
        "--out",
        str(out),
        "--steps",
        str(steps),
        "--prompts-per-step",
        str(prompts),
        "--efforts",
        "25,100",
        "--group-size",
        "2",
        "--max-new-tokens",
        "6",
        "--eval-every",
        "2",
        "--eval-prompts",
        "2",
        "--eval-samples",
        "1",
        "--grader",
        "local",
        "--max-num-seqs",
        "16",
        "--minibatches",
        "1",
        "--threads",
        "1",
        *extra,
    ]
    if nproc == 1:
        cmd = [sys.executable, "-m", "dsv41.cli", *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "dsv41.cli",
            *args,
        ]
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return _rows(out)


def _eos_prone_tiny(folder):
    """`tiny` (seed 0) with its head's end-of-sequence row made long (norm 8, a random direction), so the
    random policy ends some responses early: lengths, hence rewards (length penalty), differ within the
    (prompt, effort) subgroups and the advantages are not all 0, as they are for plain `tiny`, where
    every response runs to --max-new-tokens and scores 0."""
    from dsv41.engine.build import build_model
    from dsv41.train.checkpoint import save_checkpoint

    model, _, _ = build_model("tiny", seed=0)
    with torch.no_grad():
        row = torch.randn(model.cfg.dim, generator=torch.Generator().manual_seed(1))
        model.head.weight[model.cfg.eos_token_id] = row * (8 / row.norm())
    save_checkpoint(str(folder), model, model.cfg, None)


def _relative_gap(a: dict, b: dict, names) -> float:
    """||b - a|| / ||a|| over the named tensors of two state dicts, together."""
    num = den = 0.0
    for name in names:
        x, y = a[name].double(), b[name].double()
        num += float((y - x).pow(2).sum())
        den += float(x.pow(2).sum())
    return (num / den) ** 0.5


@pytest.mark.slow  # three runs in subprocesses (~90 s on a loaded 2-core machine); CI runs -m slow
@pytest.mark.skipif(not dist.is_gloo_available(), reason="gloo is not available")
def test_two_learner_processes_match_one(tmp_path):
    """Two processes, one prompt each per step, against one process with both prompts, for one step from a
    policy whose rewards differ within groups (so the loss and the update are not 0): the same samples
    (seeds follow the global task index), the same logged loss (normalised by all ranks' tokens), the
    same gradient and the same update.

    The gradient is read from the optimizer state (Muon's and the Sinkhorn optimizer's momentum, AdamW's
    moments: after one step, the averaged, clipped gradient): it agrees to 0.3-0.5% (measured), the
    rounding of the bf16 forward on 8 rows against 4. The weights' update (w - start, fp32 masters) is
    compared where it is a smooth function of that gradient, on every tensor Muon does not orthogonalise
    (vectors, embedding, head: 1.3% measured). Muon's update of a low-rank gradient (a few responses) is
    not: its iteration grows the gradient's weakest directions to full size, so a 0.3% difference in the
    gradient gives a 49% different update of the matrices, whichever the Newton-Schulz precision (measured
    in fp32 too); there only its size is checked."""
    from safetensors.torch import load_file

    _eos_prone_tiny(tmp_path / "policy")
    start = load_model(str(tmp_path / "policy")).state_dict()
    one = _cli(tmp_path / "one", 1, 2, model=tmp_path / "policy", steps=1)
    two = _cli(tmp_path / "two", 2, 1, model=tmp_path / "policy", steps=1)
    a, b = one[1], two[1]  # both start from the same weights, so the rollouts are identical
    for key in ("train_accuracy", "train_length", "rollouts", "train_reward_25", "train_reward_100"):
        assert a[key] == b[key], key
    assert b["first_ratio_max_deviation"] == 0.0
    assert a["loss"] > 0.1 and abs(a["loss"] - b["loss"]) < 1e-5, (a["loss"], b["loss"])  # measured 0.349

    o1, o2 = (load_file(str(tmp_path / run / "train_state" / "optimizer.safetensors")) for run in ("one", "two"))
    assert set(o1) == set(o2)
    for kind in ("muon.state", "sink.state", "adamw.state"):
        names = [k for k in o1 if kind in k and not k.endswith(".step")]
        assert names and sum(float(o1[k].abs().sum()) for k in names) > 0, kind
        gap = _relative_gap(o1, o2, names)
        assert gap < 0.02, (kind, gap)

    w1, w2 = (load_file(str(tmp_path / run / "train_state" / "weights.safetensors")) for run in ("one", "two"))
    trained = [k for k, v in w1.items() if v.dtype == torch.float32]  # the fp32 masters (the rest is frozen)
    move1 = {k: w1[k].double() - start[k].double() for k in trained}
    move2 = {k: w2[k].double() - start[k].double() for k in trained}
    smooth = [k for k in trained if w1[k].ndim < 2 or k in ("embed.weight", "head.weight")]
    gap = _relative_gap(move1, move2, smooth)
    assert gap < 0.05, gap
    for move in (move1, move2):  # measured 0.062 (the old all-zero-advantage run moved no value over 6e-5)
        size = sum(float(m.pow(2).sum()) for m in move.values()) ** 0.5
        assert size > 0.03, size


@pytest.mark.slow  # starts a Ray cluster with four actors (~35 s alone, minutes on a loaded machine); CI runs -m slow
def test_rollouts_and_sandboxes_on_two_ray_workers(tmp_path):
    pytest.importorskip("ray")
    import ray

    cfg = RLConfig(
        out=str(tmp_path / "ray"),
        **{**FAST, "steps": 1, "task": "mixed", "grader": "sandbox", "rollout_workers": 2, "sandbox_workers": 2},
    )
    trainer = RLTrainer(cfg)
    try:
        where = trainer.workers.where()
        assert len({pid for _, pid in where}) == 2 and os.getpid() not in {pid for _, pid in where}
        row = trainer.train_step()
        # the actors' engines computed what the learner replays, bit for bit, in other processes
        assert row["first_ratio_max_deviation"] == 0.0 and row["rollouts"] == 8
        # program tasks were graded by running code in the Ray sandboxes: a wrong program scores 0
        from dsv41.rl.tasks import grade_responses, program_task

        task = program_task("train", 0, 0)
        good = "</think>```python\n" + task.answer + "```"
        assert grade_responses([task, task], [good, "</think>def f(x):\n    while True: pass"], trainer.pool) == [
            1.0,
            0.0,
        ]
    finally:
        trainer.close()
        ray.shutdown()


def test_the_effort_summary_counts_each_effort_apart():
    from types import SimpleNamespace

    def rollout(effort, grade, length, reasoning):
        return SimpleNamespace(
            tag=(0, effort),
            completion_ids=[1] * length,
            values={"grade": grade, "reasons": reasoning, "reward": grade - 0.1},
        )

    rollouts = [
        rollout(25, 1.0, 4, False),
        rollout(25, 0.5, 4, False),
        rollout(25, 1.0, 20, True),
        rollout(100, 1.0, 20, True),
        rollout(100, 0.0, 22, True),
    ]
    host = SimpleNamespace(gcfg=SimpleNamespace(efforts=(25, 100)), distributed=False)
    out = RLTrainer._effort_summary(host, rollouts, "eval")
    assert out["eval_accuracy_25"] == pytest.approx(2 / 3) and out["eval_accuracy_100"] == 0.5
    assert out["eval_grade_25"] == pytest.approx(2.5 / 3) and out["eval_length_100"] == 21
    assert out["eval_reasoning_25"] == pytest.approx(1 / 3) and out["eval_reasoning_100"] == 1.0
    assert out["eval_reasoning"] == pytest.approx(3 / 5) and out["eval_samples"] == 5
    assert out["eval_grade_reasoning"] == pytest.approx(2 / 3) and out["eval_grade_direct"] == 0.75
    only_direct = RLTrainer._effort_summary(host, rollouts[:2], "eval")
    assert only_direct["eval_grade_reasoning"] is None and only_direct["eval_grade_direct"] == 0.75
    assert out["eval_length_reasoning"] == pytest.approx(62 / 3) and out["eval_length_direct"] == 4
    assert only_direct["eval_length_reasoning"] is None and only_direct["eval_length_direct"] == 4
    assert "eval_reward_25" not in out


def test_rl_eval_prints_the_table_per_effort_and_writes_its_json(tmp_path, capsys):
    from dsv41.cli import main

    out = tmp_path / "eval"
    assert (
        main(
            [
                "rl",
                "eval",
                "--model",
                "tiny",
                "--out",
                str(out),
                "--efforts",
                "25,100",
                "--eval-prompts",
                "2",
                "--eval-samples",
                "2",
                "--max-new-tokens",
                "6",
                "--grader",
                "local",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.load(open(out / "eval.json"))
    assert result["eval_samples"] == 2 * 2 * 2
    for b in (25, 100):  # one table row per effort, its numbers those of the JSON
        assert f"| {b} | {result[f'eval_accuracy_{b}']:.3f} | {result[f'eval_grade_{b}']:.3f} | " in printed
        assert 0.0 <= result[f"eval_reasoning_{b}"] <= 1.0
    assert "mean grade of the responses that reason" in printed


def test_rl_eval_reports_what_the_penalty_asks_of_each_effort(tmp_path, capsys, monkeypatch):
    from dsv41.cli import main

    summary = {
        "eval_grade_reasoning": 0.9,
        "eval_length_reasoning": 20.0,
        "eval_grade_direct": 0.4,
        "eval_length_direct": 8.0,
    }
    for b, share in ((25, 0.5), (100, 0.2)):
        summary.update(
            {f"eval_accuracy_{b}": 0.5, f"eval_grade_{b}": 0.6, f"eval_length_{b}": 12.0, f"eval_reasoning_{b}": share}
        )
    monkeypatch.setattr(RLTrainer, "evaluate", lambda self: dict(summary))
    out = tmp_path / "eval"
    assert (
        main(
            [
                "rl",
                "eval",
                "--model",
                "tiny",
                "--out",
                str(out),
                "--efforts",
                "25,100",
                "--k0",
                "0.5",
                "--tau",
                "25",
                "--c-max",
                "100",
                "--l-norm",
                "8",
                "--grader",
                "local",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    result = json.load(open(out / "eval.json"))
    gap25, gap100 = 0.5 - 0.5 * 12 / 8, 0.5 - 0.5 * math.exp(-3) * 12 / 8  # grade gap - k(b) * length gap / L_norm
    assert result["style_gap_25"] == pytest.approx(gap25) and result["style_gap_100"] == pytest.approx(gap100)
    assert result["shared_push"] == pytest.approx(0.25 * gap25 + 0.16 * gap100)
    assert f"b=25 {gap25:+.2f}, b=100 {gap100:+.2f}; shared push {0.25 * gap25 + 0.16 * gap100:+.3f}" in printed
