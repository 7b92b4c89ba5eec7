"""Engram tables sharded over the ranks of a serve, or kept in host memory (issue 32; spec-v41.md §5
"Size" and "Inference placement"; ../shared/docs/serving-at-scale.md §4 "Engram").

The release's two Engram tables are ~384M rows x 256 FP8 channels each (plus UE8M0 scales): ~98 GB apiece,
40% of the checkpoint, so a rank that holds them whole cannot fit eight-way expert parallelism into 141 GB.
The lookup is an embedding gather (`EngramTable.read`: rows dequantised element by element, no reduction),
so the rows can live anywhere as long as each token gets its rows' exact bits. Two placements, either or
both:

- **sharded** (the vocab-parallel-embedding pattern): rank r of W holds the rows `row_range(N, r, W)` of
  every table (contiguous; `expert_range`'s split). A forward's hash ids [B, S, cols] are deduplicated, and
  each distinct id is sent to the rank owning its row, which reads it (`EngramTable.read` on its local
  slice) and sends the bf16 row back as bytes; the asker scatters the rows back to [B, S, cols, dim].
  **Exact**: every row value is computed by exactly one rank with the single-device formula on the same
  stored bytes (element-wise dequantisation, so the row's bits do not depend on the other ids read with it),
  moved as raw bytes, and only gathered (indexed) afterwards; no value is summed with another, so nothing
  can reorder a sum or flip the sign of a zero (an all-reduce SUM of zero-masked partial lookups would:
  -0.0 + 0.0 = +0.0). Hence bit-identical to one device
  (tests/distributed/test_engram_parallel.py).
- **host**: the table (or this rank's slice) is kept off the device, in CPU memory, where `module.to(...)`
  does not move it (it is not a parameter or buffer); a lookup copies the ids to the host, reads there and
  copies the rows to the ids' device (spec §5: "rows can be loaded ahead of time from host memory"). On this
  CPU-only machine host and device are the same memory, so host placement is exercised (the lookup path and
  that the tables leave the module's parameters) but not timed against a GPU.

Which ranks ask which: the lookups travel in the same *rounds* as the MoE all-to-alls
(`dsv41.distributed.expert_parallel.ExpertParallel`, a table is one more tagged server there), because a
rank's forward count per step varies (bounded replay, retries, no work at all) and one shared round protocol
is what lets a rank at a table lookup meet a rank serving in `end_step` without deadlock; ranks with other
tokens, fewer tokens or none still serve their rows in `end_step`. The group is the expert-parallel group
when expert parallelism is on (with D x T, TP rank t of every engine: each engine's TP ranks ask the same
ids, each of its own peer), otherwise the whole world (one rounds object is created for it).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.distributed.expert_parallel import ExpertParallel, as_dtype, expert_range
from dsv41.model.engram import EngramTable

ID_BYTES = 8  # a request item: the global row id, int64


def row_range(rows: int, rank: int, world: int) -> range:
    """The rows of a `rows`-row table rank `rank` of `world` holds: contiguous, the first ranks one larger."""
    return expert_range(rows, rank, world)


def engram_tables(model: nn.Module) -> dict[str, nn.Module]:
    """ "layers.<i>.engram.embed" -> that layer's table module, in model order."""
    return {
        f"layers.{i}.engram.embed": block.engram.embed
        for i, block in enumerate(model.layers)
        if block.engram is not None
    }


class ShardedEngramTable(nn.Module):
    """One Engram layer's table rows `rows` (a range of the whole table's `n_rows`), answering lookups of the
    whole table: its own rows read here, the others' asked of their owners through `rounds` (None: this
    module holds every row). `weight`/`scale` keep the names of `EngramTable`'s, so a checkpoint loads into
    them (sliced by `engram_row_slice`)."""

    kind = "engram"  # the round's kind (ExpertParallel.served)
    in_bytes = ID_BYTES

    def __init__(self, n_rows: int, dim: int, rows: range, block: int = 32):
        super().__init__()
        self.n_rows, self.dim, self.rows, self.block = n_rows, dim, rows, block
        self.out_bytes = dim * torch.bfloat16.itemsize  # an answer: one bf16 row
        local = len(rows)
        self.weight = nn.Parameter(torch.zeros(local, dim, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(local, dim // block, dtype=torch.float8_e8m0fnu), requires_grad=False)
        self.host: tuple[torch.Tensor, torch.Tensor] | None = None  # (weight, scale) in CPU memory
        self.dispatcher: ExpertParallel | None = None  # the rounds; `dispatcher_of` finds them here
        self.tag = -1
        self.bounds = torch.tensor([0])  # [W + 1] row boundaries of the ranks, set by `attach`

    @classmethod
    def of(cls, table: EngramTable, rows: range) -> ShardedEngramTable:
        """`rows` of a whole `EngramTable` (copied: the whole table can then be dropped)."""
        if table.scale is None:
            raise ValueError("a trainable (dequantised) Engram table cannot be sharded: serving reads FP8 rows")
        with torch.device(table.weight.device):
            out = cls(table.weight.size(0), table.weight.size(1), rows, table.block)
        if table.weight.device.type != "meta":
            with torch.no_grad():
                out.weight.copy_(table.weight[rows.start : rows.stop])
                out.scale.copy_(table.scale[rows.start : rows.stop])
        return out

    def attach(self, rounds: ExpertParallel | None) -> None:
        """Serve and ask through `rounds` (every rank of its group holds `row_range(n_rows, r, W)`)."""
        if rounds is None:
            if len(self.rows) != self.n_rows:
                raise RuntimeError("a table holding part of its rows needs the rounds of its group")
            return
        mine = row_range(self.n_rows, rounds.rank, rounds.world)
        if mine != self.rows:
            raise RuntimeError(
                f"this table holds rows {self.rows.start}..{self.rows.stop}, but rank {rounds.rank} "
                f"of {rounds.world} owns {mine.start}..{mine.stop}"
            )
        self.bounds = torch.tensor(
            [row_range(self.n_rows, r, rounds.world).start for r in range(rounds.world)] + [self.n_rows]
        )
        self.dispatcher = rounds
        self.tag = rounds.add_server(self)

    def to_host(self) -> None:
        """Keep the rows in CPU memory, outside the module's parameters (so `.to(device)` leaves them)."""
        if self.host is None:
            self.host = (self.weight.detach().cpu(), self.scale.detach().cpu())
            del self.weight, self.scale

    def _read(self, local: torch.Tensor) -> torch.Tensor:
        """local row indices [n] -> bf16 [n, dim] on local's device."""
        if self.host is None:
            return EngramTable.read(self.weight, self.scale, local, self.block)
        weight, scale = self.host
        return EngramTable.read(weight, scale, local.cpu(), self.block).to(local.device)

    def serve(self, items: torch.Tensor) -> torch.Tensor:
        """items [R, 8] uint8 (global row ids, all in this rank's range) -> [R, dim * 2] uint8 (bf16 rows)."""
        ids = as_dtype(items, torch.int64).flatten()
        local = ids - self.rows.start
        if local.numel() and (int(local.min()) < 0 or int(local.max()) >= len(self.rows)):
            raise RuntimeError(f"Engram rows asked of rank holding {self.rows.start}..{self.rows.stop} lie outside it")
        return self._read(local).view(torch.uint8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 (global rows) -> bf16 [..., dim], each row's bits read by its owner."""
        if self.dispatcher is None:
            return self._read(ids.flatten() - self.rows.start).view(*ids.shape, self.dim)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.n_rows):
            raise IndexError(f"Engram row ids must lie in [0, {self.n_rows})")
        unique, inverse = torch.unique(ids.flatten(), sorted=True, return_inverse=True)  # [u], [n]
        # sorted ids are grouped by owner already (contiguous row ranges in rank order)
        owner = torch.searchsorted(self.bounds.to(unique.device), unique, right=True) - 1  # [u]
        counts = torch.bincount(owner, minlength=self.dispatcher.world)
        answers = self.dispatcher.request(self.tag, unique.view(-1, 1).view(torch.uint8), counts)  # [u, dim * 2]
        rows = answers.view(torch.bfloat16)  # [u, dim]
        return rows[inverse].view(*ids.shape, self.dim)

    def extra_repr(self) -> str:
        where = "host" if self.host is not None else "device"
        return f"rows {self.rows.start}..{self.rows.stop} of {self.n_rows}, dim {self.dim}, {where} memory"


def split_engram(model: nn.Module, rank: int, world: int) -> list[ShardedEngramTable]:
    """Replace every Engram table of `model` by rank `rank` of `world`'s rows (`row_range`; in place, also on
    a meta-device model before a sharded load fills the slices). Returns the new tables."""
    out = []
    for name, table in engram_tables(model).items():
        if isinstance(table, ShardedEngramTable):
            raise RuntimeError(f"{name}: the Engram table is already split")
        sharded = ShardedEngramTable.of(table, row_range(table.weight.size(0), rank, world))
        model.layers[int(name.split(".")[1])].engram.embed = sharded
        out.append(sharded)
    return out


def install_engram(model: nn.Module, rounds: ExpertParallel | None, memory: str = "device") -> list[ShardedEngramTable]:
    """Route every (split) Engram table of `model` through `rounds` (None: tables held whole, only `memory`
    changes) and place its rows in `memory` ("device" or "host"). Tables still whole are split first by the
    rounds' rank and world. Every rank of the group must call it on the same model structure, after
    `shard_experts` (the tags follow the MoE layers')."""
    if memory not in ("device", "host"):
        raise ValueError(f"Engram memory must be 'device' or 'host', got {memory!r}")
    rank, world = (rounds.rank, rounds.world) if rounds is not None else (0, 1)
    tables = []
    for name, table in engram_tables(model).items():
        if not isinstance(table, ShardedEngramTable):
            table = ShardedEngramTable.of(table, row_range(table.weight.size(0), rank, world))
            model.layers[int(name.split(".")[1])].engram.embed = table
        table.attach(rounds)
        if memory == "host":
            table.to_host()
        tables.append(table)
    return tables


def shard_engram(model: nn.Module, group=None, memory: str = "device") -> ExpertParallel | None:
    """Shard `model`'s Engram tables over the ranks of its expert-parallel dispatcher (after `shard_experts`)
    or, with none, of `group` (a new rounds object; default the world). Returns the rounds (None when the
    model has no Engram)."""
    from dsv41.distributed.expert_parallel import dispatcher_of

    if not engram_tables(model):
        return None
    rounds = dispatcher_of(model) or ExpertParallel(group)
    install_engram(model, rounds, memory)
    return rounds


def engram_row_slice(cfg, name: str, rank: int, world: int) -> slice | None:
    """The first-dimension slice of checkpoint tensor `name` an Engram-sharded rank reads, or None: the rows
    `row_range` of "layers.<i>.engram.embed.weight" and ".scale" (one scale row per table row)."""
    if world == 1 or not name.endswith((".engram.embed.weight", ".engram.embed.scale")):
        return None
    layer = int(name.split(".")[1])
    rows = cfg.engram_num_embeddings[list(cfg.engram_layer_ids).index(layer)]
    mine = row_range(rows, rank, world)
    return slice(mine.start, mine.stop)
