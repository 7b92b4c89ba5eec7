"""Expert parallelism (dsv41.distributed.expert_parallel): two gloo ranks, each serving its own prompt with
half of every layer's routed experts, give the logits one device gives each prompt, bit for bit. Every rank
ends every step with `end_step` (or `join_without_tokens` when it ran nothing), as the engine ranks do."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dsv41.config import preset
from dsv41.distributed.expert_parallel import expert_range
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer

PROMPTS = {0: 12, 1: 5, 2: 9, 3: 3}  # tokens per rank: uneven, so the all-to-all splits are uneven too


def _model(name: str) -> Transformer:
    return init_random_weights(Transformer(preset(name)), seed=7).eval()


def _prompt(rank: int, vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPTS[rank]), generator=torch.Generator().manual_seed(rank))


def _logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with model.numerics(16), torch.inference_mode():
        return model(ids, 0, model.new_cache(1, ids.size(1) + 4)).float()


def _rank(rank: int, world: int, port: int, name: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv41.distributed.expert_parallel import end_step, join_without_tokens, shard_experts

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model(name)
        total = sum(p.numel() for p in model.parameters())
        whole = _model(name)  # every expert, for the single-device sum below
        shard_experts(model)
        kept = sum(p.numel() for p in model.parameters())
        ids = _prompt(rank, model.cfg.vocab_size)
        logits = _logits(model, ids)
        with model.numerics(16), torch.inference_mode():
            end_step(model)
        # a second step in which only rank 0 has tokens: the others serve its rounds with their experts
        if rank != 0:
            with model.numerics(16), torch.inference_mode():
                served = join_without_tokens(model)
            second = None
        else:
            second = _logits(model, _prompt(0, model.cfg.vocab_size))
            with model.numerics(16), torch.inference_mode():
                served = end_step(model)
        # the routed sum itself, in fp32 before any rounding: each token's outputs added in ascending expert
        # order, as MoE.forward adds them on one device (written out here, independently of the dispatcher)
        moe, ref = model.layers[1].ffn, whole.layers[1].ffn
        x = torch.randn(PROMPTS[rank], model.cfg.dim, generator=torch.Generator().manual_seed(10 + rank)).bfloat16()
        with model.numerics(16), whole.numerics(16), torch.inference_mode():
            weights, indices = moe.gate(x)
            routed = moe.dispatcher(moe, x, weights, indices)
            single = torch.zeros(x.shape, dtype=torch.float32)
            for e in range(len(ref.experts)):
                token, slot = torch.where(indices == e)
                single[token] += ref.experts[e](x[token], weights[token, slot, None])
            end_step(model)
        torch.save(
            {
                "logits": logits,
                "second": second,
                "total": total,
                "kept": kept,
                "served": served,
                "routed_equal": torch.equal(routed, single),
            },
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "name,world",
    [("tiny", 2), pytest.param("small", 2, marks=pytest.mark.slow), pytest.param("tiny", 4, marks=pytest.mark.slow)],
)
def test_expert_parallel_ranks_give_one_device_logits(tmp_path, name, world):
    mp.get_context("spawn")  # gloo under fork has deadlocked elsewhere
    mp.start_processes(_rank, args=(world, _free_port(), name, str(tmp_path)), nprocs=world, start_method="spawn")
    model = _model(name)
    cfg = model.cfg
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        want = _logits(model, _prompt(rank, cfg.vocab_size))
        assert torch.equal(got["logits"], want), f"rank {rank}: max diff {(got['logits'] - want).abs().max()}"
        assert got["routed_equal"], f"rank {rank}: the fp32 routed sum differs from one device's"
        # each rank holds only its experts: the others' weights are gone
        expert_params = sum(p.numel() for p in model.layers[0].ffn.experts[0].parameters()) * cfg.n_layers
        held = len(expert_range(cfg.n_routed_experts, rank, world))
        assert got["total"] - got["kept"] == expert_params * (cfg.n_routed_experts - held)
    # rank 0's second forward ran while the others had no tokens at all: each served one round per MoE layer
    assert torch.equal(torch.load(tmp_path / "rank0.pt")["second"], _logits(model, _prompt(0, cfg.vocab_size)))
    assert [torch.load(tmp_path / f"rank{r}.pt")["served"] for r in range(world)] == [0] + [cfg.n_layers] * (world - 1)


def test_expert_ranges_cover_every_expert_once():
    for n, world in [(384, 8), (16, 2), (8, 3), (5, 5)]:
        ranges = [expert_range(n, r, world) for r in range(world)]
        assert [e for r in ranges for e in r] == list(range(n))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    with pytest.raises(ValueError):
        expert_range(8, 2, 2)
