"""The DeepSeek-V4.1 backbone: embed -> 4 hyper-connection copies -> (Engram) + blocks -> collapse ->
norm -> head (spec-v41.md §2, §5, §6).

Single-pass mHC (spec §6): a block's attention collapses the copies with the `pre` mix computed by the
previous block's FFN (layer 0: one-hot on copy 0); the FFN collapses with the `pre` computed from this
block's attention input; the final collapse uses the last FFN's `pre`. `post` and `comb` of each
sublayer expand its output back to the copies and mix the residual.

The encoder/decoder split (layers < n_layers/2 vs the rest) is a property of the weights and the layer
schedule (the decoder's only global KV is layer 20's compressor over the encoder output); this full
forward runs all layers over every token, like the reference. The CED prefill shortcut belongs to the
inference engine.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from dsv41 import ops
from dsv41.config import ModelConfig
from dsv41.model import dspark
from dsv41.model.attention import _trace
from dsv41.model.block import Block
from dsv41.model.cache import ModelCache
from dsv41.model.engram import EngramLayout, NgramHasher
from dsv41.model.forward import AttentionBackend, run_layers
from dsv41.model.layers import Linear, RMSNorm, weight_copy
from dsv41.model.moe import RoutingRecord
from dsv41.model.training import forward_train
from dsv41.vision.processor import ImagePatches
from dsv41.vision.vit import Aligner, VisionTransformer


class CacheAttention(AttentionBackend):
    """The plain loop's attention backend: every block reads and writes the contiguous `ModelCache` at
    positions start_pos.. (its selections shared through the forward's `shared` dict)."""

    def __init__(self, start_pos: int, cache: ModelCache, shared: dict):
        self.start_pos, self.cache, self.shared = start_pos, cache, shared

    def attend(self, layer, x: torch.Tensor) -> torch.Tensor:
        return layer.attn(x, self.start_pos, self.cache, self.shared)


class Transformer(nn.Module):
    """The V4.1 language model. `forward(input_ids, start_pos, cache)` handles prefill and decode."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # two RoPE tables shared by all layers: plain for ratio-0 layers, YaRN for compressed ones
        self.rope_plain = ops.RotaryTable(cfg.rope_head_dim, cfg.rope_theta)
        self.rope_yarn = ops.RotaryTable(
            cfg.rope_head_dim,
            cfg.compress_rope_theta,
            cfg.original_seq_len,
            cfg.rope_factor,
            cfg.beta_fast,
            cfg.beta_slow,
        )
        self.engram_layout = EngramLayout.from_config(cfg)
        engram_rows = {}
        if self.engram_layout is not None:
            derived = self.engram_layout.table_rows()
            if derived != tuple(cfg.engram_num_embeddings):
                raise ValueError(
                    f"ModelConfig.engram_num_embeddings: the prime layout gives {list(derived)} rows, "
                    f"the config says {list(cfg.engram_num_embeddings)}"
                )
            engram_rows = dict(zip(cfg.engram_layer_ids, derived))
            self.engram_hash = NgramHasher(cfg, self.engram_layout)
        else:
            self.engram_hash = None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, dtype=torch.bfloat16)
        self.layers = nn.ModuleList(
            Block(cfg, i, self.rope_yarn if cfg.compress_ratios[i] else self.rope_plain, engram_rows.get(i))
            for i in range(cfg.n_layers)
        )
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        # the DSpark drafter (mtp.*): sliding-window stages sharing embed and head with the backbone
        self.mtp = nn.ModuleList(dspark.DSparkStage(cfg, k, self.rope_plain) for k in range(cfg.drafter_stages))
        # stored bf16 in the checkpoint, kept fp32 here so the logits come out in fp32
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, dtype=torch.float32)
        if cfg.vision_enabled:  # DeepSeek-ViT + aligner + the span markers' learned embeddings (dsv41.vision)
            self.vision = VisionTransformer(
                cfg.vision_dim,
                cfg.vision_n_layers,
                cfg.vision_n_heads,
                cfg.vision_inter_dim,
                cfg.vision_patch_size,
                cfg.vision_rope_theta,
            )
            self.aligner = Aligner(cfg.vision_dim, cfg.dim, cfg.vision_downsample_ratio)
            self.image_start = nn.Parameter(torch.zeros(cfg.dim, dtype=torch.bfloat16))
            self.image_end = nn.Parameter(torch.zeros(cfg.dim, dtype=torch.bfloat16))
            self.image_newline = nn.Parameter(torch.zeros(cfg.dim, dtype=torch.bfloat16))
        else:
            self.vision = self.aligner = None
        self.row_chunk = 0
        self._numeric_modules: list | None = None  # see numerics()
        self._numeric_holder_dicts: tuple | None = None  # (modules, setting -> their __dicts__)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self, batch_size: int, max_seq_len: int) -> ModelCache:
        return ModelCache.create(self.cfg, batch_size, max_seq_len, self.device)

    def set_reference_numerics(self, enabled: bool = True) -> None:
        """Reference numerics, for golden parity: canonical numerics (dsv41.ops.canonical) in every op whose
        result could depend on the machine (GEMMs, einsums, sums and means, softmax, Sinkhorn, exp, sigmoid,
        softplus, SiLU, GELU, rsqrt, the RoPE rotation), each computed in float64 and rounded once at the
        reference's rounding points; and `torch.topk`'s own tie-breaking in the indexer, candidate pool and
        MoE gate (off: ties go to the lowest position / expert id, whatever the layout). The same bits on
        every CPU by construction; several times slower than the fast kernels, so keep it for checks."""
        self._set_numerics(reference_numerics=enabled, canonical_ties=not enabled)

    def _modules_with_numerics(self) -> list:
        """The modules holding numerics settings (row_chunk, canonical_ties, reference_numerics), found once."""
        if self._numeric_modules is None:
            self._numeric_modules = [
                m
                for m in self.modules()
                if hasattr(m, "row_chunk") or hasattr(m, "canonical_ties") or hasattr(m, "reference_numerics")
            ]
        return self._numeric_modules

    def _numeric_holders(self) -> dict[str, list[dict]]:
        """For each numerics setting, the __dict__ of every module holding it (found once, with the modules):
        `numerics` then visits only those (~1,000 modules on `small`, most holding one setting)."""
        modules = self._modules_with_numerics()
        if self._numeric_holder_dicts is None or self._numeric_holder_dicts[0] is not modules:
            holders: dict[str, list[dict]] = {}
            for module in modules:
                for name in (
                    "row_chunk",
                    "canonical_ties",
                    "reference_numerics",
                    "fp32_rows",
                    "fast_kernels",
                    "rows_kernel",
                ):
                    if name in module.__dict__:
                        holders.setdefault(name, []).append(module.__dict__)
            self._numeric_holder_dicts = (modules, holders)
        return self._numeric_holder_dicts[1]

    def _set_numerics(self, **values) -> None:
        """Set each named setting on every module that has it."""
        for module in self._modules_with_numerics():
            for name, value in values.items():
                if hasattr(module, name):
                    setattr(module, name, value)

    @contextmanager
    def numerics(
        self, row_chunk: int, reference: bool = False, fp32_rows: int = 0, fast: bool = False, rows_kernel: bool = False
    ):
        """Within the block: batch-invariant GEMMs in `row_chunk`-row chunks, reference or canonical
        numerics (see `set_reference_numerics`) and eval mode; the model's own settings come back after,
        so a caller that lends its model (the engine) does not change it.

        Entered once per engine step, so it is kept cheap: only settings that differ are written (plain
        attributes, straight into the module's __dict__, bypassing nn.Module.__setattr__), and eval mode
        is set only when the model is training (a recursive `train()` costs ~2 ms per call at 12 layers)."""
        wanted = {
            "row_chunk": row_chunk,
            "canonical_ties": not reference,
            "reference_numerics": reference,
            "fp32_rows": fp32_rows,  # fast numerics: small calls as fp32 GEMMs (Linear.keep_fp32_copy)
            "fast_kernels": fast,  # fast numerics: kernels judged statistically (Attention.attend's C++ attention)
            "rows_kernel": rows_kernel,  # the few-row C++ GEMM kernel (Linear._rows_kernel_serves says where)
        }
        changed = []  # (the modules' __dict__s holding a setting, its name, their previous values)
        holders = self._numeric_holders()
        for name, value in wanted.items():
            dicts = holders.get(name, ())
            previous = [attrs[name] for attrs in dicts]
            if previous.count(value) != len(previous):
                changed.append((dicts, name, previous))
                for attrs in dicts:
                    attrs[name] = value
        training = self.training
        try:
            if training:
                self.train(False)
            yield self
        finally:
            for dicts, name, previous in reversed(changed):
                for attrs, value in zip(dicts, previous):
                    attrs[name] = value
            if training:
                self.train(True)

    def _bf16_linears(self) -> list[Linear]:
        return [m for m in self.modules() if isinstance(m, Linear) and m.weight.dtype == torch.bfloat16]

    def keep_fp32_gemm_copies(self) -> int:
        """fp32 copies of every bf16 Linear weight, for `numerics(fp32_rows=)` (fast numerics on a machine
        where the probe found small fp32 GEMMs faster, dsv41.ops.gemm_choice). Returns the copies' bytes."""
        return sum(m.keep_fp32_copy() for m in self._bf16_linears())

    def bf16_linear_shapes(self) -> list[tuple[int, int]]:
        """[out, in] of every bf16 Linear weight (what `keep_fp32_gemm_copies` copies)."""
        return sorted({(m.out_features, m.in_features) for m in self._bf16_linears()})

    def _kernel_probes(self) -> dict:
        """name -> (verdict, args) of the fused kernels this model uses (dsv41.ops.fused)."""
        cfg, device = self.cfg, self.device.type
        probes = {
            "sinkhorn": (ops.sinkhorn.fused_normalize_agrees, (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, device)),
            "hc_mix": (ops.mhc.mix_fusion_agrees, (cfg.hc_mult, device)),
        }
        if any(layer.attn.indexer is not None for layer in self.layers):
            probes["index_score_epilogue"] = (ops.indexer.epilogue_fusion_agrees, (cfg.index_n_heads, device))
            probes["topk_keys"] = (ops.indexer.keys16_fusion_agrees, (device,))
        return probes

    def prepare_kernels(self, when: str = "now") -> dict:
        """Build and check the fused kernels this model uses (dsv41.ops.fused) before the first request
        rather than inside it: compiling them takes seconds (tens on a cold cache). Returns which are in
        use (name -> True/False; None while still being built). when: 'now' (wait for them),
        'background' (build them on a daemon thread and return at once) or 'off' (do not build them
        unless someone asks for them with 'now'). Until a kernel is built the eager reference runs, which
        gives the same bits."""
        if not ops.fused.enabled():  # DSV41_FUSED=0: nothing is compiled
            return {}
        probes = self._kernel_probes()
        if when == "background":
            ops.fused.settle_in_background(list(probes.values()))
        elif when == "off":
            for verdict, args in probes.values():
                verdict.defer(*args)
        elif when == "now":
            for verdict, args in probes.values():
                verdict.settle(*args)
        else:
            raise ValueError(f"prepare_kernels: when must be 'now', 'background' or 'off', got {when!r}")
        return self.kernel_status()

    def kernel_status(self) -> dict:
        """name -> True/False (fused kernel in use or not), None while it is still being built."""
        if not ops.fused.enabled():
            return {}
        return {name: verdict.peek(*args) for name, (verdict, args) in self._kernel_probes().items()}

    def set_batch_invariant(self, row_chunk: int = 16) -> None:
        """Make every token-wise GEMM run in fixed chunks of `row_chunk` rows (0 turns it off), so a
        token's logits do not depend on which other tokens share the batch (see ops.invariant_matmul)."""
        if row_chunk < 0:
            raise ValueError(f"row_chunk must be >= 0, got {row_chunk}")
        self._set_numerics(row_chunk=row_chunk)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden [..., dim] bf16 -> fp32 logits [..., vocab]."""
        if self.norm.reference_numerics:
            return ops.canonical.linear(x.float(), self.head.weight)
        return ops.invariant_matmul(x.float(), self.head.weight, self.row_chunk)

    def keep_bf16_head(self) -> int:
        """Keep a bf16 copy of the fp32 head (returns its bytes) for `head_bf16`: the compiled batch-1 decode
        step reads it instead of the head (dsv41.engine.compiled.final_logits), half the bytes of the largest
        single weight of a decode step."""
        self.__dict__["_head_bf16"] = None
        self.head_bf16()
        return self.head.weight.numel() * 2

    def head_bf16(self) -> torch.Tensor | None:
        """The bf16 copy of the head (`keep_bf16_head`), made again when the head's weight changed (its version
        or storage); None if none is kept."""
        if "_head_bf16" not in self.__dict__:
            return None
        return weight_copy(self.__dict__, "_head_bf16", self.head.weight, torch.bfloat16)

    def set_engram_token_map(self, token_map: torch.Tensor) -> None:
        """Install the raw-id -> compressed-id map used by the Engram hash (spec §5)."""
        if self.engram_hash is None:
            raise ValueError("this model has no Engram layers")
        self.engram_hash.set_token_map(token_map)

    # ------------------------------------------------------------------ images (dsv41.vision)
    def embed_image(self, image: ImagePatches, trace: dict | None = None, name: str = "") -> torch.Tensor:
        """One preprocessed image -> its span's input embeddings [span_length, dim] bf16: IMAGE_START, the
        aligner rows with IMAGE_NEW_LINE after each row of llm_w, IMAGE_END (golden README "Span layout")."""
        if self.vision is None:
            raise ValueError("this model has no vision tower (config vision_n_layers = 0)")
        features = self.vision(image.patches.to(self.device), image.vit_h, image.vit_w)  # [vit_h * vit_w, vision_dim]
        rows = self.aligner(features, image.vit_h, image.vit_w)  # [llm_h * llm_w, dim]
        if trace is not None:
            trace[f"{name}vit_out"], trace[f"{name}aligner_out"] = features, rows
        grid = rows.view(image.llm_h, image.llm_w, -1)
        newline = self.image_newline.expand(image.llm_h, 1, -1)
        body = torch.cat([grid, newline], dim=1).reshape(-1, rows.size(-1))  # [llm_h * (llm_w + 1), dim]
        return torch.cat([self.image_start[None], body, self.image_end[None]])

    def embed_inputs(
        self, input_ids: torch.Tensor, images: list | None = None, trace: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token embeddings [B, S, dim] with image spans filled in, and the [B, S] int64 token types
        (-1 text, 0..3 the span's kinds) or None without images. `images`: (row, start, ImagePatches)
        triples, the span occupying positions start .. start + span_length - 1 of that row."""
        x = self.embed(input_ids)  # [B, S, dim] bf16
        if not images:
            return x, None
        x = x.clone()
        types = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
        for k, (row, start, image) in enumerate(images):
            end = start + image.span_length
            if start < 0 or end > input_ids.size(1):
                raise ValueError(f"image {k}: span {start}..{end - 1} lies outside the {input_ids.size(1)} positions")
            if (types[row, start:end] >= 0).any():
                raise ValueError(f"image {k}: its span overlaps another image's")
            if (input_ids[row, start:end] != self.cfg.image_token_id).any():
                raise ValueError(f"image {k}: span positions must carry image_token_id {self.cfg.image_token_id}")
            x[row, start:end] = self.embed_image(image, trace, f"vision.images.{k}.")
            types[row, start:end] = torch.tensor(image.token_types(), device=types.device)
        return x, types

    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int = 0,
        cache: ModelCache | None = None,
        last_only: bool = False,
        trace: dict | None = None,
        token_types: torch.Tensor | None = None,
        train_options=None,
        drafter_inputs: dict | None = None,
        inputs_embeds: torch.Tensor | None = None,
        images: list | None = None,
        routing: RoutingRecord | None = None,
    ) -> torch.Tensor:
        """input_ids [B, S] int64 at positions start_pos..start_pos+S-1.

        cache: state from earlier calls (required when start_pos > 0); without one a temporary cache
        sized to this call is used. Returns fp32 logits [B, S, vocab], or [B, 1, vocab] with last_only.
        trace: if a dict, receives named intermediates (the golden sets' `hidden.*`/`debug.*` names).
        token_types: optional [B, S], bool (True inside image spans) or int64 (-1 text, >= 0 a span kind):
        span tokens route with `bias_vl` and are dead to Engram.
        inputs_embeds: optional [B, S, dim] bf16 replacing the token embeddings (image spans filled in,
        see `embed_inputs`); input_ids still feed the Engram hash.
        train_options: a `dsv41.model.training.TrainOptions` runs the training forward instead and returns
        its `TrainOutput` (called through the module so wrappers such as FSDP2 see the call); with it,
        `images` ((row, start, ImagePatches) as for `embed_inputs`) are embedded inside the call, so the
        vision tower trains with the rest.
        drafter_inputs: if a dict, receives "main_hidden" [B, S, n_targets * dim] bf16, what the DSpark
        drafter reads (every position, also with last_only); see `draft_prefill` and `draft`.
        routing: a `RoutingRecord` that receives every MoE layer's expert ids ([B*S, k], layer order), or
        with `replay` set dictates them (router replay, dsv41.rl.policy).
        """
        if images is not None and train_options is None:
            raise ValueError("images= is for the training forward; inference takes inputs_embeds from embed_inputs")
        if train_options is not None:  # the differentiable training forward (dsv41.model.training)
            return forward_train(self, input_ids, train_options, token_types, images)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        if s == 0:
            raise ValueError("input_ids is empty")
        if cache is None:
            if start_pos != 0:
                raise ValueError("start_pos > 0 needs the cache of the earlier calls")
            cache = self.new_cache(b, s)
        cache.check_fits(b, start_pos, s)
        if input_ids.min() < 0 or input_ids.max() >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")

        shared: dict = {"trace": trace}
        if routing is not None:
            shared["moe_aux"] = routing
        image_mask = token_types
        if image_mask is not None and image_mask.dtype != torch.bool:
            image_mask = image_mask >= 0
        text_mask = None if image_mask is None else ~image_mask
        hash_ids = None
        if self.engram_hash is not None:
            hash_ids = self.engram_hash(input_ids, start_pos, cache.engram_ids, text_mask)

        if inputs_embeds is None:
            x = self.embed(input_ids)  # [B, S, dim] bf16
        else:
            if inputs_embeds.shape != (b, s, self.cfg.dim):
                raise ValueError(f"inputs_embeds must be [{b}, {s}, {self.cfg.dim}], got {tuple(inputs_embeds.shape)}")
            x = inputs_embeds.to(torch.bfloat16)
        _trace(shared, "hidden.embed", x)
        h = x.unsqueeze(2).repeat(1, 1, self.cfg.hc_mult, 1)  # [B, S, hc, dim]
        pre_mix = torch.zeros(b, s, self.cfg.hc_mult, dtype=torch.float32, device=h.device)
        pre_mix[:, :, 0] = 1.0  # layer 0 collapses onto copy 0
        backend = CacheAttention(start_pos, cache, shared)
        capture = drafter_inputs is not None
        h, pre_mix, hidden = run_layers(self, h, pre_mix, backend, shared, image_mask, hash_ids, capture)
        if capture and hidden:
            drafter_inputs["main_hidden"] = torch.cat(hidden, dim=-1)
        x = self.norm(Block.hc_pre(h, pre_mix, self.norm.reference_numerics))
        if last_only:
            x = x[:, -1:]
        _trace(shared, "hidden.final_norm_last", x[:, -1])
        return self.logits(x)

    # ------------------------------------------------------------------ DSpark drafter (dsv41.model.dspark)
    def draft_prefill(self, main_hidden: torch.Tensor, start_pos: int, cache: ModelCache) -> None:
        """Write the drafter's rings for positions start_pos.. from a forward's `drafter_inputs`."""
        self._need_drafter()
        dspark.prefill(self.mtp, main_hidden, start_pos, cache)

    def draft(
        self,
        first: torch.Tensor,
        main_hidden: torch.Tensor,
        pos: int,
        cache: ModelCache,
        trace: dict | None = None,
        choose=None,
    ) -> dspark.Draft:
        """Draft dspark_block_size tokens after backbone position `pos` (see dsv41.model.dspark.draft)."""
        self._need_drafter()
        return dspark.draft(self, first, main_hidden, pos, cache, trace, choose)

    def _need_drafter(self) -> None:
        if not len(self.mtp):
            raise ValueError("this model has no DSpark drafter (config n_mtp_layers / dspark_block_size)")
