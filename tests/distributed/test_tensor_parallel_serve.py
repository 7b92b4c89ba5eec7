"""`dsv41 serve tiny --tensor-parallel-size 2` (dsv41.distributed.tensor_parallel inside the lockstep ranks of
dsv41.distributed.data_parallel), driven through its HTTP front with the `openai` client: concurrent requests'
greedy text and chosen-token logprobs equal the single-device engine's bit for bit; a layout that splits an
output group is refused before any rank starts. The D x T = 2 x 2 layout with expert parallelism (four
processes), the same serve under torchrun and speculative decoding over TP ranks are in the slow tier."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.distributed.test_data_parallel import (
    ENGINE_ARGS,
    PROMPTS,
    _client,
    _complete,
    _free_port,
    _metric,
    serve_layout,
)

openai = pytest.importorskip("openai")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))


def _serve(*layout: str, model: str = "tiny", torchrun: int = 0):
    return serve_layout(layout, model, torchrun)


def _check_concurrent(base: str, reference: dict, names: list[str]) -> None:
    client = _client(base)
    with ThreadPoolExecutor(len(names)) as pool:
        futures = {n: pool.submit(_complete, client, n, n == "b") for n in names}  # "b" streamed
        got = {n: f.result() for n, f in futures.items()}
    for n in names:
        assert got[n][0] == reference[n][0], f"request {n}: text differs"
        assert got[n][1] == reference[n][1], f"request {n}: logprobs differ"


def test_tensor_parallel_serving_equals_single_device(reference):
    with _serve("--tensor-parallel-size", "2") as (proc, base):
        _check_concurrent(base, reference, ["alone", "b", "c", "d"])
        # one engine (two TP ranks): every request counted once
        assert _metric(base, "dp_rank0_requests_assigned_total") == 4
        assert _metric(base, "requests_finished_total") == 4


@pytest.mark.slow  # torchrun's launch is covered by test_torchrun_ranks_serve_as_spawned_ones (data parallel)
def test_tensor_parallel_under_torchrun(reference):
    with _serve("--tensor-parallel-size", "2", torchrun=2) as (_, base):
        _check_concurrent(base, reference, ["b", "e"])


@pytest.mark.slow  # speculative x tensor parallelism (~9 s); each alone is in the default tier
def test_speculative_decoding_from_a_sharded_checkpoint(tmp_path):
    """--speculative with the heads split over two TP ranks that each read only their head rows from a
    checkpoint folder: the DSpark drafter's stages stay whole on both ranks; every token and logprob is the
    single-device speculative engine's."""
    import dataclasses

    from safetensors.torch import save_file

    from dsv41.config import preset
    from dsv41.engine import EngineConfig, SamplingParams, build_engine
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer
    from tests.distributed.test_data_parallel import MAX_TOKENS

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
    names = ["a", "b", "c"]
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
    with _serve("--tensor-parallel-size", "2", "--speculative", model=str(tmp_path)) as (_, base_url):
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


@pytest.mark.slow
def test_data_tensor_and_expert_parallel_together(reference):
    with _serve("--data-parallel-size", "2", "--tensor-parallel-size", "2", "--expert-parallel-size", "2") as (_, base):
        _check_concurrent(base, reference, ["a", "b", "c", "d", "e"])
        assert _metric(base, "dp_rank1_requests_assigned_total") >= 2


def test_a_tensor_parallel_size_that_splits_a_group_is_refused():
    # tiny: 4 heads in 2 output groups; 4 ranks would each hold half a group
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv41.cli",
            "serve",
            "tiny",
            "--tensor-parallel-size",
            "4",
            "--port",
            str(_free_port()),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--tensor-parallel-size 4 does not divide this model's 4 query heads in 2 output groups" in done.stderr
    assert "spawn_main" not in done.stderr  # refused before any rank started
