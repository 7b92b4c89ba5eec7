"""Images as clients send them: OpenAI `image_url` parts holding `data:` URLs (spec-v41.md §11: every
position of an image span carries the image token; dsv41.vision.processor lays it out).

The server never fetches a URL: a remote (http, https, file, ...) address is refused with a message
saying to send the image inline. A data URL must be base64 (`data:image/png;base64,...`); its size is
checked before it is decoded, its pixel count before the pixels are decoded (ImageProcessor.decode), so
neither a huge body nor a decompression bomb costs memory.
"""

from __future__ import annotations

import base64
import binascii
import re

from dsv41.vision.processor import ImageError, ImagePatches, ImageProcessor

DATA_URL = re.compile(
    r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[^;,]*)*)(?P<b64>;base64)?,", re.IGNORECASE
)
DEFAULT_MAX_IMAGES = 16


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL; ImageError for anything else or anything malformed."""
    match = DATA_URL.match(url)
    if match is None:
        scheme = url.split(":", 1)[0][:16] if ":" in url else "no scheme"
        raise ImageError(
            f"image_url must be a data: URL with the image inline (data:image/png;base64,...); "
            f"this server does not fetch URLs ({scheme!r} given)"
        )
    if not match.group("b64"):
        raise ImageError("image data URLs must be base64-encoded (data:image/...;base64,...)")
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise ImageError(f"image_url has media type {mime!r}; expected image/png, image/jpeg, image/webp, ...")
    payload = url[match.end() :]
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise ImageError(f"image is about {len(payload) * 3 // 4:,} bytes; the limit is {max_bytes:,}")
    try:
        return base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image_url holds malformed base64") from None


class ImageLoader:
    """ImageSlots (dsv41.chat.encoding) -> ImagePatches, for one model's processor and image token."""

    def __init__(self, processor: ImageProcessor, image_token_id: int, max_images: int = DEFAULT_MAX_IMAGES):
        self.processor, self.image_token_id, self.max_images = processor, image_token_id, max_images

    @classmethod
    def from_config(cls, cfg, **limits) -> ImageLoader:
        return cls(ImageProcessor.from_config(cfg, **limits), cfg.image_token_id)

    def __call__(self, slots: list) -> list[ImagePatches]:
        if len(slots) > self.max_images:
            raise ImageError(f"the request has {len(slots)} images; the limit is {self.max_images}")
        out = []
        for slot in slots:
            try:
                data = decode_data_url(slot.url, self.processor.max_image_bytes)
                out.append(self.processor(self.processor.decode(data)))
            except ImageError as exc:
                raise ImageError(f"image {slot.index}: {exc}") from None
        return out
