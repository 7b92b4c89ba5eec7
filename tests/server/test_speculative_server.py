"""`dsv41 serve --speculative`: the OpenAI server on an engine that drafts with the DSpark drafter. The
golden drafter model (random-looking weights) behind uvicorn, driven by the official client: greedy
output equals the plain engine's, streaming carries several tokens per step when drafts are accepted,
and /metrics exposes the acceptance figures."""

import os
import re

import httpx
import openai
import pytest

from dsv41.cli import _engine_config, build_parser
from dsv41.engine import EngineConfig, SamplingParams, build_engine
from dsv41.engine.llm_engine import LLMEngine
from dsv41.server import create_app
from dsv41.server.run import ServerThread
from tests.conftest import GOLDEN_DIR

DSPARK = os.path.join(GOLDEN_DIR, "v41-dspark-fp8")


def test_serve_option_turns_speculation_on():
    args = build_parser().parse_args(
        ["serve", DSPARK, "--speculative", "--num-speculative-tokens", "3", "--speculative-min-confidence", "0.2"]
    )
    cfg = _engine_config(args)
    assert cfg.speculative and cfg.num_speculative_tokens == 3 and cfg.speculative_min_confidence == 0.2


@pytest.fixture(scope="module")
def spec_server():
    engine = build_engine(DSPARK, EngineConfig(kv_pool_tokens=4096, speculative=True, numerics="deterministic"), seed=0)
    with ServerThread(create_app(engine, max_waiting=16)) as srv:
        yield srv, engine


def test_speculative_server_matches_plain_engine_and_reports_acceptance(spec_server, monkeypatch):
    srv, engine = spec_server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = [17, 300, 42, 99, 5, 801, 64, 12, 7]
    plain = build_engine(DSPARK, EngineConfig(kv_pool_tokens=4096, numerics="deterministic"), seed=0)
    want = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].token_ids

    real = LLMEngine._draft

    def oracle(self, work):  # drafts = the plain run's continuation: whole blocks accepted
        real(self, work)
        for seq in self.running:
            if seq.draft_tokens and tuple(seq.prompt_ids) == tuple(prompt):
                done = len(seq.output_ids)
                seq.draft_tokens = (want[done : done + len(seq.draft_tokens)] + seq.draft_tokens)[
                    : len(seq.draft_tokens)
                ]

    monkeypatch.setattr(LLMEngine, "_draft", oracle)
    # the byte tokenizer decodes most of these ids to "", so text alone cannot show which tokens came out:
    # record the ids of every output the engine hands the server, by request id (the response's "id")
    emitted = {}
    real_output = LLMEngine._output

    def spy(self, seq):
        out = real_output(self, seq)
        emitted.setdefault(out.request_id, []).append(list(out.new_token_ids))
        return out

    monkeypatch.setattr(LLMEngine, "_output", spy)
    # logprobs=0: each chunk lists one logprob entry per token it carries, so the stream shows its sizes
    stream = list(
        client.completions.create(
            model=engine.model_name,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            logprobs=0,
            extra_body={"ignore_eos": True},
        )
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == engine.tokenizer.decode(want)
    steps = [ids for ids in emitted[chunks[0].id] if ids]
    assert [t for ids in steps for t in ids] == want
    sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs.tokens]
    assert sizes == [len(ids) for ids in steps]  # one chunk per engine step, carrying that step's tokens
    assert sum(sizes) == 24 and max(sizes) >= 2, sizes  # accepted drafts: several tokens in one chunk
    r = client.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == engine.tokenizer.decode(want) and r.usage.completion_tokens == 24
    assert [t for ids in emitted[r.id] for t in ids] == want
    metrics = httpx.get(srv.base_url + "/metrics").text

    def value(name):
        return float(re.search(rf"^dsv41_{name} (\S+)$", metrics, re.M).group(1))

    assert value("spec_decode_draft_tokens_total") > 0
    assert value("spec_decode_accepted_tokens_total") > 0
    assert value("spec_decode_mean_emitted_per_step") > 2.0  # the oracle's blocks: several tokens per pass
    assert 0 < value("spec_decode_acceptance_rate_position_0") <= 1
