"""Scale figures of the sandbox orchestrator (issue 31): `python -m dsv41.rl.sandbox.bench [--max-concurrent N]`.

Measures, on this machine: the wall time of one sandboxed run against a bare `python -I -c pass` (the
overhead of the layers), the CPU time a run costs the machine, sandboxes completed per second through a
SandboxPool at a few widths, the resident memory of a running sandbox (launcher + program, from /proc and
from its cgroup's peak), and how many sleeping sandboxes run at once without a failure. It prints one JSON
document; docs/sandbox.md keeps the figures and their extrapolation to a large node.

It needs the same privileges as the sandbox itself (root for the per-slot uids and cgroups) and loads the
machine fully for a few seconds: not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from dsv41.rl.sandbox.config import SandboxLimits, sandbox_uid
from dsv41.rl.sandbox.launcher import sum_status_field_of_uid
from dsv41.rl.sandbox.orchestrator import run_python
from dsv41.rl.sandbox.pools import SandboxPool


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _median_wall(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per latency figure")
    parser.add_argument("--min-concurrent", type=int, default=16, help="first concurrency step (doubled each step)")
    parser.add_argument("--max-concurrent", type=int, default=128, help="largest concurrency step tried")
    args = parser.parse_args(argv)
    limits = SandboxLimits(wall_time_s=60, cpu_time_s=30)
    out: dict = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}

    bare = [sys.executable, "-I", "-c", "pass"]
    out["bare_python_wall_s"] = _median_wall(lambda: subprocess.run(bare, check=True), args.runs)
    cpu0 = _children_cpu_s()
    out["run_python_wall_s"] = _median_wall(lambda: run_python("pass", limits=limits), args.runs)
    out["run_python_cpu_s"] = (_children_cpu_s() - cpu0) / args.runs  # launcher + program + kill helper

    out["pool_runs_per_s"] = {}
    for width in (1, 2, 4, 8):
        n = max(args.runs, 4 * width)
        with SandboxPool(max_workers=width, limits=limits, slot_offset=2000) as pool:
            t = time.perf_counter()
            results = pool.map(["pass"] * n)
            elapsed = time.perf_counter() - t
        assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
        out["pool_runs_per_s"][width] = round(n / elapsed, 2)

    # A running sandbox: the launcher and the program's interpreter, sampled while the program sleeps.
    slot = 3000
    with SandboxPool(max_workers=1, limits=limits, slot_offset=slot) as pool:
        future = pool.submit("import time\ntime.sleep(2)")
        time.sleep(1.2)
        out["running_sandbox_rss_bytes"] = sum_status_field_of_uid(sandbox_uid(slot), b"VmRSS") * 1024
        result = future.result()
    out["running_sandbox_cgroup_peak_bytes"] = result.memory_peak_bytes

    # Concurrency: every sandbox sleeps long enough to overlap all the others' start-up.
    out["concurrent"] = {}
    width = args.min_concurrent
    while width <= args.max_concurrent:
        sleep_s = 2 + width * out["run_python_cpu_s"] / max(1, os.cpu_count() or 1)
        with SandboxPool(max_workers=width, limits=limits, slot_offset=4000) as pool:
            t = time.perf_counter()
            results = pool.map([f"import time\ntime.sleep({sleep_s:.2f})"] * width)
            elapsed = time.perf_counter() - t
        failed = [r.status + ": " + r.stderr[-200:] for r in results if not r.ok]
        out["concurrent"][width] = {
            "ok": width - len(failed),
            "failed": failed[:3],
            "wall_s": round(elapsed, 2),
            "sleep_s": round(sleep_s, 2),
        }
        if failed:
            break
        width *= 2
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
