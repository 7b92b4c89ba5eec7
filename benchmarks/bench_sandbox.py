"""Scale of the RL sandbox as the trainer uses it: start latency, memory per idle sandbox, gradings per
second, and how many sandboxes can be alive at once on this machine, with its limits holding at full load.

    python benchmarks/bench_sandbox.py [--runs 30] [--widths 1,2,4,8] [--gradings 32]
        [--ramp 32,256,1000,2500] [--stop-used-gib 20] [--out FILE.json]

Each figure compares the zygote (SandboxPool's default: launchers forked from one pre-imported
interpreter) with the cold start (a fresh interpreter per launcher), side by side in one run:
- start latency: p50/p99 wall time of `run_python("pass")`, one at a time, cold and zygote interleaved;
- idle memory: sandboxes blocked in a system call (`signal.pause()`, as an agent's tool call waiting on
  its caller), their PSS (proportional set size: each shared page divided among the processes mapping
  it) and their private pages, per sandbox (a sandbox is three processes: launcher, the pid namespace's
  init, the program);
- gradings per second: `grade_programs` of `--gradings` honest solutions through a SandboxPool per width;
- the ramp (zygote): more and more sandboxes alive at once, each blocked, up to each step of `--ramp`:
  when all of a step are up, their PSS and private memory, what the machine's memory and this process's
  memory cgroup (which holds every sandbox's) grew by per sandbox, the kernel's share (slab, page tables,
  kernel stacks), and three hostile programs run beside them (a memory hog, a fork bomb, an endless
  loop) must still hit their limits. The ramp stops at the first step that cannot be completed (a
  sandbox failed to start: its error names the resource), or before the machine's used memory would
  pass `--stop-used-gib`; the ceiling and its limiting resource are reported. Then every sandbox is
  released and the run checks that none of their processes or cgroups is left.

Prints a table and one JSON document (also written to --out). Needs root (the slots' uids and cgroups),
like the sandbox itself, and loads the machine: run it on an otherwise idle machine for figures worth
comparing.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import resource
import signal
import statistics
import sys
import time

from dsv41.rl.sandbox import SandboxLimits, SandboxPool, grade_programs, run_python, sandbox_uid
from dsv41.rl.sandbox.cgroups import own_paths
from dsv41.rl.sandbox.orchestrator import launcher_zygote

TESTS = ["assert add(1, 2) == 3", "add(-1, 5) == 4", "add(0, 0) == 0"]
HONEST = "def add(a, b):\n    return a + b\n"

# An idle sandbox: blocked in a system call until the benchmark releases it with SIGWINCH (ignored by
# the launcher and the init, whose default action for it is to ignore it).
HOLD = "import signal, sys\nsignal.signal(signal.SIGWINCH, lambda *_: sys.exit(0))\nsignal.pause()\n"
HOLD_LIMITS = SandboxLimits(wall_time_s=3600, cpu_time_s=10)  # outlives a slow ramp and its release

# Hostile programs run while the ramp's sandboxes are all alive: each must hit its limit.
MEMORY_HOG = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
FORK_BOMB = """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
print(n)
"""
SPIN = "while True:\n    pass\n"
PROBE_LIMITS = SandboxLimits(wall_time_s=3, cpu_time_s=30, memory_bytes=256 << 20, max_processes=16)

# Slot offsets, clear of the trainer's (100 per rank from 0), the tests' (below 2000) and run_python's
# default (counting down from the top, 5533). A slot is a uid, so a node holds at most 5534 sandboxes.
POOL_SLOTS = 2_000
PROBE_SLOTS = 2_100
RAMP_SLOTS = 2_600


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            name, value = line.split(":", 1)
            out[name] = int(value.split()[0]) * 1024
    return out


def own_cgroup(controller: str) -> str | None:
    """This process's directory in a v1 controller's hierarchy (the sandboxes' cgroups are made below it),
    or None where the controller is not mounted as v1."""
    path = own_paths()[1].get(controller)
    return None if path is None else f"/sys/fs/cgroup/{controller}{path.rstrip('/')}"


def own_memory_cgroup() -> str | None:
    directory = own_cgroup("memory")
    return directory if directory is not None and os.path.isdir(directory) else None


def cgroup_bytes(directory: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    if directory is None:
        return out
    for key, name in (("usage", "memory.usage_in_bytes"), ("kmem", "memory.kmem.usage_in_bytes")):
        try:
            with open(os.path.join(directory, name), encoding="ascii") as f:
                out[key] = int(f.read())
        except (OSError, ValueError):
            pass
    return out


def sandbox_processes(uids: set[int], rollup: bool = False) -> list[dict]:
    """The processes whose real uid is in `uids`: pid, uid, state, pid in their own namespace, and with
    `rollup` their PSS and private bytes (from /proc/PID/smaps_rollup)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if b":" in line)
            uid = int(fields[b"Uid"].split()[0])
            if uid not in uids:
                continue
            proc = {
                "pid": int(entry),
                "uid": uid,
                "state": fields[b"State"].split()[0].decode(),
                "nspid": int(fields[b"NSpid"].split()[-1]),
            }
            if rollup:
                with open(f"/proc/{entry}/smaps_rollup", "rb") as f:
                    sizes = {
                        key: int(value.split()[0]) * 1024
                        for key, value in (line.split(b":", 1) for line in f if b":" in line)
                        if key in (b"Pss", b"Private_Clean", b"Private_Dirty")
                    }
                proc["pss"] = sizes.get(b"Pss", 0)
                proc["private"] = sizes.get(b"Private_Clean", 0) + sizes.get(b"Private_Dirty", 0)
            found.append(proc)
        except (OSError, KeyError, ValueError, IndexError):
            continue  # gone meanwhile, or a zombie (no smaps)
    return found


def slots_pids_dir() -> str | None:
    """The v1 pids hierarchy's dsv41-sandbox directory below this process's cgroup (the slots' cgroups)."""
    directory = own_cgroup("pids")
    return None if directory is None else directory + "/dsv41-sandbox"


def count_up(slots: list[int], up: set[int], pids_dir: str | None) -> int:
    """How many of `slots` have their init and program (2 tasks) in their cgroup; `up` remembers those
    found (an idle sandbox stays up until released), so each call reads only the others' pids.current.
    Far cheaper than reading every process's status in /proc, which with thousands of sandboxes took the
    interpreter's lock from the orchestrator's threads long enough to slow their starts."""
    if pids_dir is None:
        up.update(
            p["uid"] - sandbox_uid(0) for p in sandbox_processes({sandbox_uid(s) for s in slots}) if p["nspid"] == 2
        )
        return len(up)
    for slot in slots:
        if slot in up:
            continue
        try:
            with open(f"{pids_dir}/slot-{slot}/pids.current", encoding="ascii") as f:
                if int(f.read()) >= 2:
                    up.add(slot)
        except (OSError, ValueError):
            pass
    return len(up)


def blocked_programs(procs: list[dict]) -> int:
    """Sandboxes whose program (pid 2 of its namespace) is asleep: up and blocked in its call."""
    return sum(1 for p in procs if p["nspid"] == 2 and p["state"] == "S")


def release(uids: set[int]) -> None:
    for p in sandbox_processes(uids):
        try:
            os.kill(p["pid"], signal.SIGWINCH)
        except ProcessLookupError:
            pass


def release_slots(slots: list[int], pids_dir: str | None, uids: set[int]) -> None:
    """SIGWINCH to the init and program of each slot, found in its pids cgroup."""
    if pids_dir is None:
        release(uids)
        return
    for slot in slots:
        try:
            with open(f"{pids_dir}/slot-{slot}/cgroup.procs", encoding="ascii") as f:
                pids = [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
        for pid in pids:
            try:
                os.kill(pid, signal.SIGWINCH)
            except ProcessLookupError:
                pass


def leftovers(uids: set[int]) -> dict:
    """Processes of these uids, and cgroups of their slots below this process's own cgroups (other
    users of the machine may have sandboxes of their own elsewhere), still on the machine."""
    slots = {u - sandbox_uid(0) for u in uids}
    left_cgroups = 0
    for controller in ("memory", "pids", "cpu"):
        directory = own_cgroup(controller)
        parent = None if directory is None else directory + "/dsv41-sandbox"
        if parent is not None and os.path.isdir(parent):
            left_cgroups += sum(1 for d in os.listdir(parent) if d.startswith("slot-") and int(d[5:]) in slots)
    return {"processes": len(sandbox_processes(uids)), "cgroups": left_cgroups}


def start_latency(runs: int) -> dict:
    """Cold and zygote starts interleaved, so both see the same load."""
    limits = SandboxLimits(wall_time_s=30)
    times: dict[str, list[float]] = {"cold": [], "zygote": []}
    with launcher_zygote() as zygote:
        assert run_python("pass", limits=limits, zygote=zygote).ok  # the zygote's own start is not a run's
        for _ in range(runs):
            for mode in times:
                t = time.perf_counter()
                result = run_python("pass", limits=limits, zygote=zygote if mode == "zygote" else None)
                times[mode].append(time.perf_counter() - t)
                assert result.ok, result
    return {
        mode: {"p50_s": round(statistics.median(v), 4), "p99_s": round(percentile(v, 0.99), 4), "runs": runs}
        for mode, v in times.items()
    }


def hold(pool: SandboxPool, n: int, uids: set[int], timeout_s: float) -> tuple[list, float]:
    """Submit n idle sandboxes and wait until all are blocked; (their futures, seconds to bring them up)."""
    t = time.perf_counter()
    futures = [pool.submit(HOLD) for _ in range(n)]
    while blocked_programs(sandbox_processes(uids)) < n:
        if any(f.done() for f in futures) or time.perf_counter() - t > timeout_s:
            raise RuntimeError("idle sandboxes did not all come up")
        time.sleep(0.2)
    return futures, time.perf_counter() - t


def idle_memory(n: int) -> dict:
    """PSS and private bytes per idle sandbox, cold and zygote, n at once."""
    out = {}
    for mode in ("cold", "zygote"):
        uids = {sandbox_uid(RAMP_SLOTS + i) for i in range(n)}
        with SandboxPool(n, limits=HOLD_LIMITS, slot_offset=RAMP_SLOTS, zygote=mode == "zygote") as pool:
            futures, _ = hold(pool, n, uids, 120)
            time.sleep(0.5)
            procs = sandbox_processes(uids, rollup=True)
            release(uids)
            results = [f.result() for f in futures]
        assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
        out[mode] = {
            "sandboxes": n,
            "pss_mib": round(sum(p["pss"] for p in procs) / n / 2**20, 2),
            "private_mib": round(sum(p["private"] for p in procs) / n / 2**20, 2),
        }
    return out


def gradings_per_s(widths: list[int], n: int) -> dict:
    out: dict = {"cold": {}, "zygote": {}}
    for width in widths:
        for mode in out:
            limits = SandboxLimits(wall_time_s=30)
            with SandboxPool(width, limits=limits, slot_offset=POOL_SLOTS, zygote=mode == "zygote") as pool:
                pool.map(["pass"] * width)  # the zygote's start is not a grading's
                t = time.perf_counter()
                scores = [s for s, _ in grade_programs([(HONEST, TESTS)] * n, pool)]
                elapsed = time.perf_counter() - t
            assert scores == [1.0] * n, scores
            out[mode][width] = round(n / elapsed, 2)
    return out


def hostile_probes() -> dict:
    """A memory hog, a fork bomb and an endless loop, each in a zygote sandbox of its own, at once."""
    with SandboxPool(3, limits=PROBE_LIMITS, slot_offset=PROBE_SLOTS) as pool:
        assert pool.submit("pass").result().ok  # the zygote's own start
        t = time.perf_counter()
        assert pool.submit("pass").result().ok
        start_s = time.perf_counter() - t
        t = time.perf_counter()
        hog, bomb, spin = pool.map([MEMORY_HOG, FORK_BOMB, SPIN])
        elapsed = time.perf_counter() - t
    forks = int(bomb.stdout) if bomb.stdout.strip().isdigit() else None
    checks = {
        "memory_hog": {
            "status": hog.status,
            "peak_mib": round((hog.memory_peak_bytes or 0) / 2**20, 1),
            "held": hog.status == "memory_limit"
            and (hog.memory_peak_bytes or 0) <= PROBE_LIMITS.memory_bytes + (1 << 20),
        },
        "fork_bomb": {
            "status": bomb.status,
            "children": forks,
            "held": forks is not None and forks < PROBE_LIMITS.max_processes,
        },
        "endless_loop": {
            "status": spin.status,
            "wall_s": round(spin.wall_s, 2),
            "cpu_s": round(spin.cpu_s, 2),
            "held": spin.status == "timeout"
            and spin.wall_s < PROBE_LIMITS.wall_time_s + 2
            and spin.cpu_s <= 1.25 * spin.wall_s * PROBE_LIMITS.cpu_cores,
        },
    }
    checks["all_held"] = all(c["held"] for c in checks.values())
    checks["wall_s"] = round(elapsed, 2)
    checks["start_latency_s"] = round(start_s, 3)  # one run("pass") beside them
    return checks


def raise_open_files(needed: int) -> int:
    """The orchestrator holds about 6 descriptors per run in flight (pipes, pidfd, slot lock, selector);
    root may raise its own limit. Returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, max(hard, needed)))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def kernel_limits() -> dict:
    out = {}
    for name in ("kernel/pid_max", "kernel/threads-max", "user/max_net_namespaces", "user/max_mnt_namespaces"):
        try:
            with open(f"/proc/sys/{name}", encoding="ascii") as f:
                out[name] = int(f.read())
        except (OSError, ValueError):
            pass
    out["RLIMIT_NOFILE"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return out


def ramp(steps: list[int], stop_used_bytes: int) -> dict:
    """Bring sandboxes up step by step in one pool (earlier steps stay alive) until the last step or a
    limit; measure at each completed step; release all; check nothing is left."""
    largest = max(steps)
    uids = {sandbox_uid(RAMP_SLOTS + i) for i in range(largest)}
    cgroup_dir = own_memory_cgroup()
    before, cg_before = meminfo(), cgroup_bytes(cgroup_dir)
    out: dict = {"steps": {}, "ceiling": 0, "limited_by": None}
    futures: list = []
    pids_dir, up_slots = slots_pids_dir(), set()
    slots = [RAMP_SLOTS + i for i in range(largest)]
    pool = SandboxPool(largest, limits=HOLD_LIMITS, slot_offset=RAMP_SLOTS)
    try:
        for target in steps:
            t = time.perf_counter()
            stop = None
            per_sandbox = None
            while len(futures) < target:
                # Submit in batches, so memory is checked while they come up.
                if per_sandbox is not None:
                    used = before["MemTotal"] - meminfo()["MemAvailable"]
                    if used + per_sandbox * min(64, target - len(futures)) > stop_used_bytes:
                        stop = f"memory: {used / 2**30:.1f} GiB used, the next sandboxes would pass the stop line"
                        break
                futures += [pool.submit(HOLD) for _ in range(min(64, target - len(futures)))]
                batch_start = time.perf_counter()
                while True:
                    time.sleep(0.5)
                    up = count_up(slots, up_slots, pids_dir)
                    failed = [f.result() for f in futures if f.done()]
                    if failed or up >= len(futures) - 8 or time.perf_counter() - batch_start > 120:
                        break
                if failed:
                    stop = f"a sandbox failed to start: {failed[0].status}: {failed[0].stderr.strip()[-300:]}"
                    break
                grown = before["MemAvailable"] - meminfo()["MemAvailable"]
                per_sandbox = max(grown, 0) / max(1, len(futures))
            while stop is None:
                up = count_up(slots, up_slots, pids_dir)
                if up >= len(futures):
                    break
                failed = [f.result() for f in futures if f.done()]
                if failed:
                    stop = f"a sandbox failed to start: {failed[0].status}: {failed[0].stderr.strip()[-300:]}"
                if time.perf_counter() - t > 600:
                    stop = "sandboxes still not up after 600 s"
                time.sleep(0.5)
            up_s = time.perf_counter() - t
            if stop is not None:
                out["limited_by"] = stop
                out["not_reached"] = target
                break
            time.sleep(1.0)
            procs = sandbox_processes(uids, rollup=True)
            now, cg_now = meminfo(), cgroup_bytes(cgroup_dir)
            n = len(futures)
            step = {
                "alive": blocked_programs(procs),
                "processes": len(procs),
                "seconds_to_bring_up_this_step": round(up_s, 1),
                "pss_mib_per_sandbox": round(sum(p["pss"] for p in procs) / n / 2**20, 2),
                "private_mib_per_sandbox": round(sum(p["private"] for p in procs) / n / 2**20, 2),
                "machine_mib_per_sandbox": round((before["MemAvailable"] - now["MemAvailable"]) / n / 2**20, 2),
                "kernel_mib_per_sandbox": round(
                    sum(now[k] - before[k] for k in ("Slab", "PageTables", "KernelStack")) / n / 2**20, 2
                ),
                "machine_used_gib": round((now["MemTotal"] - now["MemAvailable"]) / 2**30, 2),
                "orchestrator_rss_mib": round(_rss_bytes() / 2**20, 1),  # this process: a thread per sandbox
            }
            if cg_now and cg_before:
                step["cgroup_mib_per_sandbox"] = round((cg_now["usage"] - cg_before["usage"]) / n / 2**20, 2)
                if "kmem" in cg_now:
                    step["cgroup_kmem_mib_per_sandbox"] = round((cg_now["kmem"] - cg_before["kmem"]) / n / 2**20, 2)
            step["hostile_probes"] = hostile_probes()
            out["steps"][n] = step
            out["ceiling"] = n
            print(f"ramp: {n} alive, {json.dumps(step)}", file=sys.stderr, flush=True)
    finally:
        for f in futures:
            f.cancel()
        t = time.perf_counter()
        # Again until all have ended (a sandbox still starting when the signal came had no handler yet),
        # through the slots' cgroups: a search of /proc each time took the interpreter's lock from the
        # threads cleaning up.
        release(uids)
        while not all(f.done() for f in futures):
            time.sleep(2.0)
            release_slots(slots, pids_dir, uids)
        results = [f.result() for f in futures if not f.cancelled()]
        pool.close()
        out["seconds_to_release_and_clean_up"] = round(time.perf_counter() - t, 1)
        out["released_ok"] = sum(r.ok for r in results)
        out["released"] = len(results)
        out["released_statuses"] = dict(collections.Counter(r.status for r in results))
        out["left_after"] = leftovers(uids)
    return out


def table(out: dict) -> str:
    rows = [("CPU", f"{out['cpu']} ({out['cpus']} cores), {out['mem_total_gib']} GiB")]
    for mode in ("cold", "zygote"):
        if "start_latency" in out:
            lat = out["start_latency"][mode]
            rows.append((f"start latency p50 / p99, {mode}", f"{lat['p50_s']:.3f} / {lat['p99_s']:.3f} s"))
    for mode in ("cold", "zygote"):
        if "idle_memory" in out:
            mem = out["idle_memory"][mode]
            rows.append(
                (
                    f"idle sandbox ({mem['sandboxes']} at once), {mode}",
                    f"PSS {mem['pss_mib']}, private {mem['private_mib']} MiB",
                )
            )
    for mode in ("cold", "zygote"):
        if "gradings_per_s" in out:
            grad = out["gradings_per_s"][mode]
            rows.append(
                (f"gradings/s at widths {' / '.join(map(str, grad))}, {mode}", " / ".join(map(str, grad.values())))
            )
    r = out.get("ramp")
    if r:
        for n, step in r["steps"].items():
            probes = step["hostile_probes"]
            rows.append(
                (
                    f"{n} alive (zygote)",
                    f"PSS {step['pss_mib_per_sandbox']} MiB, private {step['private_mib_per_sandbox']} MiB, "
                    f"machine {step['machine_mib_per_sandbox']} MiB (kernel {step['kernel_mib_per_sandbox']}) "
                    f"per sandbox; up in {step['seconds_to_bring_up_this_step']} s; limits held: "
                    f"{probes['all_held']}",
                )
            )
        rows.append(("ceiling", f"{r['ceiling']} alive; limited by: {r['limited_by'] or 'none (last step reached)'}"))
        rows.append(("left after release", json.dumps(r["left_after"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="runs per mode for the start latency (0 skips)")
    parser.add_argument("--widths", default="1,2,4,8", help="SandboxPool widths for gradings per second ('' skips)")
    parser.add_argument("--gradings", type=int, default=32, help="gradings per width")
    parser.add_argument("--idle", type=int, default=32, help="idle sandboxes at once, cold and zygote (0 skips)")
    parser.add_argument("--ramp", default="32,256,1000,2500", help="sandboxes alive at once, step by step ('' skips)")
    parser.add_argument("--stop-used-gib", type=float, default=20.0, help="stop the ramp before this much is used")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("bench_sandbox.py needs root (the sandbox's per-slot uids and cgroups)")
    steps = [int(s) for s in args.ramp.split(",") if s]
    raise_open_files(8 * max(steps, default=0) + 1024)
    mem = meminfo()
    out: dict = {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "mem_total_gib": round(mem["MemTotal"] / 2**30, 1),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "kernel_limits": kernel_limits(),
    }
    if args.runs:
        out["start_latency"] = start_latency(args.runs)
    if args.idle:
        out["idle_memory"] = idle_memory(args.idle)
    if args.widths:
        out["gradings_per_s"] = gradings_per_s([int(w) for w in args.widths.split(",")], args.gradings)
    if steps:
        out["ramp"] = ramp(steps, int(args.stop_used_gib * 2**30))
    out["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(table(out))
    print(json.dumps(out, indent=2))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
