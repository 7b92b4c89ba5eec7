"""Running the app: `serve` (uvicorn in the foreground, what `dsv41 serve` calls) and `ServerThread`
(uvicorn on a background thread with its own event loop; tests and notebooks).

Both bind their socket before anything else, so a port clash is reported at once (before a checkpoint
is loaded), and both run uvicorn's h11 protocol with a header buffer large enough that the app itself
answers oversized headers with 431 (h11 alone can only answer 400 and close).
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import threading
import time

import uvicorn

from dsv41.server.app import create_app

# h11 buffers a request's head up to this; the app refuses anything over app.MAX_HEADER_BYTES with 431
H11_MAX_HEADER_BYTES = 4 << 20


class PortUnavailable(OSError):
    """The address cannot be bound (in use, or not ours)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0: a free one); PortUnavailable names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortUnavailable(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is another server there? pick another --port)"
        ) from None
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def uvicorn_config(app, log_level: str = "info", **kw) -> uvicorn.Config:
    return uvicorn.Config(
        app, log_level=log_level, lifespan="on", http="h11", h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES, **kw
    )


def serve(
    model: str,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine_config=None,
    seed: int = 0,
    max_waiting: int = 64,
    served_model_name: str | None = None,
    log_level: str = "info",
    api_key: str | None = None,
    max_request_bytes: int | None = None,
    max_choices: int = 16,
    max_stored_responses: int = 256,
    disaggregation_mode: str | None = None,
) -> None:
    """Build the engine for `model` (preset name or checkpoint folder) and serve it until interrupted.
    The port is bound first: a clash fails in a second, not after the weights have loaded."""
    from dsv41.engine import build_engine

    sock = bind(host, port)
    if not api_key and not is_loopback(host):
        print(
            f"dsv41: WARNING: serving on {host}, reachable from other machines, without an API key; "
            f"anyone who can reach it can use it. Set --api-key or DSV41_API_KEY.",
            file=sys.stderr,
            flush=True,
        )
    try:
        engine = build_engine(model, engine_config=engine_config, seed=seed)
        app = create_app(
            engine,
            served_model_name=served_model_name,
            max_waiting=max_waiting,
            api_key=api_key,
            max_request_bytes=max_request_bytes,
            max_choices=max_choices,
            max_stored_responses=max_stored_responses,
            disaggregation_mode=disaggregation_mode,
        )
        role = f" as a {disaggregation_mode} worker" if disaggregation_mode else ""
        print(
            f"dsv41: serving {app.state.server.model_name}{role} (max_model_len {engine.max_model_len}) "
            f"on http://{host}:{sock.getsockname()[1]}/v1" + (" (API key required)" if api_key else ""),
            flush=True,
        )
        server = uvicorn.Server(uvicorn_config(app, log_level, timeout_graceful_shutdown=5))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully and re-raises; exit quietly
            pass
    finally:
        sock.close()


class ServerThread:
    """`with ServerThread(app) as srv: ... srv.base_url ...`. Binds before starting (port 0 picks a
    free port), so the port is known and there is no race with other processes."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._sock = bind(host, port)
        self.host, self.port = host, self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn_config(app, log_level, timeout_graceful_shutdown=2))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="dsv41-server", daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


RENDEZVOUS_GRACE_S = 10.0  # how long a failed start-up waits for the collective in flight to end


def _while_ranks_live(work, children: list, what: str) -> None:
    """Run `work()` (a collective that waits for every rank) while watching the spawned ranks: a rank that
    dies first (a bad checkpoint, no memory) is one clear error here rather than a wait for gloo's timeout."""
    failure: list = []

    def run() -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            failure.append(exc)

    def check() -> None:
        for rank, child in enumerate(children, start=1):
            if child.exitcode is not None:
                raise ChildProcessError(
                    f"data-parallel rank {rank} exited (code {child.exitcode}) while {what}; its error is printed above"
                )

    thread = threading.Thread(target=run, name="dsv41-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        try:
            check()
        except ChildProcessError:
            # the collective fails soon after the dead rank's socket closes: let it end before the caller tears
            # the process group down under it (a barrier still running then aborted the process at exit,
            # "terminate called without an active exception", instead of the one clear error); bounded, for a
            # rank that died before it ever connected
            thread.join(RENDEZVOUS_GRACE_S)
            raise
    if failure:
        # a collective fails as soon as a peer's socket closes, often before that process has been reaped:
        # wait a little for the rank that died, so the error names it rather than gloo's "connection closed"
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            check()
            time.sleep(0.1)
        raise failure[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_data_parallel(
    model: str,
    parallel,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    engine_config=None,
    seed: int = 0,
    max_waiting: int = 64,
    served_model_name: str | None = None,
    log_level: str = "info",
    api_key: str | None = None,
    max_request_bytes: int | None = None,
    threads: int | None = None,
    disaggregation_mode: str | None = None,
) -> None:
    """`dsv41 serve --data-parallel-size D [--expert-parallel-size D]`: D engine ranks in lockstep
    (dsv41.distributed.data_parallel) behind one HTTP front on rank 0. With `disaggregation_mode` the front
    is a prefill or decode worker (dsv41.server.disaggregation): a hand-off is exported by, or imported
    into, the rank the front places the request on. Started alone, this process is rank 0
    and spawns ranks 1..D-1 (torch.multiprocessing, spawn); under torchrun (RANK and WORLD_SIZE set) every
    process runs this and rank 0 serves HTTP. Ctrl-C stops the front, which stops the other ranks; spawned
    ranks still alive 10 s later are terminated, so none is left behind."""
    import os

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from dsv41.distributed.data_parallel import (
        DataParallelFront,
        RankEngine,
        build_rank_engine,
        init_group,
        worker_main,
    )
    from dsv41.engine import EngineConfig

    parallel.validate()
    if parallel.tensor_parallel_size > 1:
        from dsv41.distributed.tensor_parallel import check_model_split

        check_model_split(model, parallel.tensor_parallel_size)
    engine_config = engine_config or EngineConfig()
    world = parallel.world_size  # D x T processes
    # ranks share the machine's cores unless told otherwise
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        rank = int(os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ValueError(
                f"torchrun started {os.environ['WORLD_SIZE']} processes; --data-parallel-size x "
                f"--tensor-parallel-size is {world}"
            )
        if rank != 0:  # a worker rank: no HTTP
            worker_main(rank, world, "env://", model, engine_config, seed, parallel, threads)
            return
        init_method = "env://"
    else:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
    sock = bind(host, port)
    if not api_key and not is_loopback(host):
        print(
            f"dsv41: WARNING: serving on {host}, reachable from other machines, without an API key; "
            f"anyone who can reach it can use it. Set --api-key or DSV41_API_KEY.",
            file=sys.stderr,
            flush=True,
        )
    children: list = []
    front = None
    torch.set_num_threads(threads)
    try:
        if not under_torchrun:
            context = mp.get_context("spawn")  # gloo under fork has deadlocked in other projects
            for r in range(1, world):
                child = context.Process(
                    target=worker_main,
                    name=f"dsv41-rank{r}",
                    args=(r, world, init_method, model, engine_config, seed, parallel, threads),
                )
                child.start()
                children.append(child)
        _while_ranks_live(lambda: init_group(0, world, init_method), children, "joining the process group")
        engine = build_rank_engine(model, engine_config, seed, parallel)
        _while_ranks_live(dist.barrier, children, "building its engine")
        front = DataParallelFront(RankEngine(engine), parallel, max_waiting=max_waiting)
        app = create_app(
            engine,
            front,
            served_model_name=served_model_name,
            max_waiting=max_waiting,
            api_key=api_key,
            max_request_bytes=max_request_bytes,
            disaggregation_mode=disaggregation_mode,
        )
        front.start()
        dp = parallel.data_parallel_size
        layout = (
            f"{dp} data-parallel ranks"
            + (f", experts split {dp} ways" if parallel.expert_parallel else "")
            + (
                f", attention heads split {parallel.tensor_parallel_size} ways in each"
                if parallel.tensor_parallel_size > 1
                else ""
            )
        )
        layout += f", as a {disaggregation_mode} worker" if disaggregation_mode else ""
        print(
            f"dsv41: serving {app.state.server.model_name} on {layout} (max_model_len {engine.max_model_len}) "
            f"on http://{host}:{sock.getsockname()[1]}/v1" + (" (API key required)" if api_key else ""),
            flush=True,
        )
        server = uvicorn.Server(uvicorn_config(app, log_level, timeout_graceful_shutdown=5))
        try:
            server.run(sockets=[sock])
        except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully and re-raises; exit quietly
            pass
    finally:
        if front is not None:
            front.shutdown()  # a stop round: the other ranks leave their loops and exit
        for child in children:
            child.join(timeout=10)
            if child.is_alive():
                child.terminate()
                child.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        sock.close()
