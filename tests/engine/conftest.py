import pytest

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer


@pytest.fixture(scope="module")
def model():
    """The tiny preset with random weights, batch-invariant GEMMs (16-row chunks)."""
    m = init_random_weights(Transformer(tiny()), seed=1).eval()
    m.set_batch_invariant(16)
    return m
