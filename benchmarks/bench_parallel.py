"""Data-parallel serving benchmark (issue 32, first part): `dsv41 serve` on one rank against two data- and
expert-parallel ranks, through the HTTP front, in one run.

    python benchmarks/bench_parallel.py [--preset tiny] [--requests 8] [--max-tokens 32] [--out FILE.json]
    python benchmarks/bench_parallel.py --disaggregation [--prompt-len 256] [--handoff-lens 64,256,1024]
    python benchmarks/bench_parallel.py --scale-out [--requests 8] [--max-tokens 16] [--prompt-len 64]

`--scale-out` runs, in one run: colocated serving on 1, 2 and 4 ranks (DP x EP) and disaggregated serving
with single-rank workers (1+1) and multi-rank workers of different layouts (prefill on one device or TP=2,
decode on DP=2 x EP=2), and the hand-off's bytes per token and times against the analytic KV size.

`--disaggregation` (issue 32, second part) measures instead, in one run: colocated serving (one `dsv41
serve`) against disaggregated serving (`dsv41 router` + one prefill and one decode worker, each a process
with `--threads 1`) on the same requests; and the KV hand-off itself, in process: its bytes per prompt token
against the analytic global-KV size (dsv41.model.cache.global_kv_bytes_per_token), its fixed payload, and
the time to export, serialise (crc32 per block), parse and verify, and import it, per prompt length.

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
    with requests.post(
        base + "/v1/completions",
        stream=True,
        timeout=600,
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            "logprobs": 0,
        },
    ) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                choices = json.loads(line[6:])["choices"]
                if choices and choices[0].get("logprobs"):
                    end = time.perf_counter()
                    first = first or end
                    tokens += len(choices[0]["logprobs"]["token_logprobs"])
    return {"ttft": first - start, "itl": (end - first) / max(tokens - 1, 1), "tokens": tokens, "end": end}


def run_layout(
    preset: str, ranks: int, n_requests: int, max_tokens: int, prompt_len: int, tp: int = 1, engram: str = "auto"
) -> dict:
    """`ranks` data- and expert-parallel engines (1: one device), or with tp > 1 one engine whose attention
    heads are split over `tp` tensor-parallel ranks; `engram`: --engram-sharding."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "dsv41.cli",
        "serve",
        preset,
        "--port",
        str(port),
        "--threads",
        "1",
        "--fused-kernels",
        "off",
        "--log-level",
        "warning",
    ]
    if ranks > 1:
        cmd += ["--data-parallel-size", str(ranks), "--expert-parallel-size", str(ranks)]
    if tp > 1:
        cmd += ["--tensor-parallel-size", str(tp)]
    if engram != "auto":
        cmd += ["--engram-sharding", engram]
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
        return {
            "ranks": ranks * tp,
            "layout": (f"TP={tp}" if tp > 1 else f"DP={ranks}") + ("r" if engram == "replicated" else ""),
            "requests": n_requests,
            "tokens": tokens,
            "wall_s": wall,
            "tokens_per_s": tokens / wall,
            "ttft_mean_s": statistics.mean(r["ttft"] for r in results),
            "itl_mean_s": statistics.mean(itl),
            "itl_max_s": max(itl),
            "engine_steps": steps,
            "wall_per_collective_step_s": wall / max(collective_steps, 1),
        }
    finally:
        proc.send_signal(2)  # Ctrl-C: the server stops its ranks
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _wait_up(base: str, proc, what: str) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            if requests.get(base + "/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up")
        time.sleep(0.5)


def _batch(base: str, n_requests: int, max_tokens: int, prompt_len: int) -> dict:
    model = requests.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    prompts = [[(r * 97 + 13 * i) % 1000 + 3 for i in range(prompt_len)] for r in range(n_requests)]
    _stream(base, model, prompts[0][:4], 4)  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(n_requests) as pool:
        results = list(pool.map(lambda p: _stream(base, model, p, max_tokens), prompts))
    wall = max(r["end"] for r in results) - start
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": n_requests,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "ttft_mean_s": statistics.mean(r["ttft"] for r in results),
        "itl_mean_s": statistics.mean(r["itl"] for r in results),
    }


def run_disaggregation(preset: str, n_requests: int, max_tokens: int, prompt_len: int) -> list[dict]:
    """Colocated (one server) vs disaggregated (router + prefill worker + decode worker) on one batch."""
    serve = [
        sys.executable,
        "-m",
        "dsv41.cli",
        "serve",
        preset,
        "--threads",
        "1",
        "--fused-kernels",
        "off",
        "--log-level",
        "warning",
    ]
    rows = []
    for layout in ("colocated", "disaggregated"):
        procs, ports = [], [_free_port() for _ in range(3)]
        try:
            if layout == "colocated":
                procs.append(
                    subprocess.Popen(
                        serve + ["--port", str(ports[0])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                    )
                )
                _wait_up(f"http://127.0.0.1:{ports[0]}", procs[0], "the server")
            else:
                for port, mode in zip(ports[1:], ("prefill", "decode")):
                    procs.append(
                        subprocess.Popen(
                            serve + ["--port", str(port), "--disaggregation-mode", mode],
                            stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                        )
                    )
                for port, proc in zip(ports[1:], procs):
                    _wait_up(f"http://127.0.0.1:{port}", proc, "a worker")
                procs.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "dsv41.cli",
                            "router",
                            "--port",
                            str(ports[0]),
                            "--log-level",
                            "warning",
                            "--prefill",
                            f"http://127.0.0.1:{ports[1]}",
                            "--decode",
                            f"http://127.0.0.1:{ports[2]}",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
                _wait_up(f"http://127.0.0.1:{ports[0]}", procs[-1], "the router")
            row = {"layout": layout, **_batch(f"http://127.0.0.1:{ports[0]}", n_requests, max_tokens, prompt_len)}
            if layout == "disaggregated":
                stats = requests.get(f"http://127.0.0.1:{ports[0]}/stats", timeout=10).json()
                row["router"] = stats
                row["prefill_s_per_request"] = stats["prefill_s"] / max(stats["handoffs"], 1)
                row["deliver_s_per_request"] = stats["deliver_s"] / max(stats["handoffs"], 1)
                row["handoff_bytes_per_request"] = stats["handoff_bytes"] / max(stats["handoffs"], 1)
            rows.append(row)
        finally:
            _stop(procs)
    return rows


def _stop(procs) -> None:
    """Ctrl-C to every server process, then wait for each (killed after 60 s)."""
    for proc in procs:
        proc.send_signal(2)
    for proc in procs:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


# --scale-out: every layout of one run, as (name, ranks in all, [serve layout] or (prefill layout, decode layout))
SCALE_OUT = [
    ("colocated 1", 1, []),
    ("colocated DP2xEP2", 2, ["--data-parallel-size", "2", "--expert-parallel-size", "2"]),
    ("colocated DP4xEP4", 4, ["--data-parallel-size", "4", "--expert-parallel-size", "4"]),
    ("disagg 1+1", 2, ([], [])),
    ("disagg 1+DP2xEP2", 3, ([], ["--data-parallel-size", "2", "--expert-parallel-size", "2"])),
    (
        "disagg TP2+DP2xEP2",
        4,
        (["--tensor-parallel-size", "2"], ["--data-parallel-size", "2", "--expert-parallel-size", "2"]),
    ),
]


def _start(cmd: list[str], base: str, what: str, procs: list) -> None:
    procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    _wait_up(base, procs[-1], what)


def run_scale_out(preset: str, n_requests: int, max_tokens: int, prompt_len: int, only=None) -> list[dict]:
    """Colocated serving on 1, 2 and 4 data+expert-parallel ranks, and disaggregated serving (router + a prefill
    and a decode worker) with single-rank workers and with multi-rank ones of different layouts, on the same
    batch, one layout after the other (each process `--threads 1`)."""
    serve = [
        sys.executable,
        "-m",
        "dsv41.cli",
        "serve",
        preset,
        "--threads",
        "1",
        "--fused-kernels",
        "off",
        "--log-level",
        "warning",
    ]
    rows = []
    for name, ranks, layout in SCALE_OUT:
        if only and name not in only:
            continue
        procs: list = []
        ports = [_free_port() for _ in range(3)]
        url = [f"http://127.0.0.1:{p}" for p in ports]
        try:
            if isinstance(layout, list):
                _start(serve + layout + ["--port", str(ports[0])], url[0], name, procs)
            else:
                for port, base, mode, args in zip(ports[1:], url[1:], ("prefill", "decode"), layout):
                    _start(serve + args + ["--port", str(port), "--disaggregation-mode", mode], base, name, procs)
                _start(
                    [
                        sys.executable,
                        "-m",
                        "dsv41.cli",
                        "router",
                        "--port",
                        str(ports[0]),
                        "--log-level",
                        "warning",
                        "--prefill",
                        url[1],
                        "--decode",
                        url[2],
                    ],
                    url[0],
                    "the router",
                    procs,
                )
            row = {"layout": name, "ranks": ranks, **_batch(url[0], n_requests, max_tokens, prompt_len)}
            if not isinstance(layout, list):
                stats = requests.get(url[0] + "/stats", timeout=10).json()
                n = max(stats["handoffs"], 1)
                row.update(
                    router=stats,
                    prefill_s_per_request=stats["prefill_s"] / n,
                    deliver_s_per_request=stats["deliver_s"] / n,
                    handoff_bytes_per_request=stats["handoff_bytes"] / n,
                )
            rows.append(row)
            print(
                f"{name:>20} {ranks:>5} {row['tokens_per_s']:>9.1f} {row['ttft_mean_s']:>8.2f} "
                f"{1e3 * row['itl_mean_s']:>8.1f}",
                flush=True,
            )
        finally:
            _stop(procs)
    return rows


def handoff_table(args, with_prefill: bool) -> list[dict]:
    """Measure the hand-off at --handoff-lens prompt lengths and print its table (bytes, KV bytes per token
    against the analytic size, fixed bytes, [prefill,] serialise / parse+verify / import times)."""
    handoff = measure_handoff(args.preset, [int(x) for x in args.handoff_lens.split(",")])
    prefill_head = f" {'prefill s':>9}" if with_prefill else ""
    print(
        f"{'prompt':>7} {'bytes':>9} {'KV B/tok':>9} {'analytic':>9} {'fixed B':>8}{prefill_head} {'ser ms':>7} "
        f"{'parse ms':>8} {'import ms':>9}"
    )
    for r in handoff:
        prefill = f" {r['prefill_s']:>9.2f}" if with_prefill else ""
        print(
            f"{r['prompt_tokens']:>7} {r['handoff_bytes']:>9} {r['kv_bytes_per_token']:>9.1f} "
            f"{r['analytic_kv_bytes_per_token']:>9.1f} {r['fixed_bytes']:>8}{prefill} {1e3 * r['serialize_s']:>7.2f} "
            f"{1e3 * r['parse_verify_s']:>8.2f} {1e3 * r['import_s']:>9.2f}"
        )
    return handoff


def main_scale_out(args) -> None:
    handoff = handoff_table(args, with_prefill=False)
    print(f"{'layout':>20} {'ranks':>5} {'tokens/s':>9} {'TTFT s':>8} {'ITL ms':>8}")
    rows = run_scale_out(
        args.preset, args.requests, args.max_tokens, args.prompt_len, args.layouts.split(";") if args.layouts else None
    )
    base = rows[0]
    for r in rows:
        r["tokens_per_s_vs_first"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["ttft_vs_first"] = r["ttft_mean_s"] / base["ttft_mean_s"]
        r["itl_vs_first"] = r["itl_mean_s"] / base["itl_mean_s"]
        extra = ""
        if "handoff_bytes_per_request" in r:
            extra = (
                f"; hand-off {r['handoff_bytes_per_request']:.0f} B/request, prefill {r['prefill_s_per_request']:.2f} s, "
                f"delivered in {1e3 * r['deliver_s_per_request']:.1f} ms"
            )
        print(
            f"{r['layout']} vs {base['layout']}: tokens/s {r['tokens_per_s_vs_first']:.2f}x, TTFT "
            f"{r['ttft_vs_first']:.2f}x, ITL {r['itl_vs_first']:.2f}x{extra}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "cpu_count": os.cpu_count(),
                    "load_avg": os.getloadavg(),
                    "requests": args.requests,
                    "max_tokens": args.max_tokens,
                    "prompt_len": args.prompt_len,
                    "handoff": handoff,
                    "layouts": rows,
                },
                f,
                indent=2,
            )


def measure_handoff(preset: str, lengths: list[int]) -> list[dict]:
    """The hand-off of one prompt per length, in process: sizes against the analytic KV, and timings."""
    import torch

    from dsv41.engine import EngineConfig, SamplingParams, build_engine
    from dsv41.engine.handoff import KVHandoff
    from dsv41.model.cache import fixed_state_bytes_per_sequence, global_kv_bytes_per_token

    cfg_kw = dict(kv_pool_tokens=max(lengths) * 2 + 1024, fused_kernels="off", enable_prefix_caching=False)
    p_engine = build_engine(preset, EngineConfig(**cfg_kw), seed=0)
    d_engine = build_engine(preset, EngineConfig(**cfg_kw), seed=0)
    cfg = p_engine.model_config
    analytic = global_kv_bytes_per_token(cfg)["total"]
    fixed = fixed_state_bytes_per_sequence(cfg)
    rows = []
    for n in lengths:
        prompt = [(13 * i) % 1000 + 3 for i in range(n)]
        t0 = time.perf_counter()
        p_engine.add_request(f"p{n}", prompt, SamplingParams(max_tokens=1), export_handoff=True)
        out = None
        while p_engine.has_unfinished():
            out = next((o for o in p_engine.step() if o.finished), out)
        t1 = time.perf_counter()
        data = out.handoff.to_bytes()
        t2 = time.perf_counter()
        handoff = KVHandoff.from_bytes(data, d_engine.identity())
        t3 = time.perf_counter()
        d_engine.add_request(f"d{n}", prompt, SamplingParams(temperature=0, max_tokens=1), handoff=handoff)
        while d_engine.has_unfinished():  # admission imports; the step samples the first token
            d_engine.step()
        t4 = time.perf_counter()
        kv = handoff.kv_bytes()
        rows.append(
            {
                "prompt_tokens": n,
                "handoff_bytes": len(data),
                "kv_bytes": kv,
                "kv_bytes_per_token": kv / n,
                "analytic_kv_bytes_per_token": analytic,
                "fixed_bytes": len(data) - kv,
                "analytic_fixed_state_bytes": fixed["window_fp8"] + fixed["compressor_partial_groups"],
                "logits_bytes": cfg.vocab_size * 4,
                "prefill_s": t1 - t0,
                "serialize_s": t2 - t1,
                "parse_verify_s": t3 - t2,
                "import_s": t4 - t3,
                "serialize_gb_per_s": len(data) / (t2 - t1) / 1e9,
                "threads": torch.get_num_threads(),
            }
        )
    return rows


def main_disaggregation(args) -> None:
    handoff = handoff_table(args, with_prefill=True)
    rows = run_disaggregation(args.preset, args.requests, args.max_tokens, args.prompt_len)
    print(f"{'layout':>14} {'tokens/s':>9} {'TTFT s':>8} {'ITL ms':>8}")
    for r in rows:
        print(f"{r['layout']:>14} {r['tokens_per_s']:>9.1f} {r['ttft_mean_s']:>8.2f} {1e3 * r['itl_mean_s']:>8.1f}")
    co, dis = rows
    print(
        f"disaggregated / colocated: tokens/s {dis['tokens_per_s'] / co['tokens_per_s']:.2f}x, "
        f"TTFT {dis['ttft_mean_s'] / co['ttft_mean_s']:.2f}x, ITL {dis['itl_mean_s'] / co['itl_mean_s']:.2f}x; "
        f"hand-off {dis['handoff_bytes_per_request']:.0f} B/request, delivered in "
        f"{1e3 * dis['deliver_s_per_request']:.1f} ms"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "preset": args.preset,
                    "cpu_count": os.cpu_count(),
                    "load_avg": os.getloadavg(),
                    "handoff": handoff,
                    "layouts": rows,
                },
                f,
                indent=2,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument(
        "--ranks",
        default="1,2",
        help=(
            "layouts to measure, comma-separated: N (N data- and expert-parallel ranks) or tpN (one engine, its "
            "attention heads split over N tensor-parallel ranks); Nr: N ranks with the Engram tables whole on every "
            "rank (--engram-sharding replicated; N alone shards their rows)"
        ),
    )
    parser.add_argument("--out", help="also write the results as JSON here")
    parser.add_argument(
        "--disaggregation",
        action="store_true",
        help="colocated vs prefill/decode disaggregated serving, and the KV hand-off's size and time",
    )
    parser.add_argument("--handoff-lens", default="64,256,1024", help="prompt lengths of the hand-off measurement")
    parser.add_argument(
        "--scale-out",
        action="store_true",
        help=(
            "one run over colocated 1, 2 and 4 data+expert-parallel ranks and disaggregated 1+1, 1+DP2xEP2 and "
            "TP2+DP2xEP2 workers behind the router, plus the hand-off's size and time"
        ),
    )
    parser.add_argument("--layouts", help="with --scale-out: only these layouts (names separated by ';')")
    args = parser.parse_args()
    env_path = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [env_path, os.environ.get("PYTHONPATH")]))
    if args.disaggregation or args.scale_out:
        sys.path.insert(0, env_path)
        return main_scale_out(args) if args.scale_out else main_disaggregation(args)
    rows = [
        run_layout(args.preset, 1, args.requests, args.max_tokens, args.prompt_len, tp=int(r[2:]))
        if r.startswith("tp")
        else run_layout(
            args.preset,
            int(r.rstrip("r")),
            args.requests,
            args.max_tokens,
            args.prompt_len,
            engram="replicated" if r.endswith("r") else "auto",
        )
        for r in args.ranks.split(",")
    ]
    print(
        f"{'layout':>6} {'ranks':>5} {'tokens/s':>9} {'TTFT s':>8} {'ITL ms':>8} {'ITL max':>8} {'steps':>6} {'s/step':>7}"
    )
    for r in rows:
        print(
            f"{r['layout']:>6} {r['ranks']:>5} {r['tokens_per_s']:>9.1f} {r['ttft_mean_s']:>8.2f} {1e3 * r['itl_mean_s']:>8.1f} "
            f"{1e3 * r['itl_max_s']:>8.1f} {r['engine_steps']:>6.0f} {r['wall_per_collective_step_s']:>7.3f}"
        )
    if len(rows) > 1:
        for r in rows[1:]:
            print(
                f"tokens/s ratio {r['layout']} vs {rows[0]['layout']}: {r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"preset": args.preset, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "layouts": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
