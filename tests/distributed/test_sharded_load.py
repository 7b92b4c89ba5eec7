"""Sharded weight loading (dsv41.distributed.sharded_load): an expert-parallel rank reads from the
safetensors file exactly the tensors it keeps (everything but the other ranks' routed experts), its bytes
read equal its share, the weights are the checkpoint's, and two ranks loaded this way give one device's
logits."""

import os
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

import dsv41.weights
from dsv41.config import preset
from dsv41.distributed.expert_parallel import expert_range
from dsv41.distributed.sharded_load import load_expert_shard
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.weights import load_model

WORLD = 2


def _write_checkpoint(folder) -> Transformer:
    model = init_random_weights(Transformer(preset("tiny")), seed=7).eval()
    save_file(
        {n: p.detach().contiguous() for n, p in model.named_parameters()}, os.path.join(folder, "model.safetensors")
    )
    model.cfg.to_json(os.path.join(folder, "config.json"))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-ckpt")
    return str(folder), _write_checkpoint(folder)


def _expert_of(name: str):
    match = re.search(r"\.experts\.(\d+)\.", name)
    return None if match is None else int(match.group(1))


@pytest.mark.parametrize("rank", range(WORLD))
def test_a_rank_reads_exactly_its_share(checkpoint, monkeypatch, rank):
    folder, whole = checkpoint
    read: list[str] = []
    opened = dsv41.weights._open

    class Spy:  # records every tensor whose bytes are read from the file
        def __init__(self, handle):
            self.handle = handle

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

    monkeypatch.setattr(dsv41.weights, "_open", lambda f: Spy(opened(f)))
    model = load_expert_shard(folder, rank, WORLD)
    cfg = model.cfg
    mine = expert_range(cfg.n_routed_experts, rank, WORLD)
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        stored = {k: f.get_tensor(k) for k in f.keys()}
    share = {k for k in stored if _expert_of(k) is None or _expert_of(k) in mine}
    assert set(read) == share and len(read) == len(share)  # each read once, none of the others' experts
    expected_bytes = sum(stored[k].numel() * stored[k].element_size() for k in share)
    assert model.load_report.bytes_read == expected_bytes
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == expected_bytes
    assert model.load_report.elsewhere == len(stored) - len(share)
    # the others' experts are placeholders without weights; what is held is the checkpoint's
    ffn = model.layers[0].ffn
    assert all(not list(ffn.experts[e].parameters()) for e in range(cfg.n_routed_experts) if e not in mine)
    params = dict(model.named_parameters())
    for name, p in whole.named_parameters():
        if name in params:
            assert torch.equal(params[name], p), name
        else:
            assert _expert_of(name) not in mine, name
    assert torch.equal(model.engram_hash.multipliers, whole.engram_hash.multipliers)


def _ids(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, 7 + 5 * rank), generator=torch.Generator().manual_seed(rank))


def _logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with model.numerics(16), torch.inference_mode():
        return model(ids, 0, model.new_cache(1, ids.size(1) + 4)).float()


def _rank(rank: int, world: int, port: int, folder: str) -> None:
    import torch.distributed as dist

    from dsv41.distributed.expert_parallel import end_step, shard_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load_expert_shard(folder, rank, world)
        shard_experts(model)
        logits = _logits(model, _ids(rank, model.cfg.vocab_size))
        with model.numerics(16), torch.inference_mode():
            end_step(model)
        torch.save(logits, os.path.join(folder, f"logits{rank}.pt"))
        dist.barrier()  # both ranks done before either tears its group down
    finally:
        dist.destroy_process_group()


def test_two_sharded_loads_give_one_device_logits(tmp_path):
    _write_checkpoint(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(WORLD, port, str(tmp_path)), nprocs=WORLD, start_method="spawn")
    whole = load_model(str(tmp_path))
    for rank in range(WORLD):
        want = _logits(whole, _ids(rank, whole.cfg.vocab_size))
        assert torch.equal(torch.load(tmp_path / f"logits{rank}.pt"), want), f"rank {rank}"
