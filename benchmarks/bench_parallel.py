"""Data-parallel serving benchmark (issue 32, first part): `dsv41 serve` on one rank against two data- and
expert-parallel ranks, through the HTTP front, in one run.

    python benchmarks/bench_parallel.py [--preset tiny] [--requests 8] [--max-tokens 32] [--out FILE.json]

For each layout it starts the server as a user would (`--threads 1` per rank), sends `--requests`
concurrent streamed greedy completions with random prompts, and reports output tokens/s over the whole
batch, time to first token, inter-token latency, and the engine's steps (summed over ranks) with the wall
time per step. Random weights: only speeds mean anything. On a CPU machine whose cores other work shares,
compare the layouts measured in the same run, not across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(base: str, name: str) -> float:
    for line in requests.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith(f"dsv41_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def _stream(base: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request: its first-token time, tokens (counted by their logprobs: a chunk can carry
    several tokens when a UTF-8 character is split over them) and the time of its last chunk."""
    start = time.perf_counter()
    first = end = None
    tokens = 0
    with requests.post(base + "/v1/completions", stream=True, timeout=600, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "logprobs": 0}) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("logprobs"):
                    end = time.perf_counter()
                    first = first or end
                    tokens += len(choices[0]["logprobs"]["token_logprobs"])
    return {"ttft": first - start, "itl": (end - first) / max(tokens - 1, 1), "tokens": tokens, "end": end}


def run_layout(preset: str, ranks: int, n_requests: int, max_tokens: int, prompt_len: int, tp: int = 1) -> dict:
    """`ranks` data- and expert-parallel engines (1: one device), or with tp > 1 one engine whose attention
    heads are split over `tp` tensor-parallel ranks."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dsv41.cli", "serve", preset, "--port", str(port), "--threads", "1",
           "--fused-kernels", "off", "--log-level", "warning"]
    if ranks > 1:
        cmd += ["--data-parallel-size", str(ranks), "--expert-parallel-size", str(ranks)]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if requests.get(base + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the {ranks}-rank server did not come up")
            time.sleep(0.5)
        model = requests.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
        prompts = [[(r * 97 + 13 * i) % 1000 + 3 for i in range(prompt_len)] for r in range(n_requests)]
        _stream(base, model, prompts[0][:4], 4)  # warm-up
        steps0 = _metric(base, "engine_steps_total")
        start = time.perf_counter()
        with ThreadPoolExecutor(n_requests) as pool:
            results = list(pool.map(lambda p: _stream(base, model, p, max_tokens), prompts))
        wall = max(r["end"] for r in results) - start
        steps = _metric(base, "engine_steps_total") - steps0
        tokens = sum(r["tokens"] for r in results)
        itl = [r["itl"] for r in results]  # per request: mean time between its tokens after the first
        # steps_total counts each rank's steps: the group ran steps / ranks collective steps (its ranks all
        # step together), each taking wall / that
        collective_steps = steps / ranks
        return {"ranks": ranks * tp, "layout": f"TP={tp}" if tp > 1 else f"DP={ranks}", "requests": n_requests, "tokens": tokens, "wall_s": wall,
                "tokens_per_s": tokens / wall, "ttft_mean_s": statistics.mean(r["ttft"] for r in results),
                "itl_mean_s": statistics.mean(itl), "itl_max_s": max(itl),
                "engine_steps": steps, "wall_per_collective_step_s": wall / max(collective_steps, 1)}
    finally:
        proc.send_signal(2)  # Ctrl-C: the server stops its ranks
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--ranks", default="1,2", help=(
        "layouts to measure, comma-separated: N (N data- and expert-parallel ranks) or tpN (one engine, its "
        "attention heads split over N tensor-parallel ranks)"))
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    env_path = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")]))
    rows = [run_layout(args.preset, 1, args.requests, args.max_tokens, args.prompt_len, tp=int(r[2:]))
            if r.startswith("tp") else run_layout(args.preset, int(r), args.requests, args.max_tokens, args.prompt_len)
            for r in args.ranks.split(",")]
    print(f"{'layout':>6} {'ranks':>5} {'tokens/s':>9} {'TTFT s':>8} {'ITL ms':>8} {'ITL max':>8} {'steps':>6} {'s/step':>7}")
    for r in rows:
        print(f"{r['layout']:>6} {r['ranks']:>5} {r['tokens_per_s']:>9.1f} {r['ttft_mean_s']:>8.2f} {1e3 * r['itl_mean_s']:>8.1f} "
              f"{1e3 * r['itl_max_s']:>8.1f} {r['engine_steps']:>6.0f} {r['wall_per_collective_step_s']:>7.3f}")
    if len(rows) > 1:
        for r in rows[1:]:
            print(f"tokens/s ratio {r['layout']} vs {rows[0]['layout']}: {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"preset": args.preset, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
                       "layouts": rows}, f, indent=2)


if __name__ == "__main__":
    main()
