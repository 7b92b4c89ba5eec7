"""Engram tables sharded over gloo ranks (dsv41.distributed.engram_parallel): every rank holds only its rows
of each table, each serving its own prompt (uneven lengths; prefill then decode; then a step in which only
rank 0 has tokens), and the logits equal one device's bit for bit: with the experts split too (the lookups
share the MoE rounds), without expert parallelism (Engram-only rounds over the world), and with the rows in
host memory. The rows a rank holds are its share, counted against an independent split."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from dsv41.config import preset
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from tests.distributed.test_expert_parallel import _free_port

PROMPTS = {0: 12, 1: 5, 2: 9, 3: 3}  # tokens per rank: uneven, so the lookups' splits are uneven too


def _model(name: str = "tiny") -> Transformer:
    return init_random_weights(Transformer(preset(name)), seed=7).eval()


def _prompt(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPTS[rank]), generator=torch.Generator().manual_seed(rank))


def _run(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits, logits of one decode step after the greedy token): both through the cache."""
    with model.numerics(16), torch.inference_mode():
        cache = model.new_cache(1, ids.size(1) + 4)
        prefill = model(ids, 0, cache).float()
        token = prefill[:, -1].argmax(-1, keepdim=True)
        decode = model(token, ids.size(1), cache).float()
    return prefill, decode


def _rank(rank: int, world: int, port: int, mode: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv41.distributed.engram_parallel import ShardedEngramTable, engram_tables, shard_engram
    from dsv41.distributed.expert_parallel import end_step, join_without_tokens, shard_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model()
        if mode == "experts":
            shard_experts(model)
        rounds = shard_engram(model, memory="host" if mode == "host" else "device")
        tables = engram_tables(model)
        assert all(isinstance(t, ShardedEngramTable) for t in tables.values())
        held = {name: [(t.rows.start, t.rows.stop)] for name, t in tables.items()}
        stored = sum(p.numel() * p.element_size() for t in tables.values() for p in (t.host or t.parameters()))
        in_params = sum(p.numel() for t in tables.values() for p in t.parameters())
        ids = _prompt(rank, model.cfg.vocab_size)
        prefill, decode = _run(model, ids)
        with model.numerics(16), torch.inference_mode():
            end_step(model)
        before = dict(rounds.served)
        # a step in which only rank 0 has tokens: the others serve its lookups (and experts) with their rows
        second = None
        if rank == 0:
            second = _run(model, _prompt(0, model.cfg.vocab_size))
            with model.numerics(16), torch.inference_mode():
                end_step(model)
        else:
            with model.numerics(16), torch.inference_mode():
                join_without_tokens(model)
        served = {k: rounds.served[k] - before.get(k, 0) for k in rounds.served}
        torch.save(
            {
                "prefill": prefill,
                "decode": decode,
                "second": second,
                "held": held,
                "stored": stored,
                "in_params": in_params,
                "served": served,
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _split(rows: int, world: int) -> list[tuple[int, int]]:
    """Contiguous near-equal row ranges, the first ranks one larger (written out here, not imported)."""
    out, start = [], 0
    for r in range(world):
        n = rows // world + (1 if r < rows % world else 0)
        out.append((start, start + n))
        start += n
    return out


# ~75 s each on the shared 2-core machine: the layout the release needs (experts and Engram rows split) in the
# default tier, the rest in the slow tier
@pytest.mark.parametrize(
    "mode,world",
    [
        ("experts", 2),
        pytest.param("engram-only", 2, marks=pytest.mark.slow),
        pytest.param("host", 2, marks=pytest.mark.slow),
        pytest.param("experts", 4, marks=pytest.mark.slow),
        pytest.param("engram-only", 3, marks=pytest.mark.slow),
    ],
)
def test_sharded_engram_ranks_give_one_device_logits(tmp_path, mode, world):
    mp.start_processes(_rank, args=(world, _free_port(), mode, str(tmp_path)), nprocs=world, start_method="spawn")
    model = _model()
    cfg = model.cfg
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        prefill, decode = _run(model, _prompt(rank, cfg.vocab_size))
        assert torch.equal(got["prefill"], prefill), (
            f"rank {rank}: prefill max diff {(got['prefill'] - prefill).abs().max()}"
        )
        assert torch.equal(got["decode"], decode), (
            f"rank {rank}: decode max diff {(got['decode'] - decode).abs().max()}"
        )
        # its rows are its share of each table: the rows and their bytes (FP8 rows + one UE8M0 scale per 32)
        share = [_split(rows, world)[rank] for rows in cfg.engram_num_embeddings]
        assert list(got["held"].values()) == [[s] for s in share]
        row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
        assert got["stored"] == sum(b - a for a, b in share) * row_bytes
        # in host memory the rows are not the module's parameters (so `.to(device)` would leave them)
        assert (got["in_params"] == 0) == (mode == "host")
    second = torch.load(tmp_path / "rank0.pt")["second"]
    want = _run(model, _prompt(0, cfg.vocab_size))
    assert torch.equal(second[0], want[0]) and torch.equal(second[1], want[1])
    # while only rank 0 had tokens, every other rank served one lookup round per Engram layer per forward
    # (prefill and decode), and with the experts split one MoE round per layer per forward
    engram_layers = len(cfg.engram_layer_ids)
    for rank in range(1, world):
        served = torch.load(tmp_path / f"rank{rank}.pt")["served"]
        assert served["engram"] == 2 * engram_layers
        assert served["moe"] == (2 * cfg.n_layers if mode == "experts" else 0)


def test_row_ranges_cover_every_row_once():
    from dsv41.distributed.engram_parallel import row_range

    for rows, world in [(384006168, 8), (660, 2), (864, 3), (5, 5)]:
        ranges = [row_range(rows, r, world) for r in range(world)]
        assert [(r.start, r.stop) for r in ranges] == _split(rows, world)


def test_a_rank_reads_exactly_its_rows_from_the_checkpoint(tmp_path, monkeypatch):
    """From a checkpoint folder a rank reads its rows of each table (weight and scale, `get_slice`) and
    everything else whole: bytes read = the file minus the other rank's rows, and the rows are the file's."""
    from safetensors.torch import save_file

    import dsv41.weights
    from dsv41.distributed.engram_parallel import engram_tables
    from dsv41.distributed.sharded_load import load_shard

    whole = _model()
    save_file({n: p.detach().contiguous() for n, p in whole.named_parameters()}, str(tmp_path / "model.safetensors"))
    whole.cfg.to_json(str(tmp_path / "config.json"))
    cfg = whole.cfg
    opened = dsv41.weights._open
    file_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    row_bytes = cfg.engram_head_dim + cfg.engram_head_dim // 32
    for rank in range(2):
        sliced: dict = {}

        class Spy:  # records which tensors are read by rows
            def __init__(self, handle):
                self.handle = handle

            def keys(self):
                return self.handle.keys()

            def get_tensor(self, key):
                return self.handle.get_tensor(key)

            def get_slice(self, key):
                handle = self.handle

                class Part:
                    def __getitem__(self, rows):
                        sliced[key] = (rows.start, rows.stop)  # noqa: B023 (rows: this method's argument)
                        return handle.get_slice(key)[rows]  # noqa: B023

                return Part()

        monkeypatch.setattr(dsv41.weights, "_open", lambda f: Spy(opened(f)))
        model = load_shard(str(tmp_path), engram_rank=rank, engram_world=2)
        share = [_split(rows, 2)[rank] for rows in cfg.engram_num_embeddings]
        want = {
            f"layers.{layer}.engram.embed.{leaf}": rows
            for layer, rows in zip(cfg.engram_layer_ids, share)
            for leaf in ("weight", "scale")
        }
        assert sliced == want
        others = sum(n - (b - a) for n, (a, b) in zip(cfg.engram_num_embeddings, share)) * row_bytes
        assert model.load_report.bytes_read == file_bytes - others
        for name, table in engram_tables(model).items():
            ref = dict(whole.named_parameters())
            a, b = table.rows.start, table.rows.stop
            assert torch.equal(table.weight.view(torch.uint8), ref[name + ".weight"][a:b].view(torch.uint8))
            assert torch.equal(table.scale.view(torch.uint8), ref[name + ".scale"][a:b].view(torch.uint8))


def test_engram_options_auto_shards_with_expert_parallelism_and_bad_ones_are_named():
    from dsv41.distributed.config import ParallelConfig

    assert ParallelConfig(data_parallel_size=2, expert_parallel_size=2).engram_sharded
    assert not ParallelConfig(data_parallel_size=2).engram_sharded  # no rounds to ride: kept whole
    assert ParallelConfig(data_parallel_size=2, engram_sharding="sharded").engram_sharded
    assert not ParallelConfig(data_parallel_size=2, expert_parallel_size=2, engram_sharding="replicated").engram_sharded
    with pytest.raises(ValueError, match="more than one rank"):
        ParallelConfig(engram_memory="host").validate()
    with pytest.raises(ValueError, match="--engram-sharding must be one of"):
        ParallelConfig(data_parallel_size=2, engram_sharding="rows").validate()


def test_whole_tables_in_host_memory_give_one_device_logits():
    """--engram-memory host without sharding (no rounds): the tables leave the parameters, the logits stay."""
    from dsv41.distributed.engram_parallel import engram_tables, install_engram

    whole, model = _model(), _model()
    params = sum(p.numel() for p in model.parameters())
    tables = install_engram(model, None, "host")
    assert all(t.host is not None and len(t.rows) == t.n_rows for t in tables)
    table_params = sum(p.numel() for t in engram_tables(whole).values() for p in t.parameters())
    assert sum(p.numel() for p in model.parameters()) == params - table_params
    ids = _prompt(0, whole.cfg.vocab_size)
    got, want = _run(model, ids), _run(whole, ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_handoff_identity_does_not_depend_on_where_the_engram_rows_live():
    """A disaggregated pair may place Engram differently on its two sides (one device against sharded decode
    ranks): the hand-off's model identity must be the same for every placement of the same weights, and
    still tell other weights apart."""
    from dsv41.distributed.engram_parallel import install_engram, split_engram
    from dsv41.engine.handoff import model_identity

    want = model_identity(_model())
    for rank in range(2):
        model = _model()
        split_engram(model, rank, 2)
        assert model_identity(model) == want, f"rank {rank} of 2"
    host = _model()
    install_engram(host, None, "host")
    assert model_identity(host) == want
    other = _model()
    with torch.no_grad():
        next(p for n, p in other.named_parameters() if ".engram." in n and ".embed." not in n).add_(1)
    assert model_identity(other) != want
