"""The training-side commands of the command line (`dsv41.cli.main` dispatches to them):

- `dsv41 train`: pre-training (`dsv41.train`), every `TrainConfig` field an option;
- `dsv41 train-drafter`: a DSpark drafter for a trained checkpoint (`dsv41.train.drafter`);
- `dsv41 rl sft|grpo|distill|eval|choice`: post-training with reasoning effort (`dsv41.rl`);
- `dsv41 eval ppl|passkey|niah|vartrack|recall|cost|all`: evaluations of a model (`dsv41.eval`,
  docs/eval.md), every field of the eval's config dataclass an option.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from dsv41.cli_options import (
    RUNNABLE_PRESETS,
    THREADS_HELP,
    add_engine_args,
    add_field_option,
    engine_fields,
    positive_int,
    set_threads,
)


def add_training_commands(sub) -> None:
    """Add train, train-drafter, rl and eval to the `dsv41` subcommand parsers `sub`."""
    p_train = sub.add_parser("train", help="pre-train from scratch (V4.1 recipe; torchrun for FSDP2)")
    _add_train_args(p_train)
    p_train.set_defaults(func=cmd_train)

    p_draft = sub.add_parser(
        "train-drafter",
        help="train a DSpark drafter (mtp.*) for a trained checkpoint, "
        "backbone frozen; then serve it with --speculative",
    )
    _add_drafter_args(p_draft)
    p_draft.set_defaults(func=cmd_train_drafter)

    p_rl = sub.add_parser(
        "rl",
        help="post-training with reasoning effort: sft warm-start, graded GRPO, on-policy "
        "distillation, evaluation per effort (dsv41 rl COMMAND --help)",
    )
    rl_sub = p_rl.add_subparsers(
        dest="rl_command",
        required=True,
        metavar="COMMAND",
        help="the post-training step to run: sft, grpo, distill, eval or choice",
    )
    p_sft = rl_sub.add_parser(
        "sft",
        help="warm-start a model on effort-tagged chat samples (arithmetic, direct or "
        "scratchpad replies), the base for `dsv41 rl grpo`",
    )
    _add_train_args(p_sft)
    p_sft.add_argument(
        "--task", default="arithmetic", choices=["arithmetic"], help="the samples' task (default: arithmetic)"
    )
    p_sft.add_argument(
        "--min-digits", type=positive_int, default=2, metavar="N", help="fewest digits per operand (default: 2)"
    )
    p_sft.add_argument(
        "--max-digits", type=positive_int, default=4, metavar="N", help="most digits per operand (default: 4)"
    )
    p_sft.add_argument(
        "--vocab-size",
        type=positive_int,
        metavar="N",
        help=(
            "vocabulary of the byte-level model (at least 266: bytes, BOS/EOS/PAD and the chat markers; default: "
            "the preset's)"
        ),
    )
    p_sft.add_argument(
        "--effort-echo",
        type=float,
        default=0.0,
        metavar="P",
        help=(
            "fraction of samples asking 'What is your reasoning effort?', answered '{b}</think>{b}': the model learns "
            "to read its effort line where a reply starts, never what to do with it (default: 0)"
        ),
    )
    p_sft.add_argument(
        "--style-effort-slope",
        type=float,
        default=0.0,
        metavar="S",
        help=(
            "P(scratchpad | b) = 0.5 + S (b - 50.5) / 99: 0 draws the two styles independently of the effort b, a "
            "negative S makes long replies less likely at high effort (default: 0)"
        ),
    )
    p_sft.add_argument(
        "--effort-line",
        action=argparse.BooleanOptionalAction,
        default=False,
        help=(
            "every reply opens its reasoning with its effort as three digits ('025' + newline), the styles still "
            "drawn independently of it (default: off)"
        ),
    )
    p_sft.add_argument(
        "--effort-set",
        default="25,50,75,100",
        metavar="B,...",
        help=("the efforts --effort-set-share draws from, RL's set (default: 25,50,75,100)"),
    )
    p_sft.add_argument(
        "--effort-set-share",
        type=float,
        default=0.0,
        metavar="P",
        help=("fraction of samples whose effort comes from --effort-set instead of uniformly from 1..100 (default: 0)"),
    )
    p_sft.set_defaults(func=cmd_rl_sft)
    for name, text in (
        (
            "grpo",
            "graded GRPO with reasoning effort on verifiable tasks (rollouts from the engine, "
            "grades from the sandbox, router replay); torchrun for several learner processes",
        ),
        (
            "distill",
            "on-policy distillation: the student samples, --teachers score every token (full-vocabulary reverse KL)",
        ),
        ("eval", "held-out accuracy and response length of --model at every effort"),
    ):
        p = rl_sub.add_parser(name, help=text)
        _add_rl_args(p)
        p.set_defaults(func=cmd_rl, rl_algorithm=name)

    p_choice = rl_sub.add_parser(
        "choice",
        help=(
            "P(</think> next) right after the effort line, per effort: how much the model's choice between a "
            "scratchpad and a direct answer depends on b (exact probabilities, no sampling)"
        ),
    )
    p_choice.add_argument("--model", required=True, metavar="PATH", help="a checkpoint folder (or a preset name)")
    p_choice.add_argument(
        "--efforts", default="1,25,50,75,100", metavar="B,...", help="the efforts to probe (default: 1,25,50,75,100)"
    )
    p_choice.add_argument(
        "--prompts",
        type=positive_int,
        default=16,
        metavar="N",
        help="held-out arithmetic tasks averaged over (default: 16)",
    )
    p_choice.add_argument(
        "--min-digits",
        type=positive_int,
        default=2,
        metavar="N",
        help="fewest digits per operand of the held-out additions (default: 2)",
    )
    p_choice.add_argument(
        "--max-digits",
        type=positive_int,
        default=2,
        metavar="N",
        help="most digits per operand of the held-out additions (default: 2)",
    )
    p_choice.add_argument(
        "--effort-line",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "probe after the reply's effort line, as `rl sft --effort-line` models write it; --no-effort-line "
            "probes right after <think> (default: on)"
        ),
    )
    p_choice.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    p_choice.set_defaults(func=cmd_rl_choice)

    p_eval = sub.add_parser(
        "eval",
        help="evaluate a model: perplexity, passkey / needle-in-a-haystack / variable "
        "tracking over lengths and depths, indexer recall, the cost of bounded "
        "replay and FP4 KV (dsv41 eval COMMAND --help)",
    )
    eval_sub = p_eval.add_subparsers(
        dest="eval_command",
        required=True,
        metavar="COMMAND",
        help="the evaluation to run: ppl, passkey, niah, vartrack, recall, cost or all",
    )
    for name, text in EVAL_HELP.items():
        p = eval_sub.add_parser(name, help=text)
        _add_eval_args(p, name)
        p.set_defaults(func=cmd_eval, eval_name=name)


def cmd_train(args) -> int:
    from dsv41.train import TrainConfig, train

    given = {
        f.name: getattr(args, f"train_{f.name}")
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f"train_{f.name}", None) is not None
    }
    last = train(TrainConfig(**given))
    if last:
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}
        print(json.dumps(shown))
    return 0


def _effort_list(text: str, option: str = "--effort-set") -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise SystemExit(f"error: {option} must be comma-separated integers, got {text!r}") from None


def cmd_rl_sft(args) -> int:
    from dsv41.config import preset
    from dsv41.rl.sft import EffortTaskText
    from dsv41.tokenizer import ByteTokenizer
    from dsv41.train import TrainConfig, train

    given = {
        f.name: getattr(args, f"train_{f.name}")
        for f in dataclasses.fields(TrainConfig)
        if getattr(args, f"train_{f.name}", None) is not None
    }
    cfg = TrainConfig(**given)
    tokenizer = ByteTokenizer(args.vocab_size or preset(cfg.preset).vocab_size)
    sets = tuple(
        EffortTaskText(
            split,
            tokenizer,
            args.task,
            args.min_digits,
            args.max_digits,
            args.effort_echo,
            args.style_effort_slope,
            args.effort_line,
            _effort_list(args.effort_set),
            args.effort_set_share,
        )
        for split in ("train", "val")
    )
    last = train(cfg, sets)
    if last:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}))
    return 0


def cmd_rl_choice(args) -> int:
    from dsv41.engine.build import build_model
    from dsv41.rl.probe import direct_probabilities

    set_threads(args)
    efforts = _effort_list(args.efforts, "--efforts")
    try:  # bad efforts or digit bounds are refused by the probe and the task maker
        model, tokenizer, _ = build_model(args.model)
        probs = direct_probabilities(
            model, tokenizer, efforts, args.prompts, args.min_digits, args.max_digits, with_line=args.effort_line
        )
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print("| effort | P(direct) |\n|---|---|")
    for b, p in probs.items():
        print(f"| {b} | {p:.3f} |")
    print(json.dumps({"model": args.model, "prompts": args.prompts, "p_direct": probs}))
    return 0


def cmd_rl(args) -> int:
    from dsv41.rl.trainer import RLConfig, RLTrainer

    given = {
        f.name: getattr(args, f"rl_{f.name}")
        for f in dataclasses.fields(RLConfig)
        if getattr(args, f"rl_{f.name}", None) is not None
    }
    if args.rl_algorithm != "eval":
        given["algorithm"] = args.rl_algorithm
        last = RLTrainer(RLConfig(**given)).run()
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}))
        return 0
    trainer = RLTrainer(RLConfig(**given))
    result = {"step": 0, **trainer.evaluate()}
    trainer.close()
    efforts = trainer.gcfg.efforts
    print("| effort | accuracy | mean grade | mean length | reasoning share |\n|---|---|---|---|---|")
    for b in efforts:
        print(
            f"| {b} | {result[f'eval_accuracy_{b}']:.3f} | {result[f'eval_grade_{b}']:.3f} | "
            f"{result[f'eval_length_{b}']:.1f} | {result[f'eval_reasoning_{b}']:.2f} |"
        )

    def style(kind: str) -> str:
        grade, length = result[f"eval_grade_{kind}"], result[f"eval_length_{kind}"]
        return "-" if grade is None else f"{grade:.3f} (mean length {length:.1f})"

    print(f"mean grade of the responses that reason: {style('reasoning')}; that answer directly: {style('direct')}")
    if result["eval_grade_reasoning"] is not None and result["eval_grade_direct"] is not None:
        from dsv41.rl.grpo import shared_push, style_gaps

        gaps = style_gaps(
            (result["eval_grade_reasoning"], result["eval_length_reasoning"]),
            (result["eval_grade_direct"], result["eval_length_direct"]),
            trainer.gcfg,
        )
        push = shared_push(gaps, {b: result[f"eval_reasoning_{b}"] for b in efforts})
        result.update({f"style_gap_{b}": gap for b, gap in gaps.items()}, shared_push=push)
        print(
            "reward of reasoning minus direct under this penalty: "
            + ", ".join(f"b={b} {gap:+.2f}" for b, gap in gaps.items())
            + f"; shared push {push:+.3f} (> 0: every effort towards reasoning, < 0: towards direct answers)"
        )
    with open(os.path.join(trainer.cfg.out, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


def _add_rl_args(p: argparse.ArgumentParser) -> None:
    from dsv41.rl.trainer import RLConfig

    for f in dataclasses.fields(RLConfig):
        if f.name == "algorithm":
            continue  # the subcommand
        add_field_option(p, f, f"rl_{f.name}", **({"type": str} if f.name in ("model", "ray_address") else {}))


EVAL_HELP = {
    "ppl": "perplexity of held-out text (--data or --text) and NLL by position in the context",
    "passkey": "passkey retrieval over a grid of prompt lengths x needle depths (heat map)",
    "niah": "needle in a haystack over lengths x depths: one needle, or --keys N distinct ones of which the "
    "question asks for --queries",
    "vartrack": "RULER-style variable tracking (a chain of --hops assignments) over lengths x depths",
    "recall": "indexer recall: the share of the dense attention mass over the compressed cache that the "
    "selected top-k captures, per layer and context length",
    "cost": "what bounded-replay prefill and FP4 KV cost against full prefill and a bf16 KV cache on the same "
    "prompts (continuation NLL, KL, greedy agreement)",
    "all": "every evaluation above in one run (ppl only with --data or --text), tables in OUT/all.md",
}


def _add_eval_args(p: argparse.ArgumentParser, name: str) -> None:
    from dsv41.eval.suite import EVALS

    cls, _, engine = EVALS[name]
    # the subcommand is the task; the other tasks' shape options do not apply
    left_out = {"task"} | {
        "passkey": {"keys", "queries", "hops"},
        "niah": {"hops"},
        "vartrack": {"keys", "queries"},
    }.get(name, set())
    for f in dataclasses.fields(cls):
        if f.name in left_out:
            continue
        add_field_option(p, f, f"eval_{f.name}")
    p.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    if engine:
        add_engine_args(p)


def cmd_eval(args) -> int:
    from dsv41.eval.suite import EVALS

    cls, run, engine = EVALS[args.eval_name]
    given = {
        f.name: getattr(args, f"eval_{f.name}")
        for f in dataclasses.fields(cls)
        if getattr(args, f"eval_{f.name}", None) is not None
    }
    if "task" in {f.name for f in dataclasses.fields(cls)}:
        given["task"] = args.eval_name
    set_threads(args)
    cfg = cls(**given)
    if engine:
        _, fields = engine_fields()
        overrides = {
            f.name: getattr(args, f"engine_{f.name}")
            for f in fields
            if getattr(args, f"engine_{f.name}", None) is not None
        }
        run(cfg, overrides)
    else:
        run(cfg)
    return 0


def cmd_train_drafter(args) -> int:
    from dsv41.train.drafter import DrafterConfig, train_drafter

    given = {
        f.name: getattr(args, f"drafter_{f.name}")
        for f in dataclasses.fields(DrafterConfig)
        if getattr(args, f"drafter_{f.name}", None) is not None
    }
    last = train_drafter(DrafterConfig(**given))
    print(json.dumps({"step": last["step"], "draft_loss": round(last["draft_loss"], 4), **last.get("val", {})}))
    return 0


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    from dsv41.train.drafter import DrafterConfig

    for f in dataclasses.fields(DrafterConfig):
        add_field_option(p, f, f"drafter_{f.name}", **({"type": str} if f.name in ("model", "data") else {}))


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from dsv41.train import TrainConfig

    overrides = {"preset": {"choices": RUNNABLE_PRESETS}, "data": {"type": str}}
    for f in dataclasses.fields(TrainConfig):
        add_field_option(p, f, f"train_{f.name}", **overrides.get(f.name, {}))
