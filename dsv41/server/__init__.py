"""OpenAI-compatible HTTP server over the inference engine (`dsv41 serve`).

- `protocol.py`: request bodies (pydantic) and the OpenAI error shape;
- `shapes.py`, `openapi.py`: what the free-form fields accept, as types, and the OpenAPI schema that
  states the server's contract (`/openapi.json`; docs/http-api.md is written from it);
- `chat.py`: chat messages -> prompt ids (V4.1 encoder) and generated text -> reasoning / content /
  tool calls, also while streaming;
- `metrics.py`: `/metrics` in the Prometheus text format;
- `serving.py`: what the generation endpoints share (state, checks, engine submission, SSE body);
- `app.py`: `create_app(engine)`, the FastAPI routes;
- `responses.py`, `responses_api.py`: the Responses API (`/v1/responses`): shapes, conversions, store;
  its routes;
- `run.py`: `serve(...)`, uvicorn in the foreground, and `ServerThread` (a server in a background
  thread, for tests and notebooks).
"""

__all__ = ["create_app"]


def __getattr__(name: str):
    # imported on first use: FastAPI takes ~0.7 s to import, and `dsv41 chat` needs only chat.py
    if name == "create_app":
        from dsv41.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
