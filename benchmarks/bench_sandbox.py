"""Scale of the RL sandbox as the trainer uses it: start latency, gradings per second, sandboxes alive at
once and their proportional memory.

    python benchmarks/bench_sandbox.py [--runs 30] [--widths 1,2,4,8] [--gradings 32] [--max-alive 64]

Prints one JSON document:
- start_latency_s: p50/p99 wall time of `run_python("pass")`, one at a time (launcher, pid namespace's
  init, program, cleanup);
- gradings_per_s: `grade_programs` of `--gradings` honest solutions (a probe run and an evaluation run
  each) through a SandboxPool of each width;
- alive: for 8, 16, ... up to `--max-alive` sandboxes sleeping at once, how many ran to the end, and the
  PSS (proportional set size: shared pages divided among their users) per sandbox, summed over the
  processes of their slots' uids while all sleep.

Needs root (the slots' uids and cgroups), like the sandbox itself, and loads the machine fully: run it on
an otherwise idle machine for figures worth comparing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

from dsv41.rl.sandbox import SandboxLimits, SandboxPool, grade_programs, run_python, sandbox_uid

TESTS = ["assert add(1, 2) == 3", "add(-1, 5) == 4", "add(0, 0) == 0"]
HONEST = "def add(a, b):\n    return a + b\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pss_bytes_of_uids(uids: set[int]) -> tuple[int, int]:
    """(total PSS of the processes whose real uid is in `uids`, how many processes)."""
    total = count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith(b"Uid:"))
            if uid not in uids:
                continue
            with open(f"/proc/{entry}/smaps_rollup", "rb") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(b"Pss:")) * 1024
            count += 1
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile, or a zombie (no smaps)
    return total, count


def start_latency(runs: int) -> dict:
    limits = SandboxLimits(wall_time_s=30)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        result = run_python("pass", limits=limits)
        times.append(time.perf_counter() - t)
        assert result.ok, result
    return {"p50": round(statistics.median(times), 4), "p99": round(percentile(times, 0.99), 4), "runs": runs}


def gradings_per_s(widths: list[int], n: int) -> dict:
    out = {}
    for width in widths:
        with SandboxPool(max_workers=width, limits=SandboxLimits(wall_time_s=30), slot_offset=2000) as pool:
            t = time.perf_counter()
            scores = [s for s, _ in grade_programs([(HONEST, TESTS)] * n, pool)]
            elapsed = time.perf_counter() - t
        assert scores == [1.0] * n, scores
        out[width] = round(n / elapsed, 2)
    return out


def alive(max_alive: int) -> dict:
    out = {}
    width, offset = 8, 4000
    while width <= max_alive:
        sleep_s = 3 + width * 0.1  # long enough for all to be up at once on a small machine
        uids = {sandbox_uid(offset + i) for i in range(width)}
        samples: list[tuple[int, int]] = []
        stop = threading.Event()

        def sample(uids=uids, samples=samples, stop=stop, sleep_s=sleep_s):
            deadline = time.monotonic() + sleep_s
            while not stop.is_set() and time.monotonic() < deadline:
                samples.append(pss_bytes_of_uids(uids))
                time.sleep(0.25)

        sampler = threading.Thread(target=sample)
        with SandboxPool(max_workers=width, limits=SandboxLimits(wall_time_s=60), slot_offset=offset) as pool:
            sampler.start()
            results = pool.map([f"import time\ntime.sleep({sleep_s:.1f})"] * width)
        stop.set()
        sampler.join()
        ok = sum(r.ok for r in results)
        # The sample with the most processes alive: every sandbox's launcher, init and program.
        total, processes = max(samples, key=lambda s: s[1]) if samples else (0, 0)
        out[width] = {
            "ok": ok,
            "processes_at_peak": processes,
            "pss_per_sandbox_mib": round(total / max(1, processes / 3) / 2**20, 2),
        }
        if ok < width:
            break
        width *= 2
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs for the start latency")
    parser.add_argument("--widths", default="1,2,4,8", help="SandboxPool widths for gradings per second")
    parser.add_argument("--gradings", type=int, default=32, help="gradings per width")
    parser.add_argument("--max-alive", type=int, default=64, help="largest number of sandboxes alive at once")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench_sandbox.py needs root (the sandbox's per-slot uids and cgroups)")
    out = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    out["start_latency_s"] = start_latency(args.runs)
    out["gradings_per_s"] = gradings_per_s([int(w) for w in args.widths.split(",")], args.gradings)
    out["alive"] = alive(args.max_alive)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
