"""Tensor parallelism (dsv41.distributed.tensor_parallel): two gloo ranks, each holding half of every
attention layer's query heads and output groups, give one device's logits bit for bit, for a prefill and for
decode steps after it; a layout that does not split the heads into whole output groups is refused."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from dsv41.config import preset
from dsv41.distributed.tensor_parallel import check_head_split, head_slices
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer

PROMPT = 21  # tokens: longer than tiny's window, so compressed entries are selected too
DECODE = 4


def _model(name: str) -> Transformer:
    return init_random_weights(Transformer(preset(name)), seed=7).eval()


def _run(model: Transformer, row_chunk: int = 16) -> list[torch.Tensor]:
    """Prefill logits, then the logits of DECODE greedy steps."""
    ids = torch.randint(3, model.cfg.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(1, PROMPT + DECODE + 1)
    out = []
    with model.numerics(row_chunk), torch.inference_mode():
        logits = model(ids, 0, cache).float()
        out.append(logits)
        for i in range(DECODE):
            token = logits[:, -1].argmax(-1, keepdim=True)
            logits = model(token, PROMPT + i, cache).float()
            out.append(logits)
    return out


def _rank(rank: int, world: int, port: int, name: str, out_dir: str, broken: bool) -> None:
    import torch.distributed as dist

    from dsv41.distributed.tensor_parallel import shard_attention_heads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model(name)
        total = sum(p.numel() for p in model.parameters())
        tp = shard_attention_heads(model)
        if broken:  # a deliberate fault: gather the groups in reverse rank order
            gather = tp.gather
            tp.gather = lambda x: torch.cat(list(reversed(gather(x).chunk(world, dim=-1))), dim=-1)
        kept = sum(p.numel() for p in model.parameters())
        torch.save({"logits": _run(model), "total": total, "kept": kept, "gathers": tp.gathers},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, name: str, world: int, broken: bool = False) -> list[dict]:
    mp.start_processes(_rank, args=(world, _free_port(), name, str(tmp_path), broken), nprocs=world,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("name", ["tiny", pytest.param("small", marks=pytest.mark.slow)])
def test_tensor_parallel_ranks_give_one_device_logits(tmp_path, name):
    got = _spawn(tmp_path, name, 2)
    model = _model(name)
    torch.set_num_threads(1)
    want = _run(model)
    cfg = model.cfg
    for rank, result in enumerate(got):
        for step, (g, w) in enumerate(zip(result["logits"], want)):
            assert torch.equal(g, w), f"rank {rank} step {step}: max diff {(g - w).abs().max()}"
        # each rank dropped half of every layer's wq_b rows, attn_sink entries and wo_a blocks
        attn = model.layers[0].attn
        per_layer = (attn.wq_b.weight.numel() + attn.attn_sink.numel() + attn.wo_a.weight.numel()) // 2
        assert result["total"] - result["kept"] == per_layer * cfg.n_layers
        # one gather per layer per forward
        assert result["gathers"] == cfg.n_layers * (1 + DECODE)


def test_gathering_in_the_wrong_order_changes_the_logits(tmp_path):
    got = _spawn(tmp_path, "tiny", 2, broken=True)
    want = _run(_model("tiny"))
    assert not torch.equal(got[0]["logits"][0], want[0])


def test_layouts_that_split_a_group_are_refused():
    tiny = preset("tiny")  # 4 heads in 2 output groups
    with pytest.raises(ValueError, match="must divide 2"):
        check_head_split(tiny, 4)
    with pytest.raises(ValueError, match="does not divide"):
        check_head_split(preset("small"), 4)
    check_head_split(tiny, 2)
    s = head_slices(tiny, 1, 2)
    assert (s["wq_b"], s["attn_sink"], s["wo_a"]) == (slice(128, 256), slice(2, 4), slice(32, 64))
