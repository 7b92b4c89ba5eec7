"""The V4.1 image processor and image-span layout (spec-v41.md §1.3, §11, §12b; golden `v41-vision-fp8`
README "Preprocessing" and "Span layout"; the official `inference/image_processor.py` as vendored in
tenstorrent/tt-metal, read for its rules).

Sizing plan for an image of W x H pixels (patch p, downsample r, span budget N = vision_max_n_token):
1. with `vision_max_wh_ratio` R set, a wider-than-R image is planned as if its width were H * R;
2. an image under `vision_min_pixels` is planned scaled up by sqrt(min_pixels / (W * H)), sides
   truncated to integers;
3. each side rounds up to a multiple of p; the backbone grid is ceil(side / p / r) per side;
4. if the span [IMAGE_START] + ([IMAGE] * llm_w + [IMAGE_NEW_LINE]) * llm_h + [IMAGE_END], i.e.
   llm_h * (llm_w + 1) + 2 tokens, exceeds N, the size is solved in closed form for the largest grid of
   cells (p * r pixels) that fits: mw = sqrt((N - 2) / (h / w) + 1/4) - 1/2 cells across, mh = mw * h / w
   down; a strip one cell thick when either is below one cell.
The pixels: `ImageOps.pad` to the planned size (fit inside keeping the aspect ratio, bicubic, centred on
gray 127) or, for an image at least R times wider than high, a plain resize; x = (uint8 / 255 - 0.5) /
0.5 in fp32, then bf16; patches row-major, each channel-major. Every image is converted to RGB the way
Pillow's `convert("RGB")` does (alpha dropped, not composited; grayscale copied to three channels;
CMYK by Pillow's formula; the first frame of an animation), and EXIF orientation is ignored, as the
reference does, so that served images see what the model saw in training.

Every position of a span carries `image_token_id`; `token_types` tell them apart (-1 text,
IMAGE_START 0, IMAGE 1, IMAGE_NEW_LINE 2, IMAGE_END 3).
"""

from __future__ import annotations

import hashlib
import io
import math
import warnings
from dataclasses import dataclass

import torch

TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
PAD_GRAY = (127, 127, 127)
# Decoding limits for untrusted images: the encoded bytes and the decoded pixel count are checked before
# any pixel is decoded (Pillow reads the size from the header), so a decompression bomb costs nothing.
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000


class ImageError(ValueError):
    """An image that cannot be used: undecodable, too large, or out of the processor's limits."""


def span_length(llm_h: int, llm_w: int) -> int:
    return llm_h * (llm_w + 1) + 2


def image_token_types(llm_h: int, llm_w: int) -> list[int]:
    """The span's token types: [START] + ([IMAGE] * llm_w + [NEW_LINE]) * llm_h + [END]."""
    return [IMAGE_START] + ([IMAGE] * llm_w + [IMAGE_NEW_LINE]) * llm_h + [IMAGE_END]


def plan_size(
    width: int,
    height: int,
    patch: int,
    downsample: int,
    max_tokens: int,
    min_pixels: int,
    max_wh_ratio: float | None = None,
) -> tuple[int, int]:
    """(width, height) in pixels, multiples of `patch`, that the image is padded or resized to."""
    if width <= 0 or height <= 0:
        raise ImageError(f"image has no pixels ({width}x{height})")
    if max_tokens < 4:
        raise ImageError(f"vision_max_n_token {max_tokens} cannot hold a one-cell image span (4 tokens)")
    w, h = float(width), float(height)
    if max_wh_ratio is not None and w > h * max_wh_ratio:
        w = h * max_wh_ratio
    if 0 < w * h < min_pixels:
        scale = math.sqrt(min_pixels / (w * h))
        w, h = float(int(w * scale)), float(int(h * scale))
        w, h = max(w, 1.0), max(h, 1.0)
    best_w, best_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    if span_length(_cells(best_h, patch, downsample), _cells(best_w, patch, downsample)) <= max_tokens:
        return best_w, best_h
    cell = patch * downsample
    aspect = h / w
    mw = math.sqrt((max_tokens - 2) / aspect + 0.25) - 0.5
    mh = mw * aspect
    if mw < 1:  # taller than the budget allows even one cell wide: a one-cell column
        best_w, best_h = cell, ((max_tokens - 2) // 2) * cell
    elif mh < 1:  # a one-cell row
        best_w, best_h = (max_tokens - 3) * cell, cell
    else:
        beta = min(math.floor(mw) * cell / w, math.floor(mh) * cell / h)
        best_w, best_h = math.floor(w * beta / patch) * patch, math.floor(h * beta / patch) * patch
        best_w, best_h = max(best_w, patch), max(best_h, patch)
    if span_length(_cells(best_h, patch, downsample), _cells(best_w, patch, downsample)) > max_tokens:
        raise ImageError(f"no size of a {width}x{height} image fits {max_tokens} tokens")  # unreachable by design
    return best_w, best_h


def _cells(side: int, patch: int, downsample: int) -> int:
    return -(-(side // patch) // downsample)


@dataclass
class ImagePatches:
    """One preprocessed image: what the ViT reads and how its span is laid out."""

    patches: torch.Tensor  # [vit_h * vit_w, 3, p, p] bf16, row-major patches, each (channel, y, x)
    vit_h: int
    vit_w: int
    llm_h: int
    llm_w: int
    digest: str  # sha256 of the processed pixels: the prefix cache's key for the span

    @property
    def span_length(self) -> int:
        return span_length(self.llm_h, self.llm_w)

    def token_types(self) -> list[int]:
        return image_token_types(self.llm_h, self.llm_w)


class ImageProcessor:
    """PIL image or encoded bytes -> `ImagePatches`, with the model config's vision settings."""

    def __init__(
        self,
        patch: int,
        downsample: int,
        max_tokens: int,
        min_pixels: int,
        max_wh_ratio: float | None = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    ):
        self.patch, self.downsample, self.max_tokens = patch, downsample, max_tokens
        self.min_pixels, self.max_wh_ratio = min_pixels, max_wh_ratio
        self.max_image_bytes, self.max_image_pixels = max_image_bytes, max_image_pixels

    @classmethod
    def from_config(cls, cfg, **limits) -> ImageProcessor:
        if not cfg.vision_enabled:
            raise ValueError("this model has no vision tower (vision_n_layers = 0)")
        return cls(
            cfg.vision_patch_size,
            cfg.vision_downsample_ratio,
            cfg.vision_max_n_token,
            cfg.vision_min_pixels,
            cfg.vision_max_wh_ratio,
            **limits,
        )

    def decode(self, data: bytes):
        """Encoded image bytes (PNG, JPEG, WebP, ... whatever Pillow reads) -> an RGB PIL image, refusing
        oversized files and pixel counts before decoding them."""
        from PIL import Image, UnidentifiedImageError

        if len(data) > self.max_image_bytes:
            raise ImageError(f"image is {len(data):,} bytes; the limit is {self.max_image_bytes:,}")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                width, height = image.size
                if width * height > self.max_image_pixels:
                    raise ImageError(
                        f"image is {width}x{height} = {width * height:,} pixels; the limit is {self.max_image_pixels:,}"
                    )
                with warnings.catch_warnings():  # palette transparency given as bytes: ignored, like convert()
                    warnings.filterwarnings("ignore", message="Palette images with Transparency")
                    return image.convert("RGB")
        except ImageError:
            raise
        except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
            raise ImageError(f"not a readable image: {exc}") from None
        except (OSError, ValueError, SyntaxError) as exc:  # truncated or corrupt data
            raise ImageError(f"image data is corrupt: {exc}") from None

    def __call__(self, image) -> ImagePatches:
        """A PIL image (any mode), encoded bytes, or a uint8 tensor/array [H, W, 3] -> ImagePatches."""
        from PIL import Image, ImageOps

        if isinstance(image, (bytes, bytearray, memoryview)):
            image = self.decode(bytes(image))
        elif not isinstance(image, Image.Image):
            array = torch.as_tensor(image)
            if array.dtype != torch.uint8 or array.ndim != 3 or array.shape[-1] != 3:
                raise ImageError(f"pixel arrays must be uint8 [H, W, 3], got {array.dtype} {tuple(array.shape)}")
            image = Image.fromarray(array.numpy(), "RGB")
        if image.width * image.height > self.max_image_pixels:
            raise ImageError(f"image is {image.width}x{image.height}; the limit is {self.max_image_pixels:,} pixels")
        if image.mode != "RGB":
            image = image.convert("RGB")
        p, r = self.patch, self.downsample
        best_w, best_h = plan_size(image.width, image.height, p, r, self.max_tokens, self.min_pixels, self.max_wh_ratio)
        if self.max_wh_ratio is not None and image.width >= self.max_wh_ratio * image.height:
            image = image.resize((best_w, best_h))
        else:
            image = ImageOps.pad(image, (best_w, best_h), color=PAD_GRAY)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(best_h, best_w, 3)
        x = ((pixels.permute(2, 0, 1).float() / 255.0 - 0.5) / 0.5).to(torch.bfloat16)  # [3, H, W]
        vit_h, vit_w = best_h // p, best_w // p
        patches = x.reshape(3, vit_h, p, vit_w, p).permute(1, 3, 0, 2, 4).reshape(vit_h * vit_w, 3, p, p)
        digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
        return ImagePatches(patches.contiguous(), vit_h, vit_w, -(-vit_h // r), -(-vit_w // r), digest)
