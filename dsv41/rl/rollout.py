"""Rollouts from the inference engine, for the RL learner (training.md §8; spec-v41.md §9, §10).

Sampled completions come from `dsv41.engine.LLMEngine` under continuous batching (every request of a
rollout batch is queued at once; the engine runs as many as `max_num_seqs` together), configured for a
learner: `logprobs_mode="processed"` (each token's log-probability under the distribution it was drawn
from, with the ids top-k/top-p kept), `record_routing` (every MoE layer's expert ids at every position,
and the chunk spans the engine computed, so that `dsv41.rl.policy` replays exactly that computation),
full prefill and no prefix cache (every position computed by the request itself). Each request draws
with its own seed, derived from the batch seed and its index, so the samples do not depend on how the
engine batched them.

`RolloutWorker` runs one engine in this process; `RayRolloutWorkers` runs one per Ray actor (a
cluster's machines) with the same interface, the serving weights pushed to every actor after each
learner update.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv41.chat.encoding import encode_prompt, prompt_parts
from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
from dsv41.model.transformer import Transformer
from dsv41.rl.policy import Sample

log = logging.getLogger("dsv41.rl")


@dataclass
class RolloutRequest:
    """n samples of one prompt. `tag` travels to the rollouts (e.g. the task and the effort)."""

    prompt_ids: list[int]
    n: int
    params: SamplingParams
    tag: Any = None


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float]  # per completion token, under the processed sampling distribution
    supports: list[torch.Tensor | None]  # per completion token: the ids it could be drawn from, or None
    routed_experts: torch.Tensor | None  # [len(prompt) + len(completion) - 1, n_layers, k]
    spans: list[tuple[int, int]] | None
    temperature: float
    finish_reason: str | None
    preemptions: int = 0
    tag: Any = None
    request_index: int = 0
    values: dict = field(default_factory=dict)  # grade, reward, advantage, ... filled by the trainer

    def sample(self) -> Sample:
        return Sample(
            self.prompt_ids, self.completion_ids, self.spans, self.routed_experts, self.temperature, self.supports
        )


def chat_prompt(tokenizer, messages: list[dict], effort: int | None) -> list[int]:
    """Token ids of a thinking-mode V4.1 prompt at reasoning effort `effort` (spec §10: the effort line at
    index 0), ending with `<｜Assistant｜><think>`; effort None renders a non-thinking prompt."""
    parts = prompt_parts(messages, thinking=effort is not None, reasoning_effort=effort)
    return encode_prompt(tokenizer, parts)


def request_seed(seed: int, request: int, sample: int) -> int:
    """A per-sample seed from the batch seed and the sample's place, independent of the batching."""
    digest = hashlib.sha256(f"{seed}:{request}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def rollout_engine_config(max_len: int, max_num_seqs: int = 64, **overrides) -> EngineConfig:
    """An EngineConfig for rollouts: processed log-probabilities, routing records, full prefill, no prefix
    cache, deterministic numerics (the learner recomputes a sample's log-probs and must get the rollout's
    bits, whatever the sample was batched with), and a pool that holds max_num_seqs sequences of max_len
    tokens (so nothing is preempted)."""
    block = overrides.pop("block_size", 16)
    pool = overrides.pop("kv_pool_tokens", max_num_seqs * (-(-max_len // block) + 1) * block)
    settings = dict(
        block_size=block,
        kv_pool_tokens=pool,
        max_num_seqs=max_num_seqs,
        prefill_mode="full",
        enable_prefix_caching=False,
        record_routing=True,
        logprobs_mode="processed",
        max_num_batched_tokens=1024,
        prefill_chunk_size=256,
        numerics="deterministic",
    )
    settings.update(overrides)
    return EngineConfig(**settings)


class RolloutWorker:
    """Sampling from one engine over `model` (shared, not copied: a learner that writes new weights into
    the model is sampled from at once)."""

    def __init__(self, model: Transformer, tokenizer, config: EngineConfig | None = None, max_len: int = 1024):
        config = config or rollout_engine_config(max_len)
        if not (config.record_routing and config.logprobs_mode == "processed"):
            raise ValueError(
                "a rollout engine needs record_routing=True and logprobs_mode='processed' (see rollout_engine_config)"
            )
        self.model, self.tokenizer = model, tokenizer
        self.engine = LLMEngine(model, tokenizer, config, model_name="dsv41-rl")

    def generate(
        self, requests: Sequence[RolloutRequest], seed: int = 0, indices: Sequence[int] | None = None
    ) -> list[Rollout]:
        """All samples of all requests, in request order (each request's n samples together). `indices`:
        each request's place in the whole rollout batch (default 0..), which its samples' seeds derive from."""
        indices = list(range(len(requests))) if indices is None else list(indices)
        engine = self.engine
        before = engine.counters["preemptions_total"]
        ids: list[tuple[int, int, str]] = []
        for r, req in enumerate(requests):
            if req.params.logprobs is None:
                req.params.logprobs = 0
            for j in range(req.n):
                rid = f"rl-{seed}-{indices[r]}-{j}"
                params = SamplingParams(
                    **{
                        **req.params.__dict__,
                        "seed": request_seed(seed, indices[r], j),
                        "stop": list(req.params.stop),
                        "stop_token_ids": list(req.params.stop_token_ids),
                    }
                )
                engine.add_request(rid, list(req.prompt_ids), params)
                ids.append((r, j, rid))
        lps: dict[str, list] = {rid: [] for _, _, rid in ids}
        final: dict[str, Any] = {}
        while engine.has_unfinished():
            for out in engine.step():
                lps[out.request_id].extend(out.new_logprobs)
                if out.finished:
                    final[out.request_id] = out
        if engine.counters["preemptions_total"] != before:
            log.warning(
                "rollouts were preempted (%d times): their early tokens' log-probabilities came from "
                "a computation the learner does not replay; enlarge kv_pool_tokens",
                engine.counters["preemptions_total"] - before,
            )
        rollouts = []
        for r, _j, rid in ids:
            out, req = final[rid], requests[r]
            if out.finish_reason == "error":
                raise RuntimeError(f"rollout request {rid} failed in the engine: {out.error}")
            rollouts.append(
                Rollout(
                    list(req.prompt_ids),
                    list(out.token_ids),
                    out.text,
                    [lp.logprob for lp in lps[rid]],
                    [lp.support for lp in lps[rid]],
                    out.routed_experts,
                    out.spans,
                    req.params.temperature,
                    out.finish_reason,
                    out.preemptions,
                    req.tag,
                    indices[r],
                )
            )
        return rollouts

    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Copy serving-dtype weights (by name) into the model; unknown names raise."""
        params = dict(self.model.named_parameters())
        unknown = sorted(set(state) - set(params))
        if unknown:
            raise KeyError(f"not parameters of this model: {unknown[:5]}")
        for name, value in state.items():
            params[name].copy_(value)


class _RolloutActor:
    """A Ray actor: its own model (built from config + weights) and engine."""

    def __init__(self, cfg, weights: bytes, tokenizer, engine_config: EngineConfig, threads: int):
        torch.set_num_threads(threads)
        model = Transformer(cfg)
        model.load_state_dict(_from_bytes(weights), strict=False, assign=True)
        model.eval()
        self.worker = RolloutWorker(model, tokenizer, engine_config)

    def generate(self, requests, seed, indices):
        return self.worker.generate(requests, seed, indices)

    def load_weights(self, weights: bytes):
        self.worker.load_weights(_from_bytes(weights))

    def where(self) -> tuple:
        import os
        import socket

        return socket.gethostname(), os.getpid()


_BYTE_DTYPES = {str(d): d for d in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu)}


def _to_bytes(state: dict[str, torch.Tensor]) -> bytes:
    """Weights travel to actors as safetensors bytes (no pickle of tensors). One-byte float formats go as
    uint8 views with their dtype in the metadata: safetensors' in-memory loader lacks E8M0."""
    from safetensors.torch import save

    tensors, kinds = {}, {}
    for k, v in state.items():
        v = v.detach().contiguous()
        if str(v.dtype) in _BYTE_DTYPES:
            kinds[k] = str(v.dtype)
            v = v.view(torch.uint8)
        tensors[k] = v
    return save(tensors, metadata={"byte_dtypes": json.dumps(kinds)})


def _from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    header_len = int.from_bytes(data[:8], "little")
    kinds = json.loads(json.loads(data[8 : 8 + header_len]).get("__metadata__", {}).get("byte_dtypes", "{}"))
    state = load(data)
    for k, dtype in kinds.items():
        state[k] = state[k].view(_BYTE_DTYPES[dtype])
    return state


class RayRolloutWorkers:
    """`num_workers` Ray actors, each with its own engine over a copy of `model`; `generate` spreads the
    requests over them (each request's samples on one actor, so a subgroup batches together) and returns
    the rollouts in request order, as `RolloutWorker.generate` does."""

    def __init__(
        self,
        model: Transformer,
        tokenizer,
        num_workers: int = 2,
        engine_config: EngineConfig | None = None,
        threads_per_worker: int = 1,
        address: str | None = None,
        max_len: int = 1024,
    ):
        from dsv41.rl.sandbox import _import_ray  # one place for the "pip install -e '.[rl]'" message

        ray = _import_ray()
        self.ray = ray
        if not ray.is_initialized():
            ray.init(
                address=address,
                num_cpus=None if address else max(num_workers, 2),
                include_dashboard=False,
                log_to_driver=False,
                ignore_reinit_error=True,
            )
        config = engine_config or rollout_engine_config(max_len)
        state = ray.put(_to_bytes(model.state_dict()))
        actor = ray.remote(num_cpus=threads_per_worker)(_RolloutActor)
        self.workers = [
            actor.options(scheduling_strategy="SPREAD").remote(model.cfg, state, tokenizer, config, threads_per_worker)
            for _ in range(num_workers)
        ]

    def generate(
        self, requests: Sequence[RolloutRequest], seed: int = 0, indices: Sequence[int] | None = None
    ) -> list[Rollout]:
        indices = list(range(len(requests))) if indices is None else list(indices)
        shares: list[list[int]] = [[] for _ in self.workers]
        for r in range(len(requests)):
            shares[r % len(self.workers)].append(r)
        # one call per actor with all its requests (they batch together in its engine); seeds follow each
        # request's index in the whole batch, so the samples do not depend on the number of workers
        calls = [
            w.generate.remote([requests[i] for i in idx], seed, [indices[i] for i in idx])
            for w, idx in zip(self.workers, shares)
            if idx
        ]
        by_request: dict[int, list[Rollout]] = {}
        for future in calls:
            for ro in self.ray.get(future):
                by_request.setdefault(ro.request_index, []).append(ro)
        return [ro for i in indices for ro in by_request[i]]

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        ref = self.ray.put(_to_bytes(state))
        self.ray.get([w.load_weights.remote(ref) for w in self.workers])

    def where(self) -> list[tuple]:
        return self.ray.get([w.where.remote() for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
