"""OpenAI-compatible HTTP server over the inference engine (`dsv41 serve`).

- `protocol.py`: request bodies (pydantic) and the OpenAI error shape;
- `chat.py`: chat messages -> prompt ids (V4.1 encoder) and generated text -> reasoning / content /
  tool calls, also while streaming;
- `metrics.py`: `/metrics` in the Prometheus text format;
- `app.py`: `create_app(engine)`, the FastAPI routes;
- `run.py`: `serve(...)`, uvicorn in the foreground, and `ServerThread` (a server in a background
  thread, for tests and notebooks).
"""

from dsv41.server.app import create_app

__all__ = ["create_app"]
