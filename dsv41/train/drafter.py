"""Train a DSpark drafter (`mtp.*`) for a trained checkpoint with the backbone frozen (spec-v41.md §12b:
"trained post-pretraining with the backbone frozen, with no gradient into the backbone").

Each step: a batch of training windows goes through the frozen backbone's inference forward (bf16
weights, the numerics it is served with) under no_grad, giving the drafter inputs `main_hidden` of every
position and the backbone's next-token logits. Anchors p are drawn in each window; for each, the drafter
drafts positions p+1..p+k exactly as at inference (`dsv41.model.dspark.draft_train`: ring of the main
rows p-W+1..p, input [token p+1, noise x (k-1)]), with the Markov bias teacher-forced on the true previous
token. Loss: cross-entropy against the backbone's own distribution at each drafted position (what the
drafter must predict for its tokens to be accepted is the target's choice, not the data's), weighted
`position_decay`^i because a draft position counts only if every earlier one was accepted; plus the
confidence head's binary cross-entropy on "the drafter's argmax equals the backbone's" (detached
features). Only `mtp.*` parameters are trained (fp32 master copies, AdamW, warm-up + cosine); the shared
embedding and head belong to the backbone and stay frozen.

Writes `<out>/checkpoint/` (the backbone's weights + the drafter, the release layout: `dsv41 serve
--speculative` reads it), `metrics.jsonl` and `acceptance.png`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dsv41.config import ModelConfig
from dsv41.data.build import load_engram_map
from dsv41.data.shards import TokenDataset, read_meta
from dsv41.model import dspark
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.train.checkpoint import inference_state, save_checkpoint
from dsv41.weights import checkpoint_files, checkpoint_run_info, load_model


@dataclass
class DrafterConfig:
    model: str = field(default="", metadata={"help": "the trained checkpoint folder whose backbone is frozen"})
    data: str = field(default="", metadata={"help": "data folder (dsv41 data) the windows come from"})
    out: str = field(default="runs/drafter", metadata={"help": "output folder (checkpoint/, metrics.jsonl, plot)"})
    steps: int = field(default=200, metadata={"help": "number of drafter optimizer steps to run"})
    batch_size: int = field(default=8, metadata={"help": "token windows in each training batch"})
    seq_len: int = field(default=256, metadata={"help": "length of each training window in tokens"})
    anchors: int = field(default=32, metadata={"help": "draft blocks trained per window (anchor positions)"})
    lr: float = field(default=2e-3, metadata={"help": "peak AdamW learning rate"})
    warmup: int = field(default=20, metadata={"help": "linear warm-up steps, then cosine to 10%"})
    weight_decay: float = field(default=0.01, metadata={"help": "decoupled weight decay of the AdamW optimizer"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global gradient norm to this value"})
    stages: int = field(default=3, metadata={"help": "drafter blocks (the release: 3)"})
    block_size: int = field(default=5, metadata={"help": "tokens drafted per pass, k (the release: 5)"})
    target_layers: str = field(
        default="",
        metadata={
            "help": (
                "backbone layers whose mean-over-copies inputs feed the drafter, comma-separated "
                "(default: the last three, as the release's 37, 38, 39 of 40)"
            )
        },
    )
    markov_rank: int = field(default=64, metadata={"help": "rank of the Markov head (the release: 256)"})
    experts: int = field(default=0, metadata={"help": "routed experts per drafter block (0: the backbone's)"})
    experts_per_token: int = field(default=0, metadata={"help": "experts per token (0: the backbone's)"})
    position_decay: float = field(default=0.8, metadata={"help": "loss weight of draft position i: decay^i"})
    confidence_weight: float = field(default=0.1, metadata={"help": "weight of the confidence head's loss"})
    qat: bool = field(default=True, metadata={"help": "straight-through FP8 rounding of the drafter's ring rows"})
    self_distill: int = field(
        default=0,
        metadata={
            "help": (
                "windows of the backbone's own text to generate first (the engine continues a short data prompt "
                "to --seq-len tokens); training then mixes them with data windows. The drafter is judged on the "
                "backbone's own outputs, so this moves training to the distribution it is used on"
            )
        },
    )
    self_distill_temperature: float = field(
        default=0.0,
        metadata={"help": ("sampling temperature of the generated windows (0: greedy, what greedy serving produces)")},
    )
    self_distill_fraction: float = field(
        default=0.5, metadata={"help": ("fraction of each batch drawn from the generated windows")}
    )
    eval_every: int = field(default=25, metadata={"help": "steps between validation measurements"})
    eval_batches: int = field(default=4, metadata={"help": "validation batches per measurement"})
    seed: int = field(default=0, metadata={"help": "data order, anchors and drafter initialisation"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0: torch's default)"})

    def validate(self) -> None:
        if not self.model or not os.path.isdir(self.model):
            raise ValueError(f"--model must be a trained checkpoint folder, got {self.model!r}")
        if not self.data or not os.path.isdir(self.data):
            raise ValueError(f"--data must be a data folder (dsv41 data), got {self.data!r}")
        for name in ("steps", "batch_size", "seq_len", "anchors", "stages", "block_size", "markov_rank"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0")
        if self.seq_len <= self.block_size + 1:
            raise ValueError("--seq-len must exceed --block-size + 1")


def drafter_config(base: ModelConfig, cfg: DrafterConfig, noise_token: int) -> ModelConfig:
    """The backbone's config plus a DSpark drafter."""
    n = base.n_layers
    targets = (
        tuple(int(x) for x in cfg.target_layers.split(",")) if cfg.target_layers else tuple(range(max(0, n - 3), n))
    )
    out = dataclasses.replace(
        base,
        n_mtp_layers=cfg.stages,
        compress_ratios=tuple(base.compress_ratios[:n]) + (0,) * cfg.stages,
        dspark_block_size=cfg.block_size,
        dspark_noise_token_id=noise_token,
        dspark_target_layer_ids=targets,
        dspark_markov_rank=cfg.markov_rank,
        dspark_n_routed_experts=cfg.experts or base.n_routed_experts,
        dspark_n_activated_experts=cfg.experts_per_token or base.n_activated_experts,
    )
    out.validate()
    return out


def build_drafter_model(backbone: Transformer, dcfg: ModelConfig, seed: int) -> Transformer:
    """A model with the backbone's weights and a freshly initialised drafter; backbone frozen, drafter fp32."""
    net = Transformer(dcfg)
    for stage in net.mtp:
        init_random_weights(stage, seed=seed + stage.stage)
    have = dict(backbone.named_parameters())
    with torch.no_grad():
        for name, param in net.named_parameters():
            if name.startswith("mtp."):
                continue
            param.copy_(have[name])
    for name, buf in backbone.named_buffers():
        target = net.get_buffer(name)
        target.copy_(buf)
    if backbone.engram_hash is not None:
        net.set_engram_token_map(backbone.engram_hash.token_map.clone())
    net.requires_grad_(False)
    net.mtp.float().requires_grad_(True)
    return net.eval()


def generate_windows(net: Transformer, cfg: DrafterConfig, data: TokenDataset, tokenizer) -> torch.Tensor:
    """[n, seq_len] windows of the backbone's own text: a 32-token data prompt (from a seed stream of its
    own) continued by the engine to seq_len tokens (the drafter is not used: plain decoding)."""
    from dsv41.engine import EngineConfig, LLMEngine, SamplingParams

    prompt_len = min(32, cfg.seq_len // 2)
    x, _ = data.batch(0, cfg.self_distill, prompt_len, cfg.seed + 4242)
    engine = LLMEngine(
        net,
        tokenizer,
        EngineConfig(enable_prefix_caching=False, max_num_seqs=32, kv_pool_tokens=max(65536, 32 * cfg.seq_len * 2)),
    )
    params = [
        SamplingParams(
            temperature=cfg.self_distill_temperature,
            max_tokens=cfg.seq_len - prompt_len,
            ignore_eos=True,
            seed=cfg.seed + i,
        )
        for i in range(cfg.self_distill)
    ]
    outs = engine.generate(x.tolist(), params)
    return torch.tensor([p + o.token_ids for p, o in zip(x.tolist(), outs)], dtype=torch.int64)


def _batch(step: int, cfg: DrafterConfig, data: TokenDataset, generated) -> torch.Tensor:
    x, _ = data.batch(step, cfg.batch_size, cfg.seq_len, cfg.seed)
    if generated is None:
        return x
    gen = torch.Generator().manual_seed(cfg.seed * 100003 + step)
    n = int(round(cfg.batch_size * cfg.self_distill_fraction))
    pick = torch.randint(0, generated.size(0), (n,), generator=gen)
    return torch.cat([generated[pick], x[n:]], dim=0)


def _lr_scale(step: int, cfg: DrafterConfig) -> float:
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = min((step - cfg.warmup) / max(cfg.steps - cfg.warmup, 1), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def backbone_pass(net: Transformer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen backbone's inference forward: (main_hidden [B, T, F] bf16, logits [B, T, V] fp32)."""
    inputs: dict = {}
    logits = net(x, 0, None, drafter_inputs=inputs)
    return inputs["main_hidden"], logits


def draft_losses(
    net: Transformer,
    cfg: DrafterConfig,
    x: torch.Tensor,
    hidden: torch.Tensor,
    target_logits: torch.Tensor,
    gen: torch.Generator,
) -> dict:
    """One batch's losses and greedy agreement per draft position (teacher-forced prefixes)."""
    k = net.cfg.dspark_block_size
    b, t = x.shape
    rows = torch.arange(b).repeat_interleave(cfg.anchors)
    anchors = torch.randint(0, t - k, (b * cfg.anchors,), generator=gen)
    out = dspark.draft_train(net, hidden, x, rows, anchors, qat=cfg.qat)
    positions = anchors.unsqueeze(1) + torch.arange(k)  # target logits at p+i predict token p+1+i; draft i -> p+2+i
    target = target_logits[rows.unsqueeze(1), positions + 1].float()  # [A, k, V]
    soft = torch.softmax(target, dim=-1)
    ce = -(soft * torch.log_softmax(out.logits, dim=-1)).sum(-1)  # [A, k]
    weights = cfg.position_decay ** torch.arange(k, dtype=torch.float32)
    draft_loss = (ce.mean(0) * weights).sum() / weights.sum()
    match = out.logits.argmax(-1) == target.argmax(-1)  # [A, k]
    conf_loss = F.binary_cross_entropy_with_logits(out.confidence, match.float())
    accepted = match.int().cumprod(-1)  # a position counts only with every earlier one accepted
    entropy = -(soft * torch.log_softmax(target, -1)).sum(-1)  # [A, k]: the floor of the cross-entropy
    return {
        "loss": draft_loss + cfg.confidence_weight * conf_loss,
        "draft_loss": draft_loss,
        "kl": ((ce - entropy).mean(0) * weights).sum() / weights.sum(),
        "confidence_loss": conf_loss,
        "match": match.float().mean(0),
        "accepted": accepted.float().mean(0),
    }


def train_drafter(cfg: DrafterConfig, progress: bool = True) -> dict:
    cfg.validate()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    backbone = load_model(cfg.model)
    meta = read_meta(cfg.data)
    if meta["vocab_size"] != backbone.cfg.vocab_size:
        raise ValueError(f"{cfg.data} has vocabulary {meta['vocab_size']}, the model {backbone.cfg.vocab_size}")
    if backbone.engram_hash is not None:
        token_map, _ = load_engram_map(cfg.data)
        backbone.set_engram_token_map(token_map)
    dcfg = drafter_config(backbone.cfg, cfg, noise_token=int(meta.get("pad_id", 0)))
    net = build_drafter_model(backbone, dcfg, cfg.seed)
    del backbone
    params = [p for p in net.mtp.parameters()]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    train_set = TokenDataset.from_dir(cfg.data, "train")
    val_set = TokenDataset.from_dir(cfg.data, "val")
    os.makedirs(cfg.out, exist_ok=True)
    generated = None
    if cfg.self_distill:
        from dsv41.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        generated = generate_windows(net, cfg, train_set, load_tokenizer(cfg.model, net.cfg.vocab_size))
        print(
            f"[dsv41] generated {generated.numel():,} tokens of the backbone's own text "
            f"({generated.size(0)} windows) in {time.perf_counter() - t0:.0f} s"
        )
        held = max(1, generated.size(0) // 10)  # held out: the acceptance on the backbone's own text
        generated, generated_val = generated[:-held], generated[-held:]
    log_path = os.path.join(cfg.out, "metrics.jsonl")
    gen = torch.Generator().manual_seed(cfg.seed)
    history = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc="drafter", dynamic_ncols=True)
    with open(log_path, "w") as log:
        for step in range(cfg.steps):
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = cfg.lr * _lr_scale(step, cfg)
            x = _batch(step, cfg, train_set, generated)
            hidden, target_logits = backbone_pass(net, x)
            losses = draft_losses(net, cfg, x, hidden, target_logits, gen)
            opt.zero_grad(set_to_none=True)
            losses["loss"].backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            record = {
                "step": step + 1,
                "loss": float(losses["loss"].detach()),
                "draft_loss": float(losses["draft_loss"].detach()),
                "kl": float(losses["kl"].detach()),
                "confidence_loss": float(losses["confidence_loss"].detach()),
                "grad_norm": float(grad_norm),
                "accepted_at": [round(float(v), 4) for v in losses["accepted"]],
                "lr": opt.param_groups[0]["lr"],
                "step_s": time.perf_counter() - t0,
            }
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                record["val"] = evaluate(net, cfg, val_set)
                if generated is not None:
                    record["val_generated"] = evaluate(net, cfg, val_set, generated_val)
            log.write(json.dumps(record) + "\n")
            log.flush()
            history.append(record)
            if bar is not None:
                bar.set_postfix(kl=f"{record['kl']:.3f}", acc=f"{sum(record['accepted_at']):.2f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    folder = os.path.join(cfg.out, "checkpoint")
    tokenizer = os.path.join(cfg.model, "tokenizer.json")
    info = checkpoint_run_info(cfg.model)
    name = (info.get("name") or "dsv41") + "-dspark"
    # the backbone's tensors exactly as stored (no second rounding of FP8 tables), then the drafter's
    state = {}
    for file in checkpoint_files(cfg.model):
        state.update(load_file(file))
    state.update({name: t for name, t in inference_state(net, dcfg).items() if name.startswith("mtp.")})
    save_checkpoint(
        folder,
        net,
        dcfg,
        tokenizer if os.path.exists(tokenizer) else None,
        state=state,
        run_info={**info, "name": name, "drafter_steps": cfg.steps, "backbone": os.path.abspath(cfg.model)},
    )
    _plot(history, os.path.join(cfg.out, "acceptance.png"))
    return history[-1]


@torch.no_grad()
def evaluate(net: Transformer, cfg: DrafterConfig, val_set: TokenDataset, windows=None) -> dict:
    """Validation: draft loss and the greedy acceptance per position (teacher-forced prefixes: position i
    counts when the drafter's argmax equals the backbone's at i and at every earlier one), on held-out
    data windows or on the given windows [n, seq_len] (held-out generated text)."""
    gen = torch.Generator().manual_seed(12345)
    totals, kl, accepted = 0.0, 0.0, None
    for i in range(cfg.eval_batches):
        if windows is not None:
            x = windows[(torch.arange(cfg.batch_size) + i * cfg.batch_size) % windows.size(0)]
        else:
            x, _ = val_set.batch(i, cfg.batch_size, cfg.seq_len, cfg.seed + 1)
        hidden, logits = backbone_pass(net, x)
        out = draft_losses(net, cfg, x, hidden, logits, gen)
        totals += float(out["draft_loss"])
        kl += float(out["kl"])
        accepted = out["accepted"] if accepted is None else accepted + out["accepted"]
    accepted = accepted / cfg.eval_batches
    return {
        "draft_loss": totals / cfg.eval_batches,
        "kl": kl / cfg.eval_batches,
        "accepted_at": [round(float(v), 4) for v in accepted],
        "mean_accepted": float(accepted.sum()),
    }


def _plot(history: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    evals = [r for r in history if "val" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in history], [r["kl"] for r in history], label="train")
    ax1.plot([r["step"] for r in evals], [r["val"]["kl"] for r in evals], "o-", label="validation")
    ax1.set_xlabel("step")
    ax1.set_ylabel("KL(backbone || drafter), nats")
    ax1.set_yscale("log")
    ax1.legend()
    if evals:
        key = "val_generated" if "val_generated" in evals[0] else "val"
        k = len(evals[0][key]["accepted_at"])
        for i in range(k):
            ax2.plot(
                [r["step"] for r in evals], [r[key]["accepted_at"][i] for r in evals], "o-", label=f"position {i + 1}"
            )
        ax2.set_title("held-out generated text" if key == "val_generated" else "held-out data")
    ax2.set_xlabel("step")
    ax2.set_ylabel("greedy acceptance (validation, with earlier positions)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
