"""fast numerics' GEMM choice (dsv41.ops.gemm_choice): a probe of bf16 against fp32 GEMMs at decode shapes,
kept on disk; a bf16 Linear's fp32 path and the copy that follows its weight."""

import json

import pytest
import torch

from dsv41.model.layers import Linear
from dsv41.ops import gemm_choice


def test_the_probe_answers_a_bucket_and_is_kept_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(gemm_choice, "COLD_BYTES", 1 << 20)  # a 1 MiB pass, not 64: the answer's caching is the point
    answer = gemm_choice.fp32_rows([(64, 64), (128, 64)])
    assert answer in (0, *gemm_choice.ROWS)
    assert list(json.loads((tmp_path / "dsv41" / "gemm_choice.json").read_text()).values()) == [answer]
    monkeypatch.setattr(gemm_choice, "probe", lambda *a, **k: pytest.fail("probed again"))
    assert gemm_choice.fp32_rows([(128, 64), (64, 64)]) == answer  # the same shapes, in any order
    assert gemm_choice.fp32_rows([(64, 64)], device="cuda") == 0


def test_a_probe_where_fp32_is_faster_says_so(monkeypatch):
    """With the bf16 GEMM made slow (as on a CPU without bf16 instructions), fp32 wins up to the largest bucket."""
    real = torch.nn.functional.linear

    def slow_bf16(x, w, *a):
        if w.dtype == torch.bfloat16:
            for _ in range(20):
                real(x, w)
        return real(x, w, *a)

    monkeypatch.setattr(gemm_choice.F, "linear", slow_bf16)
    monkeypatch.setattr(gemm_choice, "COLD_BYTES", 1 << 20)
    assert gemm_choice.probe([(256, 256)], rows=(1, 2, 4)) == 4


def test_the_fp32_path_of_a_bf16_linear_and_its_copy_following_the_weight():
    torch.manual_seed(0)
    layer = Linear(64, 32)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 64))
    x = torch.randn(3, 64).bfloat16()
    plain = layer(x)
    assert layer.keep_fp32_copy() == 32 * 64 * 4
    layer.fp32_rows = 4
    fp32 = layer(x)
    exact = (x.double() @ layer.weight.double().t()).to(torch.bfloat16)
    assert (
        torch.equal(fp32, exact) or (fp32.float() - exact.float()).abs().max() <= 2 * exact.float().abs().max() * 2**-8
    )
    assert (fp32.float() - plain.float()).abs().max() <= 0.05
    layer.fp32_rows = 2  # more rows than that: the bf16 GEMM
    assert torch.equal(layer(x), plain)
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place update: the copy is made again
    layer.fp32_rows = 4
    assert torch.allclose(layer(x).float(), 2 * fp32.float(), rtol=0.02, atol=0.05)
    assert Linear(64, 32, "fp32").keep_fp32_copy() == 0
