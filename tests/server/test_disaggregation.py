"""Prefill/decode disaggregation through HTTP (issue 32 item 2): `dsv41 router` in front of a prefill worker
and decode workers (tiny preset, random weights), driven with the `openai` client. Disaggregated answers
equal colocated ones bit for bit (greedy); a corrupted hand-off is caught by its checksum, re-prefilled
once, then failed clearly; a decode worker killed mid-stream fails its request at once (in-band error),
and the router keeps serving with the other worker and reports the dead one in /health."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dsv41.engine import EngineConfig, build_engine
from dsv41.server import create_app
from dsv41.server.disaggregation import max_handoff_bytes
from dsv41.server.router import HttpTransport, RouterConfig, create_router
from dsv41.server.run import ServerThread, _free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "Disaggregated serving moves the prompt's KV cache from one worker to another. " * 2


def _engine():
    return build_engine("tiny", EngineConfig(kv_pool_tokens=8192, max_model_len=1024, fused_kernels="off"), seed=0)


@pytest.fixture(scope="module")
def workers():
    """(prefill ServerThread, decode ServerThread, decode LLMEngine): two engines with the same weights."""
    prefill = ServerThread(create_app(_engine(), disaggregation_mode="prefill")).start()
    engine = _engine()
    decode = ServerThread(create_app(engine, disaggregation_mode="decode")).start()
    yield prefill, decode, engine
    prefill.stop()
    decode.stop()


def _router(prefill_urls, decode_urls, transport=None, **kw):
    return ServerThread(create_router(RouterConfig(prefill_urls, decode_urls, **kw), transport))


def _client(srv):
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_disaggregated_equals_colocated(workers):
    """Greedy completions (streamed and not) and a streamed chat through the router equal the decode worker's
    own colocated answer (same engine settings, its ordinary route, no hand-off). The prompt (~160 byte
    tokens) spans many 8-token windows and odd positions."""
    prefill, decode, engine = workers
    kw = dict(
        model=engine.model_name,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    with _router([prefill.base_url], [decode.base_url]) as router:
        direct, front = _client(decode), _client(router)
        want = direct.completions.create(**kw)
        got = front.completions.create(**kw)
        assert got.choices[0].text == want.choices[0].text
        assert got.choices[0].token_ids == want.choices[0].token_ids and len(want.choices[0].token_ids) == 10
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        streamed = "".join(c.choices[0].text for c in front.completions.create(**kw, stream=True))
        assert streamed == want.choices[0].text
        # two seeded sampled choices start from copies of one hand-off and draw what colocated choices draw
        sampled = dict(kw, temperature=0.8, seed=7, n=2, max_tokens=5)
        assert [c.text for c in front.completions.create(**sampled).choices] == [
            c.text for c in direct.completions.create(**sampled).choices
        ]
        chat = dict(
            model=engine.model_name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        want_chat = direct.chat.completions.create(**chat).choices[0].message.content
        parts = [
            c.choices[0].delta.content or "" for c in front.chat.completions.create(**chat, stream=True) if c.choices
        ]
        assert "".join(parts) == want_chat
        stats = httpx.get(router.base_url + "/stats").json()
        assert stats["handoffs"] == 4 and stats["handoff_bytes"] > 0 and stats["reprefills"] == 0
        info = httpx.get(decode.base_url + "/internal/disaggregation").json()
        assert info["handoffs_imported"] == 4 and info["handoffs_pending"] == 0
        # a bad request is refused by the prefill worker and relayed unchanged (400, OpenAI shape)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            front.completions.create(model=engine.model_name, prompt="x", max_tokens=2, temperature=-1)


class Corrupting(HttpTransport):
    """Flips one byte of the hand-off in transit, the first `times` times."""

    def __init__(self, times):
        super().__init__(httpx.AsyncClient(timeout=60))
        self.times = times

    async def deliver(self, worker, handoff, headers):
        if self.times > 0:
            self.times -= 1
            bad = bytearray(handoff)
            bad[len(bad) // 2] ^= 0x10  # inside a block: the global KV or the rings
            handoff = bytes(bad)
        return await super().deliver(worker, handoff, headers)


def test_corrupt_handoff_is_caught(workers):
    prefill, decode, engine = workers
    # straight to the decode worker: 422 naming the block; an unknown id: 422 handoff_missing
    data = httpx.post(
        prefill.base_url + "/internal/prefill/v1/completions",
        timeout=60,
        json={"model": engine.model_name, "prompt": PROMPT, "max_tokens": 2},
    ).content
    bad = bytearray(data)
    bad[-100] ^= 0x01
    r = httpx.post(decode.base_url + "/internal/handoff", content=bytes(bad), timeout=60)
    assert r.status_code == 422 and r.json()["error"]["code"] == "handoff_corrupt"
    assert "checksum mismatch" in r.json()["error"]["message"] and "block '" in r.json()["error"]["message"]
    r = httpx.post(decode.base_url + "/internal/handoff", content=data[: len(data) // 3], timeout=60)
    assert r.status_code == 422 and "truncated" in r.json()["error"]["message"]
    r = httpx.post(decode.base_url + "/internal/handoff", content=data + bytes(max_handoff_bytes(engine)), timeout=60)
    assert r.status_code == 413
    # with an API key the internal routes need it too (the same engine thread: nothing runs twice)
    keyed = create_app(
        engine, decode.server.config.app.state.server.async_engine, api_key="k", disaggregation_mode="decode"
    )
    with ServerThread(keyed) as srv:
        assert httpx.post(srv.base_url + "/internal/handoff", content=data, timeout=60).status_code == 401
        r = httpx.post(
            srv.base_url + "/internal/handoff", content=data, timeout=60, headers={"Authorization": "Bearer k"}
        )
        assert r.status_code == 200 and r.json()["tokens"] > 0
    r = httpx.post(
        decode.base_url + "/v1/completions",
        headers={"X-DSV41-Handoff": "nope"},
        timeout=60,
        json={"model": engine.model_name, "prompt": PROMPT, "max_tokens": 2},
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "handoff_missing"
    # a hand-off made for another prompt is refused by the decode worker's own tokenization
    hid = httpx.post(decode.base_url + "/internal/handoff", content=data, timeout=60).json()["handoff_id"]
    r = httpx.post(
        decode.base_url + "/v1/completions",
        headers={"X-DSV41-Handoff": hid},
        timeout=60,
        json={"model": engine.model_name, "prompt": PROMPT + "!", "max_tokens": 2},
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "handoff_mismatch"

    kw = dict(model=engine.model_name, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    want = _client(decode).completions.create(**kw).choices[0].text
    with _router([prefill.base_url], [decode.base_url], Corrupting(1)) as router:  # once: re-prefilled
        assert _client(router).completions.create(**kw).choices[0].text == want
        stats = httpx.get(router.base_url + "/stats").json()
        assert stats["handoff_rejections"] == 1 and stats["reprefills"] == 1
    with _router([prefill.base_url], [decode.base_url], Corrupting(2)) as router:  # twice: a clear failure
        r = httpx.post(router.base_url + "/v1/completions", json=kw | {"ignore_eos": True}, timeout=60)
        assert r.status_code == 502 and r.json()["error"]["code"] == "handoff_failed"
        assert "checksum mismatch" in r.json()["error"]["message"]


def _spawn_decode_worker(port):
    env = dict(os.environ, PYTHONPATH=ROOT)
    code = "import sys; from dsv41.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            code,
            "serve",
            "tiny",
            "--disaggregation-mode",
            "decode",
            "--port",
            str(port),
            "--kv-pool-tokens",
            "8192",
            "--compile-decode",
            "off",
            "--max-model-len",
            "1024",
            "--fused-kernels",
            "off",
            "--log-level",
            "warning",
            "--threads",
            "1",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _wait_healthy(url, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the decode worker process exited"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the decode worker did not start")


def test_killed_decode_worker_fails_fast_and_the_rest_serve(workers):
    prefill, decode, engine = workers
    port = _free_port()
    proc = _spawn_decode_worker(port)
    doomed = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(doomed, proc)
        with _router([prefill.base_url], [doomed, decode.base_url], timeout_s=30) as router:
            body = {
                "model": engine.model_name,
                "prompt": PROMPT,
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            events, t_kill = [], None
            with httpx.stream("POST", router.base_url + "/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200  # round robin: the first request goes to the first decode worker
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if t_kill is None:
                        proc.send_signal(signal.SIGKILL)
                        t_kill = time.monotonic()
            assert time.monotonic() - t_kill < 10  # no hang
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["code"] == "decode_worker_failed" and doomed in err["message"]
            # the router goes on with the live worker and reports the dead one
            out = _client(router).completions.create(
                model=engine.model_name, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.usage.completion_tokens == 3
            health = httpx.get(router.base_url + "/health", timeout=10)
            assert health.status_code == 200
            assert {w["url"]: w["healthy"] for w in health.json()["decode"]} == {doomed: False, decode.base_url: True}
        with _router([prefill.base_url], [doomed], timeout_s=30) as router:  # nothing left: 503 at once
            t0 = time.monotonic()
            assert httpx.get(router.base_url + "/health", timeout=10).status_code == 503
            r = httpx.post(
                router.base_url + "/v1/completions",
                timeout=30,
                json={"model": engine.model_name, "prompt": "Hi", "max_tokens": 2},
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
            assert time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_cli_refusals_are_one_line(capsys):
    """`dsv41 router` without a worker of each role or with a URL that is not http(s), and a disaggregated
    worker with an invalid parallel layout, each end with one clear line and exit code 2 (multi-rank workers
    themselves: tests/distributed/test_disaggregation_parallel.py)."""
    from dsv41.cli import main

    assert main(["router", "--prefill", "127.0.0.1:8001", "--decode", "http://127.0.0.1:8002"]) == 2
    assert "must start with http://" in capsys.readouterr().err
    with pytest.raises(ValueError, match="at least one --prefill and one --decode"):
        RouterConfig([], ["http://127.0.0.1:8002"]).validate()
    assert (
        main(
            [
                "serve",
                "tiny",
                "--disaggregation-mode",
                "decode",
                "--data-parallel-size",
                "2",
                "--expert-parallel-size",
                "3",
            ]
        )
        == 2
    )
    assert "--expert-parallel-size" in capsys.readouterr().err


def test_images_through_the_router():
    """A chat with an image (the golden FP8 vision checkpoint, as tests/vision/test_vision_server.py): the
    prefill worker encodes the image and computes the prompt; the hand-off carries the resulting state and the
    image's pixel digest; the router's answer (text and logprobs) equals the decode worker's colocated one. A
    hand-off made for one image is refused for a request with another image of the same size (the same token
    ids: only the digest tells them apart), so no token comes from the wrong picture."""
    from PIL import Image

    from tests.vision.test_vision_server import VISION, data_url, messages

    def engine():
        return build_engine(VISION, EngineConfig(kv_pool_tokens=4096, fused_kernels="off"), seed=0)

    picture = Image.new("RGB", (100, 84), (200, 40, 10))
    picture.paste((10, 10, 250), (20, 20, 60, 60))
    other = Image.new("RGB", (100, 84), (20, 140, 10))
    decode_engine = engine()
    with (
        ServerThread(create_app(engine(), disaggregation_mode="prefill")) as prefill,
        ServerThread(create_app(decode_engine, disaggregation_mode="decode")) as decode,
        _router([prefill.base_url], [decode.base_url]) as router,
    ):
        kw = dict(
            model=decode_engine.model_name,
            messages=messages(data_url(picture)),
            max_tokens=8,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        want = _client(decode).chat.completions.create(**kw)
        got = _client(router).chat.completions.create(**kw)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert [t.logprob for t in got.choices[0].logprobs.content] == [
            t.logprob for t in want.choices[0].logprobs.content
        ]
        assert got.usage.prompt_tokens == want.usage.prompt_tokens
        assert httpx.get(router.base_url + "/stats").json()["handoffs"] == 1
        # the other image's answer differs, so the check below guards something real
        other_kw = dict(kw, messages=messages(data_url(other)))
        assert (
            _client(decode).chat.completions.create(**other_kw).choices[0].logprobs.content[0].logprob
            != want.choices[0].logprobs.content[0].logprob
        )
        body = {"model": decode_engine.model_name, "messages": messages(data_url(picture)), "max_tokens": 2}
        data = httpx.post(prefill.base_url + "/internal/prefill/v1/chat/completions", json=body, timeout=120).content
        hid = httpx.post(decode.base_url + "/internal/handoff", content=data, timeout=60).json()["handoff_id"]
        r = httpx.post(
            decode.base_url + "/v1/chat/completions",
            headers={"X-DSV41-Handoff": hid},
            timeout=60,
            json=dict(body, messages=messages(data_url(other))),
        )
        assert r.status_code == 422 and r.json()["error"]["code"] == "handoff_mismatch"
        assert "other images" in r.json()["error"]["message"]


@pytest.mark.parametrize("policy", ["cache_aware", "round_robin"])
def test_a_conversation_stays_on_its_prefill_worker(workers, policy):
    """Two prefill workers: with the cache-aware policy a conversation's next turn goes to the prefill worker
    that computed its first turn and reuses its prefix cache there (usage cached_tokens); another conversation
    goes to the idle worker. Round robin (the comparison) sends the second turn to the other worker, which
    computes it all again."""
    _, decode, engine = workers
    with (
        ServerThread(create_app(_engine(), disaggregation_mode="prefill")) as p0,
        ServerThread(create_app(_engine(), disaggregation_mode="prefill")) as p1,
        _router([p0.base_url, p1.base_url], [decode.base_url], cache_aware=policy == "cache_aware") as router,
    ):
        client = _client(router)
        turn1 = [{"role": "system", "content": "You answer briefly. " * 4}, {"role": "user", "content": PROMPT}]
        kw = dict(model=engine.model_name, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
        first = client.chat.completions.create(messages=turn1, **kw)
        turn2 = turn1 + [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And then? Say more about the hand-off."},
        ]
        second = client.chat.completions.create(messages=turn2, **kw)
        exported = [httpx.get(p.base_url + "/internal/disaggregation").json()["handoffs_exported"] for p in (p0, p1)]
        cached = second.usage.prompt_tokens_details.cached_tokens
        if policy == "round_robin":
            assert exported == [1, 1] and cached == 0
            return
        assert exported == [2, 0]
        assert cached >= first.usage.prompt_tokens // 2, (cached, first.usage.prompt_tokens)
        # the same answer as a cold prefill of the whole conversation (the decode worker's colocated route)
        want = _client(decode).chat.completions.create(messages=turn2, **kw)
        assert second.choices[0].message.content == want.choices[0].message.content
        other = client.chat.completions.create(messages=[{"role": "user", "content": "A different chat. " * 8}], **kw)
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        exported = [httpx.get(p.base_url + "/internal/disaggregation").json()["handoffs_exported"] for p in (p0, p1)]
        assert exported == [2, 1]
        stats = httpx.get(router.base_url + "/stats").json()
        assert stats["prefill_cache_choices"] == 1 and stats["prefill_balance_choices"] == 2
