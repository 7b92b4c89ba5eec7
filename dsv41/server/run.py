"""Running the app: `serve` (uvicorn in the foreground, what `dsv41 serve` calls) and `ServerThread`
(uvicorn on a background thread with its own event loop; tests and notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Optional

import uvicorn

from dsv41.server.app import create_app


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, engine_config=None, seed: int = 0,
          max_waiting: int = 64, served_model_name: Optional[str] = None, log_level: str = "info") -> None:
    """Build the engine for `model` (preset name or checkpoint folder) and serve it until interrupted."""
    from dsv41.engine import build_engine

    engine = build_engine(model, engine_config=engine_config, seed=seed)
    app = create_app(engine, served_model_name=served_model_name, max_waiting=max_waiting)
    print(f"dsv41: serving {app.state.server.model_name} (max_model_len {engine.max_model_len}) "
          f"on http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class ServerThread:
    """`with ServerThread(app) as srv: ... srv.base_url ...`. Binds before starting (port 0 picks a
    free port), so the port is known and there is no race with other processes."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.host, self.port = host, self._sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="dsv41-server", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
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
