"""A synthetic image-text set for training the vision path with no image data offline (issue 14).

Every sample is rendered on demand from (split, seed, index), so the set needs no files and train and
held-out images never coincide. Images are 126x126 pixels (a 9x9 patch grid, a 3x3 cell span of 14 tokens
under spec §14's layout) and go through the real `ImageProcessor`, ViT, aligner and span merge. Text is
byte-level (`ByteTokenizer`): a question after the image span(s), the answer and EOS after it; only the
answer (and its EOS) is trained.

| task    | prompt                              | answers                         | chance |
|---------|-------------------------------------|---------------------------------|--------|
| shape   | <image> "shape?"                    | circle, square, triangle        | 1/3    |
| colour  | <image> "colour?"                   | red, green, blue, yellow        | 1/4    |
| count   | <image> "how many?"                 | one, two, three, four           | 1/4    |
| digit   | <image> "digit?"                    | 0-9 (seven-segment digit)       | 1/10   |
| same    | <image> " and " <image> "same colour?" | yes, no (half each)         | 1/2    |

A shapes image holds 1-4 copies of one shape in one colour, in distinct quadrants, with random sizes,
positions and a random light background, so every attribute is needed by some question and none can be
read from another. `same` interleaves two images with text, as a multi-image chat turn does.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from PIL import Image, ImageDraw

from dsv41.tokenizer import ByteTokenizer
from dsv41.vision.processor import ImagePatches, ImageProcessor

IMAGE_SIZE = 126
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (215, 40, 40), "green": (40, 160, 60), "blue": (45, 75, 215), "yellow": (225, 195, 30)}
COUNTS = ("one", "two", "three", "four")
TASKS = ("shape", "colour", "count", "digit", "same")
QUESTIONS = {"shape": "shape?", "colour": "colour?", "count": "how many?", "digit": "digit?", "same": "same colour?"}
CHANCE = {"shape": 1 / 3, "colour": 1 / 4, "count": 1 / 4, "digit": 1 / 10, "same": 1 / 2}
IGNORE = -100  # targets that are not trained (F.cross_entropy's default ignore_index)

# The backbone-independent ViT of the synthetic runs: small enough to train on a CPU in minutes.
SMALL_VISION = dict(
    vision_n_layers=4,
    vision_dim=128,
    vision_n_heads=4,
    vision_inter_dim=256,
    vision_patch_size=14,
    vision_rope_theta=10000.0,
    vision_downsample_ratio=3,
    vision_max_n_token=64,
    vision_min_pixels=IMAGE_SIZE * IMAGE_SIZE,
    vision_max_wh_ratio=None,
)

# Seven-segment digits: segments a (top), b (top right), c (bottom right), d (bottom), e (bottom left),
# f (top left), g (middle).
SEGMENTS = {
    0: "abcdef",
    1: "bc",
    2: "abged",
    3: "abgcd",
    4: "fgbc",
    5: "afgcd",
    6: "afgedc",
    7: "abc",
    8: "abcdefg",
    9: "abcdfg",
}


def synthetic_model_fields(vocab_size: int) -> dict:
    """ModelConfig fields that give a preset the synthetic runs' ViT and an image token id: the first id
    the byte tokenizer leaves unused (after BOS/EOS/PAD and the 256 bytes)."""
    return {**SMALL_VISION, "image_token_id": 3 + 256}


def _background(rng: random.Random) -> tuple[int, int, int]:
    g = rng.randint(205, 250)
    return (g + rng.randint(-5, 5), g + rng.randint(-5, 5), g)


def _jitter(rng: random.Random, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in rgb)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, fill) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        s = r * 0.85  # about the circle's area
        draw.rectangle((cx - s, cy - s, cx + s, cy + s), fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r * 0.8), (cx + r, cy + r * 0.8)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def render_shapes(rng: random.Random, shape: str, colour: str, count: int) -> Image.Image:
    """`count` (1-4) copies of `shape` in `colour`, one per distinct quadrant, random size and place."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _background(rng))
    draw = ImageDraw.Draw(img)
    half = IMAGE_SIZE / 2
    for quadrant in rng.sample(range(4), count):
        x0, y0 = (quadrant % 2) * half, (quadrant // 2) * half
        r = rng.uniform(11, 22)
        cx = rng.uniform(x0 + r + 2, x0 + half - r - 2)
        cy = rng.uniform(y0 + r + 2, y0 + half - r - 2)
        draw_shape(draw, shape, cx, cy, r, _jitter(rng, COLOURS[colour]))
    return img


def render_digit(rng: random.Random, digit: int, colour: str) -> Image.Image:
    """One seven-segment `digit`, random height (44-90 px), stroke, place and colour."""
    img = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _background(rng))
    draw = ImageDraw.Draw(img)
    h = rng.uniform(44, 90)
    w = h * rng.uniform(0.45, 0.6)
    stroke = max(3, int(h * rng.uniform(0.08, 0.13)))
    x0 = rng.uniform(6, IMAGE_SIZE - 6 - w)
    y0 = rng.uniform(6, IMAGE_SIZE - 6 - h)
    x1, ym, y1 = x0 + w, y0 + h / 2, y0 + h
    ends = {
        "a": ((x0, y0), (x1, y0)),
        "b": ((x1, y0), (x1, ym)),
        "c": ((x1, ym), (x1, y1)),
        "d": ((x0, y1), (x1, y1)),
        "e": ((x0, ym), (x0, y1)),
        "f": ((x0, y0), (x0, ym)),
        "g": ((x0, ym), (x1, ym)),
    }
    fill = _jitter(rng, COLOURS[colour])
    for seg in SEGMENTS[digit]:
        draw.line(ends[seg], fill=fill, width=stroke)
    return img


@dataclass
class Sample:
    """ids: prompt + answer + EOS; the answer starts at `answer_start`; images: (start, ImagePatches)."""

    ids: list[int]
    answer_start: int
    images: list[tuple[int, ImagePatches]]
    task: str
    answer: str


@dataclass
class ImageTextBatch:
    """x, y [B, L] int64 (y: next-token targets, IGNORE outside the answers); images: (row, start,
    ImagePatches) for `Transformer.embed_inputs`; tasks: each row's task."""

    x: torch.Tensor
    y: torch.Tensor
    images: list[tuple[int, int, ImagePatches]]
    tasks: list[str]


class SyntheticImageText:
    """The set for one split ("train" or "val"); `batch` mirrors `TokenDataset.batch`."""

    def __init__(
        self,
        split: str,
        processor: ImageProcessor,
        tokenizer: ByteTokenizer,
        image_token_id: int,
        tasks: tuple[str, ...] = TASKS,
    ):
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        unknown = set(tasks) - set(TASKS)
        if not tasks or unknown:
            raise ValueError(f"tasks must be a non-empty subset of {TASKS}, got {tasks!r}")
        if not 0 <= image_token_id < tokenizer.vocab_size:
            raise ValueError(f"image_token_id {image_token_id} is outside the vocabulary ({tokenizer.vocab_size})")
        self.split, self.processor, self.tokenizer = split, processor, tokenizer
        self.image_token_id, self.tasks = image_token_id, tuple(tasks)

    @classmethod
    def from_config(cls, split: str, cfg, tasks: tuple[str, ...] = TASKS) -> SyntheticImageText:
        return cls(split, ImageProcessor.from_config(cfg), ByteTokenizer(cfg.vocab_size), cfg.image_token_id, tasks)

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=False, parse_special=False)

    def sample(self, index: int, seed: int = 0) -> Sample:
        # a string seed is hashed by sha512: the same sample on every run, machine and Python version
        rng = random.Random(f"dsv41-synthetic:{self.split}:{seed}:{index}")
        task = rng.choice(self.tasks)
        if task == "digit":
            digit = rng.randrange(10)
            images, answer = [render_digit(rng, digit, rng.choice(list(COLOURS)))], str(digit)
        elif task == "same":
            first = rng.choice(list(COLOURS))
            same = rng.random() < 0.5
            second = first if same else rng.choice([c for c in COLOURS if c != first])
            images = [render_shapes(rng, rng.choice(SHAPES), c, rng.randint(1, 4)) for c in (first, second)]
            answer = "yes" if same else "no"
        else:
            shape, colour, count = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.randint(1, 4)
            images = [render_shapes(rng, shape, colour, count)]
            answer = {"shape": shape, "colour": colour, "count": COUNTS[count - 1]}[task]
        ids = [self.tokenizer.bos_id]
        placed = []
        for k, img in enumerate(images):
            patches = self.processor(img)
            if k:
                ids += self._text(" and ")
            placed.append((len(ids), patches))
            ids += [self.image_token_id] * patches.span_length
        ids += self._text(QUESTIONS[task] + "\n")
        answer_start = len(ids)
        ids += self._text(answer) + [self.tokenizer.eos_id]
        return Sample(ids, answer_start, placed, task, answer)

    def collate(self, samples: list[Sample], max_len: int | None = None) -> ImageTextBatch:
        """Right-padded rows; the targets of the prompt and the padding are IGNORE."""
        length = max(len(s.ids) for s in samples) - 1
        if max_len is not None and length > max_len:
            raise ValueError(f"a sample needs {length} positions, more than seq_len {max_len}")
        x = torch.full((len(samples), length), self.tokenizer.pad_id, dtype=torch.long)  # [B, L]
        y = torch.full((len(samples), length), IGNORE, dtype=torch.long)  # [B, L]
        images = []
        for row, s in enumerate(samples):
            ids = torch.tensor(s.ids)
            x[row, : len(ids) - 1] = ids[:-1]
            y[row, s.answer_start - 1 : len(ids) - 1] = ids[s.answer_start :]
            images += [(row, start, patches) for start, patches in s.images]
        return ImageTextBatch(x, y, images, [s.task for s in samples])

    def batch(
        self,
        index: int,
        batch_size: int,
        seq_len: int | None = None,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> ImageTextBatch:
        """Batch number `index` of this process: samples index*B*world + rank*B + 0..B-1."""
        first = (index * world_size + rank) * batch_size
        return self.collate([self.sample(first + j, seed) for j in range(batch_size)], seq_len)

    def sequential_batches(
        self, batch_size: int, seq_len: int | None, n_batches: int, rank: int = 0, world_size: int = 1
    ) -> Iterator[ImageTextBatch]:
        """The held-out batches, the same at every evaluation (seed 0 of this split)."""
        for i in range(n_batches):
            yield self.batch(i, batch_size, seq_len, 0, rank, world_size)


def answer_accuracy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[B] bool: every answer token (and the EOS after it) is the argmax, i.e. greedy decoding after the
    prompt writes exactly the answer and stops. logits [B, L, V], y [B, L] with IGNORE elsewhere."""
    trained = y != IGNORE
    hit = (logits.argmax(-1) == y) | ~trained
    return hit.all(dim=1) & trained.any(dim=1)
