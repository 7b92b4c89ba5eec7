"""The RL loop: rollouts from the engine, verifiable grades from the sandbox, graded GRPO with reasoning
effort or on-policy distillation, router replay in the learner (training.md §8, spec-v41.md §10).

One step:
1. P prompts (this rank's share of the step's tasks) x each effort b x G samples are queued on the
   rollout engine(s) at once (continuous batching), each sample with its own seed.
2. Each response is graded (the sandbox runs program tasks' code against their tests, and arithmetic
   answers against per-digit tests; `--grader local` grades arithmetic in-process).
3. GRPO: reward = grade - min(C_max, k(b) length / L_norm); advantages within each (prompt, effort)
   subgroup. Distillation: each sample's teacher scores every position over the full vocabulary.
4. The learner (`ReplayPolicy`: fp32 masters computing through the serving model with the rollout's
   expert ids and chunk spans) recomputes the log-probabilities (with the weights of the rollout they
   equal the rollout's bit for bit), and `ppo_epochs` x `minibatches` optimizer steps follow (the
   recipe's Muon / Sinkhorn momentum / AdamW groups). Several processes (torchrun, gloo or NCCL): each
   samples and grades its own prompts, gradients are averaged by DistributedDataParallel with the loss
   normalised by the tokens of all ranks, and every rank takes the same optimizer step.
5. The new weights go to the rollout engine (the local one shares the serving model; Ray actors get the
   serving-dtype tensors).

Every `eval_every` steps: held-out tasks at every effort, `eval_samples` samples each -> accuracy (grade
1), mean grade and mean response length per effort, in metrics.jsonl, `effort.png` and `effort.md`.
The run folder: metrics.jsonl, effort.png, effort.md, checkpoint/ (release layout), train_state/ (resume).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv41.engine import SamplingParams
from dsv41.engine.build import build_model
from dsv41.optim.groups import OptimConfig, build_optimizers
from dsv41.rl.distill import opd_loss, teacher_logits
from dsv41.rl.grpo import ADVANTAGE_SCALES, GRPOConfig, grpo_loss, reward, subgroup_advantages
from dsv41.rl.policy import ReplayPolicy, sequence_logits, sequence_logprobs
from dsv41.rl.rollout import RayRolloutWorkers, RolloutRequest, RolloutWorker, chat_prompt, rollout_engine_config
from dsv41.rl.tasks import grade_responses, make_task, reasons

TASK_KINDS = ("arithmetic", "program", "mixed")


@dataclass
class RLConfig:
    # Each field is a `dsv41 rl grpo|distill --field-name` option with this help text (dsv41.cli).
    model: str = field(
        default="tiny",
        metadata={
            "metavar": "PATH",
            "help": (
                "the policy to start from: a checkpoint folder (e.g. one `dsv41 rl sft` wrote) or a preset name "
                "(random weights, for tests)"
            ),
        },
    )
    out: str = field(
        default="runs/rl",
        metadata={
            "metavar": "DIR",
            "help": (
                "run folder: metrics.jsonl, effort.png, effort.md, checkpoint/, train_state/ (a run resumes from it)"
            ),
        },
    )
    algorithm: str = field(
        default="grpo",
        metadata={
            "choices": ("grpo", "distill"),
            "help": ("grpo: graded GRPO with reasoning effort; distill: on-policy distillation from --teachers"),
        },
    )
    teachers: str = field(
        default="",
        metadata={
            "metavar": "DOMAIN=PATH,...",
            "help": (
                "distill: the teacher checkpoint of each task domain (arithmetic, program), e.g. "
                "'arithmetic=runs/rl/checkpoint'; one PATH without a domain serves all"
            ),
        },
    )
    task: str = field(
        default="arithmetic",
        metadata={
            "choices": TASK_KINDS,
            "help": (
                "verifiable tasks to train on: additions (partial credit per digit), small Python functions "
                "graded by their tests in the sandbox, or both"
            ),
        },
    )
    min_digits: int = field(default=2, metadata={"metavar": "N", "help": "arithmetic: fewest digits per operand"})
    max_digits: int = field(default=4, metadata={"metavar": "N", "help": "arithmetic: most digits per operand"})
    steps: int = field(default=50, metadata={"metavar": "N", "help": "RL steps (rollout batch + updates)"})
    prompts_per_step: int = field(
        default=4,
        metadata={
            "metavar": "N",
            "help": ("tasks per step and process; each is asked at every effort, group-size times"),
        },
    )
    efforts: str = field(
        default="25,50,75,100",
        metadata={"metavar": "B,...", "help": ("reasoning efforts (1-100) every prompt is asked at")},
    )
    group_size: int = field(default=8, metadata={"metavar": "G", "help": "samples per (prompt, effort) subgroup"})
    k0: float = field(default=0.5, metadata={"help": "length penalty at the lowest effort, k(b_min)"})
    tau: float = field(
        default=25.0, metadata={"help": "effort scale of the penalty: k(b) = k0 exp(-(b - b_min) / tau)"}
    )
    c_max: float = field(default=0.5, metadata={"help": "cap of the length penalty"})
    l_norm: float = field(default=64.0, metadata={"help": "response tokens that cost k(b)"})
    scale_rewards: str = field(
        default="group",
        metadata={
            "choices": ADVANTAGE_SCALES,
            "help": (
                "group: advantages (r - mean) / std within each (prompt, effort) subgroup (GRPO); none: r - mean "
                "(Dr. GRPO), so subgroups push in proportion to their reward differences"
            ),
        },
    )
    clip_low: float = field(default=0.2, metadata={"help": "PPO clip: ratio >= 1 - clip_low"})
    clip_high: float = field(default=0.28, metadata={"help": "PPO clip: ratio <= 1 + clip_high"})
    kl_coef: float = field(default=0.0, metadata={"help": "weight of the K3 KL to the starting policy (0: none)"})
    offpolicy_kl: float = field(
        default=0.5,
        metadata={
            "help": ("drop negative-advantage responses whose mean per-token KL from the rollout policy exceeds this")
        },
    )
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of rollouts and evaluations"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (the learner applies the same support)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling, 0 off (the learner applies the same support)"})
    max_new_tokens: int = field(default=64, metadata={"metavar": "N", "help": "most tokens per response"})
    lr: float = field(default=3e-4, metadata={"help": "learning rate of Muon, AdamW and the Sinkhorn optimizer"})
    ppo_epochs: int = field(default=1, metadata={"metavar": "N", "help": "passes over each rollout batch"})
    minibatches: int = field(default=2, metadata={"metavar": "N", "help": "optimizer steps per pass"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this"})
    eval_every: int = field(
        default=10, metadata={"metavar": "STEPS", "help": "evaluate every this many steps (and at the end)"}
    )
    eval_prompts: int = field(default=32, metadata={"metavar": "N", "help": "held-out tasks per evaluation"})
    eval_samples: int = field(default=2, metadata={"metavar": "N", "help": "samples per held-out task and effort"})
    grader: str = field(
        default="sandbox",
        metadata={
            "choices": ("sandbox", "local"),
            "help": (
                "sandbox: every grade comes from running tests in the sandbox orchestrator; local: arithmetic graded "
                "in-process (program tasks always need the sandbox)"
            ),
        },
    )
    sandbox_workers: int = field(default=2, metadata={"metavar": "N", "help": "concurrent sandbox processes"})
    rollout_workers: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": (
                "0: the rollout engine and sandboxes run in this process; N: N Ray actors with an engine each, and "
                "the sandboxes on Ray too"
            ),
        },
    )
    ray_address: str | None = field(
        default=None,
        metadata={"metavar": "ADDR", "help": ("a running Ray cluster to join (default: start a local one)")},
    )
    max_num_seqs: int = field(
        default=64, metadata={"metavar": "N", "help": "rollout engine: sequences decoded together"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the task stream and of the sampling"})
    threads: int = field(default=0, metadata={"metavar": "N", "help": "torch threads (0: torch's default)"})
    save_every: int = field(
        default=0,
        metadata={
            "metavar": "STEPS",
            "help": ("write checkpoint/ and train_state/ every this many steps (0: at the end only)"),
        },
    )

    def effort_list(self) -> tuple[int, ...]:
        try:
            efforts = tuple(int(b) for b in str(self.efforts).split(",") if b.strip())
        except ValueError:
            raise ValueError(f"RLConfig.efforts must be comma-separated integers, got {self.efforts!r}") from None
        return efforts

    def grpo(self) -> GRPOConfig:
        return GRPOConfig(
            efforts=self.effort_list(),
            group_size=self.group_size,
            k0=self.k0,
            tau=self.tau,
            c_max=self.c_max,
            l_norm=self.l_norm,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            kl_coef=self.kl_coef,
            offpolicy_kl=self.offpolicy_kl,
            scale_rewards=self.scale_rewards,
        )

    def validate(self) -> None:
        self.grpo().validate()
        for name in (
            "steps",
            "prompts_per_step",
            "max_new_tokens",
            "ppo_epochs",
            "minibatches",
            "eval_every",
            "eval_prompts",
            "eval_samples",
            "sandbox_workers",
            "max_num_seqs",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"RLConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.rollout_workers < 0 or self.save_every < 0 or self.threads < 0:
            raise ValueError("RLConfig.rollout_workers, save_every and threads must be >= 0")
        if self.task not in TASK_KINDS:
            raise ValueError(f"RLConfig.task must be one of {TASK_KINDS}, got {self.task!r}")
        if self.algorithm == "distill" and not self.teachers:
            raise ValueError("--algorithm distill needs --teachers DOMAIN=PATH,...")
        if self.task != "arithmetic" and self.grader == "local":
            raise ValueError("program tasks are graded by running code: use --grader sandbox")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError("RLConfig needs 1 <= min_digits <= max_digits")
        if self.lr <= 0 or self.temperature <= 0:
            raise ValueError("RLConfig.lr and temperature must be > 0")


def parse_teachers(text: str) -> dict[str, str]:
    """'arithmetic=PATH,program=PATH' or one 'PATH' (every domain) -> {domain: path}."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        domain, _, path = item.rpartition("=")
        out[domain or "*"] = path
    return out


class RLTrainer:
    def __init__(self, cfg: RLConfig):
        cfg.validate()
        self.cfg = cfg
        self.gcfg = cfg.grpo()
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        os.makedirs(cfg.out, exist_ok=True)

        model, self.tokenizer, self.name = build_model(cfg.model, seed=cfg.seed)
        model.eval()
        self.model_cfg = model.cfg
        self.tokenizer_file = (
            os.path.join(cfg.model, "tokenizer.json")
            if os.path.isfile(os.path.join(cfg.model, "tokenizer.json"))
            else None
        )
        self.reference = None
        if cfg.algorithm == "grpo" and cfg.kl_coef > 0:
            self.reference = copy.deepcopy(model).requires_grad_(False)
        self.teachers: dict = {}
        if cfg.algorithm == "distill":
            for domain, path in parse_teachers(cfg.teachers).items():
                teacher, _, _ = build_model(path, seed=cfg.seed)
                self.teachers[domain] = teacher.eval().requires_grad_(False)
        self.policy = ReplayPolicy(model)
        self.learner = self.policy
        if self.distributed and cfg.algorithm == "grpo":  # distillation averages its gradients by hand
            from torch.nn.parallel import DistributedDataParallel

            # only the trained masters are DDP's (every rank loaded the same weights; the frozen FP8 Engram
            # tables cannot cross gloo, and the buffers are constants)
            frozen = [f"master.{n}" for n, p in self.policy.master.named_parameters() if not p.requires_grad]
            frozen += [f"master.{n}" for n, _ in self.policy.master.named_buffers()]
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(self.policy, frozen)
            self.learner = DistributedDataParallel(self.policy, broadcast_buffers=False)
        self.optimizer = build_optimizers(
            self.policy.master, OptimConfig(lr=cfg.lr, ns_dtype=torch.bfloat16), self.model_cfg
        )
        max_len = 512 + cfg.max_new_tokens
        if cfg.rollout_workers:
            from dsv41.rl.sandbox import RaySandboxPool, _import_ray

            ray = _import_ray()
            if not ray.is_initialized():  # a local cluster with a (logical) CPU for every actor of both kinds
                ray.init(
                    address=cfg.ray_address,
                    include_dashboard=False,
                    log_to_driver=False,
                    num_cpus=None if cfg.ray_address else cfg.rollout_workers + cfg.sandbox_workers,
                )

            self.workers = RayRolloutWorkers(
                model,
                self.tokenizer,
                cfg.rollout_workers,
                rollout_engine_config(max_len, cfg.max_num_seqs),
                address=cfg.ray_address,
            )
            self.pool = RaySandboxPool(cfg.sandbox_workers, address=cfg.ray_address, slot_offset=1000 + 100 * self.rank)
        else:
            from dsv41.rl.sandbox import SandboxPool

            self.workers = RolloutWorker(model, self.tokenizer, rollout_engine_config(max_len, cfg.max_num_seqs))
            self.pool = SandboxPool(cfg.sandbox_workers, slot_offset=100 * self.rank)
        self.step = 0
        self.history: list[dict] = []
        self._resume()

    # ------------------------------------------------------------------ data
    def _task(self, split: str, index: int):
        cfg = self.cfg
        kind = cfg.task
        if kind == "mixed":
            kind = ("arithmetic", "program")[index % 2]
        options = dict(min_digits=cfg.min_digits, max_digits=cfg.max_digits) if kind == "arithmetic" else {}
        return make_task(kind, split, cfg.seed, index, **options)

    def _params(self) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, max_tokens=c.max_new_tokens, logprobs=0
        )

    def _rollouts(self, tasks: list, efforts, samples: int, seed: int, first: int = 0):
        """Rollouts of every task at every effort, `samples` each; each rollout's tag is (task, effort).
        `first`: the global index of tasks[0]: each sample's seed derives from (seed, global task, effort,
        sample), so a run on several processes samples what one process would."""
        requests = [
            RolloutRequest(chat_prompt(self.tokenizer, t.messages(), b), samples, self._params(), (k, b))
            for k, t in enumerate(tasks)
            for b in efforts
        ]
        indices = [(first + k) * len(efforts) + j for k in range(len(tasks)) for j in range(len(efforts))]
        rollouts = self.workers.generate(requests, seed=seed, indices=indices)
        texts = [self.tokenizer.decode(r.completion_ids, skip_special_tokens=True) for r in rollouts]
        grades = grade_responses(
            [tasks[r.tag[0]] for r in rollouts],
            texts,
            self.pool if self.cfg.grader == "sandbox" or self.cfg.task != "arithmetic" else None,
        )
        for r, g, text in zip(rollouts, grades, texts):
            r.values["grade"] = g
            r.values["reasons"] = reasons(text)
        return rollouts

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        cfg, g = self.cfg, self.gcfg
        t0 = time.perf_counter()
        first = (self.step * self.world + self.rank) * cfg.prompts_per_step
        tasks = [self._task("train", first + i) for i in range(cfg.prompts_per_step)]
        rollouts = self._rollouts(tasks, g.efforts, g.group_size, seed=cfg.seed * 1_000_003 + self.step, first=first)
        t_roll = time.perf_counter()
        for r in rollouts:
            r.values["length"] = len(r.completion_ids)
            r.values["reward"] = reward(r.values["grade"], len(r.completion_ids), r.tag[1], g)
        adv = subgroup_advantages(
            [r.values["reward"] for r in rollouts],
            [(tasks[r.tag[0]].uid, r.tag[1]) for r in rollouts],
            g.adv_eps,
            g.scale_rewards,
        )
        rollouts = [r for r in rollouts if r.completion_ids]
        samples = [r.sample() for r in rollouts]
        old = _padded([r.logprobs for r in rollouts])
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref, _ = sequence_logprobs(self.reference, samples, self.policy.row_chunk)
        teacher_domains = [tasks[r.tag[0]].kind for r in rollouts]
        stats = {"loss": [], "policy_loss": [], "kl": [], "clip_fraction": [], "masked": 0, "distill_kl": []}
        first_deviation = None
        order = list(range(len(rollouts)))
        for epoch in range(cfg.ppo_epochs):
            if epoch:  # later passes in another (reproducible) order
                random.Random(f"{cfg.seed}:{self.step}:{epoch}").shuffle(order)
            for part in _split(order, cfg.minibatches):
                if not part:
                    continue
                sub = [samples[i] for i in part]
                self.optimizer.zero_grad(set_to_none=True)
                if cfg.algorithm == "grpo":
                    logp, mask = self.learner(sub)
                    parts = grpo_loss(
                        logp,
                        old[part, : logp.size(1)],
                        None if ref is None else ref[part, : logp.size(1)],
                        adv[part],
                        mask,
                        g,
                    )
                    share = self._token_share(parts.tokens)
                    loss = parts.loss * share
                    if first_deviation is None:
                        first_deviation = parts.ratio_max_deviation
                    # token means scaled like the loss, so that their mean over ranks is the batch's
                    stats["policy_loss"].append(float(parts.policy) * share)
                    stats["kl"].append(float(parts.kl) * share)
                    stats["clip_fraction"].append(parts.clip_fraction * share)
                    stats["masked"] += parts.masked_sequences
                else:
                    domains = [d if d in self.teachers else "*" for d in (teacher_domains[i] for i in part)]
                    target = teacher_logits(self.teachers, sub, domains, self.policy.row_chunk)
                    logits, mask = sequence_logits(
                        self.policy.policy, sub, self.policy.row_chunk, self.policy.cast_weights()
                    )
                    kl = opd_loss(logits, target[:, : logits.size(1)], mask)
                    share = self._token_share(int(mask.sum()))
                    stats["distill_kl"].append(float(kl.detach()) * share)
                    loss = kl * share
                loss.backward()
                if self.distributed and cfg.algorithm == "distill":
                    for p in self.policy.master.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad)
                            p.grad /= self.world
                torch.nn.utils.clip_grad_norm_(
                    [p for p in self.policy.master.parameters() if p.requires_grad], cfg.grad_clip
                )
                self.optimizer.step()
                stats["loss"].append(float(loss.detach()))
        self.policy.sync_policy()
        if isinstance(self.workers, RayRolloutWorkers):
            self.workers.load_weights(self.policy.serving_state())
        self.step += 1
        row = {
            "step": self.step,
            "rollout_s": t_roll - t0,
            "step_s": time.perf_counter() - t0,
            "rollouts": len(rollouts),
            "loss": self._batch_mean(stats["loss"]),
        }
        if cfg.algorithm == "grpo":
            row.update(
                policy_loss=self._batch_mean(stats["policy_loss"]),
                kl=self._batch_mean(stats["kl"]),
                clip_fraction=self._batch_mean(stats["clip_fraction"]),
                masked_sequences=int(self._reduced(stats["masked"], dist.ReduceOp.SUM)),
                first_ratio_max_deviation=self._reduced(first_deviation, dist.ReduceOp.MAX),
            )
        else:
            row["distill_kl"] = self._batch_mean(stats["distill_kl"])
        row.update(self._effort_summary(rollouts, "train"))
        row["rollouts"] = row.pop("train_samples")  # of all ranks
        return row

    def _reduced(self, value, op):
        """`value` (a number, or None for none) reduced over the ranks with `op` (SUM or MAX): None only
        when every rank has none. With one process, `value` itself."""
        if not self.distributed:
            return value
        empty = -math.inf if op == dist.ReduceOp.MAX else 0.0
        t = torch.tensor([empty if value is None else float(value)], dtype=torch.float64)
        present = torch.tensor([float(value is not None)])
        dist.all_reduce(t, op=op)
        dist.all_reduce(present)
        return float(t) if float(present) > 0 else None

    def _batch_mean(self, values: list) -> float | None:
        """The whole batch's figure from this rank's per-minibatch figures scaled by `_token_share`: the
        mean over ranks of their means (rank 0 writes the row; alone, it would log its own share only)."""
        total = self._reduced(_mean(values), dist.ReduceOp.SUM)
        return total / self.world if self.distributed and total is not None else total

    def _token_share(self, tokens: int) -> float:
        """Scale of this rank's mean-over-its-tokens loss so that DDP's gradient average equals the mean
        over every rank's tokens."""
        if not self.distributed:
            return 1.0
        total = torch.tensor([float(tokens)])
        dist.all_reduce(total)
        return tokens * self.world / max(float(total), 1.0)

    def _effort_summary(self, rollouts, prefix: str) -> dict:
        """Per effort (and overall): accuracy (grade 1), mean grade, mean length, the share of responses that
        reason (write anything before `</think>`) [, mean reward], summed over ranks."""
        keys = sorted({r.tag[1] for r in rollouts} | set(self.gcfg.efforts))
        rows = []
        for b in keys:
            rs = [r for r in rollouts if r.tag[1] == b]
            rows.append(
                [
                    len(rs),
                    sum(r.values["grade"] >= 1.0 for r in rs),
                    sum(r.values["grade"] for r in rs),
                    sum(len(r.completion_ids) for r in rs),
                    sum(r.values.get("reward", 0.0) for r in rs),
                    sum(bool(r.values.get("reasons")) for r in rs),
                    sum(r.values["grade"] for r in rs if r.values.get("reasons")),
                    sum(len(r.completion_ids) for r in rs if r.values.get("reasons")),
                ]
            )
        t = torch.tensor(rows, dtype=torch.float64)
        if self.distributed and prefix == "train":
            dist.all_reduce(t)
        out = {}
        for b, (n, right, grade, length, rew, reasoning, _, _) in zip(keys, t.tolist()):
            n = max(n, 1)
            out[f"{prefix}_accuracy_{b}"] = right / n
            out[f"{prefix}_grade_{b}"] = grade / n
            out[f"{prefix}_length_{b}"] = length / n
            out[f"{prefix}_reasoning_{b}"] = reasoning / n
            if prefix == "train":
                out[f"{prefix}_reward_{b}"] = rew / n
        total = t.sum(0).tolist()
        out[f"{prefix}_samples"] = int(total[0])
        out[f"{prefix}_accuracy"] = total[1] / max(total[0], 1)
        out[f"{prefix}_grade"] = total[2] / max(total[0], 1)
        out[f"{prefix}_length"] = total[3] / max(total[0], 1)
        out[f"{prefix}_reasoning"] = total[5] / max(total[0], 1)
        # what reasoning buys: the mean grade of the responses that reasoned and of those that answered
        # directly (None when there were none), the trade the effort's length penalty is set against
        out[f"{prefix}_grade_reasoning"] = total[6] / total[5] if total[5] else None
        out[f"{prefix}_grade_direct"] = (total[2] - total[6]) / (total[0] - total[5]) if total[0] > total[5] else None
        # and what it costs: their mean lengths in tokens (the penalty's length gap)
        out[f"{prefix}_length_reasoning"] = total[7] / total[5] if total[5] else None
        out[f"{prefix}_length_direct"] = (total[3] - total[7]) / (total[0] - total[5]) if total[0] > total[5] else None
        return out

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out tasks at every effort (rank 0's engine): accuracy, grade and length per effort."""
        cfg = self.cfg
        tasks = [self._task("eval", i) for i in range(cfg.eval_prompts)]
        rollouts = self._rollouts(tasks, self.gcfg.efforts, cfg.eval_samples, seed=cfg.seed * 7919 + 17)
        return self._effort_summary(rollouts, "eval")

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        cfg = self.cfg
        if self.step == 0 and not self.history:
            self._record(self._with_eval({"step": 0}))
        last = {}
        while self.step < cfg.steps:
            row = self.train_step()
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                row = self._with_eval(row)
            self._record(row)
            last = row
            if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.steps:
                self.save()
        self.save()
        if self.rank == 0:
            write_effort_report(self.history, cfg.out, self.gcfg.efforts)
        self.close()
        return last

    def _with_eval(self, row: dict) -> dict:
        if self.rank == 0:
            row.update(self.evaluate())
        if self.distributed:
            dist.barrier()
        return row

    def _record(self, row: dict) -> None:
        self.history.append(row)
        if self.rank == 0:
            with open(os.path.join(self.cfg.out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
            shown = {
                k: (round(v, 3) if isinstance(v, float) else v)
                for k, v in row.items()
                if k
                in (
                    "step",
                    "loss",
                    "train_accuracy",
                    "train_length",
                    "train_reasoning",
                    "eval_accuracy",
                    "eval_length",
                    "eval_reasoning",
                    "first_ratio_max_deviation",
                    "step_s",
                )
            }
            print(json.dumps(shown), flush=True)

    def save(self) -> None:
        from dsv41.train.checkpoint import inference_state, save_checkpoint, save_train_state

        if self.rank == 0:
            info = {"name": f"{self.name}-rl", "rl_step": self.step, "algorithm": self.cfg.algorithm}
            save_checkpoint(
                os.path.join(self.cfg.out, "checkpoint"),
                self.policy.policy,
                self.model_cfg,
                self.tokenizer_file,
                inference_state(self.policy.policy, self.model_cfg),
                info,
            )
            save_train_state(
                os.path.join(self.cfg.out, "train_state"),
                self.policy.master,
                self.optimizer,
                self.step,
                {"rl_config": dataclasses.asdict(self.cfg)},
            )
        if self.distributed:
            dist.barrier()

    def _resume(self) -> None:
        from dsv41.train.checkpoint import load_train_state, recover_folder
        from dsv41.train.trainer import truncate_metrics

        folder = os.path.join(self.cfg.out, "train_state")
        recover_folder(folder, ("state.json",))  # a kill during a save leaves .tmp / .old: take the newest
        recover_folder(os.path.join(self.cfg.out, "checkpoint"), ("config.json",))
        if not os.path.isdir(folder):
            return
        state = load_train_state(folder, self.policy.master, self.optimizer)
        self.step = int(state["step"])
        self.policy.sync_policy()
        if isinstance(self.workers, RayRolloutWorkers):
            self.workers.load_weights(self.policy.serving_state())
        metrics = os.path.join(self.cfg.out, "metrics.jsonl")
        if self.rank == 0 and os.path.exists(metrics):
            truncate_metrics(metrics, self.step)
            with open(metrics) as f:
                self.history = [json.loads(line) for line in f if line.strip()]
        print(f"resumed {folder} at step {self.step}", flush=True)

    def close(self) -> None:
        for thing in (self.pool, self.workers):
            for method in ("shutdown", "close"):
                if hasattr(thing, method):
                    getattr(thing, method)()
                    break


def _padded(rows: list[list[float]]) -> torch.Tensor:
    width = max([len(r) for r in rows] + [1])
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


def _split(items: list, parts: int) -> list[list]:
    size = math.ceil(len(items) / parts) if items else 0
    return [items[i : i + size] for i in range(0, len(items), size)] if size else []


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def write_effort_report(history: list[dict], out: str, efforts) -> None:
    """effort.md (the table of the first and last evaluation per effort) and effort.png (accuracy, mean
    grade and mean response length per effort against the step)."""
    evals = [h for h in history if "eval_accuracy" in h]
    if not evals:
        return
    first, last = evals[0], evals[-1]
    a, z = first["step"], last["step"]
    lines = [
        f"| effort | accuracy (step {a}) | accuracy (step {z}) | mean grade (step {a}) | mean grade (step {z}) | "
        f"mean length (step {a}) | mean length (step {z}) | reasoning share (step {a}) | "
        f"reasoning share (step {z}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def share(row: dict, key: str) -> str:  # runs logged before the reasoning share existed lack it
        return f"{row[key]:.2f}" if key in row else "-"

    for b in efforts:
        lines.append(
            f"| {b} | {first[f'eval_accuracy_{b}']:.3f} | {last[f'eval_accuracy_{b}']:.3f} | "
            f"{first[f'eval_grade_{b}']:.3f} | {last[f'eval_grade_{b}']:.3f} | "
            f"{first[f'eval_length_{b}']:.1f} | {last[f'eval_length_{b}']:.1f} | "
            f"{share(first, f'eval_reasoning_{b}')} | {share(last, f'eval_reasoning_{b}')} |"
        )
    lines.append(
        f"| all | {first['eval_accuracy']:.3f} | {last['eval_accuracy']:.3f} | {first['eval_grade']:.3f} | "
        f"{last['eval_grade']:.3f} | {first['eval_length']:.1f} | {last['eval_length']:.1f} | "
        f"{share(first, 'eval_reasoning')} | {share(last, 'eval_reasoning')} |"
    )
    with open(os.path.join(out, "effort.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in evals]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    cmap = plt.get_cmap("viridis")
    for j, b in enumerate(efforts):
        colour = cmap(j / max(len(efforts) - 1, 1))
        axes[0].plot(steps, [h[f"eval_accuracy_{b}"] for h in evals], "o-", color=colour, ms=3, label=f"effort {b}")
        axes[1].plot(steps, [h[f"eval_grade_{b}"] for h in evals], "o-", color=colour, ms=3, label=f"effort {b}")
        axes[2].plot(steps, [h[f"eval_length_{b}"] for h in evals], "o-", color=colour, ms=3, label=f"effort {b}")
        axes[3].plot(
            steps,
            [h.get(f"eval_reasoning_{b}", float("nan")) for h in evals],
            "o-",
            color=colour,
            ms=3,
            label=f"effort {b}",
        )
    axes[0].set(xlabel="RL step", ylabel="held-out accuracy (exact answer)", ylim=(0, 1.02))
    axes[1].set(xlabel="RL step", ylabel="held-out mean grade (partial credit)", ylim=(0, 1.02))
    axes[2].set(xlabel="RL step", ylabel="mean response length (tokens)")
    axes[3].set(xlabel="RL step", ylabel="share of responses that reason", ylim=(0, 1.02))
    axes[0].legend(fontsize=8)
    fig.suptitle("graded GRPO with reasoning effort")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "effort.png.part.png"), dpi=100)
    os.replace(os.path.join(out, "effort.png.part.png"), os.path.join(out, "effort.png"))
    plt.close(fig)


def train_rl(cfg: RLConfig) -> dict:
    return RLTrainer(cfg).run()
