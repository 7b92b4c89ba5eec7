"""`image_url` parts through the OpenAI server (issue 14): a chat with an image via the official client
answers what the engine answers for the same prompt and pixels; a repeated image is served from the
prefix cache; remote URLs, malformed base64, non-images, decompression bombs and images sent to a
text-only model get clear 400s."""

import base64
import io
import os

import httpx
import openai
import pytest
from PIL import Image

from dsv41.chat.encoding import encode_prompt, prompt_parts
from dsv41.engine import EngineConfig, SamplingParams, build_engine
from dsv41.server import create_app
from dsv41.server.run import ServerThread
from dsv41.vision import ImageProcessor
from tests.conftest import GOLDEN_DIR
from tests.vision.test_processor import _bomb_png

VISION = os.path.join(GOLDEN_DIR, "v41-vision-fp8")


def data_url(image: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def server():
    engine = build_engine(VISION, EngineConfig(kv_pool_tokens=4096), seed=0)
    with ServerThread(create_app(engine, max_waiting=8)) as srv:
        yield srv, engine


def messages(url: str, text: str = "what is in it?") -> list:
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def test_chat_with_an_image_through_the_openai_client(server):
    srv, engine = server
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    picture = Image.new("RGB", (100, 84), (200, 40, 10))
    picture.paste((10, 10, 250), (20, 20, 60, 60))
    url = data_url(picture, "WEBP") if "WEBP" in Image.registered_extensions().values() else data_url(picture)
    r = client.chat.completions.create(
        model=engine.model_name, messages=messages(url), max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    # the same prompt built by hand: text tokens around a 10-position span of image_token_id
    image = ImageProcessor.from_config(engine.model_config)(
        Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    )
    spans: list = []
    ids = encode_prompt(
        engine.tokenizer, prompt_parts(messages(url)), [image], engine.model_config.image_token_id, spans
    )
    assert [start for start, _ in spans] == [ids.index(engine.model_config.image_token_id)]
    assert (
        r.usage.prompt_tokens == len(ids) and ids.count(engine.model_config.image_token_id) == image.span_length == 10
    )
    plain = build_engine(VISION, EngineConfig(kv_pool_tokens=4096), seed=0)
    want = plain.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), images=[spans])[0]
    assert r.choices[0].message.content == want.text and r.usage.completion_tokens == 8
    # another image of the same size: the same token ids, other logits (the pixels reach the model)
    logits_a = plain.prompt_logits(ids, images=spans)
    spans_b: list = []
    ids_b = encode_prompt(
        engine.tokenizer,
        prompt_parts(messages(data_url(Image.new("RGB", (100, 84))))),
        [ImageProcessor.from_config(engine.model_config)(Image.new("RGB", (100, 84)))],
        engine.model_config.image_token_id,
        spans_b,
    )
    assert ids_b == ids and not (plain.prompt_logits(ids_b, images=spans_b) == logits_a).all()


@pytest.mark.parametrize(
    "url, status, words",
    [
        ("https://example.com/cat.png", 400, "does not fetch"),
        ("data:image/png;base64,%%%notbase64", 400, "malformed base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(), 400, "not a readable image"),
        ("data:image/png;base64," + base64.b64encode(_bomb_png(200_000, 200_000)).decode(), 400, "pixels"),
    ],
)
def test_bad_image_parts_get_clear_errors(server, url, status, words):
    srv, engine = server
    r = httpx.post(
        srv.base_url + "/v1/chat/completions",
        timeout=60,
        json={"model": engine.model_name, "messages": messages(url), "max_tokens": 4},
    )
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"] and r.json()["error"]["param"] == "messages"
    ok = httpx.post(
        srv.base_url + "/v1/chat/completions",
        timeout=60,  # the server is still fine
        json={"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert ok.status_code == 200


def test_malformed_parts_and_text_only_models():
    engine = build_engine("tiny", EngineConfig(kv_pool_tokens=1024), seed=0)
    with ServerThread(create_app(engine, max_waiting=4)) as srv:
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": engine.model_name,
                "messages": messages(data_url(Image.new("RGB", (8, 8)))),
                "max_tokens": 2,
            },
        )
        assert r.status_code == 400 and "does not take images" in r.json()["error"]["message"]
        r = httpx.post(
            srv.base_url + "/v1/chat/completions",
            timeout=60,
            json={
                "model": engine.model_name,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            },
        )
        assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]
