"""One request's state in the engine: tokens, sampling, and its view of the KV storage.

`SequenceCache` implements, for a batch of one, the storage protocol the attention layers call
(dsv41.model.cache.ModelCache is the plain implementation): the global caches live in the shared paged
pool (dsv41.engine.kv_pool), while the per-sequence fixed state (spec-v41.md §8) lives here:
- every layer's 128-slot window ring in FP8 E4M3 with a UE8M0 scale per 32 channels (528 B per slot at
  head_dim 512, not a bf16 container);
- the ratio-2 compressors' partial group (fp32 kv and gate scores, at most ratio-1 tokens);
- the first position each layer's window may hold (0, or the start of a bounded replay).
The Engram id history is not stored: the engine hashes from the sequence's own token list.
"""

from __future__ import annotations

import enum
import time

import torch

from dsv41.config import ModelConfig
from dsv41.engine.kv_pool import PagedKVPool
from dsv41.engine.types import SamplingParams
from dsv41.ops.quant import FP8_BLOCK, fp8_dequant, fp8_quant


class StatePool:
    """The fixed per-sequence state of every running sequence, one slot each, in shared tensors so a
    decode step can read and write all sequences' rings at once (dsv41.engine.batched)."""

    def __init__(self, cfg: ModelConfig, n_slots: int, device=None, drafter: bool = False):
        # with `drafter`, one more ring per DSpark stage (layer ids n_layers..), holding backbone rows
        n, w, d = cfg.n_layers + (cfg.drafter_stages if drafter else 0), cfg.window_size, cfg.head_dim
        self.window_codes = torch.zeros(n_slots, n, w, d, dtype=torch.float8_e4m3fn, device=device)
        # UE8M0 scales kept as their raw bytes (torch has no indexed writes for float8_e8m0fnu); 127 = 2^0
        self.window_scale = torch.full((n_slots, n, w, d // FP8_BLOCK), 127, dtype=torch.uint8, device=device)
        self.group_kv: dict[int, torch.Tensor] = {}
        self.group_score: dict[int, torch.Tensor] = {}
        for layer in cfg.kv_source_layers:
            ratio = cfg.compress_ratios[layer]
            if ratio > 1:
                self.group_kv[layer] = torch.zeros(n_slots, ratio, d, dtype=torch.float32, device=device)
                self.group_score[layer] = torch.full(
                    (n_slots, ratio, d), -torch.inf, dtype=torch.float32, device=device
                )
        self.free = list(range(n_slots - 1, -1, -1))

    def acquire(self) -> int:
        if not self.free:
            raise RuntimeError("no free sequence slot")
        slot = self.free.pop()
        for layer in self.group_kv:
            self.group_kv[layer][slot].zero_()
            self.group_score[layer][slot].fill_(-torch.inf)
        return slot

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def slot_bytes(self) -> int:
        tensors = [self.window_codes, self.window_scale, *self.group_kv.values(), *self.group_score.values()]
        return sum(t[0].numel() * t.element_size() for t in tensors)


class SequenceCache:
    def __init__(self, cfg: ModelConfig, pool: PagedKVPool, states: StatePool, slot: int):
        self.cfg, self.pool, self.states, self.slot = cfg, pool, states, slot
        self.blocks: list[int] = []
        self._table: torch.Tensor | None = None
        self.window_codes = states.window_codes[slot]  # [layers, W, D] views into the shared state
        self.window_scale = states.window_scale[slot]
        self.first = [0] * cfg.n_layers
        self.group = {
            layer: (states.group_kv[layer][slot : slot + 1], states.group_score[layer][slot : slot + 1])
            for layer in states.group_kv
        }  # [1, ratio, D] views
        self.global_writes = True  # False while replaying positions whose global entries are cached
        self.keep_group_rows = None  # set during a DSpark verify (save_positions .. keep_positions)
        self._group_rows: dict = {}

    # ------------------------------------------------------------------ blocks
    def set_blocks(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self._table = None

    def append_block(self, block: int) -> None:
        self.blocks.append(block)
        self._table = None

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            self._table = torch.tensor(self.blocks, dtype=torch.int64, device=self.window_codes.device)
        return self._table

    def fixed_state_bytes(self) -> int:
        return self.states.slot_bytes()

    # ------------------------------------------------------------------ snapshot of the fixed state
    def export_state(self) -> dict:
        return {
            "window_codes": self.window_codes.clone(),
            "window_scale": self.window_scale.clone(),
            "first": list(self.first),
            "group": {k: (a.clone(), b.clone()) for k, (a, b) in self.group.items()},
        }

    def import_state(self, state: dict) -> None:
        self.window_codes.copy_(state["window_codes"])
        self.window_scale.copy_(state["window_scale"])
        self.first = list(state["first"])
        for k, (a, b) in state["group"].items():
            self.group[k][0].copy_(a)
            self.group[k][1].copy_(b)

    # ------------------------------------------------------------------ DSpark verify rollback
    def save_positions(self, start: int, end: int) -> dict:
        """Before a forward over positions start..end-1 whose tail may be rejected: a copy of what it
        overwrites in place, the backbone ring slots of those positions (they still hold positions
        start - W ..), and from now on the compressors' per-position rows (`keep_group_rows`), from which
        the partial groups of any accepted prefix are rebuilt. Global entries (compressed KV, index keys)
        need no copy: those past the accepted point are rewritten before anything reads them."""
        n, w = self.cfg.n_layers, self.cfg.window_size
        slots = torch.arange(start, min(end, start + w), device=self.window_codes.device) % w
        self._group_rows = {}
        self.keep_group_rows = self._keep_group_rows
        return {
            "start": start,
            "end": end,
            "codes": self.window_codes[:n, slots].clone(),
            "scale": self.window_scale[:n, slots].clone(),
        }

    def _keep_group_rows(self, layer: int, first: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        """Called by a compressor (dsv41.model.attention) with its fp32 rows [1, n, D] of positions first..
        (the pending rows of the group, then the new ones)."""
        self._group_rows[layer] = (first, kv, score)

    def keep_positions(self, saved: dict, end: int) -> None:
        """After the forward: keep positions < end, undo the rest. The state is then bit for bit what
        computing positions < end alone leaves (the readable part of it: ring slots of the last W
        positions, the pending part of each partial group)."""
        self.keep_group_rows = None
        rows, self._group_rows = self._group_rows, {}
        n, w, start = self.cfg.n_layers, self.cfg.window_size, saved["start"]
        if end >= saved["end"]:
            return
        rejected = torch.arange(end, min(saved["end"], end + w), device=self.window_codes.device)
        at = (rejected - start) % w  # where each rejected position's slot sits in the copy
        self.window_codes[:n, rejected % w] = saved["codes"][:, at]
        self.window_scale[:n, rejected % w] = saved["scale"][:, at]
        for layer, (kv, score) in self.group.items():
            ratio = kv.size(1)
            pending = end % ratio  # positions end - pending .. end - 1 form the partial group
            if pending:
                first, all_kv, all_score = rows[layer]
                a = end - pending - first
                kv[:, :pending] = all_kv[:, a : a + pending]
                score[:, :pending] = all_score[:, a : a + pending]

    # ------------------------------------------------------------------ the model's cache protocol (b = 1)
    def window_first(self, layer: int) -> int:
        return self.first[layer]

    def window_read(self, layer: int, b: int) -> torch.Tensor:
        return fp8_dequant(self.window_codes[layer], _ue8m0(self.window_scale[layer])).bfloat16().unsqueeze(0)

    def window_write(self, layer: int, b: int, slots: torch.Tensor, values: torch.Tensor) -> None:
        codes, scale = fp8_quant(values[0])
        self.window_codes[layer, slots] = codes
        self.window_scale[layer, slots] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)

    def group_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv, score = self.group[layer]
        if not self.global_writes:
            return kv.clone(), score.clone()  # replay: the cached partial group must not move
        return kv, score

    def write_compressed(self, layer: int, b: int, first: int, kv: torch.Tensor, keys: torch.Tensor | None) -> None:
        if self.global_writes:
            self.pool.write(layer, self.table, first, kv[0], None if keys is None else keys[0])

    def read_compressed(self, layer: int, b: int, n: int) -> torch.Tensor:
        return self.pool.read_kv(layer, self.table, torch.arange(n, device=self.table.device)).unsqueeze(0)

    def read_index_keys(self, layer: int, b: int, n: int, start: int = 0) -> torch.Tensor:
        """Entries start..n-1, dequantised (only those: prefill scores the pool a block at a time)."""
        return self.pool.read_key_range(layer, self.table, start, n).unsqueeze(0)

    def read_index_keys_at(self, layer: int, b: int, entries: torch.Tensor) -> torch.Tensor:
        """entries [1, ...] int64 -> dequantised keys [1, ..., index_dim]."""
        return self.pool.keys_at(layer, self.pool.rows(layer, self.table, entries))

    def read_selected(
        self, layer: int, b: int, n: int, ids: torch.Tensor, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantise only the entries the queries picked (decode reads <= index_topk rows, not all n).
        The ids keep their order, so attention sums the same values in the same order."""
        valid = ids >= offset
        picked = ids[valid].long() - offset
        if picked.numel() >= n:
            return self.read_compressed(layer, b, n), ids
        unique, inverse = torch.unique(picked, sorted=True, return_inverse=True)
        rows = self.pool.read_kv(layer, self.table, unique).unsqueeze(0)
        remapped = ids.clone()
        remapped[valid] = (inverse + offset).to(ids.dtype)
        return rows, remapped


class DraftRings:
    """The DSpark stages' rings of several sequences, for one batched draft (dsv41.model.dspark.draft with
    per-row positions): reads dequantise each sequence's ring, writes store one row per sequence."""

    def __init__(self, states: StatePool, slots: list[int], rows_first: list[int] | None = None):
        device = states.window_codes.device
        self.states = states
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)  # [B]
        # [B]: each ring's first readable position, for a draft's reads (None: the rings are only written)
        self.first = None if rows_first is None else torch.tensor(rows_first, dtype=torch.int64)

    def draft_first(self) -> torch.Tensor:
        return self.first

    def window_read(self, layer: int, b: int) -> torch.Tensor:
        s = self.states
        return fp8_dequant(s.window_codes[self.slots, layer], _ue8m0(s.window_scale[self.slots, layer])).bfloat16()

    def window_write_rows(self, layer: int, ring_slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [B, 1, D] into slot ring_slots[b] of sequence b's ring."""
        codes, scale = fp8_quant(rows[:, 0])
        self.states.window_codes[self.slots, layer, ring_slots] = codes
        self.states.window_scale[self.slots, layer, ring_slots] = scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def _ue8m0(raw: torch.Tensor) -> torch.Tensor:
    """Raw UE8M0 bytes -> fp32 powers of two."""
    return raw.view(torch.float8_e8m0fnu).float()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival: int,
        images: list | None = None,
    ):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        # images in the prompt: (start, dsv41.vision.ImagePatches), spans in position order; their span
        # embeddings [span_length, dim] are computed once, on first use (image_rows)
        self.images: list = sorted(images or [], key=lambda item: item[0])
        self.image_embeds: dict[int, torch.Tensor] = {}
        self._key_ids: list | None = None
        self.output_ids: list[int] = []
        self.params = params
        self.arrival = arrival
        self.status = Status.WAITING
        self.cache: SequenceCache | None = None
        self.num_computed = 0  # positions whose state is in the cache
        self.prefill_target = 0  # tokens to prefill before sampling (prompt + any output, after preemption)
        self.decoder_from = 0  # bounded replay: positions below skip the decoder layers (this admission)
        # where the decoder layers' windows start for this request (bounded: the prompt's last window),
        # fixed at first admission so that a recompute after preemption computes what the first run did
        self.decoder_start: int | None = None
        self.restored_logits: torch.Tensor | None = None  # a whole-prompt snapshot hit: sample from these
        self.num_cached_tokens = 0
        self.needs_rebuild = False  # window rings must be rebuilt by replay before the next chunk
        self.rebuild_from = 0
        self.rebuild_decoder_from = 0
        self.block_hashes: list[int] = []  # chain hash of each full block, in order
        self.generator: torch.Generator | None = None
        self.prompt_mask_cache: dict | None = None  # repetition_penalty: the prompt's ids as a vocab mask
        self.grammar = None  # params.structured: its dsv41.engine.grammar.RequestGrammar, fed every kept token
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self.text = ""
        self.emitted_text = 0  # chars of `text` already sent
        self.emitted_tokens = 0
        self.pending_logprobs: list = []
        # SamplingParams.prompt_logprobs: entry i for prompt token i, filled as the prefill computes them
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None]
        self.finish_reason: str | None = None
        self.preemptions = 0
        # in a batch whose forward failed: runs alone until it has computed past this position
        self.suspect_until: int | None = None
        self.failed_steps = 0
        self.error: str | None = None  # why it failed (finish_reason "error")
        self.arrival_time = time.monotonic()
        self.queue_time_s: float | None = None  # arrival to first admission
        self.capture_logits = False  # keep each sampled position's logits (checks and benchmarks)
        self.prompt_logits: list[torch.Tensor] = []  # with capture_logits and prompt_logprobs: the prompt's rows
        # EngineConfig.record_routing: the (start, end) spans computed and each span's expert ids
        self.spans: list[tuple[int, int]] = []
        self.routing: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        # DSpark speculation (EngineConfig.speculative): the draft to verify with the next step, the
        # drafter rings' readable positions [rows_first, rows_end), the state saved before a verify
        self.draft_tokens: list[int] = []
        self.draft_logits: torch.Tensor | None = None  # [n, vocab] fp32: what each draft was drawn from
        self.rows_first: int | None = None
        self.rows_end = 0
        self.saved_state: dict | None = None
        # disaggregation (dsv41.engine.handoff): start from this KV hand-off instead of prefilling; or,
        # on a prefill worker, finish with a hand-off once the prompt is computed instead of sampling
        self.handoff = None
        self.export_handoff = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def key_ids(self) -> list:
        """The ids the prefix cache hashes: all_ids, except that a position inside an image span is keyed
        by (pixel digest, offset in the span), so two prompts hit each other's cache only when their images
        are the same pixels (every span position carries the same image_token_id)."""
        if not self.images:
            return self.all_ids
        if self._key_ids is None:
            keys: list = list(self.prompt_ids)
            for start, image in self.images:
                for k in range(image.span_length):
                    keys[start + k] = (image.digest, k)
            self._key_ids = keys
        return self._key_ids + self.output_ids

    def image_spans(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(image index, first, end) of the image positions inside [start, end), in order."""
        out = []
        for k, (first, image) in enumerate(self.images):
            a, b = max(first, start), min(first + image.span_length, end)
            if a < b:
                out.append((k, a, b))
        return out

    def image_positions(self, start: int, end: int) -> list[bool] | None:
        """For positions start..end-1: True inside an image span; None when there is none."""
        spans = self.image_spans(start, end)
        if not spans:
            return None
        flags = [False] * (end - start)
        for _, a, b in spans:
            flags[a - start : b - start] = [True] * (b - a)
        return flags

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def needs_prompt_logprobs(self) -> bool:
        """The request asked for prompt logprobs and some are not computed yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)
