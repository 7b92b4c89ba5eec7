"""One cgroup per sandboxed run, created by the orchestrator: the memory limit counts everything the run
holds at once (every process, shared memory, memfds, tmpfs pages, socket buffers charged as kernel
memory), which RLIMIT_AS, being per process, cannot; the pids limit caps its tasks whatever uid they run
as; the CPU controller gives the run a quota of `cpu_cores` cores and the same weight as every other run,
so processes that each start a session of their own (a scheduling autogroup each, outside a cgroup) still
share one run's CPU.

cgroup v2 is used where its memory, pids and cpu controllers are available to us (memory.max,
memory.swap.max, pids.max, cpu.max, cpu.weight, memory.peak, memory.events' oom_kill, cgroup.kill; TCP
buffers are charged to memory.max); otherwise the v1 memory, pids and cpu hierarchies
(memory.limit_in_bytes and memory.memsw.limit_in_bytes, memory.kmem.tcp.limit_in_bytes, pids.max,
cpu.cfs_quota_us, cpu.shares, memory.max_usage_in_bytes, memory.oom_control's oom_kill). The runs' common
parent cgroup weighs as many runs as the machine has cores against the host's other groups. v1 keeps TCP
buffers in a counter of their own, limited to the same `memory_bytes`: a run holds at most that much in
TCP buffers besides its other memory. A run's cgroup is made below the orchestrator's own cgroup (so any
limit placed on the trainer still holds), named after its slot, and removed after the run.

`RunCgroup.create` raises `CgroupUnavailable` with the reason when no cgroup can be made (not root and
nothing delegated, controllers missing): the caller reports it and refuses untrusted code.
"""

from __future__ import annotations

import os
import signal
import time

_PARENT_NAME = "dsv41-sandbox"
_KILL_BUDGET_S = 3.0
_CPU_PERIOD_US = 100_000
_V1_SHARES = 1024  # the kernel's default: every run weighs the same
_V2_WEIGHT = 100


class CgroupUnavailable(RuntimeError):
    pass


def _mounts() -> tuple[str | None, dict[str, str]]:
    """(the cgroup2 mount point or None, {v1 controller: its mount point})."""
    v2, v1 = None, {}
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, extra = left.split(), right.split()
            if len(fields) < 5 or len(extra) < 3:
                continue
            mount_point, fstype, super_options = fields[4], extra[0], extra[2]
            if fstype == "cgroup2" and v2 is None:
                v2 = mount_point
            elif fstype == "cgroup":
                for option in super_options.split(","):
                    v1.setdefault(option, mount_point)
    return v2, v1


def own_paths() -> tuple[str | None, dict[str, str]]:
    """Our cgroup: (its v2 path, {v1 controller: its path}) from /proc/self/cgroup."""
    v2, v1 = None, {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if controllers == "":
                v2 = path
            else:
                for c in controllers.split(","):
                    v1[c] = path
    return v2, v1


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _keyed(path: str, key: str) -> int | None:
    """The value of `key` in a flat keyed file (memory.events, memory.oom_control)."""
    try:
        for line in _read(path).splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return None


def _pids(procs_file: str) -> list[int]:
    try:
        return [int(p) for p in _read(procs_file).split()]
    except (OSError, ValueError):
        return []


class RunCgroup:
    """The cgroup(s) of one run: the launcher opens `procs_files` as root, and the program writes itself
    into them right after the fork, so that everything the program starts is inside."""

    def __init__(self, version: int, dirs: list[str], memory_dir: str, pids_dir: str):
        self.version = version
        self.dirs = dirs  # one for v2; the memory, pids and cpu ones for v1
        self.memory_dir = memory_dir
        self.pids_dir = pids_dir

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    @classmethod
    def create(cls, slot: int, memory_bytes: int, max_tasks: int, cpu_cores: float = 1.0) -> RunCgroup:
        v2_mount, v1_mounts = _mounts()
        v2_path, v1_paths = own_paths()
        errors = []
        if v2_mount is not None and v2_path is not None:
            try:
                own = os.path.join(v2_mount, v2_path.lstrip("/"))
                return cls._create_v2(own, slot, memory_bytes, max_tasks, cpu_cores)
            except (OSError, CgroupUnavailable) as exc:
                errors.append(f"v2: {exc}")
        if {"memory", "pids", "cpu"} <= set(v1_mounts):
            own = {c: os.path.join(v1_mounts[c], v1_paths.get(c, "/").lstrip("/")) for c in ("memory", "pids", "cpu")}
            try:
                return cls._create_v1(own, slot, memory_bytes, max_tasks, cpu_cores)
            except OSError as exc:
                errors.append(f"v1: {exc}")
        else:
            errors.append("v1: no memory, pids and cpu hierarchies mounted")
        raise CgroupUnavailable("; ".join(errors))

    @staticmethod
    def _fresh_dir(parent: str, slot: int) -> str:
        os.makedirs(parent, mode=0o755, exist_ok=True)
        path = os.path.join(parent, f"slot-{slot}")
        if os.path.isdir(path):  # left by a crashed orchestrator: empty it and start over
            _kill_and_remove(path)
        os.mkdir(path, 0o755)
        return path

    @classmethod
    def _create_v2(cls, own: str, slot: int, memory_bytes: int, max_tasks: int, cpu_cores: float) -> RunCgroup:
        parent = os.path.join(own, _PARENT_NAME)
        wanted = {"memory", "pids", "cpu"}
        available = _read(os.path.join(own, "cgroup.controllers")).split()
        if not wanted <= set(available):
            raise CgroupUnavailable(f"memory, pids and cpu controllers not available in {own} ({' '.join(available)})")
        os.makedirs(parent, mode=0o755, exist_ok=True)
        # Our own cgroup holds processes (us), so controllers can be enabled only one level down, in
        # dsv41-sandbox, which holds none: the kernel's no-internal-processes rule.
        enabled = _read(os.path.join(own, "cgroup.subtree_control")).split()
        if not wanted <= set(enabled):
            _write(os.path.join(own, "cgroup.subtree_control"), "+memory +pids +cpu")
        _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids +cpu")
        _write(os.path.join(parent, "cpu.weight"), str(min(10_000, _V2_WEIGHT * _cores())))
        path = cls._fresh_dir(parent, slot)
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            _write(os.path.join(path, "memory.swap.max"), "0")
        _write(os.path.join(path, "pids.max"), str(max_tasks))
        _write(os.path.join(path, "cpu.max"), f"{_quota_us(cpu_cores)} {_CPU_PERIOD_US}")
        _write(os.path.join(path, "cpu.weight"), str(_V2_WEIGHT))
        return cls(2, [path], path, path)

    @classmethod
    def _create_v1(
        cls, own: dict[str, str], slot: int, memory_bytes: int, max_tasks: int, cpu_cores: float
    ) -> RunCgroup:
        dirs = {c: cls._fresh_dir(os.path.join(path, _PARENT_NAME), slot) for c, path in own.items()}
        memory, pids, cpu = dirs["memory"], dirs["pids"], dirs["cpu"]
        try:
            _write(os.path.join(os.path.dirname(cpu), "cpu.shares"), str(_V1_SHARES * _cores()))
            _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
            memsw = os.path.join(memory, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # no swapping around the limit (must be >= limit_in_bytes: set after)
                _write(memsw, str(memory_bytes))
            # Loopback TCP buffers (network=True) are not charged to limit_in_bytes in v1; limiting them
            # turns their accounting on. Mandatory: without it a run could queue hundreds of MiB there.
            _write(os.path.join(memory, "memory.kmem.tcp.limit_in_bytes"), str(memory_bytes))
            _write(os.path.join(pids, "pids.max"), str(max_tasks))
            _write(os.path.join(cpu, "cpu.cfs_period_us"), str(_CPU_PERIOD_US))
            _write(os.path.join(cpu, "cpu.cfs_quota_us"), str(_quota_us(cpu_cores)))
            _write(os.path.join(cpu, "cpu.shares"), str(_V1_SHARES))
        except OSError:
            for d in dirs.values():
                _kill_and_remove(d)
            raise
        return cls(1, [memory, pids, cpu], memory, pids)

    def kill_all(self) -> bool:
        """Kill every process still in the run's cgroup (whatever its uid). True when none is left."""
        if self.version == 2:
            try:
                _write(os.path.join(self.dirs[0], "cgroup.kill"), "1")
            except OSError:
                pass
        return all(_kill_procs(d) for d in self.dirs)

    def peak_bytes(self) -> int | None:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(os.path.join(self.memory_dir, name)))
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int:
        if self.version == 2:
            count = _keyed(os.path.join(self.memory_dir, "memory.events"), "oom_kill")
        else:
            count = _keyed(os.path.join(self.memory_dir, "memory.oom_control"), "oom_kill")
        return count or 0

    def remove(self) -> bool:
        return all(_kill_and_remove(d) for d in self.dirs)


def _cores() -> int:
    # The runs share one parent cgroup, which competes with the host's other groups (each session is one,
    # under autogroup) as a single entity: weighted as many as the machine has cores, all runs together
    # may claim the machine under contention as N separate sessions could before they shared a parent.
    return os.cpu_count() or 1


def _quota_us(cpu_cores: float) -> int:
    return max(1000, round(cpu_cores * _CPU_PERIOD_US))  # the kernel's minimum quota is 1 ms


def _kill_procs(path: str) -> bool:
    procs = os.path.join(path, "cgroup.procs")
    deadline = time.monotonic() + _KILL_BUDGET_S
    while True:
        pids = _pids(procs)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.005)  # zombies stay listed until their parent (or init) reaps them


def _kill_and_remove(path: str) -> bool:
    if not os.path.isdir(path):
        return True
    _kill_procs(path)
    deadline = time.monotonic() + _KILL_BUDGET_S
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
