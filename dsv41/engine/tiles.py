"""The `deterministic` mode's compiled tiles (docs/numerics.md): the token-wise regions of dsv41.engine.compiled,
compiled at one tile of `row_chunk` rows and called tile after tile by every forward, so that a token's bits never
depend on what shares its forward (batch invariance by construction, checked on every layer when the graphs are
built); a decode step's attention regions at the same tile shape along the batch; one-token calls by graphs
compiled at one row where each row alone gives its tile's bits; a decode step's blocks as two graphs each
(`compiled.entry`, `compiled.leave`) around the sequence mixing, where they give every row the regions' bits.
"""

from __future__ import annotations

import functools
import logging

import torch

from dsv41.engine.compiled import (
    CompiledDecode,
    _cat,
    _cut,
    _dense,
    _direct,
    _flat,
    _join0,
    _nested,
    _options,
    _own_code,
    _RunByTokens,
    choose_expert_kernel,
    enter_kind,
    entry,
    leave,
)
from dsv41.ops import attn_cpu
from dsv41.ops.quant import fp8_quant

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ deterministic numerics: one tile shape
TILE_REGIONS = (
    "pre_attention",
    "project",
    "output",
    "post_attention",
    "post_attention_ffn",
    "window_attention",
    "index_query",
    "compress_latent",
    "compress_group",
)


# the regions a one-token call runs at one row where the build's check allows (`CompiledTiles`): every tile region
# but the window attention (the C++ decode kernel needs no tile; its compiled form keeps the tile shape).
# Inside a batch-1 step: `project` 114-131 against 154 us, `output` 119-133 against 163, `index_query` 93-107 against
# 143; the mixes (`pre_attention`) and a ratio-2 compressor's step (`compress_group`) gain once their fp32 GEMMs pad
# to the tile inside the graph (`ops.invariant_matmul`), as they would otherwise break it at the padding probe; the
# expand and MoE (`post_attention[_ffn]`) once the graphs round every bf16 intermediate as eager does (`_options`):
# before, their one-row graph fused other bf16 steps than the tile's and gave a sequence of the `wide` test model
# other log-probs alone than in a batch (a `deterministic` batch-1 step 1.07x faster, in one process)
ONE_ROW_REGIONS = (
    "pre_attention",
    "project",
    "output",
    "index_query",
    "compress_latent",
    "compress_group",
    "post_attention",
    "post_attention_ffn",
)


# the regions a decode step's two graphs a block join (`_TiledRegions.run_block`)
JOINED_REGIONS = ("pre_attention", "project", "index_query", "compress_latent", "output", "post_attention_ffn")


def _tile(t: torch.Tensor, dim: int, start: int, n: int, rows: int, pads: dict) -> torch.Tensor:
    """Tokens start .. start+n of t along `dim` (0 or 1; dim 0 of a dim-1 tensor has size 1) as a contiguous
    tile of `rows` tokens, the last real token repeated into the padding: a padding row then routes to
    the experts a real one picked, so it reads no expert weights of its own, and the C++ expert kernel computes
    a run of copies once. pads[(n, device)]: the tile's row indices for n real rows, made once (a decode step pads
    every call: an index made per call was ~1 ms of a batch-1 step)."""
    if n == rows:
        return t[start : start + rows] if dim == 0 else t[0, start : start + rows].unsqueeze(0)
    idx = pads.get((n, t.device))
    if idx is None:
        idx = pads[(n, t.device)] = torch.arange(rows, device=t.device).clamp_(max=n - 1)  # [rows]
    return t.narrow(dim, start, n).index_select(dim, idx)


class CompiledTiles:
    """`deterministic` numerics compiled: the token-wise regions (`pre_attention`, `project`, `output`,
    `post_attention[_ffn]`) compiled at one static shape of `rows` tokens and called for every forward of the
    engine: prefill chunks, decode steps and verify chunks alike, tile after tile, the last tile padded. Every
    token then goes through the same graph at the same shapes whatever shares its forward, so its numbers
    cannot depend on the batch, the chunking or the step kind: batch invariance by construction, not by
    emulation (docs/numerics.md). What that needs of the graph, that a row's result depends neither on its
    place in the tile nor on the other rows (GEMMs at a fixed row count under MKL's strict mode, per-row
    reductions and elementwise code, the C++ expert kernel's fixed order per (token, expert) pair), is checked
    on every layer when the graphs are built: where it fails, the engine stays eager.

    A call of one token (a batch-1 decode step) runs the regions at one row instead (`ONE_ROW_REGIONS`), where
    the build's check finds every layer's one-row graphs give each row the bits of its full tile; else it pays for
    15 padding rows like any other call. Both kinds of graph round every bf16 intermediate to bf16 as eager ops do
    (inductor's `emulate_precision_casts`): a graph that kept a fused chain of bf16 steps in fp32 would give bits
    that depend on what it fused, and a one-row graph fuses differently from a tile (the expand and MoE did, on a
    wider model's log-probs alone against in a batch, after passing the check on random rows).

    A decode step runs each block as two graphs, at the tile and at one row, as `fast` does
    (`compiled._Regions.run_block`): `enter` (the mixes, the input, the projections, the index query, a ratio-1
    compressor's entries) and `leave` (the output projection, the expand, the MoE), where the build's check finds
    them giving every row the bits of the regions one after the other: a token's KV then does not depend on
    whether a decode step or a prefill chunk (always region by region) wrote it.

    The attention's sequence mixing stays eager (its batch-invariant kernels). The mode is chosen once, before
    the first request: the tiles and the eager ops give different bits, so an engine never switches between
    them while it serves. Engines over one model share its graphs (`for_model`)."""

    def __init__(self, model, rows: int, moe_inside: bool):
        self.model, self.rows, self.moe_inside = model, rows, moe_inside
        functions = CompiledDecode._functions()
        # every bf16 intermediate rounded as eager rounds it (`_options`): a tile's bits and a one-row graph's then
        # do not depend on what each fused
        self._compiled = {
            name: torch.compile(_own_code(functions[name]), dynamic=False, options=_options(rows, eager_casts=True))
            for name in TILE_REGIONS
        }
        self._one = {
            name: torch.compile(_own_code(functions[name]), dynamic=False, options=_options(1, eager_casts=True))
            for name in ONE_ROW_REGIONS
        }
        # a decode step's blocks as two graphs (`compiled.entry` by layer kind, `compiled.leave`) around the sequence
        # mixing, at the tile and at one row (`_TiledRegions.run_block`): two graph calls a block instead of six.
        # Used where the build's check finds them giving every row the bits of the regions one after the other
        # (a token's KV then does not depend on whether a decode step or a prefill chunk wrote it)
        kinds = {enter_kind(block.attn) for block in model.layers}
        joined = {("enter", *kind): entry(*kind) for kind in kinds} | {"leave": leave}
        self._joined = {
            size: {
                name: torch.compile(_own_code(fn), dynamic=False, options=_options(size, eager_casts=True))
                for name, fn in joined.items()
            }
            for size in {rows, 1}
        }
        self.joined: dict | None = None  # graphs by rows that the check passed (`_build`), or None
        self.joined_differs: str | None = None  # the first joined graph the check found differing from the regions
        self.ready: bool | None = None  # None: not built yet; False: unavailable here
        self._pads: dict = {}  # a padded tile's row indices by real rows (`_tile`)
        self.attn_kernel = False  # the decode attention by the C++ kernel (decided by `_build`)
        self.one_row = False  # one-token calls by the one-row graphs (decided by `_build`'s check)
        self.one_row_differs: str | None = None  # the first one-row graph the check found differing from its tile

    @classmethod
    def for_model(cls, model, rows: int, numerics, moe_inside: bool) -> CompiledTiles | None:
        """The model's tiles for this tile size and MoE placement, built under `numerics` (the runner's
        context) on first use and kept on the model, or None where they cannot serve."""
        kept = model.__dict__.setdefault("_compiled_tiles", {})
        key = (rows, moe_inside)
        if key not in kept:
            kept[key] = cls(model, rows, moe_inside)
        tiles = kept[key]
        if tiles.ready is None:
            tiles.ready = tiles._build(numerics)
        return tiles if tiles.ready else None

    def regions(self, one_row: bool | None = None, joined: dict | None = None) -> _TiledRegions:
        """The tiles for one forward; joined: the two-graph blocks by rows (default: those the build's check
        passed)."""
        one, joined = self._one_graphs(one_row), self.joined if joined is None else joined
        return _TiledRegions(self._compiled, self.rows, self._pads, self.moe_inside, one, joined)

    def attention(self, one_row: bool | None = None) -> _TiledAttention:
        """A decode step's attention regions at the tile shape (`DecodeBatch.dense`)."""
        return _TiledAttention(self._compiled, self.rows, self._pads, self.attn_kernel, self._one_graphs(one_row))

    def _one_graphs(self, one_row: bool | None) -> dict | None:
        """The one-row graphs where one-token calls take them (`one_row`, the build's verdict, unless given)."""
        return self._one if (self.one_row if one_row is None else one_row) else None

    def _build(self, numerics) -> bool:
        try:
            if self.moe_inside:
                for block in self.model.layers:
                    if block.ffn.dispatcher is None:
                        block.ffn.stack_experts()
                choose_expert_kernel(self.model)
            # the C++ decode attention computes each sequence alone in one order (batch-invariant by
            # construction, checked below like the graphs) where it is built with bf16 dot products
            self.attn_kernel = attn_cpu.available()
            with numerics():
                bad = self._warm_and_check()
        except Exception as err:  # noqa: BLE001 - no compiler, an op it cannot take: the eager ops serve
            log.warning("compiled deterministic tiles unavailable (%s: %s); running eager", type(err).__name__, err)
            return False
        if bad:
            log.warning("compiled deterministic tiles: %s depends on the other rows of its tile; running eager", bad)
            return False
        if self.one_row_differs:
            log.info(
                "deterministic tiles: one-token calls padded (%s alone differs from its tile)", self.one_row_differs
            )
        self.one_row = self.one_row_differs is None
        # the one-row graphs of the regions the two-graph blocks join are left unchecked where those serve
        self._one = {name: fn for name, fn in self._one.items() if name not in self._one_row_joined()}
        if self.joined_differs:
            log.info("deterministic tiles: decode steps region by region (%s differs)", self.joined_differs)
        # checked: from here each graph is called without Dynamo's guards where nothing needs them (`_direct`)
        self._compiled = {name: _direct(fn) for name, fn in self._compiled.items()}
        self._one = {name: _direct(fn) for name, fn in self._one.items()}
        if self.joined is not None:
            self.joined = {
                size: {name: _direct(fn) for name, fn in graphs.items()} for size, graphs in self.joined.items()
            }
        return True

    @torch.inference_mode()
    def _warm_and_check(self) -> str | None:
        """Trace every region on every layer, on random rows, and check it: rows 0 .. R-1 against rows 1 .. R of
        the same R + 1 (each row in another place, beside other rows) and against rows 0 .. 2 (a padded
        tile). Returns the first region whose shared rows differ, or None. Then the decode step's two-graph blocks
        (`_check_joined`), and the one-row graphs they do not replace, each row alone against its row of the full
        tile: the first that differs is kept in `one_row_differs`."""
        cfg, model, rows = self.model.cfg, self.model, self.rows
        dev, bf16 = model.device, torch.bfloat16
        g = torch.Generator(device="cpu").manual_seed(0)
        n = rows + 1
        regions, single = self.regions(one_row=False), self.regions(one_row=True)
        self.one_row_differs = None

        def rand(*shape, dtype=torch.float32):
            return torch.randn(*shape, generator=g).to(device=dev, dtype=dtype)

        pending = []  # the one-row graphs' checks, run once the two-graph blocks' verdict is known

        def check_single(name: str, run, where: str) -> None:
            if name in ONE_ROW_REGIONS:
                pending.append((name, run, where))

        for block in model.layers:
            attn = block.attn
            freqs = attn.rope.at(torch.arange(n, device=dev), dev)
            h, x = rand(1, n, cfg.hc_mult, cfg.dim, dtype=bf16), rand(1, n, cfg.dim, dtype=bf16)
            o = rand(1, n, attn.n_heads, attn.head_dim, dtype=bf16)
            mix = rand(1, n, cfg.hc_mult).softmax(-1)
            post, comb = rand(1, n, cfg.hc_mult).sigmoid(), rand(1, n, cfg.hc_mult, cfg.hc_mult).softmax(-1)
            stacks = regions.stacks_for(block, None, {})
            calls = {"pre_attention": (block, (h, mix)), "project": (attn, (x, freqs)), "output": (attn, (o, freqs))}
            if stacks is not None:
                calls["post_attention_ffn"] = (block, (x, h, post, comb, mix))
            else:
                calls["post_attention"] = (block, (x, h, post, comb, mix))
            for name, (module, args) in calls.items():
                extra = (stacks,) if name == "post_attention_ffn" else ()

                def run(a, b, one=False, name=name, module=module, args=args, extra=extra):
                    cut = [t[a:b] if t.dim() == 2 else t[:, a:b] for t in args]  # freqs: tokens on dim 0
                    return _flat(getattr(single if one else regions, name)(module, *cut, *extra))

                if not _rows_agree(run, rows):
                    return f"{name} (layer {block.layer_id})"
                check_single(name, run, f"layer {block.layer_id}")
        tiled, tiled_single = self.attention(one_row=False), self.attention(one_row=True)
        for ratio in sorted({block.attn.ratio > 0 for block in model.layers}):  # window only, and with entries
            attn = next(block.attn for block in model.layers if (block.attn.ratio > 0) == ratio)
            w, d, k = attn.window, attn.head_dim, cfg.index_topk if ratio else 0
            codes, scale = fp8_quant(rand(n, w, d) * rand(n, w, 1).exp())
            args = (
                rand(n, 1, attn.n_heads, d, dtype=bf16),
                codes,
                scale.to(torch.float8_e8m0fnu).view(torch.uint8),  # the rings' UE8M0 bits
                rand(n, 1, d, dtype=bf16),
                torch.rand(n, w + 1 + k, generator=g).to(dev) > 0.3,
                rand(n, k, d, dtype=bf16) if ratio else None,
            )

            def run(a, b, args=args, attn=attn):
                cut = [None if t is None else t[a:b] for t in args]
                return [t.unsqueeze(0) for t in tiled.window_attention(*cut, attn.attn_sink, attn.softmax_scale)]

            def run_in_place(a, b, args=args, attn=attn):
                """The C++ kernel as a decode step calls it, over a state pool (each row's ring its own slot)."""
                q, codes, scale, kv, valid, selected = [None if t is None else t[a:b] for t in args]
                pool_codes, pool_scale = codes.unsqueeze(1).clone(), scale.unsqueeze(1).clone()  # [rows, 1, W, ...]
                slots, new_rows = torch.arange(b - a, device=dev), torch.zeros(b - a, dtype=torch.long, device=dev)
                o = attn_cpu.decode_ring_attn_cpu(
                    q,
                    pool_codes,
                    pool_scale,
                    slots,
                    0,
                    new_rows,
                    kv,
                    valid,
                    selected,
                    attn.attn_sink,
                    attn.softmax_scale,
                )
                return [o.unsqueeze(0), pool_codes[:, 0, 0].unsqueeze(0), pool_scale[:, 0, 0].unsqueeze(0)]

            if not _rows_agree(run, rows) or (self.attn_kernel and not _rows_agree(run_in_place, rows)):
                return f"window_attention (layer {attn.layer_id})"
        for block in model.layers:  # the indexer's query and the compressors' entries, on every layer
            attn = block.attn
            freqs = attn.rope.at(torch.arange(n, device=dev), dev)
            x = rand(n, 1, cfg.dim, dtype=bf16)
            calls = {}
            if attn.indexer is not None:
                calls["index_query"] = (attn.indexer, [rand(n, 1, cfg.q_lora_rank, dtype=bf16), x, freqs])
            if attn.compressor is not None and attn.ratio == 1:
                calls["compress_latent"] = (attn, [x, freqs])
            if attn.compressor is not None and attn.ratio > 1:
                state = rand(n, attn.ratio, attn.head_dim)
                slot = torch.arange(n, device=dev) % attn.ratio
                calls["compress_group"] = (attn, [x, state, rand(n, attn.ratio, attn.head_dim), slot, freqs])
            for name, (module, args) in calls.items():

                def run(a, b, one=False, name=name, module=module, args=args):
                    via = tiled_single if one else tiled
                    return [t.unsqueeze(0) for t in _flat(getattr(via, name)(module, *(t[a:b] for t in args)))]

                if not _rows_agree(run, rows):
                    return f"{name} (layer {block.layer_id})"
                check_single(name, run, f"layer {block.layer_id}")
        # the two-graph blocks once every region passed (a refused build compiles none of them); where their one-row
        # graphs pass, one-token decode steps never call the one-row graphs of the regions they join, which are then
        # neither compiled nor checked
        self._check_joined(rand)
        joined = self._one_row_joined()
        for name, run, where in pending:
            if name not in joined and self.one_row_differs is None and not _single_rows_agree(run, rows):
                self.one_row_differs = f"{name} ({where})"
        return None

    def _one_row_joined(self) -> tuple[str, ...]:
        """The regions whose one-row graphs the one-row two-graph blocks replace, where those passed the check."""
        return JOINED_REGIONS if self.joined is not None and 1 in self.joined else ()

    def _check_joined(self, rand) -> None:
        """The two-graph blocks of a decode step (`_TiledRegions.run_block`) against the regions one after the
        other, on every layer whose MoE is inside the graphs, on random rows: the tile's graphs must give each row
        the regions' bits in a full tile, in another place beside other rows and in a padded tile, the one-row
        graphs each row alone its full tile's bits. Sets `joined` (the graphs by rows that passed: none where a
        tile's differ, the tile's alone where only the one-row graphs differ) and `joined_differs`."""
        self.joined, self.joined_differs = None, None
        if not self.moe_inside:
            return
        cfg, model, rows = self.model.cfg, self.model, self.rows
        dev, bf16, n = model.device, torch.bfloat16, rows + 1
        by_regions, tiled = self.regions(one_row=False, joined={}), self.attention(one_row=False)
        tile_only = self.regions(one_row=False, joined={rows: self._joined[rows]})
        one_too = self.regions(one_row=False, joined=self._joined)
        one_ok = True
        for block in model.layers:
            stacks = by_regions.stacks_for(block, None, {})
            if stacks is None:
                continue
            attn, (index, latent) = block.attn, enter_kind(block.attn)
            freqs = attn.rope.at(torch.arange(n, device=dev), dev)
            h, mix = rand(1, n, cfg.hc_mult, cfg.dim, dtype=bf16), rand(1, n, cfg.hc_mult).softmax(-1)
            o = rand(1, n, attn.n_heads, attn.head_dim, dtype=bf16)
            post, comb = rand(1, n, cfg.hc_mult).sigmoid(), rand(1, n, cfg.hc_mult, cfg.hc_mult).softmax(-1)

            def regions_run(a, b, block=block, attn=attn, index=index, latent=latent, stacks=stacks, **t):
                f = t["freqs"][a:b]
                mixes_x = by_regions.pre_attention(block, t["h"][:, a:b], t["mix"][:, a:b])
                x = mixes_x[1]
                qr, q, kv = by_regions.project(attn, x, f)
                rows_ = x[0].unsqueeze(1)
                found = tiled.index_query(attn.indexer, qr[0].unsqueeze(1), rows_, f) if index else None
                entries = tiled.compress_latent(attn, rows_, f) if latent else None
                y = by_regions.output(attn, t["o"][:, a:b], f)
                cut = [u[:, a:b] for u in (t["h"], t["post"], t["comb"], t["mix"])]
                out = by_regions.post_attention_ffn(block, y, *cut, stacks)
                return _flat((mixes_x, (qr, q, kv), out)) + [u.unsqueeze(0) for u in _flat((found, entries))]

            def joined_run(a, b, one=False, block=block, attn=attn, stacks=stacks, **t):
                via, f = one_too if one else tile_only, t["freqs"][a:b]
                mixes, x, proj, found, entries = via.enter(block, t["h"][:, a:b], t["mix"][:, a:b], f)
                cut = [u[:, a:b] for u in (t["h"], t["post"], t["comb"], t["mix"])]
                out = via.leave(block, t["o"][:, a:b], f, *cut, stacks)
                return _flat(((mixes, x), proj, out)) + [u.unsqueeze(0) for u in _flat((found, entries))]

            tensors = dict(h=h, mix=mix, o=o, post=post, comb=comb, freqs=freqs)
            want, run = regions_run(0, rows, **tensors), functools.partial(joined_run, **tensors)
            if not _rows_agree(run, rows, want):
                self.joined_differs = f"the tile's two graphs (layer {block.layer_id})"
                return
            if one_ok and not _single_rows_agree(run, rows, want):
                one_ok, self.joined_differs = False, f"the one-row two graphs (layer {block.layer_id})"
        self.joined = dict(self._joined) if one_ok else {rows: self._joined[rows]}


def _rows_agree(run, rows: int, want: list | None = None) -> bool:
    """`run(a, b)` (the outputs [1, b - a, ...] of rows a .. b-1 of R + 1 random rows, R = rows) gives each row
    the same bits in another place and beside other rows (rows 1 .. R) and in a padded tile (rows 0 .. 2) as
    `want`, by default `run(0, R)` (else checked against the full tile too)."""
    calls = ((1, rows + 1), (0, min(3, rows))) if want is None else ((0, rows), (1, rows + 1), (0, min(3, rows)))
    want = run(0, rows) if want is None else want
    for a, b in calls:
        got, end = run(a, b), min(b, rows)  # the rows both calls computed: a .. end - 1
        if len(got) != len(want) or not all(torch.equal(w[:, a:end], t[:, : end - a]) for w, t in zip(want, got)):
            return False
    return True


def _single_rows_agree(run, rows: int, want: list | None = None) -> bool:
    """`run(a, a + 1, True)` (row a alone through the one-row graphs) gives rows 0, R/2 and R-1 the bits
    `want` gives them, by default `run(0, R)` (the full tile)."""
    want = run(0, rows) if want is None else want
    for a in (0, rows // 2, rows - 1):
        got = run(a, a + 1, True)
        if len(got) != len(want) or not all(torch.equal(w[:, a : a + 1], t) for w, t in zip(want, got)):
            return False
    return True


class _TiledAttention:
    """The `deterministic` tiles' decode-step regions (`CompiledTiles.attention`), batch-first (one decode token
    per sequence): `window_attention`, the indexer's query (`index_query`) and the compressors' new entries
    (`compress_latent`, `compress_group`), each compiled at the tile shape and called tile after tile along the
    batch, the last tile padded with its last real row."""

    def __init__(self, compiled: dict, rows: int, pads: dict, attn_kernel: bool = False, one: dict | None = None):
        self.compiled, self.rows, self.pads, self.attn_kernel = compiled, rows, pads, attn_kernel
        self.one = one  # the one-row graphs (`CompiledTiles.one_row`), or None

    def _run(self, name: str, lead: tuple, tensors: list, extra=()):
        """compiled[name](*lead, *tiles of `tensors` along dim 0 (None passed as it is), *extra), joined; one
        sequence's call by the one-row graph where there is one."""
        total = next(t for t in tensors if t is not None).size(0)
        if total == 1 and self.one is not None and name in self.one:
            return self.one[name](*lead, *(None if t is None else _dense(t) for t in tensors), *extra)
        outs = []
        for start in range(0, total, self.rows):
            n = min(self.rows, total - start)
            tiles = [None if t is None else _tile(t, 0, start, n, self.rows, self.pads) for t in tensors]
            out = self.compiled[name](*lead, *tiles, *extra)
            outs.append(out if n == self.rows else _nested(lambda t, n=n: t[:n], out))
        return outs[0] if len(outs) == 1 else _join0(outs)

    def window_attention(self, q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale):
        if self.attn_kernel:  # each sequence alone, at any batch: no tiles
            return attn_cpu.decode_attn_cpu(q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale)
        tensors = [q, ring_codes, ring_scale, kv, valid, selected]
        return self._run("window_attention", (), tensors, (attn_sink, softmax_scale))

    def index_query(self, idx, qr, x, freqs):
        return self._run("index_query", (idx,), [qr, x, freqs])

    def compress_latent(self, attn, x, freqs):
        return self._run("compress_latent", (attn,), [x, freqs])

    def compress_group(self, attn, x, group_kv, group_score, slot, freqs):
        return self._run("compress_group", (attn,), [x, group_kv, group_score, slot, freqs])


class _TiledRegions(_RunByTokens):
    """The tile graphs for one forward of any number of tokens (`CompiledTiles`)."""

    tiled = True
    engram = None  # Engram runs eager, its gate's sigmoid per call (dsv41.ops.lanes)

    def __init__(
        self,
        compiled: dict,
        rows: int,
        pads: dict,
        moe_inside: bool,
        one: dict | None = None,
        joined: dict | None = None,
    ):
        self.compiled, self.rows, self.pads, self.moe_inside = compiled, rows, pads, moe_inside
        self.one = one  # the one-row graphs (`CompiledTiles.one_row`), or None
        self.joined = joined or {}  # the two-graph blocks by rows (`CompiledTiles.joined`): the tile's, one row's
        # the forward's attention backend when it is one decode step (token i is sequence i), as for `fast`
        # (`compiled._Regions.run_block`); None: region by region
        self.backend = None

    def run_block(self, block, h, pre_mix, image_mask, shared):
        """A decode step's block as two graphs (`enter`, `leave`) tile after tile around the backend's sequence
        mixing, where the build's check passed them -> (h, the FFN pre mix), else None (region by region; a
        one-token step too where only the one-row regions passed)."""
        stacks = self.stacks_for(block, image_mask, shared)
        if self.backend is None or stacks is None or self.rows not in self.joined:
            return None
        if h.size(1) == 1 and 1 not in self.joined and self.one is not None:
            return None  # the one-row regions: fewer rows than a padded tile of the two graphs
        attn = block.attn
        freqs = self.backend.freqs(attn)
        mixes, x, (qr, q, kv), index, latent = self.enter(block, h, pre_mix, freqs)
        attn_pre, attn_post, attn_comb = mixes
        o = self.backend.decode_mix(attn, x, qr, q, kv, index, latent)  # [1, B, H, D]
        return self.leave(block, o, freqs, h, attn_post, attn_comb, attn_pre, stacks)

    def enter(self, block, h, pre_mix, freqs):
        """`compiled.entry` of the block's kind over the tokens (its index query and new entries batch-first)."""
        name = ("enter", *enter_kind(block.attn))
        return self._run_joined(name, block, [(h, 1), (pre_mix, 1), (freqs, 0)], batch_first=2)

    def leave(self, block, o, freqs, residual, post, comb, attn_pre, stacks):
        """`compiled.leave` over the tokens."""
        tokens = [(o, 1), (freqs, 0)] + [(t, 1) for t in (residual, post, comb, attn_pre)]
        return self._run_joined("leave", block, tokens, (stacks,))

    def _run_joined(self, name, module, tokens: list, extra=(), batch_first: int = 0):
        """`_run` for the two-graph blocks: the last `batch_first` outputs are batch-first ([B, ...], or None)."""
        total = tokens[0][0].size(tokens[0][1])
        if total == 1 and 1 in self.joined:
            return self.joined[1][name](module, *(_dense(t) for t, _ in tokens), *extra)
        outs = []

        def split(out: tuple) -> tuple[tuple, tuple]:
            return out[: len(out) - batch_first], out[len(out) - batch_first :]

        for start in range(0, total, self.rows):
            n = min(self.rows, total - start)
            out = self.joined[self.rows][name](
                module, *(_tile(t, d, start, n, self.rows, self.pads) for t, d in tokens), *extra
            )
            if n != self.rows:
                token_wise, first = split(out)
                out = _cut(token_wise, n) + _nested(lambda t, n=n: t[:n], first)
            outs.append(out)
        if len(outs) == 1:
            return outs[0]
        parts = [split(out) for out in outs]
        return _cat([p[0] for p in parts]) + _join0([p[1] for p in parts])

    def stacks_for(self, block, image_mask, shared):
        """The MoE joins the tile graph for every token or for none (decided once per engine)."""
        return block.ffn.stacked() if self.moe_inside and block.ffn.dispatcher is None else None

    def _run(self, name: str, module, tokens: list, extra=()):
        """tokens: (tensor, token dim) pairs, cut into tiles; extra: passed to every tile as they are. A call of
        one token by the one-row graph where there is one."""
        total = tokens[0][0].size(tokens[0][1])
        if total == 1 and self.one is not None and name in self.one:
            return self.one[name](module, *(_dense(t) for t, _ in tokens), *extra)
        outs = []
        for start in range(0, total, self.rows):
            n = min(self.rows, total - start)
            out = self.compiled[name](module, *(_tile(t, d, start, n, self.rows, self.pads) for t, d in tokens), *extra)
            outs.append(out if n == self.rows else _cut(out, n))
        return outs[0] if len(outs) == 1 else _cat(outs)
