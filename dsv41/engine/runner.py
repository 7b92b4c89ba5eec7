"""One forward step over a ragged batch of sequence chunks, with the V4.1 prefill (spec-v41.md §2.1, §9).

All tokens of all scheduled chunks are laid out as one row [1, T]: the token-wise work (embedding, Engram,
hyper-connection mixes, projections, MoE, head) runs once over all T tokens, and only the sequence-mixing
part of attention (window ring, compressor, indexer, sparse attention) runs per chunk against that
sequence's own cache. No padding exists, so nothing is ever pooled into a compressed entry by accident.

The runner owns no layers: it prepares the step's metadata (token ids, positions, Engram hashes, image rows,
decode-step batches) and runs the model's one layer loop (dsv41.model.forward.run_layers) with the paged
attention backend (dsv41.engine.paged_attention), which also carries out the CED bounded replay: every
layer below the decoder boundary runs over every prompt token; for positions below a chunk's
`decoder_from` the boundary layer's compressed entries and index keys are written from the encoder output
and the token leaves the batch, so the decoder layers run over the last `window_size` prompt tokens only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from dsv41 import ops
from dsv41.engine.batched import DecodeBatch
from dsv41.engine.paged_attention import PagedAttention
from dsv41.engine.sequence import SequenceCache
from dsv41.model import dspark
from dsv41.model.block import Block
from dsv41.model.forward import run_layers
from dsv41.model.moe import RoutingRecord
from dsv41.model.transformer import Transformer
from dsv41.ops import linear_cpu


@dataclass
class Chunk:
    """Positions start..start+len(tokens)-1 of one sequence, to run in this step."""

    cache: SequenceCache
    tokens: list[int]
    start: int
    context: list[int]  # up to max_ngram_size-1 tokens before `start` (the Engram hash looks back)
    decoder_from: int = 0  # positions below this skip the decoder layers
    want_logits: bool = True  # logits of the last position
    end: int = 0  # the scheduler's end position (tokens/start change when the decoder part is trimmed)
    decode: bool = False  # one token of a running sequence: batched with the other decode tokens
    n_logits: int = 1  # with want_logits: logits of this many trailing positions (a DSpark verify: n + 1;
    # every position of a prefill chunk whose request wants prompt logprobs)
    verify: bool = False  # a speculative verify: each token computed with a decode step's numerics
    stepped: bool = False  # set by the runner: this verify chunk runs as batched decode steps this forward
    shared: dict = field(default_factory=dict)
    # images: (offset in tokens, rows [n, dim] bf16) replacing those positions' token embeddings, and for
    # context + tokens, True at image-span positions (routed with bias_vl, dead to Engram); None: all text
    image_rows: list = field(default_factory=list)
    image_mask: list[bool] | None = None
    # filled by a forward with capture_hidden: the drafter's main_hidden [n, F] of the positions that
    # reached the target layers, hidden_start.. (the chunk's positions after any bounded-replay trim)
    main_hidden: torch.Tensor | None = None
    hidden_start: int = 0
    # filled by a forward with record_routing: each position's expert ids [n, n_layers, k] (uint8 or int16)
    routing: torch.Tensor | None = None

    def logit_rows(self) -> int:
        """How many logits rows a forward returns for this chunk: its last positions, after any
        bounded-replay trim (call it after the forward)."""
        return min(self.n_logits, len(self.tokens)) if self.want_logits else 0


class ModelRunner:
    """Runs ragged batches of chunks through a model it borrows, under one of the engine's numerics modes
    (EngineConfig.numerics, docs/numerics.md), entered around every forward with `model.numerics` and the
    model's own settings restored afterwards:

    - "fast": plain GEMMs and elementwise calls over the whole batch, whatever rounds fastest;
    - "deterministic": batch-invariant GEMMs in `row_chunk`-row chunks, elementwise functions as if each
      chunk ran alone (dsv41.ops.lanes), a verify chunk's tokens at a lone decode's widths: a request's
      bits do not depend on its batch, its chunking, its cache hits or speculation;
    - "reference": the golden sets' canonical float64 numerics (dsv41.ops.canonical);
    - None: the model's settings as they are (a caller that set them itself)."""

    def __init__(
        self,
        model: Transformer,
        numerics: str | None = None,
        capture_hidden: bool = False,
        record_routing: bool = False,
        batched_verify: str = "auto",
        row_chunk: int = 16,
    ):
        if numerics not in (None, "fast", "deterministic", "reference"):
            raise ValueError(f"ModelRunner: numerics must be 'fast', 'deterministic' or 'reference', got {numerics!r}")
        self.model = model
        # speculative verify chunks as batched decode steps (`_decode_steps`): "on", "off" (each on its own
        # path), "auto" (when a step has more verify chunks than its longest chunk has tokens)
        self.batched_verify = batched_verify
        self.record_routing = record_routing  # keep every MoE layer's picks per chunk (Chunk.routing)
        self.cfg = model.cfg
        self.boundary = model.cfg.decoder_boundary
        self.mode = numerics
        self.row_chunk = row_chunk if numerics == "deterministic" else 0
        # the per-chunk emulations that buy batch invariance; the other modes compute the batch as one call
        self.per_chunk = numerics in (None, "deterministic")
        # DSpark: keep the target layers' mean-over-copies inputs (dsv41.model.dspark.main_hidden)
        self.targets = tuple(model.cfg.dspark_target_layer_ids) if capture_hidden and len(model.mtp) else ()
        # fast mode: compiled token-wise regions for decode batches (dsv41.engine.compiled), set by the engine
        self.compiled = None
        # deterministic mode: the token-wise regions compiled at one tile shape for every forward
        # (dsv41.engine.tiles.CompiledTiles), set by the engine before its first request
        self.tiles = None
        # fast mode: calls of at most this many rows run bf16 layers as fp32 GEMMs (dsv41.ops.gemm_choice),
        # set by the engine from its probe; 0: never
        self.fp32_rows = 0
        # the bf16 layers' GEMMs and the logits by the few-row C++ kernel (dsv41.ops.linear_cpu): set by the
        # engine when its forwards run compiled (fast regions, deterministic tiles) and the kernel is built
        self.rows_kernel = False

    def numerics(self):
        """The context every forward of this runner runs in (also what a rank computing another rank's rows
        enters, so they get the bits their own forward would)."""
        if self.mode is None:
            return contextlib.nullcontext()
        fp32_rows = self.fp32_rows if self.mode == "fast" else 0
        return self.model.numerics(
            self.row_chunk,
            reference=self.mode == "reference",
            fp32_rows=fp32_rows,
            fast=self.mode == "fast",
            rows_kernel=self.rows_kernel,
        )

    def forward(self, chunks: list[Chunk]) -> torch.Tensor:
        """Run the chunks; returns fp32 logits [n, vocab] for the chunks with want_logits, in order."""
        with self.numerics():
            return self._forward(chunks)

    def draft(self, first: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor, rings, choose) -> dspark.Draft:
        """One batched DSpark draft (dsv41.model.dspark.draft, per-row positions) under the runner's numerics."""
        with self.numerics():
            return self._draft(first, hidden, pos, rings, choose)

    @torch.inference_mode()
    def _draft(self, first, hidden, pos, rings, choose):
        return dspark.draft(self.model, first, hidden, pos, rings, choose=choose, head_logits=self._fast_logits())

    def _fast_logits(self):
        """The shared head as `fast` compiled forwards compute it (the bf16 copy by the few-row kernel, fp32 sums,
        where it is built: half the bytes of the fp32 head; 1.0 against 2.4 ms hot for 8 drafts of 5 on `small`,
        2 threads), else None (`Transformer.logits`)."""
        head = self.model.head_bf16()
        if self.mode != "fast" or not self.rows_kernel or head is None:
            return None

        def logits(x: torch.Tensor) -> torch.Tensor:
            if not linear_cpu.fits(x, head, max_rows=linear_cpu.MAX_ROWS):
                return self.model.logits(x)
            return linear_cpu.rows_linear(x, head)

        return logits

    def draft_rows(self, hidden: torch.Tensor, start: int, cache: SequenceCache) -> None:
        """Write one sequence's drafter-ring rows for positions start.. (hidden [1, S, F])."""
        with self.numerics():
            return self._draft_rows(hidden, start, cache)

    @torch.inference_mode()
    def _draft_rows(self, hidden, start, cache):
        dspark.prefill(self.model.mtp, hidden, start, cache)

    def draft_rows_at(self, hidden: torch.Tensor, positions: torch.Tensor, rings) -> None:
        """Drafter-ring rows of several sequences at once (hidden [N, F], positions [N], rings: `DraftRings` with
        each row's sequence slot; at most one row per ring slot of a sequence)."""
        with self.numerics(), torch.inference_mode():
            dspark.write_rows(self.model.mtp, hidden, positions, rings)

    @torch.inference_mode()
    def _forward(self, chunks: list[Chunk]) -> torch.Tensor:
        model, cfg = self.model, self.cfg
        device = model.device
        ids = torch.tensor([t for c in chunks for t in c.tokens], dtype=torch.int64, device=device).unsqueeze(0)
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks])
        for c in chunks:
            # an unbatched verify chunk attends each query at a lone decode's width (Attention._attend_at_lone_widths)
            lone = c.verify and self.per_chunk
            c.shared, c.main_hidden, c.routing = {"lone_widths": True} if lone else {}, None, None
        record = RoutingRecord(ids_only=True) if self.record_routing else None
        steps = self._decode_steps(chunks, device)
        hash_ids = self._engram_hashes(chunks) if model.engram_hash is not None else None
        # fast numerics: the compiled regions serve forwards of decode and verify tokens only (a prefill chunk's
        # long GEMMs gain little from them, and its bounded replay changes the token count mid-forward)
        stepwise = record is None and all(c.decode or c.verify for c in chunks)
        if self.tiles is not None:
            regions = self.tiles.regions()
            for batch, _ in steps:  # the decode attention at the tile shape too, dense (DecodeBatch.dense)
                batch.regions = self.tiles.attention()
        elif self.compiled is not None and stepwise:
            regions = self.compiled.regions(ids.size(1))
            for batch, members in steps:  # each decode step's attention at its own bucket
                batch.regions = self.compiled.attention_regions(len(members))
        else:
            regions = None

        x, image_mask = self._embed(ids, chunks)
        h = x.unsqueeze(2).repeat(1, 1, cfg.hc_mult, 1)  # [1, T, hc, dim]
        pre_mix = torch.zeros(1, ids.size(1), cfg.hc_mult, dtype=torch.float32, device=device)
        pre_mix[..., 0] = 1.0
        shared: dict = {}
        if record is not None:
            shared["moe_aux"] = record
        if regions is not None:
            shared["regions"] = regions
        backend = PagedAttention(chunks, positions, steps, regions, self.per_chunk, self.boundary)
        if regions is not None and backend.decode_only:
            # each block as two graphs around its mixing (compiled._Regions.run_block, tiles._TiledRegions.run_block)
            regions.backend = backend
        if self.compiled is not None and len(steps) > 1:
            backend.flat_regions = self.compiled.attention_regions(sum(len(m) for _, m in steps))
        capture = bool(self.targets)
        h, pre_mix, hidden = run_layers(model, h, pre_mix, backend, shared, image_mask, hash_ids, capture)
        chunks = backend.chunks

        if record is not None:
            self._split_routing(record, chunks)
        if self.targets and len(hidden) == len(self.targets):
            main = torch.cat(hidden, dim=-1)[0]  # [T, n_targets * dim]
            offset = 0
            for c in chunks:
                c.main_hidden, c.hidden_start = main[offset : offset + len(c.tokens)], c.start
                offset += len(c.tokens)
        last, offset = [], 0
        for c in chunks:
            offset += len(c.tokens)
            last.extend(range(offset - c.logit_rows(), offset))
        if not last:
            return torch.empty(0, cfg.vocab_size)
        # compiled forwards read the bf16 copy of the head: a `fast` one-token step in its compiled `final_logits`;
        # with the few-row C++ kernel (dsv41.ops.linear_cpu: ~0.2 against ~1 ms for the fp32 head at 8 rows on
        # `small`), `fast` decode and verify forwards of up to MAX_ROWS rows and every forward of `deterministic`
        # tiles (any rows: each row's logits are its own dot products, batch-invariant by construction)
        if regions is not None and not regions.tiled and regions.rows == 1 and (head := model.head_bf16()) is not None:
            return regions.final_logits(model.norm, h, pre_mix, head, self.rows_kernel)
        index = torch.tensor(last, device=device)
        x = model.norm(Block.hc_pre(h[:, index], pre_mix[:, index]))[0]  # [n, dim]
        if regions is not None and self.rows_kernel and (head := model.head_bf16()) is not None:
            if linear_cpu.fits(x, head, max_rows=None if regions.tiled else linear_cpu.MAX_ROWS):
                return linear_cpu.rows_linear(x, head)
        return model.logits(x)

    def _split_routing(self, record: RoutingRecord, chunks: list[Chunk]) -> None:
        """Each chunk's rows of every layer's picks -> Chunk.routing [n, n_layers, k]. Only a forward in
        which every layer saw every token (no bounded-replay trim) records: EngineConfig checks that."""
        if len(record) != self.cfg.n_layers:
            raise RuntimeError(f"{len(record)} of {self.cfg.n_layers} MoE layers reported their routing")
        dtype = torch.uint8 if self.cfg.n_routed_experts <= 256 else torch.int16
        ids = torch.stack([call[1] for call in record.calls], dim=1).to(dtype).cpu()  # [T, n_layers, k]
        offset = 0
        for c in chunks:
            c.routing = ids[offset : offset + len(c.tokens)]
            offset += len(c.tokens)

    def _embed(self, ids: torch.Tensor, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings [1, T, dim] with the chunks' image rows written in, and the [1, T] image-span
        mask (None when no chunk has an image position)."""
        x = self.model.embed(ids)
        if not any(c.image_mask for c in chunks):
            return x, None
        mask = torch.zeros(ids.shape, dtype=torch.bool, device=ids.device)
        offset = 0
        for c in chunks:
            for at, rows in c.image_rows:
                x[0, offset + at : offset + at + rows.size(0)] = rows
            if c.image_mask:
                flags = c.image_mask[len(c.context) :]
                mask[0, offset : offset + len(flags)] = torch.tensor(flags, device=ids.device)
            offset += len(c.tokens)
        return x, mask

    def embed_image(self, image) -> torch.Tensor:
        """One image's span embeddings [span_length, dim] bf16 (Transformer.embed_image)."""
        with torch.inference_mode():
            return self.model.embed_image(image)

    def _decode_steps(self, chunks: list[Chunk], device) -> list[tuple[DecodeBatch, list[Chunk]]]:
        """The decode-step batches of this forward's attention. Decode tokens run as one batched decode
        step; a speculative verify chunk of n tokens runs as n consecutive decode steps (its i-th token in
        step i, batched with every other chunk's i-th token), so each verified token is computed exactly
        as the decode step it replaces would compute it, and all verify chunks share each step's ops."""
        if self.mode == "reference":  # every token through the model's own per-chunk attention, whose every op
            return []  # follows the canonical rule (the batched paged path keeps the fast kernels)
        verify = [c for c in chunks if c.verify]
        mode = self.batched_verify
        # `fast` numerics attend all stepped tokens in one set of ops (dsv41.engine.batched.chunk_decode_attend)
        longest = max((len(c.tokens) for c in verify), default=0)
        batch_them = mode == "on" or (mode == "auto" and (self.mode == "fast" or len(verify) > longest))
        # with compiled tiles a decode step's attention is the tiles' dense one: a verified token gets a decode
        # step's bits only as a row of a decode step (the per-chunk path attends another way); "off" then runs
        # each verify chunk in decode steps of its own
        batch_them = batch_them or self.tiles is not None
        for c in verify:
            c.stepped = batch_them
        stepped = [c for c in chunks if c.decode or (c.verify and batch_them)]
        groups = [stepped]  # chunks whose i-th tokens share decode step i
        if self.tiles is not None and mode == "off":  # each verify chunk in decode steps of its own
            groups = [[c for c in chunks if c.decode]] + [[c] for c in verify]
        steps = []
        for group in groups:
            for i in range(max((len(c.tokens) for c in group), default=0)):
                members = [c for c in group if len(c.tokens) > i]
                batch = DecodeBatch.build([c.cache for c in members], [c.start + i for c in members], device)
                batch.token_index = i
                batch.fast = self.mode == "fast"
                batch.dense = batch.fast or self.tiles is not None
                steps.append((batch, members))
        return steps

    def _engram_hashes(self, chunks: list[Chunk]) -> torch.Tensor:
        """[1, T, n_engram_layers, columns] row ids, hashing from each chunk's own context tokens.
        Chunks with the same context and token counts (all decode tokens, typically) hash together."""
        hasher = self.model.engram_hash
        pad_id = int(hasher.token_map[hasher.pad_token])
        groups: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(chunks):
            groups.setdefault((len(c.context), len(c.tokens)), []).append(i)
        parts: list = [None] * len(chunks)
        for (n_context, n_tokens), members in groups.items():
            ids = torch.tensor(
                [chunks[i].context + chunks[i].tokens for i in members], dtype=torch.int64, device=self.model.device
            )
            compressed = hasher.token_map[ids]
            if any(chunks[i].image_mask for i in members):  # image-span positions are dead: look-back stops
                dead = torch.tensor(
                    [chunks[i].image_mask or [False] * ids.size(1) for i in members],
                    dtype=torch.bool,
                    device=ids.device,
                )
                compressed = torch.where(dead, ops.engram_hash.DEAD, compressed)
            # the context reaches back to position 0 only when it is shorter than the look-back
            hashed = ops.ngram_hash(
                compressed, n_context, n_tokens, hasher.multipliers, hasher.primes, hasher.offsets, pad_id
            )  # [members, n_tokens, L, cols]
            for row, i in enumerate(members):
                parts[i] = hashed[row : row + 1]
        return torch.cat(parts, dim=1)
