"""Pools of sandboxed runs: `SandboxPool` (threads on this machine, one slot each) and `RaySandboxPool`
(Ray actors, each a SandboxPool over its own slot range, spread over a cluster). Both turn every failure
into an error result: a task never takes the pool, or the trainer, down."""

from __future__ import annotations

import concurrent.futures
import math
import queue
from collections.abc import Iterable, Mapping
from typing import Any

from dsv41.rl.sandbox.config import MAX_SLOTS as _MAX_SLOTS
from dsv41.rl.sandbox.config import SandboxLimits, SandboxResult, SandboxTask, TaskLike
from dsv41.rl.sandbox.config import as_task as _as_task
from dsv41.rl.sandbox.orchestrator import launcher_zygote, run_python
from dsv41.rl.sandbox.zygote import Zygote


def _safe_run(task: SandboxTask, limits: SandboxLimits, slot: int, zygote: Zygote | None = None) -> SandboxResult:
    try:
        return run_python(task.code, task.stdin, task.files, task.limits or limits, slot=slot, zygote=zygote)
    except Exception as exc:  # a task must never take the pool (or the trainer) down
        return SandboxResult.runner_error(f"{type(exc).__name__}: {exc}", slot=slot)


class SandboxPool:
    """Runs sandboxed programs concurrently on this machine: `max_workers` threads, each owning a slot
    (so concurrent runs never share a sandbox uid or cgroup) and running one program at a time. Pools that
    run at the same time on one machine should use distinct `slot_offset`s: a run whose slot another run
    holds (another pool, another process) waits for it rather than disturbing it.

    zygote=True (the default): the pool keeps a zygote (zygote.py) that forks each run's launcher from an
    interpreter that has imported what it needs, instead of starting a fresh interpreter per run: faster
    to start, and a running sandbox shares most of its memory with the others. The restrictions are the
    same, applied by the same code. False starts each launcher cold."""

    def __init__(
        self,
        max_workers: int = 4,
        limits: SandboxLimits = SandboxLimits(),
        slot_offset: int = 0,
        zygote: bool = True,
    ):
        if isinstance(max_workers, bool) or not isinstance(max_workers, int) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive integer, got {max_workers!r}")
        if not isinstance(limits, SandboxLimits):
            raise TypeError(f"limits must be a SandboxLimits, got {type(limits).__name__}")
        if not 0 <= slot_offset or slot_offset + max_workers - 1 > _MAX_SLOTS:
            raise ValueError(f"slots {slot_offset}..{slot_offset + max_workers - 1} exceed [0, {_MAX_SLOTS}]")
        self.limits = limits
        self.slots = range(slot_offset, slot_offset + max_workers)
        self._free_slots: queue.SimpleQueue[int] = queue.SimpleQueue()
        for s in self.slots:
            self._free_slots.put(s)
        self.zygote = launcher_zygote() if zygote else None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="dsv41-sandbox")

    def _run(self, task: SandboxTask) -> SandboxResult:
        slot = self._free_slots.get()  # never waits: as many slots as threads
        try:
            return _safe_run(task, self.limits, slot, self.zygote)
        finally:
            self._free_slots.put(slot)

    def submit(
        self,
        code: str,
        stdin: str = "",
        files: Mapping[str, str | bytes] | None = None,
        limits: SandboxLimits | None = None,
    ) -> concurrent.futures.Future:
        """Queue one program; the future's result is a SandboxResult (never an exception)."""
        return self._executor.submit(self._run, SandboxTask(code, stdin, files, limits))

    def submit_task(self, task: TaskLike) -> concurrent.futures.Future:
        try:
            task = _as_task(task)
        except (TypeError, ValueError) as exc:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_result(SandboxResult.runner_error(f"invalid task: {exc}"))
            return future
        return self._executor.submit(self._run, task)

    def map(self, tasks: Iterable[TaskLike]) -> list[SandboxResult]:
        """Run all tasks (SandboxTask, code string or {"code", "stdin", "files", "limits"} mapping);
        results in input order."""
        futures = [self.submit_task(t) for t in tasks]
        return [f.result() for f in futures]

    def close(self, wait: bool = True) -> None:
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        if self.zygote is not None and wait:
            # Only once no run is left: launchers die with the zygote's keeper thread, which this ends.
            self.zygote.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _SandboxActor:
    """Body of a Ray actor: a SandboxPool over this actor's slot range, on whichever node it landed."""

    def __init__(self, limits: SandboxLimits, slot_offset: int, slots: int):
        self._pool = SandboxPool(max_workers=slots, limits=limits, slot_offset=slot_offset)

    def run(self, task: SandboxTask) -> SandboxResult:
        return self._pool.submit_task(task).result()


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("RaySandboxPool needs Ray: pip install -e '.[rl]' (or pip install ray)") from exc
    return ray


class RaySandboxPool:
    """`SandboxPool.map` over Ray actors, to spread sandboxed programs over a cluster's machines.

    Actor i owns slots slot_offset + i*slots_per_worker ... (distinct across actors, so two actors on one
    node never share a sandbox uid; the default offset keeps them clear of a default SandboxPool's) and
    runs up to slots_per_worker programs at once; tasks go to whichever actor is free. Ray is initialised
    (locally, or at `address`) only if it is not already; `shutdown()` kills the actors and shuts Ray down
    if this pool started it.
    """

    def __init__(
        self,
        num_workers: int = 2,
        limits: SandboxLimits = SandboxLimits(),
        address: str | None = None,
        slots_per_worker: int = 1,
        slot_offset: int = 1000,
        cpus_per_worker: float = 1.0,
    ):
        for name, value in (("num_workers", num_workers), ("slots_per_worker", slots_per_worker)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if slot_offset < 0 or slot_offset + num_workers * slots_per_worker - 1 > _MAX_SLOTS:
            raise ValueError(
                f"slots {slot_offset}..{slot_offset + num_workers * slots_per_worker - 1} exceed [0, {_MAX_SLOTS}]"
            )
        ray = _import_ray()
        self._ray = ray
        self.limits = limits
        self._owns_ray = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
            if address is None:
                kwargs["num_cpus"] = max(1, math.ceil(num_workers * cpus_per_worker))
            else:
                kwargs["address"] = address
            ray.init(**kwargs)
            self._owns_ray = True
        # SPREAD: put the actors on different nodes where the cluster has several.
        actor_cls = ray.remote(_SandboxActor).options(
            num_cpus=cpus_per_worker, max_concurrency=slots_per_worker, scheduling_strategy="SPREAD"
        )
        self.slots_per_worker = slots_per_worker
        self._actors = [
            actor_cls.remote(limits, slot_offset + i * slots_per_worker, slots_per_worker) for i in range(num_workers)
        ]

    def map(self, tasks: Iterable[TaskLike]) -> list[SandboxResult]:
        """Run all tasks on the actors; results in input order, failures as error results."""
        ray = self._ray
        if self._actors is None:
            raise RuntimeError("RaySandboxPool.map after shutdown()")
        tasks = list(tasks)
        results: list[SandboxResult | None] = [None] * len(tasks)
        pending: list[tuple[int, SandboxTask]] = []
        for i, t in enumerate(tasks):
            try:
                pending.append((i, _as_task(t)))
            except (TypeError, ValueError) as exc:
                results[i] = SandboxResult.runner_error(f"invalid task: {exc}")
        pending.reverse()  # pop() from the end keeps input order
        free = [self.slots_per_worker] * len(self._actors)
        alive = [True] * len(self._actors)
        in_flight: dict[Any, tuple[int, int]] = {}
        while pending or in_flight:
            for a, actor in enumerate(self._actors):
                while pending and alive[a] and free[a] > 0:
                    i, task = pending.pop()
                    in_flight[actor.run.remote(task)] = (i, a)
                    free[a] -= 1
            if not in_flight:  # every actor is dead: fail what is left rather than wait forever
                for i, _ in pending:
                    results[i] = SandboxResult.runner_error("no live Ray sandbox actor")
                break
            done, _ = ray.wait(list(in_flight), num_returns=1)
            for ref in done:
                i, a = in_flight.pop(ref)
                free[a] += 1
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:
                    if isinstance(exc, ray.exceptions.RayActorError):
                        alive[a] = False
                    results[i] = SandboxResult.runner_error(f"{type(exc).__name__}: {exc}")
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        if self._actors is not None:
            for actor in self._actors:
                try:
                    self._ray.kill(actor)
                except Exception:
                    pass
            self._actors = None
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns_ray = False

    close = shutdown

    def __enter__(self) -> RaySandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
