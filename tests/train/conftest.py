import random

import pytest


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small synthetic text corpus built into shards with a BPE (seconds)."""
    from dsv41.data.build import build_dataset
    from dsv41.data.sources import Document

    rng = random.Random(0)
    words = (
        "the of and to in a is that for it as was with be by on not he this are or his from at which but "
        "have an they you were her she there one all we their"
    ).split()
    docs = [
        Document(
            "synthetic",
            f"doc{i:03d}",
            "\n".join(" ".join(rng.choice(words) for _ in range(12)) + "." for _ in range(60)),
        )
        for i in range(40)
    ]
    folder = tmp_path_factory.mktemp("corpus")
    build_dataset(str(folder), vocab_size=512, documents=docs, val_fraction=0.1)
    return str(folder)
