import random

import pytest

from dsv41.eval.common import load_model

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from "
    "river stone light over under quickly said came went long small old new house garden night day"
).split()


@pytest.fixture(scope="session")
def tiny_eval():
    """The tiny preset with random weights, as `dsv41 eval --model tiny` loads it (byte tokenizer)."""
    return load_model("tiny", seed=0)


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A held-out text of about 2,400 ASCII words in sentences (byte tokenizer: one token per byte)."""
    rng = random.Random(7)
    sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(300)]
    path = tmp_path_factory.mktemp("text") / "heldout.txt"
    path.write_text(" ".join(sentences), encoding="utf-8")
    return str(path)
