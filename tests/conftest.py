import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on CPU (tests/ops/test_triton.py). The variable is read when
    # functions are decorated, Triton's own library included, so it is set before anything imports it.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dsv41.config import tiny
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer

# modules that must import (comma-separated): .ci/run names the extras it has just installed, so that a
# broken install fails their tests instead of skipping them
REQUIRED_OPTIONAL = {m.strip() for m in os.environ.get("DSV41_REQUIRE_OPTIONAL", "").split(",") if m.strip()}


def optional_import(name: str):
    """pytest.importorskip(name), except for a module DSV41_REQUIRE_OPTIONAL names: imported outright,
    its ImportError failing the test module."""
    if name in REQUIRED_OPTIONAL:
        return importlib.import_module(name)
    return pytest.importorskip(name)


GOLDEN_DIR = os.path.join(os.path.dirname(__file__), "data", "golden")
GOLDEN_FOLDERS = sorted(os.path.join(GOLDEN_DIR, d) for d in os.listdir(GOLDEN_DIR))


@pytest.fixture(scope="session")
def tiny_model():
    torch.manual_seed(0)
    return init_random_weights(Transformer(tiny()), seed=1, std=0.1).eval()


def pin_routing(model, margin: float = 50.0):
    """Give every router a decisive selection bias towards k experts (a different set per layer), so
    MoE selection cannot flip on bf16 noise. For tests comparing numerically different paths (prefill vs
    decode, recompute vs cached state) whose premise is that no discrete choice flips; routing weights
    still come from the (unbiased) scores. Returns the model."""
    with torch.no_grad():
        for layer in model.layers:
            gate = layer.ffn.gate
            n, k = gate.bias.numel(), gate.topk
            gate.bias.zero_()
            for j in range(k):
                gate.bias[(layer.layer_id + j) % n] = margin
            if gate.bias_vl is not None:
                gate.bias_vl.zero_()
                for j in range(k):
                    gate.bias_vl[(layer.layer_id + k + j) % n] = margin
    return model


def poison_sampling(monkeypatch, seed: int, message: str) -> None:
    """Make the engine's sampling raise RuntimeError(message) for requests with this seed (a request
    that fails on its own, for fault-isolation tests); every other request samples as usual."""
    import dsv41.engine.llm_engine as llm_engine

    real_sample = llm_engine.sample

    def sample(logits, params, generator, history=None):
        if params.seed == seed:
            raise RuntimeError(message)
        return real_sample(logits, params, generator, history)

    monkeypatch.setattr(llm_engine, "sample", sample)


def tie_every_selection(model):
    """Make every top-k choice an exact tie: indexer scores all 0 (their head weights zeroed) and every
    router score equal (gate weights and bias zeroed). The tie-break alone then decides each selection,
    so determinism tests see any layout dependence at once. Returns the model."""
    with torch.no_grad():
        for layer in model.layers:
            if layer.attn.indexer is not None:
                layer.attn.indexer.weights_proj.weight.zero_()  # scores = sum_h relu(q.k) * 0 = 0
            layer.ffn.gate.weight.zero_()
            layer.ffn.gate.bias.zero_()
    return model
