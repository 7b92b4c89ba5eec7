"""Images through the model and the engine (issue 14): the golden set's images embedded into their spans,
causality across a span, routing/Engram treatment of span tokens, the engine equal to the model with
chunks splitting spans, the prefix cache keyed by pixels, and refusals."""

import os

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from dsv41.engine import EngineConfig, LLMEngine, SamplingParams
from dsv41.tokenizer import ByteTokenizer
from dsv41.vision import IMAGE_START, ImageProcessor
from dsv41.weights import load_model
from tests.conftest import GOLDEN_DIR

VISION = os.path.join(GOLDEN_DIR, "v41-vision-fp8")


@pytest.fixture(scope="module")
def golden():
    model = load_model(VISION)
    model.set_batch_invariant(16)
    inputs = load_file(os.path.join(VISION, "inputs.safetensors"))
    model.set_engram_token_map(inputs["engram_token_map"])
    # the set's text positions are random ids, and one of them (row 1, position 19) is the image token;
    # the reference runs that as text, but the engine refuses an image token without an image (as vLLM
    # does), so text positions holding it get another id here
    ids = inputs["input_ids"].clone()
    stray = (ids == model.cfg.image_token_id) & (inputs["token_types"] < 0)
    ids[stray] = model.cfg.image_token_id - 1
    inputs = dict(inputs, input_ids=ids)
    processor = ImageProcessor.from_config(model.cfg)
    starts = (inputs["token_types"] == IMAGE_START).nonzero().tolist()
    images = [(row, start, processor(inputs[f"image_pixels.{k}"])) for k, (row, start) in enumerate(starts)]
    return model, inputs, processor, images


def forward(model, ids, images):
    with torch.inference_mode():
        embeds, types = model.embed_inputs(ids, images)
        return model(ids, 0, None, inputs_embeds=embeds, token_types=types)


def make(model, **overrides) -> LLMEngine:
    # deterministic numerics: the engine is compared with the plain loop bit for bit
    settings = dict(
        block_size=8, kv_pool_tokens=2048, prefill_chunk_size=16, max_num_batched_tokens=64, numerics="deterministic"
    )
    settings.update(overrides)
    return LLMEngine(model, ByteTokenizer(model.cfg.vocab_size), EngineConfig(**settings))


def test_spans_are_causal_and_the_image_decides_what_follows(golden):
    """Positions before a span, and its IMAGE_START marker (a learned embedding, the same for every image),
    do not see the image; every position from the first image row on does."""
    model, inputs, processor, images = golden
    ids = inputs["input_ids"][1:2]
    (_, start, image) = images[2]
    other = processor(Image.new("RGB", (100, 84), (200, 30, 90)))
    a = forward(model, ids, [(0, start, image)])[0]
    b = forward(model, ids, [(0, start, other)])[0]
    assert torch.equal(a[: start + 1], b[: start + 1])
    assert all((a[p] - b[p]).abs().max() > 1e-3 for p in range(start + 1, ids.size(1)))


def test_span_tokens_route_with_bias_vl_and_are_dead_to_engram(golden):
    """The same merged embeddings with the span marked as text give other logits after it (the span's
    own routing bias and the Engram look-back both change)."""
    model, inputs, _, images = golden
    ids = inputs["input_ids"][1:2]
    with torch.inference_mode():
        embeds, types = model.embed_inputs(ids, [(0, images[2][1], images[2][2])])
        as_image = model(ids, 0, None, inputs_embeds=embeds, token_types=types)
        as_text = model(ids, 0, None, inputs_embeds=embeds)
    start = images[2][1]
    assert torch.equal(as_image[0, :start], as_text[0, :start]) and not torch.equal(
        as_image[0, start:], as_text[0, start:]
    )


@pytest.mark.parametrize("mode", ["full", "bounded"])
def test_engine_equals_the_model_with_chunks_splitting_spans(golden, mode):
    model, inputs, _, images = golden
    for row in range(2):
        prompt = inputs["input_ids"][row].tolist()
        spans = [(start, image) for r, start, image in images if r == row]
        one_shot = make(model, prefill_mode=mode, prefill_chunk_size=64).prompt_logits(prompt, images=spans)
        if mode == "full":  # the full prefill is the model's forward, bit for bit
            assert torch.equal(
                one_shot, forward(model, inputs["input_ids"][row : row + 1], [(0, s, im) for s, im in spans])[0, -1]
            )
        for chunk in (3, 5, 7):  # chunk boundaries fall inside the spans (positions 5..12, 15..24, 3..12)
            assert torch.equal(
                make(model, prefill_mode=mode, prefill_chunk_size=chunk).prompt_logits(prompt, images=spans), one_shot
            ), chunk


def test_prefix_cache_reuses_the_same_image_and_never_another(golden):
    model, inputs, processor, images = golden
    prompt = inputs["input_ids"][0].tolist()
    spans = [(start, image) for r, start, image in images if r == 0]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fresh = make(model, enable_prefix_caching=False).generate([prompt], greedy, images=[spans])[0]

    engine = make(model)
    first = engine.generate([prompt], greedy, images=[spans])[0]
    follow = prompt + first.token_ids + list(range(40, 50))  # a new turn longer than the window (8)
    again = engine.generate([follow], greedy, images=[spans])[0]
    assert first.token_ids == fresh.token_ids
    # the turn before, both images (positions 5..12 and 15..24) included, came from the cache: exact reuse
    # resumes from the reply's snapshot (all but its last token)
    assert again.num_cached_tokens == len(prompt) + len(first.token_ids) - 1
    alone = make(model, enable_prefix_caching=False).generate([follow], greedy, images=[spans])[0]
    assert again.token_ids == alone.token_ids

    # the same token ids with a different second image: nothing past that span's start may be reused
    other = [spans[0], (spans[1][0], processor(Image.new("RGB", (126, 70), (0, 255, 0))))]
    swapped = engine.generate([prompt], greedy, images=[other])[0]
    assert swapped.num_cached_tokens <= spans[1][0]
    assert (
        swapped.token_ids
        == make(model, enable_prefix_caching=False).generate([prompt], greedy, images=[other])[0].token_ids
    )


def test_bad_image_requests_are_refused(golden, tiny_model):
    vision_model, inputs, _, images = golden
    prompt = inputs["input_ids"][0].tolist()
    spans = [(start, image) for r, start, image in images if r == 0]
    engine = make(vision_model)
    with pytest.raises(ValueError, match="without an image"):
        engine.add_request("a", prompt, images=spans[:1])  # the second span's tokens have no image
    with pytest.raises(ValueError, match="image_token_id"):
        engine.add_request("b", prompt, images=[(0, spans[0][1])] + spans[1:])  # span over text tokens
    with pytest.raises(ValueError, match="outside"):
        engine.add_request("c", prompt[:20], images=spans)
    with pytest.raises(ValueError, match="overlaps"):
        engine.add_request("d", prompt, images=spans + [(spans[1][0], spans[0][1])])
    with pytest.raises(ValueError, match="no vision tower"):
        make(tiny_model).add_request("e", [5, 6, 7], images=spans)
