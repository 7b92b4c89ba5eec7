"""Training-step benchmark: where a step's time goes, for the variants the issue compares.

    python benchmarks/bench_train.py [--preset small] [--out bench_out] [--threads 2] [--quick]

For each variant one training step is split into forward + backward (the model, `forward_train`) and the
optimizer step (Muon's Newton-Schulz dominates it on small CPU models), measured side by side in one
run (these machines are noisy; compare the ratios). Variants: the recipe (sparse top-k + QAT, Newton-
Schulz in bf16), the same with fp32 Newton-Schulz, dense attention, QAT off, and the recipe at 4x the
batch (the optimizer's cost is per step, so tokens/s grows with the batch). Random weights and tokens:
only times mean anything here. Prints a table and writes bench_out/train_step_<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

from dsv41.config import preset
from dsv41.model.init import init_random_weights
from dsv41.model.training import TrainOptions, prepare_for_training
from dsv41.model.transformer import Transformer
from dsv41.optim import OptimConfig, build_optimizers


def time_steps(cfg, batch: int, seq_len: int, steps: int, ns_dtype: torch.dtype, opts: TrainOptions) -> dict:
    """Mean seconds of forward+backward and of the optimizer step over `steps` steps (after one warm-up)."""
    model = prepare_for_training(init_random_weights(Transformer(cfg), seed=0))
    optimizer = build_optimizers(model, OptimConfig(ns_dtype=ns_dtype), cfg)
    g = torch.Generator().manual_seed(0)
    fwd_bwd, opt_step = [], []
    for step in range(steps + 1):
        ids = torch.randint(3, cfg.vocab_size, (batch, seq_len + 1), generator=g)  # [B, S+1]
        t0 = time.perf_counter()
        out = model(ids[:, :-1], train_options=opts)
        loss = (
            F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.indexer_kl + 1e-4 * out.balance_loss
        )
        loss.backward()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if step:  # the first step warms allocators and caches
            fwd_bwd.append(t1 - t0)
            opt_step.append(t2 - t1)
    fb, op = sum(fwd_bwd) / steps, sum(opt_step) / steps
    tokens = batch * seq_len
    return {
        "tokens_per_step": tokens,
        "fwd_bwd_s": fb,
        "optimizer_s": op,
        "step_s": fb + op,
        "tokens_per_s": tokens / (fb + op),
        "fwd_bwd_tokens_per_s": tokens / fb,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant (after one warm-up)")
    parser.add_argument("--vocab", type=int, default=8192, help="vocabulary (a BPE-8k corpus, as in training)")
    parser.add_argument("--quick", action="store_true", help="tiny preset, small batch, one timed step (CI smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.preset, args.batch, args.seq_len, args.steps, args.vocab = "tiny", 2, 64, 1, 1024
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset).replace(
        vocab_size=args.vocab, max_position_embeddings=max(preset(args.preset).max_position_embeddings, args.seq_len)
    )
    b, s = args.batch, args.seq_len
    variants = [
        ("recipe (sparse + QAT, NS bf16)", b, torch.bfloat16, TrainOptions()),
        ("recipe, NS fp32", b, torch.float32, TrainOptions()),
        ("dense attention", b, torch.bfloat16, TrainOptions(dense_indexer=True)),
        ("QAT off", b, torch.bfloat16, TrainOptions(qat=False)),
        ("recipe, batch x4", 4 * b, torch.bfloat16, TrainOptions()),
    ]
    rows = []
    for name, batch, ns_dtype, opts in variants:
        result = time_steps(cfg, batch, s, args.steps, ns_dtype, opts)
        rows.append({"variant": name, "batch": batch, "seq_len": s, **result})
        print(f"  measured {name}: {result['step_s']:.2f} s/step", flush=True)

    base = rows[0]["tokens_per_s"]
    print(
        f"\ntraining step, preset {args.preset}, {args.threads} threads, seq {s} "
        f"(fwd+bwd = forward_train + backward; opt = Muon + Sinkhorn + AdamW)"
    )
    print(f"{'variant':34} {'tokens':>7} {'fwd+bwd s':>10} {'opt s':>7} {'tok/s':>7} {'vs recipe':>10}")
    for r in rows:
        print(
            f"{r['variant']:34} {r['tokens_per_step']:7d} {r['fwd_bwd_s']:10.2f} {r['optimizer_s']:7.2f} "
            f"{r['tokens_per_s']:7.1f} {r['tokens_per_s'] / base:9.2f}x"
        )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"train_step_{args.preset}.json")
    with open(path, "w") as f:
        json.dump(
            {"preset": args.preset, "threads": args.threads, "torch": torch.__version__, "rows": rows}, f, indent=1
        )
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
