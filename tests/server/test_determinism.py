"""Determinism through the server (issue 10): 6 greedy requests sent one by one, all at once, staggered,
and repeated with the prefix cache on (the default) give the same completions, on a model whose every
top-k selection is an exact tie (tests/conftest.tie_every_selection)."""

import threading
import time

import httpx
import pytest

from dsv41.engine import EngineConfig, build_engine
from dsv41.server import create_app
from dsv41.server.run import ServerThread
from tests.conftest import tie_every_selection

PROMPTS = [f"Question {k}: " + "tell me about the weather " * (2 * k + 1) for k in range(6)]


@pytest.fixture(scope="module")
def tied_server():
    engine = build_engine(
        "tiny", EngineConfig(kv_pool_tokens=8192, max_model_len=1024, numerics="deterministic"), seed=0
    )
    tie_every_selection(engine.model)  # the engine borrows its model: make every selection a tie
    with ServerThread(create_app(engine)) as srv:
        yield srv


def _complete(srv, prompt: str) -> str:
    r = httpx.post(
        srv.base_url + "/v1/completions",
        timeout=120,
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _concurrently(srv, prompts, stagger: float = 0.0) -> list[str]:
    out = [None] * len(prompts)

    def run(k):
        out[k] = _complete(srv, prompts[k])

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(120)
    return out


def test_solo_batched_staggered_and_repeated_requests_agree(tied_server):
    solo = [_complete(tied_server, p) for p in PROMPTS]
    assert _concurrently(tied_server, PROMPTS) == solo
    assert _concurrently(tied_server, PROMPTS, stagger=0.05) == solo
    repeated = _concurrently(tied_server, [PROMPTS[2]] * 6)
    assert repeated == [solo[2]] * 6
    cached = httpx.post(
        tied_server.base_url + "/v1/completions",
        timeout=60,
        json={"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    ).json()
    assert cached["choices"][0]["text"] == solo[2]
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] == cached["usage"]["prompt_tokens"]
