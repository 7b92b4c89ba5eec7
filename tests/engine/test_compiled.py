"""Compiled decode regions (dsv41.engine.compiled): under `fast` numerics a decode batch runs its token-wise
work as compiled graphs, padded to a bucket, and is judged as `fast` is: against the reference numerics on
the shipped trained checkpoint (dsv41.eval.agreement)."""

import os

import numpy as np
import pytest
import torch

import dsv41.engine.compiled as compiled
from dsv41.checkpoints import checkpoint_path
from dsv41.engine import EngineConfig
from dsv41.engine.build import build_engine
from dsv41.eval.agreement import decode_agreement, held_out_windows

VAL = os.path.join(os.path.dirname(__file__), "..", "data", "shakespeare-chat-val", "val.bin")


@pytest.mark.slow
def test_compiled_regions_serve_decode_batches_and_agree_with_the_reference(monkeypatch):
    engine = build_engine(
        checkpoint_path(),
        EngineConfig(numerics="fast", compile_decode="now", max_num_seqs=4, kv_pool_tokens=8192, fused_kernels="off"),
    )
    assert engine.runner.compiled.ready == {1, 2, 4}
    used = []
    real = compiled._Regions.pre_attention
    monkeypatch.setattr(compiled._Regions, "pre_attention", lambda self, *a: used.append(self.rows) or real(self, *a))
    tokens = np.fromfile(VAL, dtype=np.uint16)
    prompts = held_out_windows(tokens[2000:], [40, 72, 104], stride=150)  # 3 decode tokens a step: bucket 4
    result = decode_agreement(engine, engine.model, prompts, new_tokens=16, passes=1)
    assert result.top1 >= 0.99 and result.kl_mean <= 2e-3, result.as_dict()
    # the steps decoding all three ran compiled, padded to 4 rows (and those decoding fewer, at their buckets)
    assert used.count(4) >= 10 * engine.model_config.n_layers and set(used) <= {1, 2, 4}, used


def test_padding_rows_to_a_bucket_and_cutting_them_back():
    t = torch.arange(6.0).view(1, 3, 2)
    padded = compiled._pad_rows(t, 4)
    assert padded.shape == (1, 4, 2) and torch.equal(padded[:, :3], t) and not padded[:, 3].any()
    assert compiled._cut((padded, (padded, padded)), 3)[1][0].shape == (1, 3, 2)
    regions = compiled._Regions({}, 3, 4)
    freqs = torch.polar(torch.ones(3, 5), torch.rand(3, 5))
    assert torch.equal(regions._freqs(freqs)[3], torch.ones(5, dtype=torch.complex64))  # the identity rotation
