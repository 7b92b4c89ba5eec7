"""`dsv41 serve tiny --data-parallel-size 2 --expert-parallel-size 2` (dsv41.distributed.data_parallel), driven
through its HTTP front with the `openai` client: every request's greedy text and chosen-token logprobs equal
the single-device engine's bit for bit, whichever rank serves it and whatever the other rank is doing; and
Ctrl-C leaves no process behind.

One server for the module (start-up costs two processes building `tiny`). The tests run in file order: the
first request finds both ranks idle, so it goes to rank 0 while rank 1 only serves its experts.
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import torch

from dsv41.engine import EngineConfig, SamplingParams, build_engine

openai = pytest.importorskip("openai")

# small prefill chunks: a prompt longer than a chunk plus the window (8 at tiny) has chunks that lie wholly
# before the bounded replay's decoder start, so its rank skips the decoder layers' MoE rounds in that step
# deterministic numerics: ranks and devices are compared with one device bit for bit
ENGINE_ARGS = {
    "prefill_chunk_size": 16,
    "kv_pool_tokens": 8192,
    "max_model_len": 1024,
    "fused_kernels": "off",
    "numerics": "deterministic",
}
MAX_TOKENS = 6


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 251 + 3 for i in range(n)]


PROMPTS = {
    "alone": _prompt(1, 40),
    "a": _prompt(2, 40),
    "b": _prompt(3, 9),
    "c": _prompt(4, 3),
    "d": _prompt(5, 23),
    "e": _prompt(6, 12),
}


def _reference() -> dict:
    engine = build_engine("tiny", EngineConfig(**ENGINE_ARGS), seed=0)
    out = {}
    for name, prompt in PROMPTS.items():
        engine.add_request(
            name, prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
        )
        logprobs, text = [], None
        while text is None:
            for o in engine.step():
                logprobs += [lp.logprob for lp in o.new_logprobs]
                if o.finished:
                    text = o.text
        out[name] = (text, logprobs)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_layout(layout: tuple, model: str = "tiny", torchrun: int = 0):
    """`dsv41 serve MODEL *layout` as a user starts it (or every process under torchrun with `torchrun`
    processes; rank 0 serves HTTP), with the tests' engine settings; (process, base URL)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    launcher = [sys.executable, "-m", "dsv41.cli"]
    if torchrun:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun),
            "--master-port",
            str(_free_port()),
            "-m",
            "dsv41.cli",
        ]
    cmd = launcher + ["serve", model, *layout, "--port", str(port), "--log-level", "warning", "--threads", "1"]
    cmd += [a for k, v in ENGINE_ARGS.items() for a in ("--" + k.replace("_", "-"), str(v))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited: {proc.stdout.read()}")
            try:
                if requests.get(base + "/health", timeout=5).status_code == 200:
                    break
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or listening but still busy loading (a slow probe under load is no failure)
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.5)
        yield proc, base
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
        proc.wait(timeout=30)


def _serve(expert_parallel: int = 2, torchrun: bool = False, model: str = "tiny", extra: tuple = ()):
    """`dsv41 serve tiny` with two data-parallel ranks (and the experts split over them)."""
    layout = ("--data-parallel-size", "2", "--expert-parallel-size", str(expert_parallel), *extra)
    return serve_layout(layout, model, 2 if torchrun else 0)


@pytest.fixture(scope="module")
def server():
    with _serve() as running:
        yield running


def _metric(base: str, name: str) -> float:
    for line in requests.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"dsv41_{name} "):
            return float(line.split()[1])
    raise KeyError(name)


def _complete(client, name: str, stream: bool = False) -> tuple[str, list[float]]:
    kw = dict(
        model="dsv41-tiny",
        prompt=PROMPTS[name],
        max_tokens=MAX_TOKENS,
        temperature=0,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        return choice.text, list(choice.logprobs.token_logprobs)
    text, logprobs = "", []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs is not None:
                logprobs += chunk.choices[0].logprobs.token_logprobs
    return text, logprobs


def _client(base: str):
    # a hang (a rank skipping a collective) fails the test instead of stalling the suite
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", timeout=120, max_retries=0)


def test_request_on_rank0_while_rank1_idle(server, reference):
    _, base = server
    got = _complete(_client(base), "alone")
    assert got == reference["alone"]
    assert _metric(base, "dp_rank0_requests_assigned_total") == 1
    assert _metric(base, "dp_rank1_requests_assigned_total") == 0
    # rank 1 had no request, yet served every MoE round of rank 0: one per layer a step ran. The 40-token
    # prompt is prefilled in chunks of 16 ending at 16, 32, 40; bounded replay runs the decoder layers only
    # over the last window (positions 32-39), so the first two steps stop at the decoder boundary (layer 6 of
    # 10) and rank 0 ends them early; then a full step, then MAX_TOKENS - 1 decode steps
    assert _metric(base, "dp_served_moe_rounds_total") == 6 + 6 + 10 + 10 * (MAX_TOKENS - 1)


def test_concurrent_requests_equal_single_device(server, reference):
    _, base = server
    client = _client(base)
    names = ["a", "b", "c", "d", "e"]
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(_complete, client, n, n == "b") for n in names}  # "b" streamed
        got = {n: f.result() for n, f in futures.items()}
    for n in names:
        assert got[n][0] == reference[n][0], f"request {n}: text differs"
        assert got[n][1] == reference[n][1], f"request {n}: logprobs differ"
    # the front spread them (least outstanding requests): both ranks served some
    assert _metric(base, "dp_rank1_requests_assigned_total") >= 2
    assert _metric(base, "dp_rank0_requests_assigned_total") >= 3
    assert _metric(base, "dp_rank0_running") == 0 and _metric(base, "dp_rank1_running") == 0
    assert requests.get(base + "/health", timeout=10).json() == {"status": "ok"}


def test_cancelled_stream_is_aborted_on_its_rank(server):
    _, base = server
    before = _metric(base, "requests_finished_total")
    stream = _client(base).completions.create(
        model="dsv41-tiny",
        prompt=PROMPTS["d"],
        max_tokens=500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # it is running on a rank...
    stream.close()  # ...when the client goes away: the front sends that rank an abort
    deadline = time.monotonic() + 60
    while _metric(base, "requests_finished_total") == before:
        assert time.monotonic() < deadline, "the cancelled request was not aborted"
        time.sleep(0.2)
    assert _metric(base, "dp_rank0_running") == 0 and _metric(base, "dp_rank1_running") == 0
    assert _metric(base, "generation_tokens_total") < 500 * 2


def test_next_turn_goes_to_the_rank_holding_its_prefix(server):
    """Prefix-cache-aware placement (dsv41.distributed.affinity): a prompt's continuation goes to the rank
    whose prefix cache holds its start, even while that rank is busier (here with a long stream) and the
    other is idle, and is served from that cache; a least-outstanding choice alone would send it to the idle
    rank, which would compute it all again."""
    _, base = server
    client = _client(base)
    first = _prompt(7, 48)
    kw = dict(model="dsv41-tiny", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})

    def assigned():
        return [_metric(base, f"dp_rank{r}_requests_assigned_total") for r in (0, 1)]

    def busy_stream(seed):
        stream = client.completions.create(
            model="dsv41-tiny",
            prompt=_prompt(seed, 5),
            max_tokens=400,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))  # placed, and running there
        return stream

    def close_and_wait(stream, running):
        stream.close()  # the front aborts it on its rank
        deadline = time.monotonic() + 60
        while _metric(base, "num_requests_running") > running:
            assert time.monotonic() < deadline, "the closed stream was not aborted"
            time.sleep(0.2)

    before = assigned()
    placed = _metric(base, "dp_prefix_placements_total")
    assert client.completions.create(prompt=first, **kw).usage.prompt_tokens_details.cached_tokens == 0
    home = [a - b for a, b in zip(assigned(), before)].index(1)  # the rank that holds `first`'s prefix
    # a long stream on that rank, and none on the other: a stream placed by load on the other rank is closed,
    # and the next one then goes to the idle `home`
    at = assigned()
    busy = busy_stream(8)
    if assigned()[home] == at[home]:
        other = busy
        busy = busy_stream(10)
        close_and_wait(other, running=1)
    assert assigned()[home] == at[home] + 1 and _metric(base, f"dp_rank{1 - home}_running") == 0
    try:
        second = client.completions.create(prompt=first + _prompt(9, 30), **kw)
        assert assigned()[home] == at[home] + 2, "the continuation left the rank that holds its prefix"
    finally:
        close_and_wait(busy, running=0)  # the tests after this one want idle ranks
    assert _metric(base, "dp_prefix_placements_total") == placed + 1
    # served from that rank's cache: the first prompt's snapshot (48 tokens, inside the pool's first 64-token block)
    assert second.usage.prompt_tokens_details.cached_tokens == len(first)


def test_idle_ranks_sleep(server):
    proc, base = server
    ranks = [psutil.Process(proc.pid)] + [
        c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())
    ]
    assert len(ranks) == 2 and _metric(base, "num_requests_running") == 0
    before = [sum(r.cpu_times()[:2]) for r in ranks]
    time.sleep(3)
    used = [sum(r.cpu_times()[:2]) - b for r, b in zip(ranks, before)]
    assert max(used) < 0.3, f"CPU seconds used in 3 idle seconds, per rank: {used}"


def test_ctrl_c_leaves_no_processes(server):
    proc, _ = server
    family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) >= 2  # rank 0 and the spawned rank 1 (and multiprocessing's resource tracker)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in family):
        assert time.monotonic() < deadline, f"left behind: {[p for p in family if psutil.pid_exists(p)]}"
        time.sleep(0.2)


def test_a_dead_rank_fails_requests_and_health_not_the_front():
    with _serve() as (proc, base):
        worker = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(worker) == 1
        worker[0].kill()
        while worker[0].is_running() and worker[0].status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.1)
        started = time.monotonic()
        reply = requests.post(
            base + "/v1/completions",
            timeout=60,
            json={"model": "dsv41-tiny", "prompt": PROMPTS["b"], "max_tokens": 4, "temperature": 0},
        )
        assert reply.status_code == 500 and time.monotonic() - started < 30
        health = requests.get(base + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        # a request after the failure is refused at once, and Ctrl-C still ends the front
        assert (
            requests.post(
                base + "/v1/completions",
                timeout=10,
                json={"model": "dsv41-tiny", "prompt": PROMPTS["b"], "max_tokens": 4},
            ).status_code
            == 500
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


@pytest.mark.slow  # a fault run: three processes to one error line (~8 s on one core); CI runs -m slow
def test_a_rank_failing_at_start_up_is_one_clear_error(tmp_path):
    """A checkpoint whose damage only rank 1 reads (one of its experts' tensors stored in the wrong dtype;
    rank 0 never reads that tensor): serve exits with one line naming the rank, not a hang."""
    from safetensors.torch import save_file

    from dsv41.config import preset
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    model = init_random_weights(Transformer(preset("tiny")), seed=7)
    state = {n: p.detach().contiguous() for n, p in model.named_parameters()}
    bad = "layers.3.ffn.experts.6.w1.weight"  # expert 6 of 8: rank 1's
    state[bad] = state[bad].half()
    save_file(state, str(tmp_path / "model.safetensors"))
    model.cfg.to_json(str(tmp_path / "config.json"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv41.cli",
            "serve",
            str(tmp_path),
            "--data-parallel-size",
            "2",
            "--expert-parallel-size",
            "2",
            "--port",
            str(_free_port()),
            "--threads",
            "1",
            "--fused-kernels",
            "off",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: data-parallel rank 1 exited (code 1) while building its engine; its error is printed above"
    )
    assert f"{bad}: checkpoint dtype torch.float16" in done.stderr


# slow tier: tests/distributed/test_engram_serve.py serves two data-parallel ranks without expert parallelism
# in the default tier (every expert on each rank, no MoE rounds, the single device's outputs)
@pytest.mark.slow
def test_data_parallel_without_expert_parallel(reference):
    """--expert-parallel-size 1: each rank holds every expert; the ranks still step together, and a request's
    output is still one device's."""
    with _serve(expert_parallel=1) as (_, base):
        client = _client(base)
        with ThreadPoolExecutor(2) as pool:
            got = dict(zip("ab", pool.map(lambda n: _complete(client, n), "ab")))
        assert got == {n: reference[n] for n in "ab"}
        assert _metric(base, "dp_rank1_requests_assigned_total") == 1
        assert _metric(base, "dp_served_moe_rounds_total") == 0  # no expert parallelism: no MoE rounds


def test_torchrun_ranks_serve_as_spawned_ones(reference):
    """The same command under torchrun: every process runs `serve`, rank 0 answers HTTP; Ctrl-C to torchrun
    ends every rank."""
    with _serve(torchrun=True) as (proc, base):
        assert _complete(_client(base), "e") == reference["e"]
        family = [proc.pid] + [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(family) >= 3  # torchrun and its two ranks
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in family):
            assert time.monotonic() < deadline, "a rank outlived torchrun"
            time.sleep(0.2)


@pytest.mark.slow  # speculative x data and expert parallelism (~10 s); each alone is in the default tier
def test_speculative_decoding_across_ranks(tmp_path):
    """--speculative under data and expert parallelism: the DSpark drafter's own MoE layers are sharded too
    and their rounds interleave with the backbone's; every token and logprob is the single-device speculative
    engine's (itself equal to plain decoding, tests/engine/test_speculative.py)."""
    import dataclasses

    from safetensors.torch import save_file

    from dsv41.config import preset
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer

    base = preset("tiny")
    cfg = dataclasses.replace(
        base,
        n_mtp_layers=2,
        compress_ratios=base.compress_ratios + (0, 0),
        dspark_block_size=4,
        dspark_noise_token_id=base.vocab_size - 1,
        dspark_target_layer_ids=(3, 6, 8),
        dspark_markov_rank=16,
        dspark_n_routed_experts=4,
        dspark_n_activated_experts=2,
    )
    model = init_random_weights(Transformer(cfg), seed=1)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(tmp_path / "model.safetensors"))
    cfg.to_json(str(tmp_path / "config.json"))
    names = ["a", "b", "c", "d"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = build_engine(str(tmp_path), EngineConfig(speculative=True, **ENGINE_ARGS))
        want = {}
        for n in names:
            engine.add_request(
                n, PROMPTS[n], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)
            )
            want[n] = []
        while engine.has_unfinished():
            for o in engine.step():
                want[o.request_id] += [lp.logprob for lp in o.new_logprobs]
    finally:
        torch.set_num_threads(threads)
    assert engine.metrics()["spec_decode_draft_tokens_total"] > 0
    with _serve(model=str(tmp_path), extra=("--speculative",)) as (_, base_url):
        client = _client(base_url)
        with ThreadPoolExecutor(len(names)) as pool:
            got = dict(
                zip(
                    names,
                    pool.map(
                        lambda n: (
                            client.completions.create(
                                model=os.path.basename(str(tmp_path)),
                                prompt=PROMPTS[n],
                                max_tokens=MAX_TOKENS,
                                temperature=0,
                                logprobs=0,
                                extra_body={"ignore_eos": True},
                            )
                            .choices[0]
                            .logprobs.token_logprobs
                        ),
                        names,
                    ),
                )
            )
        assert got == want
        assert _metric(base_url, "spec_decode_draft_tokens_total") == engine.metrics()["spec_decode_draft_tokens_total"]
        assert _metric(base_url, "dp_rank1_requests_assigned_total") == 2
