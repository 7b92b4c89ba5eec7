"""Training with images (issue 14 part 3): the synthetic image-text set (labels checked against the
pixels by an independent reading of the rendered image), batches, the training forward with images
(gradients reach the ViT, span tokens route with bias_vl, it agrees with the inference forward), and
`dsv41 train --images synthetic` end to end into a checkpoint the engine loads."""

import json
import os
import random

import pytest
import torch

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.training import TrainOptions, forward_train, prepare_for_training
from dsv41.model.transformer import Transformer
from dsv41.train import TrainConfig, train
from dsv41.vision.synthetic import (
    COLOURS,
    IGNORE,
    SEGMENTS,
    SHAPES,
    TASKS,
    SyntheticImageText,
    answer_accuracy,
    render_digit,
    render_shapes,
    synthetic_model_fields,
)
from tests.conftest import pin_routing


def vision_tiny(**changes):
    cfg = tiny()
    return cfg.replace(**synthetic_model_fields(cfg.vocab_size), **changes)


def foreground(img, threshold=60):
    """bool [H, W]: pixels far from the background colour (the corner pixel)."""
    px = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(img.height, img.width, 3).int()
    return (px - px[0, 0]).abs().sum(-1) > threshold, px


def components(mask):
    """4-connected components of a bool [H, W] mask (an independent flood fill)."""
    seen = torch.zeros_like(mask)
    h, w = mask.shape
    m, s = mask.tolist(), seen.tolist()
    count = 0
    for y in range(h):
        for x in range(w):
            if m[y][x] and not s[y][x]:
                count += 1
                stack = [(y, x)]
                s[y][x] = True
                while stack:
                    cy, cx = stack.pop()
                    for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                        if 0 <= ny < h and 0 <= nx < w and m[ny][nx] and not s[ny][nx]:
                            s[ny][nx] = True
                            stack.append((ny, nx))
    return count


@pytest.mark.parametrize("seed", range(6))
def test_shape_images_show_their_count_colour_and_shape(seed):
    rng = random.Random(seed)
    shape, colour, count = SHAPES[seed % 3], list(COLOURS)[seed % 4], 1 + seed % 4
    img = render_shapes(rng, shape, colour, count)
    mask, px = foreground(img)
    assert components(mask) == count
    mean = px[mask].float().mean(0)
    nearest = min(COLOURS, key=lambda c: float((mean - torch.tensor(COLOURS[c], dtype=torch.float)).norm()))
    assert nearest == colour
    # fill ratio of the bounding box tells the shapes apart: square ~1, circle ~pi/4, triangle ~1/2
    ys, xs = mask.nonzero(as_tuple=True)
    if count == 1:
        box = (int(ys.max()) - int(ys.min()) + 1) * (int(xs.max()) - int(xs.min()) + 1)
        fill = int(mask.sum()) / box
        expected = {"square": 1.0, "circle": 0.785, "triangle": 0.5}[shape]
        assert abs(fill - expected) < 0.09, (shape, fill)


@pytest.mark.parametrize("digit", range(10))
def test_digits_light_exactly_their_segments(digit):
    """Segment centres are read back from the pixels: lit exactly for the digit's segments."""
    img = render_digit(random.Random(digit), digit, "blue")
    mask, _ = foreground(img)
    ys, xs = mask.nonzero(as_tuple=True)
    y0, y1, x0, x1 = int(ys.min()), int(ys.max()), int(xs.min()), int(xs.max())
    if digit == 1:  # segments b and c only: one narrow column, lit from top to bottom
        assert x1 - x0 < 0.25 * (y1 - y0) and mask[y0 : y1 + 1, (x0 + x1) // 2].float().mean() > 0.9
        return
    ym, q = (y0 + y1) // 2, (y1 - y0) // 4
    xm = (x0 + x1) // 2
    probes = {
        "a": (y0 + 1, xm),
        "d": (y1 - 1, xm),
        "g": (ym, xm),
        "f": (ym - q, x0 + 1),
        "b": (ym - q, x1 - 1),
        "e": (ym + q, x0 + 1),
        "c": (ym + q, x1 - 1),
    }
    lit = {seg for seg, (y, x) in probes.items() if mask[y - 1 : y + 2, x - 1 : x + 2].any()}
    assert lit == set(SEGMENTS[digit])


def test_samples_are_deterministic_and_splits_are_disjoint():
    cfg = vision_tiny()
    train_set = SyntheticImageText.from_config("train", cfg)
    again = SyntheticImageText.from_config("train", cfg)
    val = SyntheticImageText.from_config("val", cfg)
    a, b = train_set.sample(7), again.sample(7)
    assert a.ids == b.ids and [p.digest for _, p in a.images] == [p.digest for _, p in b.images]
    train_digests = {p.digest for i in range(60) for _, p in train_set.sample(i).images}
    val_digests = {p.digest for i in range(60) for _, p in val.sample(i).images}
    assert not train_digests & val_digests
    assert {train_set.sample(i).task for i in range(60)} == set(TASKS)


def test_batches_train_only_the_answer_and_lay_spans_on_image_tokens():
    cfg = vision_tiny()
    data = SyntheticImageText.from_config("train", cfg)
    batch = data.batch(3, 6, 64)
    tok = data.tokenizer
    for row in range(6):
        s = data.sample(3 * 6 + row)
        targets = batch.y[row][batch.y[row] != IGNORE].tolist()
        assert targets[-1] == tok.eos_id and tok.decode(targets[:-1]) == s.answer
        assert batch.tasks[row] == s.task
    for row, start, patches in batch.images:
        span = batch.x[row, start : start + patches.span_length]
        assert (span == cfg.image_token_id).all() and patches.span_length == 14
    n_image_tokens = int((batch.x == cfg.image_token_id).sum())
    assert n_image_tokens == sum(p.span_length for _, _, p in batch.images)
    with pytest.raises(ValueError, match="seq_len"):
        data.batch(0, 6, 20)


def test_answer_accuracy_needs_every_answer_token_and_the_eos():
    y = torch.full((3, 5), IGNORE)
    y[:, 2:4] = torch.tensor([7, 1])
    logits = torch.zeros(3, 5, 10)
    logits[0, 2, 7] = logits[0, 3, 1] = 1  # right
    logits[1, 2, 7] = logits[1, 3, 2] = 1  # wrong EOS
    logits[2, 2, 7] = logits[2, 3, 1] = logits[2, 0, 5] = 1  # right; prompt positions do not count
    assert answer_accuracy(logits, y).tolist() == [True, False, True]


def test_training_forward_with_images_trains_the_vit_and_matches_inference():
    cfg = vision_tiny(index_topk=64, candidate_topk_blocks=64)
    model = pin_routing(init_random_weights(Transformer(cfg), seed=1))
    data = SyntheticImageText.from_config("train", cfg)
    batch = data.batch(0, 3, 64)
    with torch.no_grad():
        out = forward_train(model, batch.x, images=batch.images)
        embeds, types = model.embed_inputs(batch.x, batch.images)
        ref = model(batch.x, inputs_embeds=embeds, token_types=types)
    rel = (out.logits - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert rel < 0.035 and (out.logits.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    n_image = int((types >= 0).sum())
    k = cfg.n_activated_experts
    for layer in range(cfg.n_layers):
        assert out.expert_load_vl[layer].sum() == n_image * k
        assert out.expert_load[layer].sum() == (batch.x.numel() - n_image) * k

    trainable = prepare_for_training(init_random_weights(Transformer(cfg), seed=2))
    out = forward_train(trainable, batch.x, TrainOptions(), images=batch.images)
    torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch.y.flatten()).backward()
    for name in (
        "vision.patch_embed.proj.weight",
        "vision.blocks.0.attn.wqkv.weight",
        "aligner.w1.weight",
        "image_start",
        "image_newline",
        "image_end",
    ):
        grad = dict(trainable.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    with pytest.raises(ValueError, match="not both"):
        forward_train(trainable, batch.x, images=batch.images, token_types=types >= 0)


@pytest.mark.slow  # a whole training/planning run (~15-50 s); the slow tier, which CI runs
def test_train_images_synthetic_end_to_end(tmp_path):
    """A few steps of `dsv41 train --images synthetic`: the loss falls on a fixed batch order, the
    evaluation reports accuracy per task, and the checkpoint loads with its vision tower."""
    from dsv41.weights import load_model

    out = tmp_path / "run"
    cfg = TrainConfig(
        preset="tiny",
        images="synthetic",
        out=str(out),
        steps=12,
        batch_size=8,
        seq_len=64,
        eval_every=12,
        eval_batches=2,
        save_every=12,
        lr=3e-3,
        threads=1,
    )
    last = train(cfg)
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert 0 <= last["val_accuracy"] <= 1 and {f"val_accuracy_{t}" for t in TASKS} <= set(last)
    model = load_model(os.path.join(out, "checkpoint"))
    assert model.cfg.vision_enabled and model.cfg.image_token_id == 259
    data = SyntheticImageText.from_config("val", model.cfg)
    image = data.sample(0).images[0][1]
    assert model.embed_image(image).shape == (14, model.cfg.dim)
    with pytest.raises(ValueError, match="not both"):
        TrainConfig(images="synthetic", data="somewhere").validate()
