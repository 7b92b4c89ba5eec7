"""DSpark speculative decoding inside the engine's step (spec-v41.md §12b; the drafter is model/dspark.py).

`Speculation` is the part of `LLMEngine` (engine/llm_engine.py) that drafts tokens with the DSpark drafter
after a step's target pass, verifies a sequence's drafts against the target's logits (greedy or by
rejection sampling, losslessly), rolls the caches back past a rejected draft, and reports acceptance per
draft position. It is a mixin: the drafter, counters and rings are created by `LLMEngine.__init__`.
"""

from __future__ import annotations

import logging

import torch

from dsv41.engine.runner import Chunk
from dsv41.engine.sampling import GREEDY_TEMPERATURE, sample, verify_draft
from dsv41.engine.sequence import DraftRings, Sequence, Status
from dsv41.engine.types import RequestOutput

log = logging.getLogger("dsv41.engine")


class Speculation:
    """DSpark drafting, verification and acceptance metrics for `LLMEngine`."""

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
            accepted, nxt = verify_draft(
                rows, draft, draft_logits, seq.params, seq.generator or self.generator, self._history(seq)
            )
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
        # fast numerics: the rows of every sequence in one drafter call (they are token-wise, and nothing there asks
        # a row for the bits of its sequence's own call); the other modes write each sequence's rows by itself
        together = self.runner.mode == "fast"
        rows: list[tuple[Sequence, torch.Tensor, int]] = []  # (sequence, main hidden [n, F], first position)
        for seq, chunk in work:
            if seq.status != Status.RUNNING or seq.cache is None or chunk.main_hidden is None:
                continue
            first_pos, m = chunk.hidden_start, chunk.main_hidden.size(0)
            last = min(first_pos + m, len(seq) - 1) - 1  # the last position both computed and kept
            if last < first_pos:
                continue
            can_draft = not seq.in_prefill and not seq.needs_rebuild and last == len(seq) - 2
            budget = min(
                self.num_draft, seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - len(seq) - 1
            )
            can_draft = can_draft and budget > 0
            write_from = max(first_pos, seq.rows_end if seq.rows_first is not None else first_pos)
            write_to = last if can_draft else last + 1  # a draft writes the row at `last` itself
            if write_from < write_to:
                hidden = chunk.main_hidden[write_from - first_pos : write_to - first_pos]
                if together and write_to - write_from <= self.draft_window:
                    rows.append((seq, hidden, write_from))
                else:  # a prompt's rows (a whole chunk: only its last window is kept), or one sequence at a time
                    self.runner.draft_rows(hidden.unsqueeze(0), write_from, seq.cache)
                self._rows_written(seq, write_from, write_to)
            if can_draft:
                todo.append((seq, chunk.main_hidden[last - first_pos], last, budget))
        if rows:
            slots = [seq.cache.slot for seq, hidden, _ in rows for _ in range(hidden.size(0))]
            positions = torch.cat([torch.arange(p, p + h.size(0)) for _, h, p in rows])
            self.runner.draft_rows_at(torch.cat([h for _, h, _ in rows]), positions, DraftRings(self.states, slots))
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
        # every request greedy with no logit processing: one argmax over the batch (ties to the lowest id, as
        # `sample` breaks them), not a `sample` call per request and position
        greedy = all(s.params.temperature < GREEDY_TEMPERATURE and not s.params.processes_logits for s in seqs)

        def choose(logits: torch.Tensor) -> torch.Tensor:
            if greedy:
                return logits.float().argmax(-1)
            # each request draws with its own params, its logit processing seeing the drafts before this
            # one (what plain decoding would have generated there), as verify_draft assumes
            picks = []
            for i, s in enumerate(seqs):
                picks.append(
                    sample(logits[i], s.params, s.generator or self.generator, self._history(s, tuple(drafted[i])))
                )
                drafted[i].append(picks[-1])
            return torch.tensor(picks, dtype=torch.int64, device=logits.device)

        result = self.runner.draft(first, hidden, pos, rings, choose)
        likely = None
        if self.config.speculative_min_confidence > 0:
            likely = torch.sigmoid(result.confidence.float()).cumprod(-1) >= self.config.speculative_min_confidence
        for i, (seq, _, _, budget) in enumerate(todo):
            n = budget if likely is None else int(likely[i, :budget].sum())  # a running product: a prefix
            seq.draft_tokens = result.tokens[i, 1 : n + 1].tolist()
            seq.draft_logits = result.logits[i, :n].float().cpu()

    @staticmethod
    def _rows_written(seq: Sequence, start: int, end: int) -> None:
        if seq.rows_first is None or start > seq.rows_end:  # a gap: the readable rows start again here
            seq.rows_first = start
        seq.rows_end = max(seq.rows_end, end)

    def _spec_metrics(self) -> dict:
        """DSpark acceptance: the fraction of drafted tokens kept, tokens emitted per verify step, and the
        acceptance rate at each draft position (verified there with every earlier draft kept)."""
        if not self.speculative:
            return {}
        c = self.counters
        out = {
            "spec_decode_acceptance_rate": c["spec_decode_accepted_tokens_total"]
            / max(c["spec_decode_draft_tokens_total"], 1),
            "spec_decode_mean_emitted_per_step": c["spec_decode_emitted_tokens_total"]
            / max(c["spec_decode_steps_total"], 1),
        }
        for i, (a, v) in enumerate(zip(self.accepted_at, self.verified_at)):
            out[f"spec_decode_acceptance_rate_position_{i}"] = a / max(v, 1)
        return out
