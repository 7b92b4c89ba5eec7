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
import math
import time
from collections import deque
from typing import Optional

import torch

from dsv41.config import ModelConfig
from dsv41.engine.config import EngineConfig
from dsv41.engine.handoff import KVHandoff, check_handoff, export_sequence, import_sequence, model_identity
from dsv41.engine.kv_pool import BlockAllocator, PagedKVPool, PoolExhausted
from dsv41.engine.prefix_cache import PrefixStats, Snapshot, SnapshotStore, chain_hashes, prefix_key
from dsv41.engine.runner import Chunk, ModelRunner
from dsv41.engine.sampling import TokenHistory, prompt_token_logprobs, sample, token_logprobs, verify_draft
from dsv41.engine.sequence import DraftRings, Sequence, SequenceCache, StatePool, Status
from dsv41.engine.types import RequestOutput, SamplingParams
from dsv41.model.transformer import Transformer

log = logging.getLogger("dsv41.engine")


class LLMEngine:
    def __init__(self, model: Transformer, tokenizer, config: Optional[EngineConfig] = None,
                 model_name: str = "dsv41", seed: int = 0):
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
            raise ValueError("--speculative needs a model with a DSpark drafter (mtp.* weights; config "
                             "n_mtp_layers and dspark_block_size); this one has none")
        self.num_draft = 0
        if self.speculative:
            k = cfg.dspark_block_size
            self.num_draft = k if config.num_speculative_tokens is None else min(k, config.num_speculative_tokens)
        self.states = StatePool(cfg, config.max_num_seqs, model.device, drafter=self.speculative)
        self.snapshots = SnapshotStore(config.max_snapshots if config.enable_prefix_caching else 0, config.window_ttl_s)
        self.runner = ModelRunner(model, config.row_chunk if config.batch_invariant else 0,
                                  capture_hidden=self.speculative, record_routing=config.record_routing,
                                  batched_verify=config.batched_verify)
        # built before the first request ('now'), or on a thread while the eager ops serve ('background')
        self.fused_kernels = model.prepare_kernels(config.fused_kernels)
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
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "requests_finished_total": 0,
                         "preemptions_total": 0, "steps_total": 0, "failed_steps_total": 0,
                         "requests_failed_total": 0, "handoffs_exported_total": 0, "handoffs_imported_total": 0}
        if self.speculative:
            self.counters.update({"spec_decode_steps_total": 0, "spec_decode_draft_tokens_total": 0,
                                  "spec_decode_accepted_tokens_total": 0, "spec_decode_emitted_tokens_total": 0})
            self.accepted_at = [0] * self.num_draft  # per draft position: verified with a draft kept there
            self.verified_at = [0] * self.num_draft
        self._recent: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated) per step
        self._identity: Optional[dict] = None
        self._grammar_compiler = None

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Optional[SamplingParams] = None,
                    images: Optional[list] = None, handoff: Optional[KVHandoff] = None,
                    export_handoff: bool = False) -> None:
        """Queue a request. `images`: (start, dsv41.vision.ImagePatches) pairs, each image's span occupying
        prompt positions start .. start + span_length - 1, which must carry the model's image_token_id
        (dsv41.vision.prompt builds such prompts). Disaggregation (dsv41.engine.handoff): `export_handoff`
        computes the prompt and finishes with the KV hand-off (finish_reason "handoff", output.handoff)
        instead of sampling; `handoff` starts the request from one (no prefill) and decodes on."""
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
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; this model's context limit is "
                             f"{self.max_model_len} tokens, prompt and output together")
        self._check_images(prompt_token_ids, images or [])
        if export_handoff and params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not supported with prefill/decode disaggregation")
        if handoff is not None:
            check_handoff(self, handoff, prompt_token_ids)  # HandoffError (a ValueError) names the problem
        seq = Sequence(request_id, prompt_token_ids, params, self._arrivals, images)
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
            raise ValueError(f"the prompt has image_token_id {cfg.image_token_id} at position {stray[0]} "
                             f"without an image for it")

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

    def generate(self, prompts: list[list[int]], params: Optional[SamplingParams | list[SamplingParams]] = None,
                 images: Optional[list] = None) -> list[RequestOutput]:
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

    def prompt_logits(self, prompt_token_ids: list[int], request_id: Optional[str] = None,
                      images: Optional[list] = None) -> torch.Tensor:
        """fp32 logits [vocab] of the prompt's last position, computed the way this engine prefills
        (prefill mode, chunking, prefix cache). For parity checks and the bounded-replay gap."""
        rid = request_id or f"logits-{self._arrivals}"
        self.add_request(rid, prompt_token_ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), images)
        seq = self.requests[rid]
        seq.capture_logits = True
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
            rows = logits[row:row + chunk.logit_rows()]  # [n, vocab]: the chunk's last n positions
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
                log.warning("DSpark drafting failed (%s: %s); these requests decode one token this step",
                            type(exc).__name__, exc)
                for seq, _, _ in plan:
                    seq.draft_tokens, seq.draft_logits = [], None
        self.counters["generation_tokens_total"] += generated
        self._recent.append((time.perf_counter(), generated))
        return outputs

    def _prefetch_masks(self, plan: list) -> None:
        """The grammar masks of every constrained request sampling this step, in one batched call."""
        grammars = [seq.grammar for seq, chunk, kind in plan
                    if seq.grammar is not None and kind != "rebuild" and chunk.end >= seq.prefill_target]
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

    def _history(self, seq: Sequence, drafted: tuple = ()) -> Optional[TokenHistory]:
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
            seq.prompt_logprobs += prompt_token_logprobs(rows[lo - first:hi - first], prompt[lo + 1:hi + 1],
                                                         seq.params.prompt_logprobs, self.tokenizer)

    def _append_token(self, seq: Sequence, token: int, logits: torch.Tensor) -> None:
        """Add one token (chosen from logits [vocab]) to the output; sets the finish reason if it ends it."""
        if seq.capture_logits:
            seq.logits.append(logits.clone())
        if seq.params.logprobs is not None:
            processed = seq.params if self.config.logprobs_mode == "processed" else None
            seq.pending_logprobs.append(token_logprobs(logits, token, seq.params.logprobs, self.tokenizer, processed,
                                                       self._history(seq)))
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

    # ------------------------------------------------------------------ DSpark speculative decoding
    def _verified(self, seq: Sequence, chunk: Chunk, rows: torch.Tensor) -> RequestOutput:
        """A decode step with speculation on: the chunk ran the last known token and the draft; rows
        [n + 1, vocab] are the logits at the last known token and at each draft. Keeps the longest valid
        prefix plus one token. Whatever the rejected positions (or those past a finish inside the draft)
        wrote is undone (`SequenceCache.keep_positions`), so the state is that of plain decoding."""
        draft, seq.draft_tokens = seq.draft_tokens, []
        draft_logits, seq.draft_logits = seq.draft_logits, None
        saved, seq.saved_state = seq.saved_state, None
        n = len(draft)
        try:
            accepted, nxt = verify_draft(rows, draft, draft_logits, seq.params, seq.generator or self.generator,
                                         self._history(seq))
            emitted = 0
            for i, token in enumerate(draft[:accepted] + [nxt]):
                self._append_token(seq, token, rows[i])
                emitted += 1
                if seq.finish_reason is not None:
                    break
        except Exception as exc:  # noqa: BLE001 - this request's own failure (sampling, decoding, stop)
            return self._fail(seq, exc)
        # positions up to the last token's predecessor are final; a draft's rejected tail is undone
        seq.num_computed = len(seq) - 1
        if saved is not None:
            seq.cache.keep_positions(saved, seq.num_computed)
        if seq.suspect_until is not None and seq.num_computed >= seq.suspect_until:
            seq.suspect_until = None
        self._register_full_blocks(seq)
        c = self.counters
        if n:
            c["spec_decode_steps_total"] += 1
            c["spec_decode_draft_tokens_total"] += n
            c["spec_decode_accepted_tokens_total"] += accepted
            c["spec_decode_emitted_tokens_total"] += emitted
            for i in range(n):
                self.verified_at[i] += 1
                self.accepted_at[i] += accepted > i
        return self._emit(seq)

    def _draft(self, work: list[tuple[Sequence, Chunk]]) -> None:
        """After a forward: write the drafter rings' rows of the positions it computed and kept, then draft
        the next block for every decoding sequence, all in one batched drafter pass."""
        model = self.model
        todo = []
        for seq, chunk in work:
            if seq.status != Status.RUNNING or seq.cache is None or chunk.main_hidden is None:
                continue
            first_pos, m = chunk.hidden_start, chunk.main_hidden.size(0)
            last = min(first_pos + m, len(seq) - 1) - 1  # the last position both computed and kept
            if last < first_pos:
                continue
            can_draft = not seq.in_prefill and not seq.needs_rebuild and last == len(seq) - 2
            budget = min(self.num_draft, seq.params.max_tokens - len(seq.output_ids) - 1,
                         self.max_model_len - len(seq) - 1)
            can_draft = can_draft and budget > 0
            write_from = max(first_pos, seq.rows_end if seq.rows_first is not None else first_pos)
            write_to = last if can_draft else last + 1  # a draft writes the row at `last` itself
            if write_from < write_to:
                self.runner.draft_rows(chunk.main_hidden[write_from - first_pos:write_to - first_pos].unsqueeze(0),
                                       write_from, seq.cache)
                self._rows_written(seq, write_from, write_to)
            if can_draft:
                todo.append((seq, chunk.main_hidden[last - first_pos], last, budget))
        if not todo:
            return
        seqs = [t[0] for t in todo]
        pos = torch.tensor([t[2] for t in todo], dtype=torch.int64)
        for seq, _, p, _ in todo:
            self._rows_written(seq, p, p + 1)
        rings = DraftRings(self.states, [s.cache.slot for s in seqs], [s.rows_first for s in seqs])
        first = torch.tensor([s.all_ids[-1] for s in seqs], dtype=torch.int64, device=model.device)
        hidden = torch.stack([t[1] for t in todo]).unsqueeze(1)  # [B, 1, F]

        drafted: list[list[int]] = [[] for _ in seqs]

        def choose(logits: torch.Tensor) -> torch.Tensor:
            # each request draws with its own params, its logit processing seeing the drafts before this
            # one (what plain decoding would have generated there), as verify_draft assumes
            picks = []
            for i, s in enumerate(seqs):
                picks.append(sample(logits[i], s.params, s.generator or self.generator,
                                    self._history(s, tuple(drafted[i]))))
                drafted[i].append(picks[-1])
            return torch.tensor(picks, dtype=torch.int64, device=logits.device)

        result = self.runner.draft(first, hidden, pos, rings, choose)
        likely = None
        if self.config.speculative_min_confidence > 0:
            likely = torch.sigmoid(result.confidence.float()).cumprod(-1) >= self.config.speculative_min_confidence
        for i, (seq, _, _, budget) in enumerate(todo):
            n = budget if likely is None else int(likely[i, :budget].sum())  # a running product: a prefix
            seq.draft_tokens = result.tokens[i, 1:n + 1].tolist()
            seq.draft_logits = result.logits[i, :n].float().cpu()

    @staticmethod
    def _rows_written(seq: Sequence, start: int, end: int) -> None:
        if seq.rows_first is None or start > seq.rows_end:  # a gap: the readable rows start again here
            seq.rows_first = start
        seq.rows_end = max(seq.rows_end, end)

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
        log.warning("engine step over %d requests failed (%s: %s); retrying them one at a time",
                    len(work), type(exc).__name__, exc)
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
        log.error("request %s failed: %s: %s", seq.request_id, type(exc).__name__, exc,
                  exc_info=(type(exc), exc, exc.__traceback__))
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

    # ------------------------------------------------------------------ scheduling
    def _schedule(self) -> list[tuple[Sequence, Chunk, str]]:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        self._admit()
        plan = []
        # decodes first (one token each), then prefill work, each in arrival order
        order = sorted(self.running, key=lambda s: (s.in_prefill or s.needs_rebuild, s.arrival))
        suspects = [s for s in order if s.suspect_until is not None]
        if suspects:  # after a failed batch: the oldest suspect runs alone until it catches up
            order = [min(suspects, key=lambda s: s.arrival)]
        for seq in order:
            if seq.status != Status.RUNNING or seq.restored_logits is not None:
                continue  # preempted earlier in this loop, or nothing to compute (a whole-prompt hit)
            tokens = seq.all_ids
            if seq.needs_rebuild:
                start, end, kind = seq.rebuild_from, seq.num_computed, "rebuild"
            elif seq.in_prefill:
                start = seq.num_computed
                end = min(seq.prefill_target, (start // cfg.prefill_chunk_size + 1) * cfg.prefill_chunk_size)
                kind = "prefill"
            else:
                start, end, kind = seq.num_computed, len(tokens), "decode"
                if seq.draft_tokens and end + len(seq.draft_tokens) - start > budget:
                    seq.draft_tokens, seq.draft_logits = [], None  # no room this step: verify nothing
                end += len(seq.draft_tokens)
                tokens = tokens + seq.draft_tokens
            if end - start > budget:
                continue
            if not self._reserve_blocks(seq, end, plan):
                continue
            budget = cfg.max_num_batched_tokens - sum(c.end - c.start for _, c, _ in plan) - (end - start)
            lookback = self.model_config.engram_max_ngram_size - 1
            every = kind == "prefill" and seq.needs_prompt_logprobs  # logits at every position (prompt logprobs)
            chunk = Chunk(seq.cache, tokens[start:end], start, tokens[max(0, start - lookback):start],
                          decoder_from=seq.rebuild_decoder_from if kind == "rebuild" else seq.decoder_from,
                          want_logits=kind != "rebuild" and (end >= seq.prefill_target or every), end=end,
                          decode=kind == "decode" and end - start == 1, verify=kind == "decode" and end - start > 1,
                          n_logits=len(seq.draft_tokens) + 1 if kind == "decode" else end - start if every else 1)
            if seq.images:
                self._attach_images(seq, chunk, start - len(chunk.context), end)
            plan.append((seq, chunk, kind))
        return plan

    def _attach_images(self, seq: Sequence, chunk: Chunk, first: int, end: int) -> None:
        """The chunk's image rows (slices of each span's embeddings, computed once per request) and its
        image-position flags over context + tokens. A chunk may hold any part of a span."""
        chunk.image_mask = seq.image_positions(first, end)
        for k, a, b in seq.image_spans(chunk.start, end):
            span_start, image = seq.images[k]
            if k not in seq.image_embeds:
                seq.image_embeds[k] = self.runner.embed_image(image)  # [span_length, dim]
            chunk.image_rows.append((a - chunk.start, seq.image_embeds[k][a - span_start:b - span_start]))

    def _reserve_blocks(self, seq: Sequence, end: int, plan: list) -> bool:
        """Make the sequence's block table cover positions < end, preempting newer requests if needed
        (dropping their work from this step's plan)."""
        needed = math.ceil(end / self.config.block_size) - len(seq.cache.blocks)
        while needed > 0:
            try:
                seq.cache.append_block(self.allocator.allocate())
                needed -= 1
            except PoolExhausted:
                victims = [s for s in self.running if s is not seq and s.arrival > seq.arrival]
                victim = max(victims, key=lambda s: s.arrival) if victims else seq
                self._preempt(victim)
                plan[:] = [entry for entry in plan if entry[0] is not victim]
                if victim is seq:
                    return False
        return True

    def _preempt(self, seq: Sequence, count: bool = True) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.counters["preemptions_total"] += count
        # keep arrival order among the waiting: a preempted request goes back before later arrivals
        index = next((i for i, s in enumerate(self.waiting) if s.arrival > seq.arrival), len(self.waiting))
        self.waiting.insert(index, seq)

    def _admit(self) -> None:
        cfg = self.config
        while self.waiting and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            if not self._start(seq):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            if seq.queue_time_s is None:
                seq.queue_time_s = time.monotonic() - seq.arrival_time
            self.running.append(seq)

    def _start(self, seq: Sequence) -> bool:
        """Set up a sequence's cache for (re)prefill of all its tokens, reusing what the prefix cache
        holds. Returns False (changing nothing) when the pool cannot take it yet."""
        mcfg, bs = self.model_config, self.config.block_size
        if seq.handoff is not None:
            return self._start_from_handoff(seq)
        tokens = seq.key_ids  # what the prefix cache hashes (image spans keyed by their pixels)
        n = len(tokens)
        seq.draft_tokens, seq.draft_logits, seq.saved_state = [], None, None  # a new cache: no draft, no rows
        seq.spans, seq.routing = [], []  # record_routing: recomputed from position 0 (no prefix cache then)
        seq.rows_first, seq.rows_end = None, 0
        hashes = chain_hashes(tokens, bs, [])
        w = mcfg.window_size
        bounded = self.config.prefill_mode == "bounded"
        if seq.decoder_start is None:  # fixed at first admission, so a recompute takes the same path
            # prompt logprobs need the logits of every prompt position: the decoder runs over all of them
            full = not bounded or seq.params.prompt_logprobs is not None
            seq.decoder_start = 0 if full else max(0, len(seq.prompt_ids) - w)
        start = seq.decoder_start
        exact = self.config.exact_prefix_reuse
        # prompt logprobs still to compute: every prompt position runs here, nothing is read from the cache
        lookup = self.config.enable_prefix_caching and not seq.needs_prompt_logprobs
        matched: list[int] = []
        if lookup:
            for h in hashes[:(n if exact else n - 1) // bs]:
                block = self.allocator.lookup(h)
                if block is None:
                    break
                matched.append(block)
        snap = None
        if lookup:
            if exact:
                # resume only where a miss computes the same: the windows kept, and the decoder either
                # not yet started there (its windows begin at `start` in both paths) or started at `start`
                # (a snapshot of the whole prompt serves when it kept the logits of its last position)
                snap = self.snapshots.find(
                    tokens, bs, hashes, len(matched), n, exact_blocks=False,
                    accept=lambda s: s.window_valid and (s.length <= start or s.decoder_start == start)
                    and (s.length < n or s.logits is not None))
                matched = matched[:snap.length // bs] if snap is not None else []
            else:
                snap = self.snapshots.find(tokens, bs, hashes, len(matched), n - 1)
        revived = sum(1 for b in matched if self.allocator.refcount[b] == 0)
        to_allocate = math.ceil(n / bs) - len(matched)
        if self.allocator.num_available() - revived < to_allocate + len(self.running):
            if self.running or self.allocator.num_available() - revived < to_allocate:
                return False
        if lookup:
            self.stats.queried_tokens += n
        for b in matched:
            self.allocator.acquire_cached(b)
        cache = SequenceCache(mcfg, self.pool, self.states, self.states.acquire())
        cache.set_blocks(list(matched))
        seq.cache = cache
        seq.block_hashes = hashes[:len(matched)]
        length = len(matched) * bs
        window_from = 0
        if snap is not None:
            length = snap.length
            if length % bs:
                cache.append_block(self.allocator.allocate())
                for layer, packed in snap.tail.items():
                    entries = torch.arange(len(matched) * bs // self.pool.sources[layer].ratio,
                                           length // self.pool.sources[layer].ratio)
                    self.pool.import_entries(layer, cache.table, entries, packed)
            if snap.window_valid:
                cache.import_state(snap.state)
                window_from = None
            else:
                for k, (a, b) in snap.state["group"].items():
                    cache.group[k][0].copy_(a)
                    cache.group[k][1].copy_(b)
            self.stats.snapshot_hits += 1
            if snap.length == n:  # nothing left to compute: the first token comes from the kept logits
                seq.restored_logits = snap.logits
        self.stats.hit_tokens += length
        seq.num_cached_tokens = length
        seq.num_computed = length
        seq.prefill_target = n
        seq.needs_rebuild = False
        seq.decoder_from = max(length, start) if bounded else 0
        decoder_needs_history = not bounded or start < length
        if window_from is not None:  # no ring state: rebuild it from the cached global KV if needed
            window_from = max(0, length - w)
            cache.first = [window_from] * mcfg.n_layers
            if length > 0:
                seq.needs_rebuild = True
                seq.rebuild_from = window_from
                seq.rebuild_decoder_from = window_from if decoder_needs_history else length
                self.stats.window_rebuilds += 1
        if not decoder_needs_history:
            for layer in range(self.boundary, mcfg.n_layers):
                cache.first[layer] = seq.decoder_from
        if seq.preemptions == 0:
            self.counters["prompt_tokens_total"] += n
        return True

    # ------------------------------------------------------------------ disaggregation (engine/handoff.py)
    def identity(self) -> dict:
        """The model's identity, which a hand-off must carry to be imported here (computed once)."""
        if self._identity is None:
            self._identity = model_identity(self.model)
        return self._identity

    def _start_from_handoff(self, seq: Sequence) -> bool:
        """Admit a request from its KV hand-off: blocks for the prompt, the state written, the first token
        sampled from the handed-off logits by the next step. False (nothing changed) when there is no room."""
        blocks = math.ceil(len(seq.prompt_ids) / self.config.block_size)
        if self.allocator.num_available() < blocks + len(self.running):
            if self.running or self.allocator.num_available() < blocks:
                return False
        cache = SequenceCache(self.model_config, self.pool, self.states, self.states.acquire())
        for _ in range(blocks):
            cache.append_block(self.allocator.allocate())
        import_sequence(self, seq, seq.handoff, cache)
        seq.handoff = None  # consumed: a recompute after preemption prefills here, from the same decoder start
        self._register_full_blocks(seq)
        self.counters["handoffs_imported_total"] += 1
        return True

    def _export_handoff(self, seq: Sequence, logits: torch.Tensor, chunk: Optional[Chunk]) -> RequestOutput:
        """A prefill-only request computed its prompt: keep its snapshot, write the drafter rings of the last
        chunk (what the draft after the first token would have written), export, finish and release."""
        try:
            self._save_snapshot(seq, logits)
            if self.speculative and chunk is not None and chunk.main_hidden is not None:
                first_pos = chunk.hidden_start
                start = max(first_pos, seq.rows_end if seq.rows_first is not None else first_pos)
                if start < seq.num_computed:
                    self.runner.draft_rows(chunk.main_hidden[start - first_pos:seq.num_computed - first_pos]
                                           .unsqueeze(0), start, seq.cache)
                    self._rows_written(seq, start, seq.num_computed)
            handoff = export_sequence(self, seq, logits)
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            return self._fail(seq, exc)
        seq.finish_reason = "handoff"
        seq.status = Status.FINISHED
        self.running.remove(seq)
        self._release(seq)
        self._finish(seq)
        out = self._output(seq)
        out.handoff = handoff
        self.counters["handoffs_exported_total"] += 1
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _register_full_blocks(self, seq: Sequence) -> None:
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed // self.config.block_size
        if full > len(seq.block_hashes):
            seq.block_hashes = chain_hashes(seq.key_ids[:full * self.config.block_size], self.config.block_size,
                                            seq.block_hashes)
            for i in range(full):
                self.allocator.register(seq.cache.blocks[i], seq.block_hashes[i])

    def _save_snapshot(self, seq: Sequence, logits: Optional[torch.Tensor] = None) -> None:
        """Keep the partial tail block, partial groups and window rings at a message boundary, and at the
        end of a prompt the logits of its last position (a repeat of the prompt then computes nothing)."""
        if not self.config.enable_prefix_caching or seq.cache is None:
            return
        bs, length = self.config.block_size, seq.num_computed
        if length == 0:
            return
        tokens = seq.key_ids[:length]
        hashes = chain_hashes(tokens, bs, seq.block_hashes[:length // bs])
        tail = {}
        for layer, lay in self.pool.sources.items():
            first = (length // bs) * bs // lay.ratio
            entries = torch.arange(first, length // lay.ratio)
            if entries.numel():
                tail[layer] = self.pool.export_entries(layer, seq.cache.table, entries)
        snap = Snapshot(length, tail, seq.cache.export_state(), time.monotonic(), decoder_start=seq.decoder_start,
                        logits=None if logits is None else logits.clone())
        self.snapshots.put(prefix_key(tokens, length, bs, hashes), snap)

    def _release(self, seq: Sequence) -> None:
        if seq.cache is not None:
            for block in seq.cache.blocks:
                self.allocator.release(block)
            self.states.release(seq.cache.slot)
            seq.cache = None
        seq.num_computed = 0
        seq.block_hashes = []

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
                seq.text = seq.text[:min(hits)]
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
        new_text = text[seq.emitted_text:visible]
        seq.emitted_text = visible
        new_ids = seq.output_ids[seq.emitted_tokens:]
        seq.emitted_tokens = len(seq.output_ids)
        logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        routed = spans = None
        if finished and self.config.record_routing and seq.routing:
            routed, spans = torch.cat(seq.routing), list(seq.spans)
        return RequestOutput(seq.request_id, new_ids, new_text, list(seq.output_ids), text[:visible], finished,
                             seq.finish_reason if finished else None, len(seq.prompt_ids), seq.num_cached_tokens,
                             logprobs, error=seq.error if finished else None,
                             queue_time_s=seq.queue_time_s if finished else None,
                             routed_experts=routed, spans=spans, preemptions=seq.preemptions,
                             prompt_logprobs=None if seq.needs_prompt_logprobs else seq.prompt_logprobs)

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
        return {"waiting": len(self.waiting), "running": len(self.running), "kv_blocks_used": used,
                "kv_blocks_total": total, "kv_resident_bytes_per_token": kv["global_kv_bytes_per_token"],
                "kv_fixed_state_bytes": kv["fixed_state_bytes"], "kv_usage": used / total,
                "prefix_cache_queried_tokens": q, "prefix_cache_hit_tokens": h, "prefix_cache_hit_rate": h / q if q else 0.0,
                "prefix_cache_snapshot_hits": self.stats.snapshot_hits, "window_rebuilds": self.stats.window_rebuilds,
                "generation_tokens_per_s": rate, **self.counters, **self._spec_metrics()}

    def _spec_metrics(self) -> dict:
        """DSpark acceptance: the fraction of drafted tokens kept, tokens emitted per verify step, and the
        acceptance rate at each draft position (verified there with every earlier draft kept)."""
        if not self.speculative:
            return {}
        c = self.counters
        out = {"spec_decode_acceptance_rate": c["spec_decode_accepted_tokens_total"] / max(c["spec_decode_draft_tokens_total"], 1),
               "spec_decode_mean_emitted_per_step": c["spec_decode_emitted_tokens_total"] / max(c["spec_decode_steps_total"], 1)}
        for i, (a, v) in enumerate(zip(self.accepted_at, self.verified_at)):
            out[f"spec_decode_acceptance_rate_position_{i}"] = a / max(v, 1)
        return out

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
        return {"tokens": tokens, "global_kv_bytes": entries_bytes, "allocated_block_bytes": block_bytes,
                "global_kv_bytes_per_token": entries_bytes / tokens if tokens else 0.0,
                "fixed_state_bytes": fixed, "sequences": len(self.running)}
