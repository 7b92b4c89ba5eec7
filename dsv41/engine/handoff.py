"""The KV hand-off of prefill/decode disaggregation: everything a decode engine needs to continue a prompt
that another engine prefilled, as one checksummed byte string (spec-v41.md §8 "fixed state", §9).

What decode needs after a prompt of n tokens (and nothing else: V4.1's cache has no head sharding, so the
two sides may run different block sizes, pool sizes, batch limits or parallel layouts):
- per kv-source layer, the packed global entries 0 .. n // ratio - 1 (FP4 compressed KV + e4m3 scales,
  FP4 index keys + UE8M0 scales), addressed by entry index, never by block id, so the receiver lays them
  out in its own blocks;
- the fixed per-sequence state: every layer's FP8 window ring (+ UE8M0 scales), including the DSpark
  stages' rings when the sender speculates, each layer's first window position, and the ratio-2
  compressors' partial group (fp32 kv and gate scores);
- the fp32 logits of the last prompt position: the receiver samples the first token itself, so a seeded
  generator, logit processing and logprobs live on one side only and the output is what one engine gives;
- the token ids (the Engram n-gram history is hashed from them; the engine keeps no other copy), the
  bounded-replay positions (decoder_start / decoder_from), the DSpark rings' readable span, and the
  prefix-cache identity (sha256 of the token ids; the receiver registers its own blocks under its own
  chain hashes).

Wire format (version 1): MAGIC, u64 header length, the header (UTF-8 JSON), the header's crc32 (u32), then
each block's raw bytes in header order. Every block carries its dtype, shape, byte count and crc32, all
checked on arrival before anything is written into an engine: a flipped byte, a truncated or missing
block, trailing bytes or a model mismatch raise `HandoffError` naming the block.

Why crc32 (zlib) and not sha256: the threat is accidental corruption (a transport or a copy that
deduplicates memory regions and garbles state, as vLLM #57661 did), not an adversary. CRC-32 catches every
error burst of up to 32 bits (so any single corrupted byte, always) and most others with probability
1 - 2^-32, at ~3.7 GB/s here against sha256's ~1 GB/s. It is not a MAC: the workers' internal routes
belong on a trusted network (or behind --api-key).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import zlib
from dataclasses import dataclass, field

import torch

MAGIC = b"DSV41KVH"
VERSION = 1
_LEN = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float8_e4m3fn)}


class HandoffError(ValueError):
    """A hand-off that cannot be used: corrupt, truncated, incomplete or for another model. Never
    imported: no token is produced from such state."""


# the backbone attention tensors a tensor-parallel rank holds only its rows of
# (dsv41.distributed.tensor_parallel.parameter_slice): left out of the fingerprint, so that prefill and
# decode workers of different layouts (one device, TP=2, DP x EP) have the same identity
_HEAD_SPLIT = (".attn.wq_b.", ".attn.attn_sink", ".attn.wo_a.")


def _layout_dependent(name: str) -> bool:
    if ".experts." in name:  # expert parallelism: each rank its own experts
        return True
    if ".engram.embed." in name:  # Engram sharding: each rank its own table rows (or none, in host memory)
        return True
    return name.startswith("layers.") and ".indexer." not in name and any(k in name for k in _HEAD_SPLIT)


def model_identity(model) -> dict:
    """What must match between the two sides: the model config (sha256 of its fields) and a fingerprint of
    the weights (sha256 over the first 64 values of every parameter that every parallel layout holds whole:
    cheap at any size, and the same on every expert-, tensor- or Engram-sharded rank as on one device)."""
    cfg = dataclasses.asdict(model.cfg)
    config_hash = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if _layout_dependent(name):
            continue
        h.update(name.encode())
        h.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return {"config_sha256": config_hash, "weights_sha256": h.hexdigest()}


def prefix_identity(token_ids: list[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


@dataclass
class KVHandoff:
    """One prefilled prompt. `meta`: JSON-able request state; `tensors`: name -> CPU tensor."""

    meta: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def prompt_ids(self) -> list[int]:
        return self.meta["prompt_ids"]

    def kv_bytes(self) -> int:
        """Bytes of the global entries (they grow with the prompt; the rest is a fixed payload)."""
        return sum(_nbytes(t) for name, t in self.tensors.items() if name.startswith("kv"))

    def nbytes(self) -> int:
        return sum(_nbytes(t) for t in self.tensors.values())

    # ------------------------------------------------------------------ wire format
    def to_bytes(self) -> bytes:
        blocks, payloads = [], []
        for name, t in self.tensors.items():
            raw = _raw(t)
            blocks.append(
                {
                    "name": name,
                    "dtype": str(t.dtype),
                    "shape": list(t.shape),
                    "nbytes": len(raw),
                    "crc32": zlib.crc32(raw),
                }
            )
            payloads.append(raw)
        header = json.dumps({"version": VERSION, "meta": self.meta, "blocks": blocks}).encode()
        return b"".join([MAGIC, _LEN.pack(len(header)), header, _CRC.pack(zlib.crc32(header)), *payloads])

    @classmethod
    def from_bytes(cls, data: bytes, expect_identity: dict | None = None) -> KVHandoff:
        """Parse and verify every checksum; HandoffError names what is wrong."""
        data = memoryview(data)
        if len(data) < len(MAGIC) + _LEN.size or bytes(data[: len(MAGIC)]) != MAGIC:
            raise HandoffError("not a dsv41 KV hand-off (bad magic): truncated or not this format")
        (hlen,) = _LEN.unpack_from(data, len(MAGIC))
        at = len(MAGIC) + _LEN.size
        if hlen > len(data) - at - _CRC.size:
            raise HandoffError(f"truncated hand-off: the header needs {hlen} bytes, {len(data) - at} arrived")
        header = bytes(data[at : at + hlen])
        (crc,) = _CRC.unpack_from(data, at + hlen)
        if zlib.crc32(header) != crc:
            raise HandoffError("hand-off header checksum mismatch (crc32): the header was corrupted in transit")
        head = json.loads(header)
        if head.get("version") != VERSION:
            raise HandoffError(f"hand-off format version {head.get('version')}, this engine reads {VERSION}")
        at += hlen + _CRC.size
        tensors = {}
        for block in head["blocks"]:
            name, n = block["name"], block["nbytes"]
            raw = data[at : at + n]
            if len(raw) < n:
                raise HandoffError(f"truncated hand-off: block {name!r} needs {n} bytes, {len(raw)} arrived")
            if zlib.crc32(raw) != block["crc32"]:
                raise HandoffError(f"hand-off block {name!r} checksum mismatch (crc32): corrupted in transit")
            tensors[name] = _tensor(raw, block["dtype"], block["shape"], name)
            at += n
        if at != len(data):
            raise HandoffError(f"hand-off has {len(data) - at} bytes past its last block")
        handoff = cls(head["meta"], tensors)
        if expect_identity is not None:
            handoff.check_identity(expect_identity)
        return handoff

    def check_identity(self, identity: dict) -> None:
        theirs = self.meta.get("model", {})
        for key in ("config_sha256", "weights_sha256"):
            if theirs.get(key) != identity[key]:
                what = "config" if key.startswith("config") else "weights"
                raise HandoffError(
                    f"the hand-off was prefilled by a model with other {what} "
                    f"({str(theirs.get(key))[:12]}..., here {identity[key][:12]}...): "
                    f"prefill and decode workers must serve the same model"
                )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _tensor(raw, dtype: str, shape: list[int], name: str) -> torch.Tensor:
    if dtype not in _DTYPES:
        raise HandoffError(f"hand-off block {name!r} has dtype {dtype}, which no block of this format has")
    target = _DTYPES[dtype]
    numel = 1
    for s in shape:
        numel *= s
    if numel * target.itemsize != len(raw):
        raise HandoffError(f"hand-off block {name!r}: {len(raw)} bytes do not make a {dtype} tensor of shape {shape}")
    if not numel:
        return torch.empty(shape, dtype=target)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(target).reshape(shape)


# ---------------------------------------------------------------------------------------------- engine side


def export_sequence(engine, seq, logits: torch.Tensor) -> KVHandoff:
    """The hand-off of a sequence whose prompt the engine has just computed (before any token is sampled)."""
    n = seq.num_computed
    if n != len(seq.prompt_ids) or seq.output_ids:
        raise RuntimeError(f"hand-off export at position {n} of a {len(seq.prompt_ids)}-token prompt")
    pool, cache = engine.pool, seq.cache
    tensors: dict[str, torch.Tensor] = {"logits": logits.detach().float().cpu().clone()}  # [vocab]
    for layer, lay in pool.sources.items():
        entries = torch.arange(n // lay.ratio, device=cache.table.device)
        packed = pool.export_entries(layer, cache.table, entries)  # 4 x [entries, ...] packed bytes
        for part, t in zip(("kv_codes", "kv_scale", "key_codes", "key_scale"), packed):
            tensors[f"kv{layer}.{part}"] = t.cpu()
    state = cache.export_state()
    tensors["window_codes"] = state["window_codes"].cpu()  # [layers (+ drafter stages), W, D] fp8
    tensors["window_scale"] = state["window_scale"].cpu()  # [layers (+ stages), W, D / 32] UE8M0 bytes
    for layer, (kv, score) in state["group"].items():
        tensors[f"group{layer}.kv"] = kv.cpu()  # [1, ratio, D] fp32
        tensors[f"group{layer}.score"] = score.cpu()
    meta = {
        "model": engine.identity(),
        "prompt_ids": list(seq.prompt_ids),
        "num_computed": n,
        "first": list(state["first"]),
        "decoder_start": seq.decoder_start,
        "decoder_from": seq.decoder_from,
        "num_cached_tokens": seq.num_cached_tokens,
        "rows_first": seq.rows_first,
        "rows_end": seq.rows_end,
        "drafter_rings": int(engine.speculative),
        "prefix_sha256": prefix_identity(seq.prompt_ids),
        "images": image_identity(seq.images),
        "block_size": engine.config.block_size,
        "request_id": seq.request_id,
    }
    return KVHandoff(meta, tensors)


def expected_blocks(engine) -> set[str]:
    names = {"logits", "window_codes", "window_scale"}
    for layer in engine.pool.sources:
        names |= {f"kv{layer}.{p}" for p in ("kv_codes", "kv_scale", "key_codes", "key_scale")}
    for layer in engine.states.group_kv:
        names |= {f"group{layer}.kv", f"group{layer}.score"}
    return names


def image_identity(images) -> list:
    """[start, pixel digest] of each image of a prompt, in position order: an image span's positions all
    carry image_token_id, so the token ids alone do not say which pixels the prefilled state saw."""
    return [[start, image.digest] for start, image in sorted(images or [], key=lambda item: item[0])]


def check_handoff(engine, handoff: KVHandoff, prompt_ids: list[int], images=None) -> None:
    """Everything that can be checked before the engine has room for the request: same model, same
    prompt (token ids, and the pixels of its images), every block present with the shape this engine
    stores."""
    handoff.check_identity(engine.identity())
    if list(prompt_ids) != handoff.prompt_ids:
        raise HandoffError(
            f"the hand-off is for another prompt ({len(handoff.prompt_ids)} tokens, "
            f"prefix {handoff.meta.get('prefix_sha256', '')[:12]}...) than this request "
            f"({len(prompt_ids)} tokens)"
        )
    theirs, ours = handoff.meta.get("images", []), image_identity(images)
    if theirs != ours:
        raise HandoffError(
            f"the hand-off was prefilled with other images ({len(theirs)} image(s), pixel digests "
            f"{[d[:12] for _, d in theirs]}) than this request has ({len(ours)}, "
            f"{[d[:12] for _, d in ours]}): the same token ids, other pixels"
        )
    if prefix_identity(handoff.prompt_ids) != handoff.meta.get("prefix_sha256"):
        raise HandoffError("the hand-off's token ids do not match its prefix identity")
    missing = sorted(expected_blocks(engine) - set(handoff.tensors))
    if missing:
        raise HandoffError(f"the hand-off lacks block(s) {', '.join(missing)}")
    n, t = len(prompt_ids), handoff.tensors
    want = {"logits": [engine.model_config.vocab_size]}
    for layer, lay in engine.pool.sources.items():
        want[f"kv{layer}.kv_codes"] = [n // lay.ratio, engine.pool.kv_codes[layer].size(1)]
    for layer, kv in engine.states.group_kv.items():
        want[f"group{layer}.kv"] = [1, *kv.shape[1:]]
    w = engine.states.window_codes.shape
    if list(t["window_codes"].shape[1:]) != list(w[2:]) or t["window_codes"].size(0) < engine.model_config.n_layers:
        raise HandoffError(
            f"hand-off block 'window_codes' has shape {list(t['window_codes'].shape)}; "
            f"this engine's rings are {list(w[1:])}"
        )
    for name, shape in want.items():
        if list(t[name].shape) != shape:
            raise HandoffError(f"hand-off block {name!r} has shape {list(t[name].shape)}, expected {shape}")


def import_sequence(engine, seq, handoff: KVHandoff, cache) -> None:
    """Write a checked hand-off into a fresh SequenceCache whose blocks cover the prompt, and set the
    sequence up as if this engine had prefilled it: the next step samples the first token from the
    handed-off logits."""
    pool, meta, t = engine.pool, handoff.meta, handoff.tensors
    n = meta["num_computed"]
    device = cache.table.device
    for layer, lay in pool.sources.items():
        entries = torch.arange(n // lay.ratio, device=device)
        if entries.numel():
            packed = tuple(t[f"kv{layer}.{p}"].to(device) for p in ("kv_codes", "kv_scale", "key_codes", "key_scale"))
            pool.import_entries(layer, cache.table, entries, packed)
    rings = min(t["window_codes"].size(0), cache.window_codes.size(0))  # drafter rings if both sides have them
    cache.window_codes[:rings].copy_(t["window_codes"][:rings])
    cache.window_scale[:rings].copy_(t["window_scale"][:rings])
    cache.first = list(meta["first"])
    for layer, (kv, score) in cache.group.items():
        kv.copy_(t[f"group{layer}.kv"])
        score.copy_(t[f"group{layer}.score"])
    seq.cache = cache
    seq.num_computed = seq.prefill_target = n
    seq.decoder_start, seq.decoder_from = meta["decoder_start"], meta["decoder_from"]
    seq.num_cached_tokens = meta["num_cached_tokens"]
    seq.needs_rebuild = False
    both_draft = bool(meta.get("drafter_rings")) and engine.speculative
    seq.rows_first = meta["rows_first"] if both_draft else None  # no rings: the drafter starts them afresh
    seq.rows_end = meta["rows_end"] if both_draft else 0
    seq.restored_logits = t["logits"].to(device).clone()  # several choices may share one hand-off
