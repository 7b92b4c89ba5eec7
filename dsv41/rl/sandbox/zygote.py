"""The orchestrator's side of the zygote (launcher.py's `zygote_main`): one interpreter, started once, that
has imported what a launcher and a program need and forks a launcher per run, so a run neither starts
an interpreter nor holds a private copy of one (the forks share the zygote's pages until they write).

`Zygote.spawn` hands the zygote a run's configuration and the ends of its pipes and gets back the
launcher's pid. The launcher is this process's child (the zygote forks it with CLONE_PARENT), so the
orchestrator supervises it as it does a cold-started one: wait4 for its status and CPU time, signals, its
process group. What it does from there on is the cold launcher's code, unchanged.

The zygote is started from a thread of its own that lives as long as the `Zygote`: a parent-death
signal fires when the parent *thread* exits, and the launchers' parent is the thread that started the
zygote, so that thread must not be a pool's worker that may come and go.

A zygote that died (killed, crashed) is noticed at the next request and replaced; a request it took
but never answered fails that run (its launcher may or may not exist: the run's cleanup kills whatever
of its slot is left) rather than being retried. If no zygote can be started, `spawn` raises: the run is
refused, never started some other way.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

_READY_TIMEOUT_S = 30.0  # importing the preloaded modules on a loaded machine
_REPLY_TIMEOUT_S = 10.0  # a fork takes milliseconds; a zygote silent this long is stuck (stopped, swapped)


class ZygoteError(RuntimeError):
    """The zygote could not start a launcher for this run (nothing of the run was started, or whatever
    was is the run's cleanup's to kill)."""


class SpawnedLauncher:
    """A launcher the zygote forked, with what the orchestrator needs of a `subprocess.Popen`: its pid,
    the parent's ends of its stdin, stdout and stderr, and a returncode the supervisor sets once it has
    reaped it."""

    def __init__(self, pid: int, stdin: int, stdout: int, stderr: int):
        self.pid = pid
        self.stdin = open(stdin, "wb", buffering=0)
        self.stdout = open(stdout, "rb", buffering=0)
        self.stderr = open(stderr, "rb", buffering=0)
        self.returncode: int | None = None


class Zygote:
    """A zygote process, started on first use and replaced when it dies. Thread-safe: requests are
    serialised (the zygote forks one launcher at a time anyway). `close()` ends it; launchers already
    forked are not affected, but close only once none is running, since they die with the thread that
    started the zygote (which close ends)."""

    def __init__(self, launcher_path: str, env: dict[str, str]):
        self._launcher_path = launcher_path
        self._env = dict(env)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._closed = False
        self.starts = 0  # zygote processes started so far (a replacement counts)
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._keeper = threading.Thread(target=self._keep, name="dsv41-sandbox-zygote", daemon=True)
        self._keeper.start()

    @property
    def pid(self) -> int | None:
        """The current zygote process's pid (None before the first request)."""
        return self._proc.pid if self._proc is not None else None

    def _keep(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def _on_keeper(self, fn: Callable[[], Any]) -> Any:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def job() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._jobs.put(job)
        return future.result()

    def _start(self) -> None:
        """A new zygote process (on the keeper thread), replacing a dead one."""
        self._stop_current()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            config = {"control_fd": theirs.fileno(), "orchestrator_pid": os.getpid()}
            self._proc = self._on_keeper(
                lambda: subprocess.Popen(
                    launcher_command(self._launcher_path, "zygote_main", config),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    cwd="/",
                    env=self._env,
                    start_new_session=True,
                    pass_fds=(theirs.fileno(),),
                    close_fds=True,
                )
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._control = ours
        self.starts += 1
        ours.settimeout(_READY_TIMEOUT_S)
        try:
            ready = ours.recv(16)
        except OSError as exc:
            ready = f"{type(exc).__name__}: {exc}".encode()
        if ready != b"ready":
            self._stop_current()
            raise ZygoteError(f"the sandbox zygote did not start ({ready.decode(errors='replace') or 'it exited'})")
        ours.settimeout(_REPLY_TIMEOUT_S)

    def _stop_current(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def spawn(self, config: dict, env: dict[str, str], cwd: str, report_fd: int) -> SpawnedLauncher:
        """Fork a launcher for one run: `config` as a cold launcher gets it, its report pipe's write end
        `report_fd` (the caller keeps and closes its own copy). Raises ZygoteError if the zygote cannot
        start it."""
        pipes = [os.pipe() for _ in range(3)]  # stdin, stdout, stderr
        theirs = [pipes[0][0], pipes[1][1], pipes[2][1], report_fd]
        ours = [pipes[0][1], pipes[1][0], pipes[2][0]]
        request = json.dumps({"config": config, "env": env, "cwd": cwd}).encode()
        try:
            pid = self._request(request, theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs[:3]:
                os.close(fd)
        return SpawnedLauncher(pid, *ours)

    def _request(self, request: bytes, fds: list[int]) -> int:
        with self._lock:
            if self._closed:
                raise ZygoteError("the sandbox zygote was closed")
            for attempt in range(2):
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                try:
                    socket.send_fds(self._control, [request], fds)
                except OSError as exc:
                    # It died before taking the request: nothing was forked, so a new one may do it.
                    self._stop_current()
                    if attempt:
                        raise ZygoteError(f"the sandbox zygote is not answering: {exc}") from exc
                    continue
                try:
                    reply = self._control.recv(256)
                except OSError as exc:
                    reply = f"error: no reply ({type(exc).__name__}: {exc})".encode()
                    self._stop_current()
                if not reply:
                    self._stop_current()
                    raise ZygoteError("the sandbox zygote died while forking this run's launcher")
                text = reply.decode(errors="replace")
                if text.startswith("error: "):
                    raise ZygoteError(f"the sandbox zygote could not fork: {text[7:]}")
                return int(text)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_current()
        self._jobs.put(None)
        self._keeper.join()

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launcher_command(launcher_path: str, entry: str, config: dict) -> list[str]:
    """A fresh interpreter (isolated mode) that loads launcher.py by path, so it never imports the dsv41
    package (and torch), and calls `entry` with the JSON config."""
    boot = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('_dsv41_sandbox_launcher', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "getattr(module, sys.argv[2])(sys.argv[3])\n"
    )
    return [sys.executable, "-I", "-B", "-X", "utf8", "-c", boot, launcher_path, entry, json.dumps(config)]
