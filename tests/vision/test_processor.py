"""The image processor and span layout (issue 14): sizes from the plan's rules, edge cases of real
images (tiny, huge, extreme aspect, grayscale, alpha, CMYK, palette), malformed and hostile inputs."""

import base64
import io
import math
import struct
import zlib

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from dsv41.chat.encoding import ImageSlot
from dsv41.vision import ImageError, ImageProcessor, image_token_types, plan_size, span_length
from dsv41.vision.inputs import ImageLoader, decode_data_url
from tests.conftest import GOLDEN_DIR

FLASH = dict(patch=14, downsample=3, max_tokens=1024, min_pixels=544 * 544)


def flash_processor(**limits) -> ImageProcessor:
    return ImageProcessor(14, 3, 1024, 544 * 544, None, **limits)


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_span_layout_matches_the_golden_token_types():
    types = load_file(f"{GOLDEN_DIR}/v41-vision-fp8/inputs.safetensors")["token_types"]
    assert types[0, 5:13].tolist() == image_token_types(2, 2)  # 84x84 -> 6x6 patches -> 2x2 cells
    assert types[0, 15:25].tolist() == image_token_types(2, 3)  # 126x70 -> 5x9 patches -> 2x3 cells
    assert image_token_types(1, 1) == [0, 1, 2, 3]
    assert span_length(2, 3) == len(image_token_types(2, 3)) == 10


@pytest.mark.parametrize(
    "size",
    [
        (1, 1),
        (3, 5000),
        (5000, 3),
        (640, 480),
        (544, 544),
        (1920, 1080),
        (4000, 3000),
        (20000, 100),
        (100, 20000),
        (1343, 1345),
        (30000, 30000),
    ],
)
def test_planned_sizes_fit_the_budget_and_are_as_large_as_it_allows(size):
    w, h = size
    bw, bh = plan_size(w, h, **FLASH)
    assert bw % 14 == 0 and bh % 14 == 0
    cells = lambda side: math.ceil(side / 14 / 3)  # noqa: E731
    assert span_length(cells(bh), cells(bw)) <= 1024
    if w * h < 544 * 544:  # small images are planned up to at least the minimum (less the truncation)
        assert bw * bh >= (544 - 1) ** 2 * 0.99 or span_length(cells(bh), cells(bw)) > 900
    elif span_length(math.ceil(h / 42), math.ceil(w / 42)) <= 1024:  # fits as is: only rounded up
        assert (bw, bh) == (math.ceil(w / 14) * 14, math.ceil(h / 14) * 14)
    elif min(w, h) * 8 > max(w, h):  # shrunk, not a strip: one more cell both ways would not fit, and
        assert span_length(cells(bh) + 1, cells(bw) + 1) > 1024  # the aspect ratio is kept to within a cell
        assert abs(bw / bh - w / h) < 42 / min(bw, bh) * (w / h) + 0.05
    else:  # a strip a cell or two thick: the aspect ratio still kept
        assert min(cells(bh), cells(bw)) <= 2 and abs(bw / bh - w / h) <= 0.01 * (w / h)


def test_published_token_budget_figures():
    """Spec §12b: <= 1024 tokens per image, about 1344^2 pixels; minimum 544^2."""
    bw, bh = plan_size(1344, 1344, **FLASH)
    assert span_length(math.ceil(bh / 42), math.ceil(bw / 42)) <= 1024 and bw >= 1260
    assert plan_size(544, 544, **FLASH) == (546, 546)


def test_tiny_image_is_upscaled_to_the_minimum_and_fills_it():
    out = flash_processor()(Image.new("RGB", (1, 1), (255, 0, 0)))
    assert (out.vit_h, out.vit_w) == (39, 39) and (out.llm_h, out.llm_w) == (13, 13)
    assert out.patches.shape == (39 * 39, 3, 14, 14) and out.patches.dtype == torch.bfloat16
    assert torch.all(out.patches[:, 0] == 1.0) and torch.all(out.patches[:, 1:] == -1.0)  # red, no gray border


def test_padding_is_centred_gray_and_values_are_normalised():
    proc = ImageProcessor(14, 3, 64, 7056)
    image = Image.new("RGB", (100, 84), (255, 255, 255))
    image.paste((0, 0, 0), (0, 0, 50, 84))  # left half black
    out = proc(image)
    assert (out.vit_h, out.vit_w) == (6, 8)  # padded to 112x84
    x = out.patches.view(6, 8, 3, 14, 14).permute(2, 0, 3, 1, 4).reshape(3, 84, 112).float()
    gray = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(x[:, :, :6], torch.tensor(gray), atol=1e-2) and torch.allclose(
        x[:, :, 106:], torch.tensor(gray), atol=1e-2
    )
    assert torch.all(x[:, :, 6:56] == -1.0) and torch.all(x[:, :, 56:106] == 1.0)


def test_modes_convert_like_the_reference():
    proc = ImageProcessor(14, 3, 64, 7056)
    gray = proc(Image.new("L", (84, 84), 200)).patches
    assert torch.equal(gray[:, 0], gray[:, 1]) and torch.equal(gray[:, 1], gray[:, 2])
    assert abs(gray[0, 0, 0, 0].item() - (200 / 255 - 0.5) / 0.5) < 1e-2
    rgba = proc(Image.new("RGBA", (84, 84), (10, 20, 30, 0))).patches  # alpha dropped, not composited
    assert torch.allclose(rgba[0, :, 0, 0].float(), torch.tensor([10, 20, 30]) / 127.5 - 1, atol=1e-2)
    white = proc(Image.new("CMYK", (84, 84), (0, 0, 0, 0))).patches
    black = proc(Image.new("CMYK", (84, 84), (0, 0, 0, 255))).patches
    assert torch.all(white == 1.0) and torch.all(black == -1.0)
    palette = Image.new("P", (84, 84), 0)
    palette.putpalette([0, 255, 0] * 256)
    assert torch.all(proc(palette).patches[:, 1] == 1.0)
    assert torch.equal(
        proc(png(Image.new("RGB", (84, 84), (9, 9, 9)))).patches, proc(Image.new("RGB", (84, 84), (9, 9, 9))).patches
    )  # encoded bytes = the image


def test_the_digest_keys_pixels():
    proc = ImageProcessor(14, 3, 64, 7056)
    a, b = Image.new("RGB", (84, 84), (1, 2, 3)), Image.new("RGB", (84, 84), (1, 2, 4))
    assert proc(a).digest == proc(a.copy()).digest != proc(b).digest


def _bomb_png(width: int, height: int) -> bytes:
    """A valid 1x1 PNG whose header claims width x height (Pillow reads the size without decoding)."""
    data = bytearray(png(Image.new("RGB", (1, 1))))
    ihdr = 8 + 8  # signature, then length + type of the first chunk
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


def test_hostile_and_malformed_images_are_refused_cheaply():
    proc = flash_processor(max_image_pixels=10_000_000, max_image_bytes=1 << 20)
    with pytest.raises(ImageError, match="pixels"):
        proc(_bomb_png(100_000, 100_000))  # a decompression bomb: refused from its header
    with pytest.raises(ImageError, match="bytes"):
        proc(b"\x89PNG" + bytes(2 << 20))
    with pytest.raises(ImageError, match="not a readable image"):
        proc(b"this is not an image")
    with pytest.raises(ImageError):
        proc(png(Image.new("RGB", (64, 64)))[:60])  # truncated
    with pytest.raises(ImageError, match="uint8"):
        proc(torch.zeros(4, 4, 3, dtype=torch.float32))


def test_data_urls():
    image = png(Image.new("RGB", (30, 20), (5, 6, 7)))
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    assert decode_data_url(url, 1 << 20) == image
    for bad, message in [
        ("https://example.com/cat.png", "does not fetch"),
        ("file:///etc/passwd", "does not fetch"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64,@@@!", "malformed base64"),
        ("data:text/plain;base64,aGk=", "media type"),
    ]:
        with pytest.raises(ImageError, match=message):
            decode_data_url(bad, 1 << 20)
    with pytest.raises(ImageError, match="limit"):
        decode_data_url("data:image/png;base64," + "A" * 4000, 1000)
    loader = ImageLoader(ImageProcessor(14, 3, 64, 7056), image_token_id=1000, max_images=1)
    # 30x20 is under the 7056-pixel minimum: planned x sqrt(7056/600) -> 102x68 -> 112x70 (8x5 patches,
    # 3x2 cells) -> 2 rows of 3 + newline, plus start and end
    assert loader([ImageSlot(0, url)])[0].span_length == 10
    with pytest.raises(ImageError, match="limit is 1"):
        loader([ImageSlot(0, url), ImageSlot(1, url)])
