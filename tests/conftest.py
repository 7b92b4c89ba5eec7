import os

import pytest
import torch

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer

GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "data", "golden")
GOLDEN_FOLDERS = sorted(os.path.join(GOLDEN_DIR, d) for d in os.listdir(GOLDEN_DIR))


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return init_random_weights(Transformer(tiny()), seed=1, std=0.1).eval()
