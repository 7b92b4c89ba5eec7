"""The compiled regions of a `fast` decode step, one graph per region and batch bucket (docs/engine-speed.md).

A decode step of a small batch is bound by dispatch, not by arithmetic: each block runs ~150 small eager
ops (the hyper-connection RMS statistic, mix projection, sigmoids and 20 Sinkhorn iterations, the
collapse and expand sums, norms, the q/kv projections and RoPE, FP8 rounding, the MoE's routing and
expert calls, the window ring's FP8 codes), a few microseconds each. Under `fast` numerics nothing asks for
those ops' exact roundings, so they are compiled (torch.compile, inductor's C++ backend and C++ wrapper on
a CPU) with static shapes, leaving eager only what has data-dependent shapes (the indexer's scoring over
the visible entries and its top-k, the ratio-2 compressors' group completion, the paged gathers and writes):

- `engram`: an Engram layer's table rows (their UE8M0 scales read from the bits), projection and gates;
- `pre_attention`: the attention sublayer's mixes (RMS, projection, Sinkhorn) and its normed input;
- `project`: the attention's q/kv projections, norms, RoPE and the window KV's FP8 rounding;
- `window_attention`: the FP8 window ring decoded, the new row encoded, the dense softmax over the window
  and the selected compressed rows (dsv41.engine.batched.decode_attend);
- `index_query`: the indexer's query heads and head weights;
- `compress_latent`: a ratio-1 compressor's new entry (latent, index keys, FP4 packing);
- `compress_group`: a ratio-2 compressor's rows and, as if the token completed its group, the group's entry;
- `output`: the inverse RoPE and the grouped output projection;
- `post_attention_ffn`: the attention sublayer's expand (`hc_post`), the FFN sublayer's mixes and normed
  input, and the whole MoE over the experts' stacked weights (`MoE.decode_forward`); `post_attention`
  without the MoE where the experts cannot be stacked (quantized experts, expert parallelism);
- `final_logits`: a one-token step's last norm and head, over a bf16 copy of the fp32 head.

A forward that is one decode step (token i is sequence i) joins them into two graphs a block (`enter`: the mixes,
the input, the projections and, by the layer's kind, the indexer's query and a ratio-1 compressor's entry;
`leave`: the output projection and `post_attention_ffn`) around the attention's sequence mixing
(`_Regions.run_block`): each graph call costs tens of us outside its kernels, more inside a step whose weight
reads have evicted its code and objects from the caches. Once a bucket is built its graphs are called as
Dynamo's output code without the cache lookup and guards (`_direct`), where nothing needs them.

The functions take the block or attention module as an argument, so one graph serves every layer of the
same shape (the compiler treats the modules' weights as inputs). A batch of B decode tokens is padded to the
next bucket (1, 2, 4, 8, 16, 32, then 48 .. 256 in steps of 1.5x and 2x; token-wise math, so the padding rows
never touch the real ones); an engine builds the buckets up to the first that holds its largest decode or
verify forward, larger forwards run in pieces of the largest, and prefill chunks stay eager. Compiling a
bucket takes seconds (tens on a cold compiler cache; inductor's on-disk caches make later processes faster),
so buckets are built on a background thread (`dsv41 serve`'s default) or before the first request
(`EngineConfig.compile_decode`), and until a bucket is built its steps run eager.
"""

from __future__ import annotations

import dis
import logging
import threading
import types

import torch

from dsv41.engine.batched import compress_group, index_query, pack_entries, window_attention
from dsv41.model.block import Block
from dsv41.ops import attn_cpu, index_cpu, linear_cpu, moe_cpu
from dsv41.ops.quant import FP8_BLOCK

log = logging.getLogger(__name__)

# past 32 rows, steps of 1.5x and 2x (padding at most a third of a call): a speculative verify of 8 sequences x 6
# tokens is one call of 48, and its chunked attention's indexer query and ratio-1 compressor run compiled too
# (1.25x the tokens/s of 32 + 16 rows with those eager, at batch 8 on `small`)
BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)

MODULE_ARGS = ("block", "attn", "idx", "norm", "module")  # the regions' module arguments


def _keep_guard(entries) -> list[bool]:
    """Dynamo guard filter: drop the guards on the module arguments (their attributes, parameters and hooks)
    and on globals; keep those on the tensor arguments (shapes, dtypes: they pick the bucket's graph) and the
    grad-mode state. Checking every attribute and parameter of the block handed in costs ~80 us a call, four
    calls a layer. What they would catch cannot differ between calls: the regions are traced only from blocks
    of one shape, under `fast` numerics (the runner enters the same settings around every forward), and
    `_warm` runs every layer through them before a bucket is used."""
    return [not (e.is_global or e.name.split(".")[0].split("[")[0] in MODULE_ARGS) for e in entries]


# cpp_wrapper: a graph's calling code is C++ too, not Python (a region calls dozens of kernels; ~15% of a
# batch-1 step on the machines measured)
_OPTIONS = {"cpp_wrapper": True, "guard_filter_fn": _keep_guard}
# graphs of up to this many rows run their generated kernels on one thread: a region's elementwise work at these
# sizes is a few us a kernel, less than the OpenMP barriers between its dozens of kernels (the Sinkhorn's
# iterations each end in one) cost on 2 threads. Measured on 2 cores, one process, alternating: a `fast` decode
# step 1.11x faster at batch 8, 1.04x at 32; `deterministic` tiles 1.10x at batch 8. The C++ kernels a graph
# calls (the GEMMs, the experts) keep their own threads.
ONE_THREAD_ROWS = 64


# the options of the four kinds of graph, by (one thread, eager casts), each one object shared by every graph of
# its kind: torch 2.13 failed to replay a traced Python side effect (a test's counter) from graphs compiled with
# an options dict made per compile (an IndexError in the indexer's query region)
_OPTIONS_BY_KIND = {
    (one, casts): dict(
        _OPTIONS, **({"cpp.threads": 1} if one else {}), **({"emulate_precision_casts": True} if casts else {})
    )
    for one in (False, True)
    for casts in (False, True)
}


def _options(rows: int, eager_casts: bool = False) -> dict:
    """The graphs' inductor options at `rows` rows. eager_casts: round every bf16 intermediate to bf16 as eager
    ops do (inductor otherwise keeps a fused chain of bf16 ops in fp32, so a graph's bits would depend on what it
    fused, which differs between a graph of one row and one of a tile)."""
    return _OPTIONS_BY_KIND[(rows <= ONE_THREAD_ROWS, eager_casts)]


def engram(module, h: torch.Tensor, hash_ids: torch.Tensor, scale_bits: torch.Tensor) -> torch.Tensor:
    """`Engram.forward` for text tokens: h [1, T, hc, dim] bf16, hash_ids [1, T, cols], the table's scales as
    uint8 bits (inductor takes no float8_e8m0fnu tensor) -> h with the memory added."""
    return module(h, hash_ids, scale_bits=scale_bits)


def pre_attention(block: Block, h: torch.Tensor, pre_mix: torch.Tensor):
    """h [1, T, hc, dim] bf16, pre_mix [1, T, hc] -> ((pre, post, comb) of the attention sublayer, normed x)."""
    mixes = block.hc_mixes(h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base)
    return mixes, block.attn_input(h, pre_mix)


def project(attn, x: torch.Tensor, freqs: torch.Tensor):
    """`Attention.project`: x [1, T, dim] -> (qr, q, kv)."""
    return attn.project(x, freqs)


def output(attn, o: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """`Attention.output`: o [1, T, H, D] -> [1, T, dim]."""
    return attn.output(o, freqs)


def post_attention(block: Block, x, residual, post, comb, attn_pre):
    """The attention sublayer's expand, then the FFN sublayer's mixes and normed input:
    -> (h [1, T, hc, dim], (pre, post, comb) of the FFN, normed FFN input [1, T, dim])."""
    h = block.hc_post(x, residual, post, comb)
    mixes = block.hc_mixes(h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base)
    return h, mixes, block.ffn_norm(block.hc_pre(h, attn_pre))


def compress_latent(attn, x, freqs):
    """A ratio-1 compressor's work for a decode step (every token completes its group,
    dsv41.engine.batched._compress): x [B, 1, dim], freqs [B, rope/2] -> `pack_entries` of the new latents."""
    comp = attn.compressor
    return pack_entries(attn, comp.norm(comp.wkv(x))[:, 0], freqs)


def post_attention_ffn(block: Block, x, residual, post, comb, attn_pre, stacks):
    """`post_attention`, the MoE (`MoE.decode_forward` over the experts' stacked weights) and the FFN
    sublayer's expand: the whole block after its attention -> (h [1, T, hc, dim], the FFN pre mix)."""
    h, (ffn_pre, ffn_post, ffn_comb), y = post_attention(block, x, residual, post, comb, attn_pre)
    return block.hc_post(block.ffn.decode_forward(y, stacks), h, ffn_post, ffn_comb), ffn_pre


def entry(index: bool, latent: bool):
    """The `enter` graph of one kind of layer (`enter_kind`): with the indexer's query, with a ratio-1
    compressor's new entries. The kind is fixed here, not read from the module inside the graph, so one graph
    serves every layer of the kind."""

    def enter(block: Block, h: torch.Tensor, pre_mix: torch.Tensor, freqs: torch.Tensor):
        """A decode step's block up to its sequence mixing, one graph: `pre_attention`, `project` and, by the
        kind, the indexer's `index_query` and a ratio-1 compressor's `compress_latent` on the same rows.
        h [1, B, hc, dim], pre_mix [1, B, hc], freqs [B, rope/2] (token i is sequence i) -> ((pre, post, comb),
        x, (qr, q, kv), the indexer's (q, weights) or None, the new latents' packed entries or None)."""
        mixes, x = pre_attention(block, h, pre_mix)
        attn = block.attn
        qr, q, kv = attn.project(x, freqs)
        rows = x[0].unsqueeze(1)  # [B, 1, dim]: the attention's batch-first rows
        found = index_query(attn.indexer, qr[0].unsqueeze(1), rows, freqs) if index else None
        return mixes, x, (qr, q, kv), found, compress_latent(attn, rows, freqs) if latent else None

    return enter


def leave(block: Block, o: torch.Tensor, freqs: torch.Tensor, residual, post, comb, attn_pre, stacks):
    """The block after its sequence mixing, one graph: `output`, then `post_attention_ffn`.
    o [1, B, H, D] -> (h [1, B, hc, dim], the FFN pre mix)."""
    return post_attention_ffn(block, block.attn.output(o, freqs), residual, post, comb, attn_pre, stacks)


def enter_kind(attn) -> tuple[bool, bool]:
    """Which `enter` graph a layer takes: (has an indexer, has a ratio-1 compressor). Each kind is compiled as a
    function of its own: the graphs drop the guards on the modules (`_keep_guard`), so nothing else would keep a
    layer without an indexer off a graph traced with one."""
    return attn.indexer is not None, attn.compressor is not None and attn.ratio == 1


def final_logits(norm, h: torch.Tensor, pre_mix: torch.Tensor, head: torch.Tensor, kernel: bool) -> torch.Tensor:
    """The last norm and the head for a one-token step, over the bf16 copy of the fp32 head
    (`Transformer.keep_bf16_head`): h [1, 1, hc, dim], pre_mix [1, 1, hc], head [vocab, dim] -> fp32 logits
    [1, vocab]. kernel: the head by the few-row C++ kernel (dsv41.ops.linear_cpu, where it is built), else by
    inductor's reduction loop over the bf16 weight. Either reads half the bytes of the fp32 head, the largest
    weight a decode step reads. The products are summed in fp32 and the logits kept in fp32: rounded to bf16,
    as a bf16 GEMM would give them, they flip ~0.7% of the top-1 picks against the reference
    (bench_agreement.py)."""
    x = norm(Block.hc_pre(h, pre_mix))[0]  # [1, dim] bf16
    if kernel:
        return linear_cpu.rows_linear(x, head)
    return (x.float().unsqueeze(-2) * head.float()).sum(-1)


def _own_code(fn):
    """A copy of function `fn` with a code object of its own (Dynamo's graph cache is per code object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _direct(compiled):
    """A warmed compiled function as a plain function running Dynamo's output code (the graph's call, its inputs
    read from the arguments), without the cache lookup and guards of each call (~30 us hot, more once a step's
    weight reads have evicted them from the caches; vLLM calls its compiled models' code the same way). Only for a
    function with one graph whose code only calls it (`_only_the_graph`): no guard then chooses between graphs,
    and what the guards check holds by construction (the modules by `_keep_guard`'s reasoning, the numerics by
    the runner's context around every forward, dtypes by the callers), while the graph itself still refuses
    inputs of other sizes or strides (inductor's input checks). Else, or where the output code cannot be found,
    the compiled function itself."""
    orig = getattr(compiled, "_torchdynamo_orig_callable", None)
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        entries = _debug_get_cache_entry_list(orig.__code__)
    except Exception:  # noqa: BLE001 - another torch: keep the guarded call
        return compiled
    if len(entries) != 1 or not _only_the_graph(entries[0].code):
        return compiled
    return types.FunctionType(entries[0].code, orig.__globals__, orig.__name__, orig.__defaults__, orig.__closure__)


# what Dynamo's output code does to call a graph: read the inputs (arguments, their modules' parameters, global
# tensors), three calls (the pregraph records around it and the graph), unpack and return the outputs. A Python
# side effect traced into the graph (a test's counter) is replayed by stores (`STORE_SUBSCR` into a list) or
# further calls; a graph break calls a resume function. Those need the guards
_GRAPH_CALL_OPS = {
    "RESUME", "NOP", "CACHE", "EXTENDED_ARG", "COPY_FREE_VARS", "PUSH_NULL", "KW_NAMES", "PRECALL", "CALL",
    "LOAD_FAST", "LOAD_CONST", "LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_DEREF", "LOAD_CLOSURE",
    "STORE_FAST", "DELETE_FAST", "COPY", "SWAP", "POP_TOP", "BINARY_SUBSCR", "UNPACK_SEQUENCE",
    "BUILD_LIST", "BUILD_TUPLE", "LIST_EXTEND", "RETURN_VALUE",
}  # fmt: skip


def _only_the_graph(output) -> bool:
    """Whether Dynamo's output code `output` only calls its graph (`_GRAPH_CALL_OPS`)."""
    ops = [i.opname for i in dis.get_instructions(output)]
    resumes = any(n.startswith("__resume") for n in output.co_names)
    return not resumes and ops.count("CALL") <= 3 and set(ops) <= _GRAPH_CALL_OPS


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Pad dim 1 (tokens) of t with zeros to `rows`."""
    extra = rows - t.size(1)
    if not extra:
        return t
    return torch.cat([t, t.new_zeros(t.size(0), extra, *t.shape[2:])], dim=1)


def _cut(value, n: int):
    """Every tensor in a (nested) tuple cut back to its first n tokens (dim 1)."""
    if isinstance(value, tuple):
        return tuple(_cut(v, n) for v in value)
    return value[:, :n]


def choose_expert_kernel(model) -> None:
    """The picked experts by the C++ kernel (dsv41.ops.moe_cpu) where it is built with the bf16 dot-product
    instructions, else by the compiled reference. Decided before the first graph is traced."""
    use = None  # the same answer on every call (moe_cpu.library is built and loaded once a process)
    for block in model.layers:
        stacks = block.ffn.stacked()
        if stacks is not None and moe_cpu.fits(stacks[0], stacks[2]):
            use = moe_cpu.available() if use is None else use  # built (~6 s, once) only where it could serve
            block.ffn.cpu_expert_kernel = use
    # the index layers' C++ scan (dsv41.ops.paged, dsv41.ops.index_cpu), which a decode step uses once it is
    # built but never waits for: built here, with the graphs
    index_cpu.available()


class CompiledDecode:
    """The compiled regions of one model's decode steps, bucket by bucket. `regions(n)` gives an object with
    the four functions for a decode batch of n tokens once that bucket is built, else None (run eager)."""

    def __init__(
        self, model, buckets: tuple[int, ...] = BUCKETS, numerics=None, rows_kernel: bool = False, verify: bool = True
    ):
        # numerics: the context the regions are traced in, the runner's (`ModelRunner.numerics`): the graphs keep
        # what the modules' settings were then (the guards on the modules are dropped, `_keep_guard`), so they
        # must be the settings of the forwards that call them (the small-call fp32 GEMMs, `fp32_rows`, above all)
        self.model, self.buckets = model, buckets
        self.numerics = numerics or (lambda: model.numerics(0, fast=True))
        # the one-token head by the few-row kernel (`final_logits`): the runner's choice (`ModelRunner.rows_kernel`),
        # which its numerics also give the layers
        self.rows_kernel = rows_kernel
        # whether the build warms the region-by-region graphs of every block too (`pre_attention` ..
        # `post_attention_ffn`, the index query, the ratio-1 compressor), which a speculative verify takes; without
        # verify forwards a decode step's blocks run as `enter` and `leave` (a block whose MoE is outside the graphs
        # region by region, warmed either way), and a forward that asked for the others would compile them then
        self.per_region = verify
        # the decode attention by the C++ kernel (dsv41.ops.attn_cpu) where it is built with bf16 dot products,
        # else the `window_attention` region; decided when the buckets are built (None until then)
        self.attn_kernel: bool | None = None
        self.ready: set[int] = set()
        self.failed = False
        # one compiled function per (region, bucket), each with a code object of its own: Dynamo keeps its
        # graphs per code object and checks the guards of every graph it holds in turn, so one function
        # serving all buckets would try up to six guard sets a call; one per bucket tries one
        functions = dict(self._functions())
        for kind in {enter_kind(block.attn) for block in model.layers}:
            functions[("enter", *kind)] = entry(*kind)
        self._compiled = {
            b: {
                name: torch.compile(_own_code(fn), dynamic=False, options=_options(b)) for name, fn in functions.items()
            }
            for b in buckets
        }
        # what a built bucket's regions call: each graph's code without Dynamo's guards where it has one (`_direct`)
        self._calls: dict[int, dict] = {}
        self._thread: threading.Thread | None = None
        model.keep_bf16_head()  # read by `final_logits` (one-token steps)
        for block in model.layers:  # the experts' weights as stacked views (MoE.stack_experts): the MoE then
            if block.ffn.dispatcher is None:  # runs inside `post_attention_ffn` (bf16 experts only)
                block.ffn.stack_experts()

    @staticmethod
    def _functions() -> dict:
        return {
            "engram": engram,
            "pre_attention": pre_attention,
            "project": project,
            "output": output,
            "post_attention": post_attention,
            "post_attention_ffn": post_attention_ffn,
            "window_attention": window_attention,
            "index_query": index_query,
            "compress_latent": compress_latent,
            "compress_group": compress_group,
            "final_logits": final_logits,
            "leave": leave,
        }

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def regions(self, n: int) -> _Regions | _SplitRegions | None:
        """The token-wise regions (`pre_attention` .. `post_attention_ffn`) for a forward of n decode or verify
        tokens: one bucket's graphs where n fits a built bucket, else pieces of the built buckets (a speculative
        verify of 8 sequences x 6 tokens: 32 + 16 rows; `fast` numerics ask no row to keep its bits). None
        while no bucket is built."""
        if self.failed or not self.ready:
            return None
        pieces, start = [], 0
        while start < n:
            rest = n - start
            b = min((b for b in self.ready if b >= rest), default=None)
            if b is None:  # more rows than the largest built bucket: a full piece of it, then the rest
                b = rest = max(self.ready)
            pieces.append(_Regions(self._calls[b], rest, b, self.attn_kernel))
            start += rest
        return pieces[0] if len(pieces) == 1 else _SplitRegions(pieces)

    def attention_regions(self, n: int) -> _Regions | None:
        """The decode attention's regions (`window_attention`, `index_query`, `compress_latent`) for one decode
        step of n sequences, where its bucket is built (larger steps attend eager)."""
        b = self.bucket(n)
        if b is None or b not in self.ready or self.failed:
            return None
        return _Regions(self._calls[b], n, b, self.attn_kernel)

    # ---------------------------------------------------------------- building
    def build(self, buckets: tuple[int, ...] | None = None) -> None:
        """Compile the given buckets now (each traced on every layer shape the model has)."""
        if self.attn_kernel is None:
            self.attn_kernel = attn_cpu.available()  # builds it once per machine (seconds), before any bucket serves
        for b in buckets or self.buckets:
            if self.failed or b in self.ready or b not in self._compiled:
                continue
            try:
                choose_expert_kernel(self.model)
                self._warm(b)
            except Exception as err:  # noqa: BLE001 - no compiler, an op it cannot take: the eager ops serve
                log.warning("compiled decode regions unavailable (%s: %s); decoding eager", type(err).__name__, err)
                self.failed = True
                return
            self._calls[b] = {name: _direct(fn) for name, fn in self._compiled[b].items()}
            self.ready.add(b)

    def build_in_background(self) -> threading.Thread:
        """Compile every bucket on a daemon thread, smallest first; steps run eager until theirs is built."""
        self._thread = threading.Thread(target=self.build, name="dsv41-compile-decode", daemon=True)
        self._thread.start()
        return self._thread

    @torch.inference_mode()
    def _warm(self, rows: int) -> None:
        """Run each region on every layer at `rows` tokens on stand-in inputs: the first layer compiles, the
        others check that they reuse its graphs (a layer that needed its own would compile here, not inside
        a request)."""
        cfg, model = self.model.cfg, self.model
        dev = model.device
        h = torch.zeros(1, rows, cfg.hc_mult, cfg.dim, dtype=torch.bfloat16, device=dev)
        pre = torch.full((1, rows, cfg.hc_mult), 1.0 / cfg.hc_mult, device=dev)
        positions = torch.arange(rows, device=dev)
        regions = _Regions(self._compiled[rows], rows, rows, self.attn_kernel)
        with self.numerics():
            for block in model.layers:
                attn = block.attn
                freqs = attn.rope.at(positions, dev)
                if block.engram is not None:
                    ids = torch.zeros(1, rows, cfg.n_hash_columns, dtype=torch.int64, device=dev)
                    regions.engram(block.engram, h, ids)
                stacks = block.ffn.stacked()
                if stacks is not None:  # the two graphs of a whole decode-step block (`_Regions.run_block`)
                    kind = ("enter", *enter_kind(attn))
                    (a_pre, a_post, a_comb), x, (qr, q, kv), _, _ = self._compiled[rows][kind](block, h, pre, freqs)
                    self._compiled[rows]["leave"](block, q, freqs, h, a_post, a_comb, a_pre, stacks)
                if stacks is None or self.per_region:
                    (a_pre, a_post, a_comb), x = regions.pre_attention(block, h, pre)
                    qr, q, kv = regions.project(attn, x, freqs)
                    o = regions.output(attn, q, freqs)
                    if stacks is not None:
                        regions.post_attention_ffn(block, o, h, a_post, a_comb, a_pre, stacks)
                    else:
                        regions.post_attention(block, o, h, a_post, a_comb, a_pre)
                self._warm_attention(regions, attn, rows, positions, self.per_region or stacks is None)
            if rows == 1:
                regions.final_logits(model.norm, h, pre, model.head_bf16(), self.rows_kernel)

    def _warm_attention(self, regions: _Regions, attn, rows: int, positions: torch.Tensor, per_region: bool) -> None:
        """The decode attention's regions on one layer's shapes, on stand-in inputs (zero rings, no valid row
        but the new token's); per_region: the index query and the ratio-1 compressor too (`enter` computes them
        for a decode step)."""
        cfg, dev = self.model.cfg, self.model.device
        w, d, bf16 = attn.window, attn.head_dim, torch.bfloat16
        q = torch.zeros(rows, 1, attn.n_heads, d, dtype=bf16, device=dev)
        kv = torch.zeros(rows, 1, d, dtype=bf16, device=dev)
        codes = torch.zeros(rows, w, d, dtype=torch.float8_e4m3fn, device=dev)
        scales = torch.full((rows, w, d // FP8_BLOCK), 127, dtype=torch.uint8, device=dev)
        k = cfg.index_topk if attn.ratio else 0
        valid = torch.zeros(rows, w + 1 + k, dtype=torch.bool, device=dev)
        valid[:, w] = True
        selected = torch.zeros(rows, k, d, dtype=bf16, device=dev) if attn.ratio else None
        regions.window_attention(q, codes, scales, kv, valid, selected, attn.attn_sink, attn.softmax_scale)
        x = torch.zeros(rows, 1, cfg.dim, dtype=bf16, device=dev)
        if attn.indexer is not None and per_region:
            qr = torch.zeros(rows, 1, cfg.q_lora_rank, dtype=bf16, device=dev)
            regions.index_query(attn.indexer, qr, x, attn.rope.at(positions, dev))
        if attn.compressor is not None and attn.ratio == 1 and per_region:
            regions.compress_latent(attn, x, attn.rope.at(positions, dev))
        if attn.compressor is not None and attn.ratio > 1:
            state = torch.zeros(rows, attn.ratio, attn.head_dim, device=dev)
            slot = positions % attn.ratio
            regions.compress_group(attn, x, state, state, slot, attn.rope.at(positions, dev))


class _Regions:
    """The compiled regions for one decode step of n tokens, padded to `rows`."""

    tiled = False  # (`tiles._TiledRegions`: every forward, no decode attention or head regions)

    def __init__(self, compiled: dict, n: int, rows: int, attn_kernel: bool = False):
        self.compiled, self.n, self.rows, self.attn_kernel = compiled, n, rows, attn_kernel
        # the forward's attention backend when it is one decode step (token i is sequence i): the blocks then run
        # as two graphs around the sequence mixing (`run_block`); None: region by region
        self.backend = None

    def run_block(self, block, h, pre_mix, image_mask, shared):
        """The whole block of a decode step as two graphs, `enter` and `leave`, around the backend's sequence
        mixing (`decode_mix`), instead of five to seven region calls: each call of a graph costs tens of us in
        Dynamo's cache lookup and wrappers, more when the step's weight reads have evicted them from the caches.
        -> (h, the FFN pre mix), or None where the block runs region by region (no decode step, the MoE
        outside the graphs)."""
        stacks = self.stacks_for(block, image_mask, shared)
        if self.backend is None or stacks is None:
            return None
        attn, backend = block.attn, self.backend
        freqs = self._freqs(backend.freqs(attn))
        pad = lambda t: _pad_rows(t, self.rows)  # noqa: E731
        mixes, x, (qr, q, kv), index, latent = self.compiled[("enter", *enter_kind(attn))](
            block, pad(h), pad(pre_mix), freqs
        )
        if self.rows != self.n:
            mixes, x, qr, q, kv = _cut((mixes, x, qr, q, kv), self.n)
            index, latent = _nested(lambda t: t[: self.n], index), _nested(lambda t: t[: self.n], latent)
        attn_pre, attn_post, attn_comb = mixes
        o = backend.decode_mix(attn, x, qr, q, kv, index, latent)  # [1, B, H, D]
        out = self.compiled["leave"](
            block, pad(o), freqs, pad(h), pad(attn_post), pad(attn_comb), pad(attn_pre), stacks
        )
        return out if self.rows == self.n else _cut(out, self.n)

    def _call(self, name: str, module, *tensors):
        padded = [_pad_rows(t, self.rows) for t in tensors]
        out = self.compiled[name](module, *padded)
        return out if self.rows == self.n else _cut(out, self.n)

    def engram(self, module, h, hash_ids):
        ids = _dense(_pad_rows(hash_ids, self.rows))  # (a column of the forward's hashes: a strided view)
        out = self.compiled["engram"](module, _pad_rows(h, self.rows), ids, module.embed.scale.view(torch.uint8))
        return out[:, : self.n]

    def pre_attention(self, block, h, pre_mix):
        return self._call("pre_attention", block, h, pre_mix)

    @staticmethod
    def stacks_for(block, image_mask, shared):
        """The experts' stacks when the MoE joins `post_attention_ffn` (text tokens, experts in bf16, no
        routing record, no expert parallelism), else None (`post_attention`, then the eager MoE)."""
        if image_mask is not None or "moe_aux" in shared or block.ffn.dispatcher is not None:
            return None
        return block.ffn.stacked()

    def _freqs(self, freqs: torch.Tensor) -> torch.Tensor:
        """RoPE rows [T, rope/2] complex64 (tokens on dim 0) padded with the identity rotation."""
        if self.rows == self.n:
            return freqs
        return torch.cat([freqs, freqs.new_ones(self.rows - self.n, *freqs.shape[1:])])

    def project(self, attn, x, freqs):
        out = self.compiled["project"](attn, _pad_rows(x, self.rows), self._freqs(freqs))
        return out if self.rows == self.n else _cut(out, self.n)

    def output(self, attn, o, freqs):
        out = self.compiled["output"](attn, _pad_rows(o, self.rows), self._freqs(freqs))
        return out if self.rows == self.n else out[:, : self.n]

    def post_attention(self, block, x, residual, post, comb, attn_pre):
        return self._call("post_attention", block, x, residual, post, comb, attn_pre)

    def post_attention_ffn(self, block, x, residual, post, comb, attn_pre, stacks):
        padded = [_pad_rows(t, self.rows) for t in (x, residual, post, comb, attn_pre)]
        out = self.compiled["post_attention_ffn"](block, *padded, stacks)
        return out if self.rows == self.n else _cut(out, self.n)

    # the attention's per-sequence tensors are batch-first ([B, ...], one decode token per sequence)
    def _pad0(self, t: torch.Tensor | None, fill=0) -> torch.Tensor | None:
        if t is None or self.rows == self.n:
            return t
        return torch.cat([t, t.new_full((self.rows - t.size(0), *t.shape[1:]), fill)])

    def window_attention(self, q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale):
        """`window_attention` for the B real sequences (padding rows have no valid row), or the C++ kernel's."""
        if self.attn_kernel:  # each sequence alone: no padding
            return attn_cpu.decode_attn_cpu(q, ring_codes, ring_scale, kv, valid, selected, attn_sink, softmax_scale)
        p = self._pad0
        out = self.compiled["window_attention"](
            p(q), p(ring_codes), p(ring_scale), p(kv), p(valid), p(selected), attn_sink, softmax_scale
        )
        return out if self.rows == self.n else tuple(t[: self.n] for t in out)

    def compress_latent(self, attn, x, freqs):
        kv, keys = self.compiled["compress_latent"](attn, self._pad0(x), self._pad0(freqs, 1))
        if self.rows == self.n:
            return kv, keys
        cut = lambda pair: None if pair is None else tuple(t[: self.n] for t in pair)  # noqa: E731
        return cut(kv), cut(keys)

    def compress_group(self, attn, x, group_kv, group_score, slot, freqs):
        p = self._pad0
        out = self.compiled["compress_group"](attn, p(x), p(group_kv), p(group_score), p(slot), p(freqs, 1))
        return out if self.rows == self.n else _nested(lambda t: t[: self.n], out)

    def final_logits(self, norm, h, pre_mix, head, kernel: bool):
        """`final_logits` (one-token steps only)."""
        return self.compiled["final_logits"](norm, h, pre_mix, head, kernel)

    def index_query(self, idx, qr, x, freqs):
        out = self.compiled["index_query"](idx, self._pad0(qr), self._pad0(x), self._pad0(freqs, 1))
        return out if self.rows == self.n else tuple(t[: self.n] for t in out)


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with the strides of a fresh tensor of its shape: the graphs were traced on such inputs, and Dynamo
    checks every stride (a slice keeps its parent's, even along a dimension of size 1, and would recompile)."""
    stride, expected = 1, []
    for size in reversed(t.shape):
        expected.append(stride)
        stride *= size
    if t.stride() == tuple(reversed(expected)):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


class _RunByTokens:
    """The token-wise region methods of a regions object that cuts its calls along the tokens itself:
    `_run(name, module, [(tensor, token dim), ...], extra)` (`_SplitRegions`, `tiles._TiledRegions`)."""

    def run_block(self, block, h, pre_mix, image_mask, shared):
        return None  # region by region (`_Regions.run_block`)

    def _run(self, name: str, module, tokens: list, extra=()):
        raise NotImplementedError

    def engram(self, module, h, hash_ids):
        return self._run("engram", module, [(h, 1), (hash_ids, 1)])  # (`_SplitRegions`: `_Regions.engram`)

    def pre_attention(self, block, h, pre_mix):
        return self._run("pre_attention", block, [(h, 1), (pre_mix, 1)])

    def project(self, attn, x, freqs):
        return self._run("project", attn, [(x, 1), (freqs, 0)])

    def output(self, attn, o, freqs):
        return self._run("output", attn, [(o, 1), (freqs, 0)])

    def post_attention(self, block, x, residual, post, comb, attn_pre):
        return self._run("post_attention", block, [(t, 1) for t in (x, residual, post, comb, attn_pre)])

    def post_attention_ffn(self, block, x, residual, post, comb, attn_pre, stacks):
        tokens = [(t, 1) for t in (x, residual, post, comb, attn_pre)]
        return self._run("post_attention_ffn", block, tokens, (stacks,))


class _SplitRegions(_RunByTokens):
    """The token-wise regions of a forward with more tokens than one built bucket holds, as consecutive
    pieces (`_Regions` each, the last padded to its bucket) whose outputs are joined along the tokens."""

    tiled = False

    def __init__(self, pieces: list[_Regions]):
        self.pieces = pieces
        self.rows = sum(p.n for p in pieces)  # never 1: the one-token head is a single bucket's

    stacks_for = staticmethod(_Regions.stacks_for)

    def _run(self, name: str, module, tokens: list, extra=()):
        """tokens: (tensor, token dim) pairs, cut into the pieces; extra: passed to every piece as they are."""
        outs, start = [], 0
        for piece in self.pieces:
            end = start + piece.n
            cut = [_dense(t[start:end] if d == 0 else t[:, start:end]) for t, d in tokens]
            outs.append(getattr(piece, name)(module, *cut, *extra))
            start = end
        return _cat(outs)


def _cat(parts: list):
    """The tiles' outputs (nested tuples of [1, n, ...] tensors) joined along the token dim."""
    if isinstance(parts[0], tuple):
        return tuple(_cat([p[i] for p in parts]) for i in range(len(parts[0])))
    return torch.cat(parts, dim=1)


def _nested(fn, value):
    """fn applied to every tensor of a nested tuple (None kept)."""
    if isinstance(value, tuple):
        return tuple(_nested(fn, v) for v in value)
    return None if value is None else fn(value)


def _join0(parts: list):
    """The tiles' outputs (nested tuples of batch-first tensors, or None) joined along dim 0."""
    if isinstance(parts[0], tuple):
        return tuple(_join0([p[i] for p in parts]) for i in range(len(parts[0])))
    return None if parts[0] is None else torch.cat(parts)


def _flat(value) -> list[torch.Tensor]:
    if isinstance(value, tuple):
        return [t for v in value for t in _flat(v)]
    return [] if value is None else [value]
