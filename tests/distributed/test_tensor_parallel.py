"""Tensor parallelism (dsv41.distributed.tensor_parallel): two gloo ranks, each holding half of every
attention layer's query heads and output groups, give one device's logits bit for bit, for a prefill and for
decode steps after it; a layout that does not split the heads into whole output groups is refused."""

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

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


def _rank(rank: int, world: int, port: int, name: str, out_dir: str, broken: bool, folder=None) -> None:
    import torch.distributed as dist

    from dsv41.distributed.sharded_load import load_shard
    from dsv41.distributed.tensor_parallel import TensorParallel, install_gather, shard_attention_heads

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = _model(name)
        total = sum(p.numel() for p in model.parameters())
        if folder is None:
            tp = shard_attention_heads(model)
        else:  # this rank reads only its head rows from the checkpoint
            model = load_shard(folder, tp_rank=rank, tp_world=world)
            tp = TensorParallel()
            install_gather(model, tp)
        if broken:  # a deliberate fault: gather the groups in reverse rank order
            gather = tp.gather
            tp.gather = lambda x: torch.cat(list(reversed(gather(x).chunk(world, dim=-1))), dim=-1)
        kept = sum(p.numel() for p in model.parameters())
        torch.save(
            {"logits": _run(model), "total": total, "kept": kept, "gathers": tp.gathers}, f"{out_dir}/rank{rank}.pt"
        )
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, name: str, world: int, broken: bool = False, folder=None) -> list[dict]:
    mp.start_processes(
        _rank, args=(world, _free_port(), name, str(tmp_path), broken, folder), nprocs=world, start_method="spawn"
    )
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _write_checkpoint(folder) -> Transformer:
    model = _model("tiny")
    save_file(
        {n: p.detach().contiguous() for n, p in model.named_parameters()}, os.path.join(folder, "model.safetensors")
    )
    model.cfg.to_json(os.path.join(folder, "config.json"))
    return model


# loaded from a checkpoint: slow tier (the FP8 golden test below also loads sliced in the default tier)
@pytest.mark.parametrize(
    "name,loaded",
    [
        ("tiny", False),
        pytest.param("tiny", True, marks=pytest.mark.slow),
        pytest.param("small", False, marks=pytest.mark.slow),
    ],
)
def test_tensor_parallel_ranks_give_one_device_logits(tmp_path, name, loaded):
    folder = None
    if loaded:
        folder = tmp_path / "ckpt"
        folder.mkdir()
        _write_checkpoint(folder)
    got = _spawn(tmp_path, name, 2, folder=None if folder is None else str(folder))
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


@pytest.mark.slow  # a deliberate fault: shows the equality test can fail
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


@pytest.mark.parametrize("rank", range(2))
def test_a_rank_reads_only_its_head_rows(tmp_path, monkeypatch, rank):
    import dsv41.weights
    from dsv41.distributed.sharded_load import load_shard

    whole = _write_checkpoint(tmp_path)
    sliced: dict[str, slice] = {}
    opened = dsv41.weights._open

    class Spy:  # records which tensors are read in slices, and which slice
        def __init__(self, handle):
            self.handle = handle

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key):
            return self.handle.get_tensor(key)

        def get_slice(self, key):
            spy = self

            class Part:
                def __getitem__(self, rows):
                    sliced[key] = rows
                    return spy.handle.get_slice(key)[rows]

            return Part()

    monkeypatch.setattr(dsv41.weights, "_open", lambda f: Spy(opened(f)))
    model = load_shard(str(tmp_path), tp_rank=rank, tp_world=2)
    cfg = whole.cfg
    file_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    split = 0
    for i in range(len(whole.layers)):
        for leaf in ("wq_b.weight", "attn_sink", "wo_a.weight"):
            name = f"layers.{i}.attn.{leaf}"
            part = dict(whole.named_parameters())[name]
            split += part.numel() * part.element_size()
            assert name in sliced, f"{name} was read whole"
            # the rank's rows are the checkpoint's rows of its heads
            assert torch.equal(dict(model.named_parameters())[name], part[sliced[name]])
    assert sliced["layers.0.attn.attn_sink"] == slice(2 * rank, 2 * rank + 2)
    assert not any(".indexer." in k for k in sliced)  # the indexer stays whole
    assert model.load_report.bytes_read == file_bytes - split // 2
    assert len(sliced) == 3 * cfg.n_layers


def test_diverged_tensor_parallel_ranks_stop_the_group():
    from dsv41.distributed.data_parallel import engine_replies
    from dsv41.engine.types import RequestOutput

    def reply(tokens):
        return {"outputs": [RequestOutput("r", tokens, "", tokens, "")], "unfinished": True}

    same = [reply([5]), reply([5]), reply([7]), reply([7])]
    assert engine_replies(same, 2) == [same[0], same[2]]
    with pytest.raises(RuntimeError, match="tensor-parallel rank 3 produced other tokens than rank 2"):
        engine_replies([reply([5]), reply([5]), reply([7]), reply([8])], 2)


def _vision_logits(model, folder: str) -> torch.Tensor:
    """The golden vision set's second row with its image spans (the released FP8 layout, vision tower on)."""
    from safetensors.torch import load_file

    from dsv41.vision import IMAGE_START, ImageProcessor

    model.set_batch_invariant(16)
    inputs = load_file(os.path.join(folder, "inputs.safetensors"))
    model.set_engram_token_map(inputs["engram_token_map"])
    ids = inputs["input_ids"].clone()
    ids[(ids == model.cfg.image_token_id) & (inputs["token_types"] < 0)] = model.cfg.image_token_id - 1
    processor = ImageProcessor.from_config(model.cfg)
    starts = (inputs["token_types"] == IMAGE_START).nonzero().tolist()
    images = [(row, start, processor(inputs[f"image_pixels.{k}"])) for k, (row, start) in enumerate(starts)]
    with torch.inference_mode():
        embeds, types = model.embed_inputs(ids, images)
        return model(ids, 0, None, inputs_embeds=embeds, token_types=types).float()


def _vision_rank(rank: int, world: int, port: int, folder: str, out_dir: str) -> None:
    import torch.distributed as dist

    from dsv41.distributed.sharded_load import load_shard
    from dsv41.distributed.tensor_parallel import TensorParallel, install_gather

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = load_shard(folder, tp_rank=rank, tp_world=world)
        install_gather(model, TensorParallel())
        torch.save(
            {"logits": _vision_logits(model, folder), "bytes_read": model.load_report.bytes_read},
            f"{out_dir}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def test_the_released_fp8_layout_with_images_splits_exactly(tmp_path):
    """The golden FP8 vision checkpoint (FP8 wq_b with its scale, FP8 wo_a + 32x32 scales dequantised on
    load, the vision tower replicated on both ranks): each TP rank reads its FP8 rows and scale rows, and
    the two give one device's logits for a prompt with images."""
    from dsv41.weights import load_model
    from tests.conftest import GOLDEN_DIR

    folder = os.path.join(GOLDEN_DIR, "v41-vision-fp8")
    mp.start_processes(_vision_rank, args=(2, _free_port(), folder, str(tmp_path)), nprocs=2, start_method="spawn")
    torch.set_num_threads(1)
    whole = load_model(folder)
    want = _vision_logits(whole, folder)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got["logits"], want), f"rank {rank}: max diff {(got['logits'] - want).abs().max()}"
        assert got["bytes_read"] < whole.load_report.bytes_read
