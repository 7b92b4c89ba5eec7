"""Vision: DeepSeek-ViT, the aligner, the image processor and image inputs (spec-v41.md §1.3, §12b).

The modules live on the Transformer under their checkpoint names (`vision.*`, `aligner.*`, `image_*`);
this package holds their code, the preprocessing and the span layout, with no import from dsv41.model.
"""

from dsv41.vision.processor import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    TEXT,
    ImageError,
    ImagePatches,
    ImageProcessor,
    image_token_types,
    plan_size,
    span_length,
)

__all__ = [
    "IMAGE",
    "IMAGE_END",
    "IMAGE_NEW_LINE",
    "IMAGE_START",
    "TEXT",
    "ImageError",
    "ImagePatches",
    "ImageProcessor",
    "image_token_types",
    "plan_size",
    "span_length",
]
