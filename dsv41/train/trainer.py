"""Pre-training from scratch with the V4.1 recipe (training.md §1, §4, §5, §7, §10; spec-v41.md §7).

One step: `grad_accum` micro-batches through `dsv41.model.training.forward_train` (QAT, indexer KL from
step 0, balance loss); loss = LM + kl_weight * KL + balance_weight * balance; gradient clipping; the
optimizer set (Muon / head-wise Muon / Sinkhorn momentum / AdamW, dsv41.optim) with warm-up and cosine
decay; then the aux-loss-free bias update of every router from the step's expert loads (or, with
`--bias-update lookahead`, a bias solved before the step on a probe batch: dsv41.train.balance and
docs/moe-balancing.md). Each step logs every MoE layer's max/mean load and router-input shared fraction.

Batches are a function of (seed, step, rank) only, the model has no dropout and the optimizer state is
saved exactly, so a run resumed from its last training state repeats the uninterrupted run on CPU, with any
number of threads. A start first recovers what a kill during a save left (`recover_folder`), refuses
changed run flags unless told (`run_changes`) and cuts metrics.jsonl back to the resumed step.
Under `torchrun --nproc-per-node N` the blocks are sharded with FSDP2 (`fully_shard`), each rank takes its
slice of every global batch, and expert loads are summed over ranks before the bias update.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dsv41 import ops
from dsv41.config import preset
from dsv41.model.init import init_random_weights
from dsv41.model.training import TrainOptions, gate_input_shared_fraction, prepare_for_training
from dsv41.model.transformer import Transformer
from dsv41.optim import OptimConfig, build_optimizers
from dsv41.train.balance import decorrelate_router, load_ratio, proportional_bias_update, solve_balancing_bias
from dsv41.train.checkpoint import (
    CHECKPOINT_FILES,
    TRAIN_STATE_FILES,
    full_tensor,
    inference_state,
    load_train_state,
    read_train_state_json,
    recover_folder,
    save_checkpoint,
    save_train_state,
    train_state_payload,
)
from dsv41.train.compare import read_metrics
from dsv41.train.config import NS_DTYPES, TrainConfig, parse_mix_weights, run_changes
from dsv41.train.plots import plot_accuracy, plot_losses, plot_routing
from dsv41.weights import checkpoint_run_info

PROBE_SEED_OFFSET = 7919  # the look-ahead probe batches: the run's data order under seed + this


def lr_scale(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to 1, then cosine to min_lr_ratio at the last step."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    span = max(cfg.steps - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def default_data(cfg: TrainConfig, vocab_size: int) -> str:
    """With no --data: a corpus from this Python's standard library sources (always present offline),
    tokenized with a BPE of the preset's vocabulary size, built once and cached."""
    import sysconfig

    from dsv41.data.build import build_dataset
    from dsv41.data.sources import Document

    folder = os.path.join(os.path.expanduser("~"), ".cache", "dsv41", f"stdlib-bpe{vocab_size}")
    if os.path.isfile(os.path.join(folder, "meta.json")):
        return folder
    root = sysconfig.get_paths()["stdlib"]
    # filter on the path below the root: a root that itself contains "test" (a venv under a tests folder)
    # must not exclude every file
    files = sorted(
        os.path.join(d, f)
        for d, _, fs in os.walk(root)
        for f in fs
        if f.endswith(".py") and "site-packages" not in (rel := os.path.relpath(d, root)) and "test" not in rel
    )[:400]
    docs = []
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as fh:
            docs.append(Document("stdlib", os.path.relpath(path, root), fh.read()))
    build_dataset(folder, vocab_size=vocab_size, documents=docs)
    return folder


def resolve_device(name: str) -> torch.device:
    """ "auto" -> CUDA when available, else CPU; "cuda" without a GPU is an error, not a silent CPU run."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "TrainConfig.device is 'cuda' but torch sees no CUDA device "
            f"(torch {torch.__version__}; the pinned wheel on CPU machines has no CUDA)"
        )
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: TrainConfig, datasets: tuple | None = None):
        """datasets: optional (train, val) sets with the interface of `dsv41.vision.synthetic.SyntheticImageText`
        (batch, sequential_batches; batches with x, y (-100 outside the targets), images, tasks) over a byte
        tokenizer (`.tokenizer`, whose size becomes the vocabulary), replacing --data (`dsv41 rl sft`)."""
        cfg = cfg.resolved()  # --balance's defaults filled in: the run and its saved config use concrete values
        cfg.validate()
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device)
        self.distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
        if self.device.type == "cuda" and self.distributed:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.distributed and not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1

        from dsv41.data import TokenDataset, read_meta
        from dsv41.data.build import load_engram_map

        base = preset(cfg.preset)
        token_map = None
        if cfg.images:  # image-text samples rendered on demand (dsv41.vision.synthetic), byte-level text
            from dsv41.vision.synthetic import SyntheticImageText, synthetic_model_fields

            self.data_dir = None
            self.model_cfg = base.replace(
                **synthetic_model_fields(base.vocab_size),
                max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len),
            )
            self.model_cfg.validate()
            self.tokenizer_file = None  # checkpoints then load with the byte tokenizer
            self.train_set = SyntheticImageText.from_config("train", self.model_cfg)
            self.val_set = SyntheticImageText.from_config("val", self.model_cfg)
        elif datasets is not None:
            self.data_dir = None
            vocab = datasets[0].tokenizer.vocab_size  # the sets' byte tokenizer sizes the vocabulary
            self.model_cfg = base.replace(
                vocab_size=vocab, max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len)
            )
            self.model_cfg.validate()
            self.tokenizer_file = None  # checkpoints then load with the byte tokenizer
            self.train_set, self.val_set = datasets
        else:
            data = cfg.data or (default_data(cfg, base.vocab_size) if self.rank == 0 else None)
            if self.distributed:
                holder = [data]
                dist.broadcast_object_list(holder, src=0)
                data = holder[0]
            self.data_dir = data
            meta = read_meta(data)
            token_map, compressed = load_engram_map(data)
            self.model_cfg = base.replace(
                vocab_size=meta["vocab_size"],
                engram_compressed_vocab_size=compressed,
                max_position_embeddings=max(base.max_position_embeddings, cfg.seq_len),
            )
            self.tokenizer_file = os.path.join(data, meta["tokenizer_path"]) if meta.get("tokenizer_path") else None
            self.train_set = TokenDataset.from_dir(data, "train")
            self.val_set = TokenDataset.from_dir(data, "val")
            if cfg.mix == "retrieval":  # retrieval tasks over the data's tokenizer, text batches mixed in
                from dsv41.data.retrieval_tasks import RetrievalMix
                from dsv41.tokenizer import load_tokenizer

                tokenizer = load_tokenizer(
                    os.path.dirname(self.tokenizer_file) if self.tokenizer_file else None, self.model_cfg.vocab_size
                )
                options = dict(text_fraction=cfg.mix_text_fraction, min_len=cfg.mix_min_len)
                weights = parse_mix_weights(cfg.mix_weights) if cfg.mix_weights else None
                self.train_set = RetrievalMix(
                    self.train_set,
                    tokenizer,
                    "train",
                    weights=weights,
                    curriculum=cfg.curriculum_steps * cfg.grad_accum,
                    **options,
                )
                self.val_set = RetrievalMix(self.val_set, tokenizer, "val", **options)
        if cfg.swa_only:  # the baseline without the compressed path: every layer a window-only layer
            n_all = self.model_cfg.n_layers + self.model_cfg.n_mtp_layers
            self.model_cfg = self.model_cfg.replace(
                compress_ratios=(0,) * n_all, kv_source_layers=(), index_source_layers=(), candidate_source_layer=-1
            )
            self.model_cfg.validate()
        self.tokens_seen: int | None = None  # tokens trained on so far (set at the first step)
        self.last_eval: dict = {}  # the latest evaluation's extra figures (answer accuracy with --images)

        torch.manual_seed(cfg.seed)
        model = Transformer(self.model_cfg)
        init_random_weights(model, seed=cfg.seed)
        if cfg.embed_init_std != 0.02:  # init_random_weights draws N(0, 0.02^2): rescale the same draw
            with torch.no_grad():
                model.embed.weight.mul_(cfg.embed_init_std / 0.02)
        if model.engram_hash is not None and token_map is not None:
            model.set_engram_token_map(token_map)
        self.model = prepare_for_training(model).to(self.device)
        if self.distributed:
            from torch.distributed.fsdp import fully_shard

            for block in self.model.layers:
                fully_shard(block)
            fully_shard(self.model)
        optim_cfg = OptimConfig(
            lr=cfg.lr, use_muon=cfg.use_muon, use_sink=cfg.use_sink, ns_dtype=getattr(torch, NS_DTYPES[cfg.ns_dtype])
        )
        self.replicas = MatrixReplicas(self.model, optim_cfg) if self.distributed else None
        target = self.replicas.view() if self.replicas else self.model
        self.optimizer = build_optimizers(target, optim_cfg, self.model_cfg)
        muon = dict(self.optimizer.optimizers).get("muon")
        if self.replicas and muon is not None:  # each rank orthogonalises its share of the matrices
            muon.split_work(self.rank, self.world)
        self.step = 0
        self.history: list[dict] = []  # this process's steps; metrics.jsonl holds the whole run
        self.resumed = False
        state_dir = os.path.join(cfg.out, "train_state")
        if self.rank == 0:  # a kill during a save may have left only .old/.tmp copies: put them back first
            for folder, files in ((state_dir, TRAIN_STATE_FILES), (self._checkpoint_dir, CHECKPOINT_FILES)):
                note = recover_folder(folder, files)
                if note:
                    self._log(note)
        if self.distributed:
            dist.barrier()
        if os.path.isdir(state_dir):
            self._check_resume_config(state_dir, read_train_state_json(state_dir))
            state = load_train_state(state_dir, self.model, self.optimizer)
            if self.replicas:
                self.replicas.after_load(self.optimizer)
            self.step = state["step"]
            self.tokens_seen = state.get("tokens_seen")  # absent in older states: estimated at the first step
            self.resumed = True
            self._log(f"resumed from {state_dir} at step {self.step}")
            self._sync_checkpoint()
        if self.rank == 0:
            truncate_metrics(os.path.join(cfg.out, "metrics.jsonl"), self.step)

    # ------------------------------------------------------------------ helpers
    @property
    def _checkpoint_dir(self) -> str:
        return os.path.join(self.cfg.out, "checkpoint")

    def _check_resume_config(self, state_dir: str, saved: dict) -> None:
        """Refuse to resume under flags that change the run (listing them), unless allowed."""
        changes = run_changes(saved.get("config", {}), dict(self.cfg.__dict__), saved.get("world_size", 1), self.world)
        if not changes:
            return
        listed = "; ".join(changes)
        if not self.cfg.allow_config_change:
            raise ValueError(
                f"{state_dir} was saved by a run with other settings ({listed}); resuming under these would "
                f"silently train a mix of two runs. Give the saved values, use another --out, or pass "
                f"--allow-config-change to resume anyway (extending --steps needs it too: it stretches the "
                f"learning-rate schedule)"
            )
        self._log(f"resuming with changed settings (--allow-config-change): {listed}")

    def _checkpoint_info(self) -> dict:
        """What checkpoint/ records of its run: the step (checked on resume) and the model's name, which
        `dsv41 serve` and chat report; it is the run folder's, since this folder is always `checkpoint`."""
        run = os.path.basename(os.path.normpath(os.path.abspath(self.cfg.out)))
        return {"name": f"dsv41-{self.cfg.preset}-{run}", "train_step": self.step, "preset": self.cfg.preset}

    def _write_checkpoint(self, weights=None) -> None:
        """checkpoint/ at the current step (every rank calls this: gathering `weights` is collective)."""
        weights = weights if weights is not None else inference_state(self.model, self.model_cfg)
        if self.rank == 0:
            save_checkpoint(
                self._checkpoint_dir, self.model, self.model_cfg, self.tokenizer_file, weights, self._checkpoint_info()
            )

    def _sync_checkpoint(self) -> None:
        """After loading the training state: a kill between the two writes of a save leaves checkpoint/ at
        an older step (or none); say so and rewrite it now, so it never silently differs from the state."""
        found = checkpoint_run_info(self._checkpoint_dir).get("train_step") if self.rank == 0 else None
        if self.distributed:  # rank 0's view decides, so every rank joins the same collectives
            holder = [found]
            dist.broadcast_object_list(holder, src=0)
            found = holder[0]
        if found == self.step:
            return
        where = (
            f"step {found}"
            if found is not None
            else "an unknown step"
            if os.path.isdir(self._checkpoint_dir)
            else "nowhere (it is absent)"
        )
        self._log(
            f"{self._checkpoint_dir} is from {where}, the training state from step {self.step}: "
            f"rewriting it from the training state"
        )
        self._write_checkpoint()
        if self.distributed:
            dist.barrier()

    def _log(self, text: str) -> None:
        if self.rank == 0:
            print(f"[dsv41 train] {text}", file=sys.stderr, flush=True)

    def _options(self, step: int) -> TrainOptions:
        cfg = self.cfg
        start = None
        if cfg.replay_prob > 0:
            g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
            if torch.rand((), generator=g) < cfg.replay_prob:
                window = self.model_cfg.window_size
                start = int(torch.randint(window, max(cfg.seq_len, window + 1), (), generator=g))
        dense = cfg.dense_attention or step < cfg.dense_steps  # --dense-steps: the dense warm-up
        return TrainOptions(qat=cfg.qat, dense_indexer=dense, replay_start=start, capacity_factor=cfg.capacity_factor)

    def _losses(self, x: torch.Tensor, y: torch.Tensor, opts: TrainOptions, images: list | None = None):
        """LM loss over the trained targets (image-text batches mark the rest IGNORE = -100, the
        default ignore_index) and the forward's outputs."""
        # through the module call: FSDP2 unshards around it (the vision tower's too)
        out = self.model(x, train_options=opts, images=images)
        lm = F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
        return lm, out

    def _batch(self, dataset, index: int, seed: int):
        """(x, y, images or None) of this process's micro-batch `index`, on the device."""
        cfg = self.cfg
        got = dataset.batch(index, cfg.batch_size, cfg.seq_len, seed, rank=self.rank, world_size=self.world)
        if isinstance(got, tuple):
            x, y = got
            return x.to(self.device), y.to(self.device), None
        return got.x.to(self.device), got.y.to(self.device), got.images

    @torch.no_grad()
    def evaluate(self) -> float:
        cfg = self.cfg
        total, count = 0.0, 0
        batches = list(
            self.val_set.sequential_batches(
                cfg.batch_size, cfg.seq_len, cfg.eval_batches, rank=self.rank, world_size=self.world
            )
        )
        if self.distributed:  # every rank must run the same number of (collective) forwards
            n = torch.tensor(len(batches), device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            batches = batches[: int(n)]
        right: dict[str, list[int]] = {}  # task -> [correct, seen] (image-text batches)
        # task -> [answer-token loss sum, answer tokens]; "text" for plain text batches (--mix retrieval)
        nats: dict[str, list[float]] = {}
        for batch in batches:
            images = tasks = None
            if not isinstance(batch, tuple):
                batch, images, tasks = (batch.x, batch.y), batch.images, batch.tasks
            x, y = batch[0].to(self.device), batch[1].to(self.device)
            lm, out = self._losses(x, y, TrainOptions(qat=cfg.qat, dense_indexer=cfg.dense_attention), images)
            weight = int((y != -100).sum())  # trained targets (all of them in a text batch)
            total += float(lm) * weight
            count += weight
            if self.cfg.mix:  # the mix's text and each task's answers apart (the mean mixes them)
                rows = F.cross_entropy(out.logits.transpose(1, 2), y, reduction="none").sum(1)  # [B]
                counts = (y != -100).sum(1)  # [B]
                for row, task in enumerate(tasks or ["text"] * y.shape[0]):
                    acc = nats.setdefault(task, [0.0, 0.0])
                    acc[0] += float(rows[row])
                    acc[1] += float(counts[row])
            if tasks is not None:
                from dsv41.vision.synthetic import answer_accuracy

                for task, ok in zip(tasks, answer_accuracy(out.logits, y).tolist()):
                    right.setdefault(task, [0, 0])
                    right[task][0] += int(ok)
                    right[task][1] += 1
        if self.distributed:
            t = torch.tensor([total, count], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            total, count = float(t[0]), float(t[1])
            if right:
                names = sorted(right)
                r = torch.tensor([right[n] for n in names], dtype=torch.float64, device=self.device)
                dist.all_reduce(r)
                right = {n: [int(a), int(b)] for n, (a, b) in zip(names, r.tolist())}
        self.last_eval = {}
        if self.distributed and nats:  # (every rank sees the same task names: the batches are alike)
            names = sorted(nats)
            t = torch.tensor([nats[n] for n in names], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            nats = dict(zip(names, t.tolist()))
        for task in sorted(nats):  # nats per trained token: "val_loss_text", "val_loss_passkey", ...
            self.last_eval[f"val_loss_{task}"] = nats[task][0] / max(nats[task][1], 1)
        if right:
            self.last_eval["val_accuracy"] = sum(a for a, _ in right.values()) / sum(b for _, b in right.values())
            for task in sorted(right):
                self.last_eval[f"val_accuracy_{task}"] = right[task][0] / right[task][1]
        return total / max(count, 1)

    def train_step(self) -> dict:
        cfg, step = self.cfg, self.step
        t0 = time.perf_counter()
        self.optimizer.set_lr_scale(lr_scale(step, cfg))
        if cfg.bias_update == "lookahead":
            self._lookahead_balance()
        opts = self._options(step)
        sums = {"lm": 0.0, "kl": 0.0, "balance": 0.0}
        loads: dict[tuple[str, int], torch.Tensor] = {}  # (bias name, layer) -> tokens per expert
        moments: dict[int, torch.Tensor] = {}  # layer -> router input moments (gate_input_moments)
        tokens = 0
        for micro in range(cfg.grad_accum):
            x, y, images = self._batch(self.train_set, step * cfg.grad_accum + micro, cfg.seed)
            tokens += x.numel() * self.world
            lm, out = self._losses(x, y, opts, images)
            loss = lm + cfg.kl_weight * out.indexer_kl + cfg.balance_weight * out.balance_loss
            if cfg.shared_input_weight:  # (no backward through the term when it is off)
                loss = loss + cfg.shared_input_weight * out.shared_input_loss
            (loss / cfg.grad_accum).backward()
            sums["lm"] += float(lm.detach()) / cfg.grad_accum
            sums["kl"] += float(out.indexer_kl.detach()) / cfg.grad_accum
            sums["balance"] += float(out.balance_loss.detach()) / cfg.grad_accum
            # "natural": the router's own picks before the capacity bound (what the bias must correct)
            for name, per_layer in (
                ("bias", out.expert_load),
                ("bias_vl", out.expert_load_vl),
                ("natural", out.expert_load_natural),
            ):
                for layer, load in per_layer.items():
                    loads[name, layer] = loads.get((name, layer), 0) + load
            for layer, stats in out.gate_stats.items():
                moments[layer] = moments.get(layer, 0) + stats
        if self.distributed:
            for stats in moments.values():
                dist.all_reduce(stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if self.replicas:
            self.replicas.gather_grads()
        self.optimizer.step()
        if cfg.decorrelate_router and cfg.bias_update != "lookahead":  # (look-ahead: before the next step)
            self._decorrelate_routers(moments)
        if self.replicas:
            self.replicas.scatter_params()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        ratios, natural = self._update_router_bias(loads)  # layer -> max/mean text load, summed over ranks
        shared = {layer: gate_input_shared_fraction(stats) for layer, stats in moments.items()}
        if self.distributed:
            t = torch.tensor([sums["lm"], sums["kl"], sums["balance"]], dtype=torch.float64, device=self.device)
            dist.all_reduce(t)
            sums = dict(zip(sums, (t / self.world).tolist()))
        seconds = time.perf_counter() - t0
        if self.tokens_seen is None:  # (re)started: earlier steps counted at this step's size, exact for text
            self.tokens_seen = step * tokens
        self.tokens_seen += tokens
        self.step += 1
        return {
            "step": self.step,
            "loss": sums["lm"],
            "indexer_kl": sums["kl"],
            "balance": sums["balance"],
            "lr_scale": lr_scale(step, cfg),
            "grad_norm": float(full_tensor(grad_norm)),
            "tokens": self.tokens_seen,
            "tokens_per_s": tokens / seconds,
            "max_load_ratio": max(ratios.values(), default=0.0),
            "load_ratio": [round(ratios[layer], 4) for layer in sorted(ratios)],
            "gate_shared": [round(shared[layer][0], 4) for layer in sorted(shared)],
            "gate_shared_seq": [round(shared[layer][1], 4) for layer in sorted(shared)],
            **({"load_ratio_natural": [round(natural[layer], 4) for layer in sorted(natural)]} if natural else {}),
        }

    def _lookahead_balance(self) -> None:
        """Balance the routers for the weights this step will use (dsv41.train.balance): route a probe batch
        (same distribution, another seed, so the step's own routing stays out of sample), optionally
        decorrelate every router from the probe's mean router input, then set each text bias to the one
        that balances the probe's routing under the (decorrelated) router."""
        cfg = self.cfg
        got = self.train_set.batch(
            self.step,
            cfg.probe_sequences or cfg.batch_size,
            cfg.seq_len,
            cfg.seed + PROBE_SEED_OFFSET,
            rank=self.rank,
            world_size=self.world,
        )
        x, images = (got[0], None) if isinstance(got, tuple) else (got.x, got.images)
        with torch.no_grad():  # image spans route with bias_vl and stay out of the text bias's probe
            out = self.model(
                x.to(self.device),
                images=images,
                train_options=TrainOptions(qat=cfg.qat, dense_indexer=cfg.dense_attention),
            )
        if self.distributed:
            for stats in out.gate_stats.values():
                dist.all_reduce(stats)
        if cfg.decorrelate_router:
            self._decorrelate_routers(out.gate_stats)
            if self.replicas:
                self.replicas.scatter_params()
        masters = dict((self.replicas.view() if self.replicas else self.model).named_parameters())
        for layer, inputs in out.router_inputs.items():
            gate = self.model.layers[layer].ffn.gate
            weight = full_tensor(masters[f"layers.{layer}.ffn.gate.weight"].data).float()
            scores = ops.router_scores(inputs.float() @ weight.T / gate.temperature, gate.score_func)
            with torch.no_grad():
                new = solve_balancing_bias(
                    scores, full_tensor(gate.bias.data), gate.topk, reduce=dist.all_reduce if self.distributed else None
                )
                _assign(gate.bias, new)

    def _decorrelate_routers(self, moments: dict[int, torch.Tensor]) -> None:
        """Project every router matrix off the mean router input of `moments` (dsv41.train.balance). Runs on
        the optimizer's masters (the full replicas under FSDP2), before they are cut into shards."""
        target = dict((self.replicas.view() if self.replicas else self.model).named_parameters())
        for layer, stats in moments.items():
            weight = target[f"layers.{layer}.ffn.gate.weight"].data
            if hasattr(weight, "to_local"):  # a sharded parameter (router on AdamW): FSDP2 splits the
                weight = weight.to_local()  # rows (experts), so every local row is whole
            decorrelate_router(weight, stats[:-4])

    def _update_router_bias(
        self, loads: dict[tuple[str, int], torch.Tensor]
    ) -> tuple[dict[int, float], dict[int, float]]:
        """The load-driven bias step per router and modality (--bias-update: b += rate * sign(mean - load), or
        rate * (mean - load) / mean; under 'lookahead' the text bias was already set before the step): text
        tokens move `gate.bias`, image-span tokens `gate.bias_vl`; loads are summed over ranks in place.
        Under --capacity-factor the text bias follows the router's picks before the bound ("natural").
        Returns every layer's max/mean text load as processed, and before the bound ({} without one)."""
        for key in sorted(loads):
            if self.distributed:
                dist.all_reduce(loads[key])
        ratios = {layer: load_ratio(load) for (name, layer), load in loads.items() if name == "bias"}
        natural = {layer: load_ratio(load) for (name, layer), load in loads.items() if name == "natural"}
        for (name, layer), load in sorted(loads.items()):
            if name == "natural":
                continue
            if name == "bias":
                if self.cfg.bias_update == "lookahead":
                    continue  # set before the step, from the probe batch (_lookahead_balance)
                load = loads.get(("natural", layer), load)
            param = getattr(self.model.layers[layer].ffn.gate, name)
            with torch.no_grad():
                bias = full_tensor(param.data)
                if self.cfg.bias_update == "proportional":
                    new = proportional_bias_update(bias, load.to(bias.dtype), self.cfg.bias_rate)
                else:
                    new = ops.moe.balance_bias_update(bias, load.to(bias.dtype), self.cfg.bias_rate)
                _assign(param, new)
        return ratios, natural

    def save(self) -> None:
        """Training state and release-layout checkpoint. Every rank gathers (FSDP2 collectives run in the
        same order everywhere); rank 0 writes."""
        cfg = self.cfg
        payload = train_state_payload(self.model, self.optimizer)
        weights = inference_state(self.model, self.model_cfg)
        if self.rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
            # no metrics history: metrics.jsonl is the record, and the state must not grow with every save.
            # world_size: batch_size is per process, so a resume compares global batches.
            # tokens_seen: with --mix the batch length varies, so a resume cannot rebuild the count from the step
            extra = {"config": dict(cfg.__dict__), "world_size": self.world, "tokens_seen": self.tokens_seen}
            save_train_state(
                os.path.join(cfg.out, "train_state"), self.model, self.optimizer, self.step, extra, payload
            )
        # after the state: a kill between the two leaves checkpoint/ behind, which a resume rewrites
        self._write_checkpoint(weights)
        if self.distributed:
            dist.barrier()

    def run(self) -> dict:
        cfg = self.cfg
        metrics_path = os.path.join(cfg.out, "metrics.jsonl")
        if self.rank == 0:
            os.makedirs(cfg.out, exist_ok=True)
        bar = _progress(cfg.steps, self.step, self.rank == 0)
        last: dict = {}
        while self.step < cfg.steps:
            last = self.train_step()
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                last["val_loss"] = self.evaluate()
                last.update(self.last_eval)
            self.history.append(last)
            if self.rank == 0 and (self.step % cfg.log_every == 0 or "val_loss" in last):
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(last) + "\n")
            if bar is not None:
                bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{last['tokens_per_s']:.0f}")
                bar.update(1)
            if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                self.save()
        if bar is not None:
            bar.close()
        if self.rank == 0:
            # after a resume this process saw only the later steps: plot the whole run from its record
            resumed = self.resumed and os.path.isfile(metrics_path)
            history = read_metrics(cfg.out) if resumed else self.history
            if history:
                plot_losses(history, os.path.join(cfg.out, "loss.png"))
                plot_routing(history, os.path.join(cfg.out, "routing.png"))
                plot_accuracy(history, os.path.join(cfg.out, "accuracy.png"))
        return last


class MatrixReplicas:
    """FSDP2 support for the matrix optimizers (training.md §1.1, §9). Muon and the Sinkhorn optimizer
    need whole matrices, so every rank keeps a full fp32 replica of the parameters they own: after the
    backward the gradients are gathered, every rank takes the same optimizer step on its replicas, and
    each rank copies its shard back. AdamW works on the sharded parameters directly."""

    def __init__(self, model: torch.nn.Module, optim_cfg: OptimConfig):
        from dsv41.optim.groups import GROUP_OPTIMIZER, classify_param

        self.named: list[tuple[str, torch.nn.Parameter]] = []
        self.pairs: list[tuple[torch.nn.Parameter, torch.nn.Parameter]] = []
        for name, p in model.named_parameters():
            kind = classify_param(name, p, optim_cfg)
            if kind is not None and GROUP_OPTIMIZER[kind] in ("muon", "sink"):
                replica = torch.nn.Parameter(full_tensor(p).detach().clone())
                self.pairs.append((p, replica))
                self.named.append((name, replica))
            else:
                self.named.append((name, p))

    def view(self):
        """An object with the model's parameter names over the replicas (for build_optimizers)."""
        named = self.named

        class View:
            def named_parameters(self):
                return iter(named)

        return View()

    def gather_grads(self) -> None:
        for sharded, replica in self.pairs:
            replica.grad = None if sharded.grad is None else full_tensor(sharded.grad).detach().clone()

    def scatter_params(self) -> None:
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for sharded, replica in self.pairs:
                # every rank holds the same replica, so each cuts its own shard without communication
                local = distribute_tensor(replica.data, sharded.device_mesh, sharded.placements, src_data_rank=None)
                sharded.data.copy_(local)

    def after_load(self, optimizer) -> None:
        """Refresh the replicas from the loaded (sharded) weights; give AdamW's loaded full states the
        sharding of their parameters."""
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for sharded, replica in self.pairs:
                replica.data.copy_(full_tensor(sharded))
        adamw = dict(optimizer.optimizers).get("adamw")
        if adamw is not None:
            for p, state in adamw.state.items():
                for key, value in list(state.items()):
                    if (
                        hasattr(p, "device_mesh")
                        and isinstance(value, torch.Tensor)
                        and value.shape == p.shape
                        and not hasattr(value, "device_mesh")
                    ):
                        state[key] = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)


def _assign(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        param.data.copy_(distribute_tensor(full, param.device_mesh, param.placements))
    else:
        param.data.copy_(full)


def _progress(total: int, done: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def truncate_metrics(path: str, step: int) -> None:
    """Drop the lines of steps after `step` (and torn lines): a resumed run redoes those steps and writes
    them again. Rewritten through a rename, so a kill leaves the old file or the new one."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        texts = f.readlines()
    keep = []
    for text in texts:
        try:
            line = json.loads(text)
        except ValueError:
            continue
        if isinstance(line, dict) and line.get("step", 0) <= step:
            keep.append(text if text.endswith("\n") else text + "\n")
    if keep == texts:
        return
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def train(cfg: TrainConfig, datasets: tuple | None = None) -> dict:
    return Trainer(cfg, datasets).run()
