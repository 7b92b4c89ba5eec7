import pytest

from dsv41.engine import EngineConfig, build_engine
from dsv41.server import create_app
from dsv41.server.run import ServerThread


@pytest.fixture(scope="module")
def served():
    """(ServerThread, LLMEngine, AsyncEngine): the real engine on the tiny preset behind uvicorn."""
    engine = build_engine("tiny", EngineConfig(kv_pool_tokens=8192, max_model_len=1024), seed=0)
    app = create_app(engine, max_waiting=64)
    with ServerThread(app) as srv:
        yield srv, engine, app.state.server.async_engine


@pytest.fixture(scope="module")
def served_small():
    """(ServerThread, LLMEngine, AsyncEngine) on the `small` preset (8,192-id byte vocabulary, random
    weights): for the slow tier only, a request decodes a few tokens/s at best on a shared CPU."""
    engine = build_engine("small", EngineConfig(kv_pool_tokens=16384, max_model_len=4096), seed=0)
    app = create_app(engine, max_waiting=8)
    with ServerThread(app) as srv:
        yield srv, engine, app.state.server.async_engine
