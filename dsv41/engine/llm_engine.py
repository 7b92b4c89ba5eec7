"""The inference engine: continuous batching over the paged FP4 cache with CED prefill and prefix caching
(spec-v41.md §2.1, §8, §9).

Each `step()` schedules one ragged batch: a decode token for every running sequence that finished its
prefill, then prefill chunks (fixed boundaries at multiples of `prefill_chunk_size`, so a request's
numerics do not depend on what it was batched with), then newly admitted requests. When the pool runs
out of blocks the newest running request is preempted: its blocks are released (full ones stay in the
prefix cache) and it is re-queued at the front, to resume by recomputing from its tokens; nothing is lost.

A request's life: admission (prefix-cache match, snapshot restore or window rebuild) -> prefill chunks
(encoder over every token, decoder over the last window only, unless prefill_mode="full") -> decode
steps -> finish (stop string/id, EOS, max_tokens, context limit, abort) -> snapshot at the message
boundary and release.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from dsv41.config import ModelConfig
from dsv41.engine.compiled import BUCKETS, CompiledDecode
from dsv41.engine.config import EngineConfig
from dsv41.engine.handoff import KVHandoff, check_handoff
from dsv41.engine.kv_pool import BlockAllocator, PagedKVPool
from dsv41.engine.prefix_cache import PrefixStats, SnapshotStore
from dsv41.engine.runner import ModelRunner
from dsv41.engine.sampling import TokenHistory, prompt_token_logprobs, sample, token_logprobs
from dsv41.engine.scheduler import Scheduling
from dsv41.engine.sequence import Sequence, StatePool, Status
from dsv41.engine.speculative import Speculation
from dsv41.engine.tiles import CompiledTiles
from dsv41.engine.types import RequestOutput, SamplingParams
from dsv41.model.transformer import Transformer
from dsv41.ops import fused, linear_cpu
from dsv41.ops.gemm_choice import fp32_rows

log = logging.getLogger("dsv41.engine")


class LLMEngine(Scheduling, Speculation):
    def __init__(
        self,
        model: Transformer,
        tokenizer,
        config: EngineConfig | None = None,
        model_name: str = "dsv41",
        seed: int = 0,
    ):
        config = config or EngineConfig()
        config.validate()
        self.config, self.tokenizer, self.model_name = config, tokenizer, model_name
        # the model is borrowed: the runner applies the engine's numerics (batch-invariant GEMMs,
        # canonical top-k ties, eval mode) around each forward and restores the model's own settings
        self.model = model
        self.model_config: ModelConfig = model.cfg
        cfg = self.model_config
        bs = config.block_size
        num_blocks = config.kv_pool_tokens // bs
        self.pool = PagedKVPool(cfg, bs, num_blocks, model.device)
        self.allocator = BlockAllocator(num_blocks)
        self.speculative = config.speculative
        if self.speculative and not len(model.mtp):
            raise ValueError(
                "--speculative needs a model with a DSpark drafter (mtp.* weights; config "
                "n_mtp_layers and dspark_block_size); this one has none"
            )
        self.num_draft = 0
        if self.speculative:
            k = cfg.dspark_block_size
            self.num_draft = k if config.num_speculative_tokens is None else min(k, config.num_speculative_tokens)
        # the drafter rings' smallest window: rows of one sequence written together never share a ring slot
        self.draft_window = min((stage.attn.window for stage in model.mtp), default=0)
        self.states = StatePool(cfg, config.max_num_seqs, model.device, drafter=self.speculative)
        self.snapshots = SnapshotStore(config.max_snapshots if config.enable_prefix_caching else 0, config.window_ttl_s)
        self.runner = ModelRunner(
            model,
            config.numerics,
            capture_hidden=self.speculative,
            record_routing=config.record_routing,
            batched_verify=config.batched_verify,
            row_chunk=config.row_chunk,
        )
        # built before the first request ('now'), or on a thread while the eager ops serve ('background')
        self.fused_kernels = model.prepare_kernels(config.fused_kernels)
        if config.numerics == "fast" and config.fast_gemm == "auto":
            # small (decode) calls as fp32 GEMMs where this machine runs them faster than bf16 ones, chosen by a
            # probe cached on disk (dsv41.ops.gemm_choice); the copies cost 2x the bf16 weights' bytes
            rows = fp32_rows(model.bf16_linear_shapes(), model.device.type)
            if rows:
                model.keep_fp32_gemm_copies()
                self.runner.fp32_rows = rows
        if config.numerics == "fast" and config.compile_decode != "off" and fused.enabled():
            # the compiled token-wise regions of decode and verify steps, one graph per bucket up to the first that
            # holds the largest such forward (max_num_seqs tokens, each with its draft when speculating); larger
            # forwards run in pieces of the largest (dsv41.engine.compiled.CompiledDecode.regions)
            most = config.max_num_seqs * (1 + self.num_draft)
            buckets = tuple(b for b in BUCKETS if b < most) + tuple(b for b in BUCKETS if b >= most)[:1]
            # the regions' bf16 GEMMs and the steps' logits by the few-row kernel, where it is built (~7 s, once)
            self.runner.rows_kernel = linear_cpu.available()
            self.runner.compiled = CompiledDecode(
                model, buckets, self.runner.numerics, self.runner.rows_kernel, verify=self.num_draft > 0
            )
            if config.compile_decode == "now":
                self.runner.compiled.build()
            else:
                self.runner.compiled.build_in_background()
        single = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        if config.numerics == "deterministic" and config.compile_decode != "off" and fused.enabled() and single:
            # the token-wise regions compiled at one tile shape for every forward, built before the first
            # request whatever the setting says: the tiles and the eager ops give different bits, so an engine
            # never switches between them while it serves (dsv41.engine.tiles.CompiledTiles). One process only:
            # ranks that split the work (data, expert, tensor parallel) keep the eager ops, whose bits on several
            # ranks equal one device's (tested); the tiles' have not been checked across ranks
            vision = any(getattr(block.ffn.gate, "bias_vl", None) is not None for block in model.layers)
            moe_inside = not (config.record_routing or vision)
            # every bf16 GEMM and the logits by the few-row kernel where it is built (batch-invariant by
            # construction), in the tiles and in the eager attention alike; eager engines keep the chunked GEMMs
            self.runner.rows_kernel = linear_cpu.available()
            if self.runner.rows_kernel:
                model.keep_bf16_head()
            self.runner.tiles = CompiledTiles.for_model(model, config.row_chunk, self.runner.numerics, moe_inside)
            if self.runner.tiles is None:
                self.runner.rows_kernel = False
        self.boundary = self.runner.boundary
        limit = config.max_model_len or cfg.max_position_embeddings
        self.max_model_len = min(limit, num_blocks * bs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._arrivals = 0
        self._finished_outputs: list[RequestOutput] = []
        self.stats = PrefixStats()
        self.counters = {
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "requests_finished_total": 0,
            "preemptions_total": 0,
            "steps_total": 0,
            "failed_steps_total": 0,
            "requests_failed_total": 0,
            "handoffs_exported_total": 0,
            "handoffs_imported_total": 0,
            # prompt tokens that arrived computed in a KV hand-off (also in prompt_tokens_total)
            "handoff_imported_tokens_total": 0,
        }
        if self.speculative:
            self.counters.update(
                {
                    "spec_decode_steps_total": 0,
                    "spec_decode_draft_tokens_total": 0,
                    "spec_decode_accepted_tokens_total": 0,
                    "spec_decode_emitted_tokens_total": 0,
                }
            )
            self.accepted_at = [0] * self.num_draft  # per draft position: verified with a draft kept there
            self.verified_at = [0] * self.num_draft
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated) per step
        self._identity: dict | None = None
        self._grammar_compiler = None

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        images: list | None = None,
        handoff: KVHandoff | None = None,
        export_handoff: bool = False,
        capture_logits: bool = False,
    ) -> None:
        """Queue a request. `images`: (start, dsv41.vision.ImagePatches) pairs, each image's span occupying
        prompt positions start .. start + span_length - 1, which must carry the model's image_token_id
        (dsv41.vision.prompt builds such prompts). Disaggregation (dsv41.engine.handoff): `export_handoff`
        computes the prompt and finishes with the KV hand-off (finish_reason "handoff", output.handoff)
        instead of sampling; `handoff` starts the request from one (no prefill) and decodes on.
        `capture_logits` keeps the full fp32 logits rows the request's tokens are sampled from on its
        sequence (`logits`; with prompt_logprobs also the prompt's, `prompt_logits`): for numerics checks."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not (0 <= t < vocab) for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        params.validate(vocab)
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; this model's context limit is "
                f"{self.max_model_len} tokens, prompt and output together"
            )
        self._check_images(prompt_token_ids, images or [])
        if export_handoff and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with prefill/decode disaggregation")
        if handoff is not None:
            check_handoff(self, handoff, prompt_token_ids, images)  # HandoffError (a ValueError) names the problem
        seq = Sequence(request_id, prompt_token_ids, params, self._arrivals, images)
        seq.capture_logits = capture_logits
        seq.handoff, seq.export_handoff = handoff, export_handoff
        if params.structured is not None:
            seq.grammar = self.grammar_compiler.matcher(params.structured)
        self._arrivals += 1
        self.requests[request_id] = seq
        self.waiting.append(seq)

    @property
    def grammar_compiler(self):
        """The `GrammarCompiler` for this tokenizer and vocabulary, built on first use (llguidance is an
        optional dependency: without it, GrammarUnavailable, a ValueError). A concurrent first use
        builds it twice, harmlessly."""
        if self._grammar_compiler is None:
            from dsv41.engine.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_compiler

    def _check_images(self, prompt: list[int], images: list) -> None:
        """Every image span inside the prompt, on image_token_id positions, without overlaps; and no
        image_token_id outside a span (it would be read as a token embedding the model never saw)."""
        cfg = self.model_config
        if images and not cfg.vision_enabled:
            raise ValueError("this model has no vision tower: it cannot take images")
        if not cfg.vision_enabled:
            return
        covered = [False] * len(prompt)
        for k, item in enumerate(images):
            start, image = item
            end = start + image.span_length
            if not (isinstance(start, int) and 0 <= start and end <= len(prompt)):
                raise ValueError(f"image {k}: its span {start}..{end - 1} lies outside the {len(prompt)}-token prompt")
            if any(covered[start:end]):
                raise ValueError(f"image {k}: its span overlaps another image's")
            if any(t != cfg.image_token_id for t in prompt[start:end]):
                raise ValueError(f"image {k}: span positions must carry image_token_id {cfg.image_token_id}")
            covered[start:end] = [True] * (end - start)
        stray = [i for i, t in enumerate(prompt) if t == cfg.image_token_id and not covered[i]]
        if stray:
            raise ValueError(
                f"the prompt has image_token_id {cfg.image_token_id} at position {stray[0]} without an image for it"
            )

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request; its final output (finish_reason "abort") comes with the next step."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status == Status.FINISHED:
            return False
        if seq.status == Status.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._release(seq)
        seq.finish_reason = "abort"
        self._finish(seq)
        self._finished_outputs.append(self._output(seq))
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished_outputs)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        images: list | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (offline use); returns the final output of each, in order.
        `images`: per prompt, its (start, ImagePatches) list or None."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{self._arrivals + i}" for i in range(len(prompts))]
        for k, (rid, prompt, p) in enumerate(zip(ids, prompts, plist)):
            self.add_request(rid, prompt, p, images[k] if images else None)
        final: dict[str, RequestOutput] = {}
        while any(rid not in final for rid in ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def prompt_logits(
        self, prompt_token_ids: list[int], request_id: str | None = None, images: list | None = None
    ) -> torch.Tensor:
        """fp32 logits [vocab] of the prompt's last position, computed the way this engine prefills
        (prefill mode, chunking, prefix cache). For parity checks and the bounded-replay gap."""
        rid = request_id or f"logits-{self._arrivals}"
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        self.add_request(rid, prompt_token_ids, params, images, capture_logits=True)
        seq = self.requests[rid]
        while seq.status != Status.FINISHED:
            self.step()
        return seq.logits[0]

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        plan = self._schedule()
        for seq in [s for s in self.running if s.restored_logits is not None]:
            logits, seq.restored_logits = seq.restored_logits, None
            if seq.export_handoff:  # a whole-prompt prefix-cache hit on a prefill worker
                outputs.append(self._export_handoff(seq, logits, None))
                continue
            try:
                outputs.append(self._sampled(seq, "restored", logits))
                self.counters["generation_tokens_total"] += 1  # generated without a forward of its own
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                outputs.append(self._fail(seq, exc))
        if not plan:
            return outputs
        chunks = [chunk for _, chunk, _ in plan]
        for seq, chunk, kind in plan:
            seq.cache.global_writes = kind != "rebuild"
            if kind == "decode" and seq.draft_tokens:  # a rejected draft is undone from this copy
                seq.saved_state = seq.cache.save_positions(chunk.start, chunk.end)
        try:
            logits = self.runner.forward(chunks)
        except Exception as exc:  # noqa: BLE001 - whatever broke, the other requests must go on
            for seq, _, _ in plan:
                if seq.cache is not None:
                    seq.cache.global_writes = True
            self._forward_failed(plan, exc)
            outputs += self._finished_outputs
            self._finished_outputs = []
            return outputs
        self.counters["steps_total"] += 1
        self._prefetch_masks(plan)
        row, generated = 0, 0
        for seq, chunk, kind in plan:
            seq.cache.global_writes = True
            rows = logits[row : row + chunk.logit_rows()]  # [n, vocab]: the chunk's last n positions
            row += len(rows)
            if kind == "rebuild":
                seq.needs_rebuild = False
                continue
            if kind == "decode" and self.speculative:
                before = len(seq.output_ids)
                outputs.append(self._verified(seq, chunk, rows))
                generated += len(seq.output_ids) - before
                continue
            seq.num_computed = chunk.end
            if chunk.routing is not None:  # record_routing: what this request's positions ran through
                seq.spans.append((chunk.start, chunk.start + len(chunk.tokens)))
                seq.routing.append(chunk.routing)
            if seq.suspect_until is not None and seq.num_computed >= seq.suspect_until:
                seq.suspect_until = None  # it got past the work of the failed batch alone: cleared
            self._register_full_blocks(seq)
            if kind == "prefill" and seq.needs_prompt_logprobs:
                try:
                    self._add_prompt_logprobs(seq, chunk.end - len(rows), rows)
                except Exception as exc:  # noqa: BLE001 - this request's own failure
                    outputs.append(self._fail(seq, exc))
                    continue
            if seq.num_computed < seq.prefill_target:
                continue
            if seq.export_handoff:
                outputs.append(self._export_handoff(seq, rows[-1], chunk))
                continue
            try:
                out = self._sampled(seq, kind, rows[-1])
            except Exception as exc:  # noqa: BLE001 - this request's own failure (sampling, decoding, stop)
                outputs.append(self._fail(seq, exc))
                continue
            generated += 1
            outputs.append(out)
        if self.speculative:
            try:
                self._draft([(seq, chunk) for seq, chunk, kind in plan if kind != "rebuild"])
            except Exception as exc:  # noqa: BLE001 - drafting is an optimisation: decode on without it
                log.warning(
                    "DSpark drafting failed (%s: %s); these requests decode one token this step",
                    type(exc).__name__,
                    exc,
                )
                for seq, _, _ in plan:
                    seq.draft_tokens, seq.draft_logits = [], None
        self.counters["generation_tokens_total"] += generated
        self._recent.append((time.perf_counter(), generated))
        return outputs

    def _prefetch_masks(self, plan: list) -> None:
        """The grammar masks of every constrained request sampling this step, in one batched call."""
        grammars = [
            seq.grammar
            for seq, chunk, kind in plan
            if seq.grammar is not None and kind != "rebuild" and chunk.end >= seq.prefill_target
        ]
        if grammars:
            try:
                self.grammar_compiler.prefetch(grammars)
            except Exception as exc:  # noqa: BLE001 - each request then computes its own mask when sampling
                log.warning("batched grammar masks failed (%s: %s)", type(exc).__name__, exc)

    def _sampled(self, seq: Sequence, kind: str, logits: torch.Tensor) -> RequestOutput:
        """Sample the sequence's next token from its logits [vocab] and account for it."""
        if kind == "prefill":
            self._save_snapshot(seq, logits)  # message boundary: end of the prompt
        token = sample(logits, seq.params, seq.generator or self.generator, self._history(seq))
        self._append_token(seq, token, logits)
        return self._emit(seq)

    def _history(self, seq: Sequence, drafted: tuple = ()) -> TokenHistory | None:
        """What the request's logit processing reads at its next position (after `drafted` more tokens);
        None when it has no processing. The prompt's presence mask is kept on the sequence."""
        p = seq.params
        if not p.processes_logits:
            return None
        eos = self.model_config.eos_token_id
        stop_ids = list(p.stop_token_ids) + ([eos] if eos is not None and not p.ignore_eos else [])
        if seq.prompt_mask_cache is None:
            seq.prompt_mask_cache = {}
        output = seq.output_ids + list(drafted) if drafted else seq.output_ids
        return TokenHistory(seq.prompt_ids, output, stop_ids, seq.prompt_mask_cache, seq.grammar)

    def _add_prompt_logprobs(self, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """Record the prompt logprobs the logits rows [n, vocab] of positions first..first+n-1 give: row j
        scores prompt token first+j+1. Positions already recorded (a recompute after preemption) are skipped."""
        prompt, have = seq.prompt_ids, len(seq.prompt_logprobs)
        if first > have - 1:  # cannot happen: such a request prefills every position from 0 in order
            raise RuntimeError(f"prompt logprobs: positions {have - 1}..{first - 1} were never computed")
        lo, hi = max(have - 1, first), min(first + len(rows), len(prompt) - 1)  # positions to score
        if lo < hi:
            if seq.capture_logits:
                seq.prompt_logits.append(rows[lo - first : hi - first].clone())
            seq.prompt_logprobs += prompt_token_logprobs(
                rows[lo - first : hi - first], prompt[lo + 1 : hi + 1], seq.params.prompt_logprobs, self.tokenizer
            )

    def _append_token(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """Add one token (chosen from logits [vocab]) to the output; sets the finish reason if it ends it."""
        if seq.capture_logits:
            seq.logits.append(logits.clone())
        if seq.params.logprobs is not None:
            processed = seq.params if self.config.logprobs_mode == "processed" else None
            seq.pending_logprobs.append(
                token_logprobs(logits, token, seq.params.logprobs, self.tokenizer, processed, self._history(seq))
            )
        seq.output_ids.append(token)
        if seq.grammar is not None:
            seq.grammar.advance(token)
        self._check_finished(seq, token)

    def _emit(self, seq: Sequence) -> RequestOutput:
        """The output since the last one; a finished sequence leaves the batch (snapshot, release)."""
        out = self._output(seq)
        if seq.status == Status.FINISHED:
            self.running.remove(seq)
            self._save_snapshot(seq)
            self._release(seq)
            self._finish(seq)
        return out

    # ------------------------------------------------------------------ failures
    MAX_FAILED_STEPS = 3  # a request in this many failed batches is failed even if it never failed alone

    def _forward_failed(self, plan: list, exc: Exception) -> None:
        """A forward pass raised. Alone in its batch, the request is the cause and fails by itself. In a
        batch the culprit is unknown: every request of the batch is preempted (its state is rebuilt from
        its tokens, so nothing half-written is kept) and marked suspect up to the position the failed
        step was computing; suspects then run one at a time until they are past it (`_schedule`), so the
        one that fails alone is found and the rest go on."""
        self.counters["failed_steps_total"] += 1
        work = [(seq, chunk.end) for seq, chunk, _ in plan if seq.status == Status.RUNNING]
        if len(work) == 1:
            self._finished_outputs.append(self._fail(work[0][0], exc))
            return
        log.warning(
            "engine step over %d requests failed (%s: %s); retrying them one at a time",
            len(work),
            type(exc).__name__,
            exc,
        )
        for seq, end in work:
            seq.failed_steps += 1
            if seq.failed_steps >= self.MAX_FAILED_STEPS:
                self._finished_outputs.append(self._fail(seq, exc))
                continue
            self._preempt(seq, count=False)
            # one position past the failed work, so it also takes a decode step alone: a failure tied
            # to the request rather than to a position (its decode always breaks) is caught too
            seq.suspect_until = max(end + 1, seq.suspect_until or 0)

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """Finish one request with finish_reason "error"; the details go to the log under its id."""
        log.error(
            "request %s failed: %s: %s",
            seq.request_id,
            type(exc).__name__,
            exc,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish_reason = "error"
        seq.error = f"{type(exc).__name__}: {exc}"
        self._finish(seq)
        self.counters["requests_failed_total"] += 1
        return self._output(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.requests.pop(seq.request_id, None)
        self.counters["requests_finished_total"] += 1

    def _check_finished(self, seq: Sequence, token: int) -> None:
        p = seq.params
        eos = self.model_config.eos_token_id
        # a finished grammar allows only EOS: with ignore_eos too, the request ends there
        grammar_done = seq.grammar is not None and seq.grammar.finished
        if (token == eos and (not p.ignore_eos or grammar_done)) or token in p.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            seq.finish_reason = "length"
        text_ids = seq.output_ids[:-1] if seq.finish_reason == "stop" else seq.output_ids
        seq.text = self.tokenizer.decode(text_ids)
        if p.stop and len(seq.output_ids) >= p.min_tokens:  # vLLM: no stop string before min_tokens
            window_from = max(0, seq.emitted_text - max(len(s) for s in p.stop))
            hits = [i for i in (seq.text.find(s, window_from) for s in p.stop) if i >= 0]
            if hits:
                seq.text = seq.text[: min(hits)]
                seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            seq.status = Status.FINISHED

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.status == Status.FINISHED or seq.finish_reason is not None
        text = seq.text
        visible = len(text)
        if not finished:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                visible = len(text.rstrip("\ufffd"))
            if seq.params.stop:  # hold back what could still become a stop string
                visible = min(visible, max(seq.emitted_text, len(text) - max(len(s) for s in seq.params.stop) + 1))
        visible = max(visible, seq.emitted_text)
        new_text = text[seq.emitted_text : visible]
        seq.emitted_text = visible
        new_ids = seq.output_ids[seq.emitted_tokens :]
        seq.emitted_tokens = len(seq.output_ids)
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        routed = spans = None
        if finished and self.config.record_routing and seq.routing:
            routed, spans = torch.cat(seq.routing), list(seq.spans)
        return RequestOutput(
            seq.request_id,
            new_ids,
            new_text,
            list(seq.output_ids),
            text[:visible],
            finished,
            seq.finish_reason if finished else None,
            len(seq.prompt_ids),
            seq.num_cached_tokens,
            logprobs,
            error=seq.error if finished else None,
            queue_time_s=seq.queue_time_s if finished else None,
            routed_experts=routed,
            spans=spans,
            preemptions=seq.preemptions,
            prompt_logprobs=None if seq.needs_prompt_logprobs else seq.prompt_logprobs,
        )

    # ------------------------------------------------------------------ reporting
    def metrics(self) -> dict:
        used, total = self.allocator.num_used(), self.allocator.num_blocks
        now = time.perf_counter()
        recent = [(t, n) for t, n in self._recent if now - t < 10.0]
        rate = 0.0
        if len(recent) >= 2:
            rate = sum(n for _, n in recent[1:]) / max(recent[-1][0] - recent[0][0], 1e-9)
        q, h = self.stats.queried_tokens, self.stats.hit_tokens
        kv = self.resident_kv_bytes()
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "kv_blocks_used": used,
            "kv_blocks_total": total,
            "kv_resident_bytes_per_token": kv["global_kv_bytes_per_token"],
            "kv_fixed_state_bytes": kv["fixed_state_bytes"],
            "kv_usage": used / total,
            "prefix_cache_queried_tokens": q,
            "prefix_cache_hit_tokens": h,
            "prefix_cache_hit_rate": h / q if q else 0.0,
            "prefix_cache_snapshot_hits": self.stats.snapshot_hits,
            "window_rebuilds": self.stats.window_rebuilds,
            "generation_tokens_per_s": rate,
            **self.counters,
            **self._spec_metrics(),
        }

    def resident_kv_bytes(self) -> dict:
        """Measured bytes of the live sequences' state: global KV entries actually stored (by kv source,
        at the pool's packed sizes), and the fixed per-sequence state, with the tokens they cover."""
        tokens = entries_bytes = fixed = 0
        for seq in self.running:
            if seq.cache is None:
                continue
            tokens += seq.num_computed
            for layer, lay in self.pool.sources.items():
                entries_bytes += self.pool.stored_bytes(layer, seq.num_computed // lay.ratio)
            fixed += seq.cache.fixed_state_bytes()
        block_bytes = self.allocator.num_used() * self.pool.bytes_per_block()
        return {
            "tokens": tokens,
            "global_kv_bytes": entries_bytes,
            "allocated_block_bytes": block_bytes,
            "global_kv_bytes_per_token": entries_bytes / tokens if tokens else 0.0,
            "fixed_state_bytes": fixed,
            "sequences": len(self.running),
        }
