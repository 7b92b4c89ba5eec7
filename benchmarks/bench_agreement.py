"""How far the engine's `fast` and `deterministic` numerics are from the reference, on a trained model.

    python benchmarks/bench_agreement.py [--positions 20000] [--out bench_out] [--quick]

The shipped checkpoint (dsv41/checkpoints/shakespeare-chat) on held-out text it never trained on
(tests/data/shakespeare-chat-val, the validation split of `dsv41 data --format chat`), each mode judged
against the reference numerics (canonical float64, the golden sets' rule) position by position
(dsv41.eval.agreement): perplexity ratio, top-1 agreement, mean and worst KL(reference || mode). Rows:
- prefill, batch 1: one window at a time, every position scored (prompt logprobs);
- prefill, batch 8: windows of mixed lengths (96-544 tokens) in one batch;
- decode, batch 8: greedy decoding after mixed-length prompts, one token per step over the paged pool, twice
  (the second pass takes the prompts from the prefix cache); the scored tokens are the mode's own argmaxes,
  so its perplexity is biased low and only agreement and KL are targets there.
Targets for `fast`: perplexity within 0.5%, top-1 >= 99%, mean KL <= 2e-3 nats/token. Writes
bench_out/agreement.json; names the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from bench_serve import machine, table

from dsv41.checkpoints import checkpoint_path
from dsv41.engine import EngineConfig
from dsv41.engine.build import build_engine
from dsv41.eval.agreement import decode_agreement, held_out_windows, merge, prefill_agreement

VAL = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "shakespeare-chat-val", "val.bin")
MIXED = [96, 160, 224, 288, 352, 416, 480, 544]  # a batch of 8 mixed lengths (2,560 tokens)


def measure(mode: str, tokens: np.ndarray, positions: int, new_tokens: int, memo: dict) -> list[dict]:
    # "fast-compiled": `fast` with its compiled decode regions, as `dsv41 serve` runs it (decode rows differ)
    numerics, compile_decode = ("fast", "now") if mode == "fast-compiled" else (mode, "off")
    # max_num_seqs 8: the widest batch here; a compiled engine builds its decode graphs only up to it (each bucket
    # is seconds of compiling, minutes on a cold compiler cache)
    config = EngineConfig(numerics=numerics, compile_decode=compile_decode, kv_pool_tokens=65536, max_num_seqs=8)
    engine = build_engine(checkpoint_path(), config)
    model, rows = engine.model, []
    half = positions // 2  # half the positions at batch 1, half at batch 8
    # batch 1: windows of 512 tokens from the start of the stream; batch 8: mixed windows after them
    alone, at = [], 0
    t = time.perf_counter()
    while sum(a.positions for a in alone) < half:
        alone.append(prefill_agreement(engine, model, held_out_windows(tokens[at:], [512]), memo))
        at += 512
    rows.append({"mode": mode, "path": "prefill, batch 1", **merge(alone).as_dict(), "s": time.perf_counter() - t})
    batch = []
    t = time.perf_counter()
    while sum(a.positions for a in batch) < positions - half:
        batch.append(prefill_agreement(engine, model, held_out_windows(tokens[at:], MIXED), memo))
        at += sum(MIXED)
    rows.append({"mode": mode, "path": "prefill, batch 8", **merge(batch).as_dict(), "s": time.perf_counter() - t})
    t = time.perf_counter()
    prompts = held_out_windows(tokens[at:], [m // 4 for m in MIXED], stride=200)
    decoded = decode_agreement(engine, model, prompts, new_tokens, passes=2, memo=memo)
    rows.append({"mode": mode, "path": "decode, batch 8 (+ prefix cache)", **decoded.as_dict()})
    rows[-1]["s"] = time.perf_counter() - t
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--positions", type=int, default=20000, help="prefill positions scored per mode (default 20000)")
    ap.add_argument("--new-tokens", type=int, default=64, help="greedy tokens per decode request (default 64)")
    ap.add_argument(
        "--modes",
        default="fast,fast-compiled,deterministic",
        help="comma-separated (default fast,fast-compiled,deterministic; fast-compiled: with --compile-decode now)",
    )
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--quick", action="store_true", help="2,000 positions and 8 new tokens (a smoke run)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.positions, args.new_tokens = 2000, 8
    torch.set_num_threads(args.threads)
    tokens = np.fromfile(VAL, dtype=np.uint16)
    memo: dict = {}  # the reference logits, computed once for every mode
    rows = []
    for mode in args.modes.split(","):
        rows += measure(mode, tokens, args.positions, args.new_tokens, memo)
    info = machine()
    print(f"\n{info['cpu']} ({', '.join(info['flags'])}), {args.threads} threads, torch {info['torch']}")
    print(
        table(
            "agreement with the reference numerics (shakespeare-chat, held-out text)",
            ["mode", "path", "positions", "ppl ratio", "top-1", "KL mean", "KL max", "s"],
            [
                [
                    r["mode"],
                    r["path"],
                    r["positions"],
                    f"{r['ppl_ratio']:.5f}",
                    f"{r['top1']:.4f}",
                    f"{r['kl_mean']:.2e}",
                    f"{r['kl_max']:.3f}",
                    f"{r['s']:.0f}",
                ]
                for r in rows
            ],
        )
    )
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "agreement.json")
    with open(path, "w") as f:
        json.dump({"machine": info, "threads": args.threads, "rows": rows}, f, indent=2)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
