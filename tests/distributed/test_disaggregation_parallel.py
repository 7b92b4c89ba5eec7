"""Prefill/decode disaggregation with multi-rank workers (issue 32): `dsv41 serve tiny --disaggregation-mode
prefill|decode` combined with `--data-parallel-size` / `--tensor-parallel-size` / `--expert-parallel-size`,
different layouts on the two sides, behind `dsv41 router`, driven with the `openai` client. Every request's
greedy text and chosen-token logprobs equal colocated single-device serving's bit for bit (the hand-off
addresses global entries by index and carries no rank's layout), the hand-offs land on the decode ranks
the decode front places them on (both ranks import some), and the decode side's counters count the
imported prompts.

Default tier: a single-device prefill worker (in this process) in front of a DP=2 x EP=2 decode worker (two
processes). Slow tier: prefill TP=2 -> decode DP=2 x EP=2 (four processes), prefill DP=2 x EP=2 -> decode
TP=2 (four processes), and chats with images to a DP=2 x EP=2 decode worker."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from dsv41.engine import EngineConfig, build_engine
from dsv41.server import create_app
from dsv41.server.router import RouterConfig, create_router
from dsv41.server.run import ServerThread
from tests.distributed.test_data_parallel import ENGINE_ARGS, PROMPTS, _client, _complete, _metric, serve_layout

openai = pytest.importorskip("openai")

NAMES = ["a", "b", "c", "d", "e"]  # "b" streamed


def _engine():
    return build_engine("tiny", EngineConfig(**ENGINE_ARGS), seed=0)


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each served rank uses (see test_data_parallel)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def colocated(one_thread):
    """name -> (text, logprobs) of colocated single-device serving (the ordinary route, no hand-off), each
    request on its own."""
    with ServerThread(create_app(_engine())) as srv:
        client = _client(srv.base_url)
        return {n: _complete(client, n) for n in PROMPTS}


def _through_router(prefill_url: str, decode_url: str, names=NAMES) -> dict:
    with ServerThread(create_router(RouterConfig([prefill_url], [decode_url], timeout_s=300))) as router:
        client = _client(router.base_url)
        with ThreadPoolExecutor(len(names)) as pool:
            futures = {n: pool.submit(_complete, client, n, n == "b") for n in names}
            got = {n: f.result() for n, f in futures.items()}
        stats = requests.get(router.base_url + "/stats", timeout=10).json()
    assert stats["handoffs"] == len(names) and stats["reprefills"] == 0
    return got


def _check(got: dict, colocated: dict) -> None:
    for n, (text, logprobs) in got.items():
        assert text == colocated[n][0], f"request {n}: text differs from colocated serving"
        assert logprobs == colocated[n][1], f"request {n}: logprobs differ from colocated serving"


def _check_decode_counters(base: str, names) -> None:
    """The decode front's engine metrics (summed over its ranks) count every imported prompt: admitted
    prompt tokens, imported hand-offs and their tokens, finished requests; nothing was prefilled there."""
    tokens = sum(len(PROMPTS[n]) for n in names)
    assert _metric(base, "handoffs_imported_total") == len(names)
    assert _metric(base, "prompt_tokens_total") == tokens
    assert _metric(base, "handoff_imported_tokens_total") == tokens
    assert _metric(base, "requests_finished_total") == len(names)
    assert _metric(base, "prefix_cache_queried_tokens_total") == 0


def test_single_device_prefill_to_data_parallel_decode(colocated):
    """Prefill on one device, decode on two data-parallel ranks with the experts split over them: each
    hand-off is imported by the rank the decode front placed its request on (both ranks get some)."""
    prefill = ServerThread(create_app(_engine(), disaggregation_mode="prefill")).start()
    try:
        with serve_layout(
            ("--data-parallel-size", "2", "--expert-parallel-size", "2", "--disaggregation-mode", "decode")
        ) as (_, decode):
            _check(_through_router(prefill.base_url, decode), colocated)
            assert _metric(decode, "dp_rank0_requests_assigned_total") >= 2
            assert _metric(decode, "dp_rank1_requests_assigned_total") >= 2
            _check_decode_counters(decode, NAMES)
            assert _metric(decode, "handoffs_exported_total") == 0
            # the prefill worker sampled nothing and counted every prompt once
            assert prefill.server.config.app.state.server.async_engine.metrics()["generation_tokens_total"] == 0
    finally:
        prefill.stop()


@pytest.mark.slow  # four server processes
def test_tensor_parallel_prefill_to_data_parallel_decode(colocated):
    with (
        serve_layout(("--tensor-parallel-size", "2", "--disaggregation-mode", "prefill")) as (_, prefill),
        serve_layout(
            ("--data-parallel-size", "2", "--expert-parallel-size", "2", "--disaggregation-mode", "decode")
        ) as (_, decode),
    ):
        _check(_through_router(prefill, decode), colocated)
        assert _metric(prefill, "handoffs_exported_total") == len(NAMES)
        assert _metric(prefill, "generation_tokens_total") == 0
        assert _metric(decode, "dp_rank1_requests_assigned_total") >= 2
        _check_decode_counters(decode, NAMES)


@pytest.mark.slow  # four server processes
def test_data_parallel_prefill_to_tensor_parallel_decode(colocated):
    with (
        serve_layout(
            ("--data-parallel-size", "2", "--expert-parallel-size", "2", "--disaggregation-mode", "prefill")
        ) as (_, prefill),
        serve_layout(("--tensor-parallel-size", "2", "--disaggregation-mode", "decode")) as (_, decode),
    ):
        _check(_through_router(prefill, decode), colocated)
        assert _metric(prefill, "dp_rank1_requests_assigned_total") >= 2  # both prefill ranks exported some
        assert _metric(prefill, "handoffs_exported_total") == len(NAMES)
        _check_decode_counters(decode, NAMES)


@pytest.mark.slow  # two server processes loading the golden vision checkpoint
def test_images_to_a_data_parallel_decode_worker(one_thread):
    """Chats with images (the golden FP8 vision checkpoint) prefilled on one device and decoded on two
    data-parallel ranks with the experts split over them (each reading its own experts from the folder): the
    hand-offs, with their image digests, cross the decode worker's process group to the rank that serves
    them, and the answers equal colocated single-device serving's."""
    from PIL import Image

    from tests.vision.test_vision_server import VISION, data_url, messages

    def vision_engine():
        return build_engine(VISION, EngineConfig(**ENGINE_ARGS), seed=0)

    pictures = [Image.new("RGB", (100, 84), (200, 40, 10)), Image.new("RGB", (64, 96), (20, 140, 210))]
    bodies = [
        dict(
            messages=messages(data_url(p)), max_tokens=6, temperature=0, logprobs=True, extra_body={"ignore_eos": True}
        )
        for p in pictures
    ]

    def answers(base: str, model: str) -> list:
        client = _client(base)
        with ThreadPoolExecutor(len(bodies)) as pool:
            outs = list(pool.map(lambda b: client.chat.completions.create(model=model, **b), bodies))
        return [(o.choices[0].message.content, [t.logprob for t in o.choices[0].logprobs.content]) for o in outs]

    engine = vision_engine()
    with ServerThread(create_app(engine)) as colocated:
        want = answers(colocated.base_url, engine.model_name)
    assert want[0] != want[1]
    with (
        ServerThread(create_app(vision_engine(), disaggregation_mode="prefill")) as prefill,
        serve_layout(
            ("--data-parallel-size", "2", "--expert-parallel-size", "2", "--disaggregation-mode", "decode"),
            model=VISION,
        ) as (_, decode),
        ServerThread(create_router(RouterConfig([prefill.base_url], [decode], timeout_s=300))) as router,
    ):
        assert answers(router.base_url, engine.model_name) == want
        assert _metric(decode, "handoffs_imported_total") == 2
        assert (
            _metric(decode, "dp_rank0_requests_assigned_total")
            == _metric(decode, "dp_rank1_requests_assigned_total")
            == 1
        )
