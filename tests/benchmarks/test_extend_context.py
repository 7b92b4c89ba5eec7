"""benchmarks/extend_context.py: a checkpoint served past its training length with YaRN loads with the
compressed layers' long RoPE pairs slowed by the factor, its short pairs and its weights untouched."""

import json
import math
import os
import subprocess
import sys

import torch

from dsv41.config import preset
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.train.checkpoint import save_checkpoint
from dsv41.weights import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "extend_context.py")


def _run(*args):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=120)


def test_yarn_extension_slows_only_the_long_pairs(tmp_path):
    cfg = preset("recall")
    save_checkpoint(str(tmp_path / "ck"), init_random_weights(Transformer(cfg), seed=0), cfg, None)
    run = _run(str(tmp_path / "ck"), str(tmp_path / "x4"), "--factor", "4", "--original", "320")
    assert run.returncode == 0, run.stderr
    base, ext = load_model(str(tmp_path / "ck")), load_model(str(tmp_path / "x4"))
    assert ext.cfg.original_seq_len == 320 and ext.cfg.rope_factor == 4.0
    before, after = base.rope_yarn.freqs, ext.rope_yarn.freqs
    for f0, f1 in zip(before.tolist(), after.tolist()):
        turns = 320 * f0 / (2 * math.pi)  # rotations of the pair over the training length
        if turns >= 32:  # beta_fast: turns many times within training, kept
            assert f1 == f0
        elif turns <= 1:  # beta_slow: less than one turn in training, slowed by the factor
            assert math.isclose(f1, f0 / 4, rel_tol=1e-6)
        else:
            assert f0 / 4 <= f1 <= f0
    assert torch.equal(base.rope_plain.freqs, ext.rope_plain.freqs)  # the window-only layer keeps plain RoPE
    for (name, p), (_, q) in zip(base.named_parameters(), ext.named_parameters()):
        assert torch.equal(p, q), name


def test_refuses_a_second_extension_and_non_checkpoints(tmp_path):
    cfg = preset("recall")
    save_checkpoint(str(tmp_path / "ck"), init_random_weights(Transformer(cfg), seed=0), cfg, None)
    assert _run(str(tmp_path / "ck"), str(tmp_path / "x4"), "--factor", "4", "--original", "320").returncode == 0
    again = _run(str(tmp_path / "x4"), str(tmp_path / "x16"), "--factor", "4", "--original", "1280")
    assert again.returncode == 2 and "already uses YaRN" in again.stderr
    assert not os.path.exists(tmp_path / "x16")
    (tmp_path / "empty").mkdir()
    missing = _run(str(tmp_path / "empty"), str(tmp_path / "y"), "--factor", "4", "--original", "320")
    assert missing.returncode == 2 and "no config.json" in missing.stderr
    with open(tmp_path / "ck" / "config.json") as f:
        assert json.load(f)["original_seq_len"] == 0  # the source checkpoint is left as it was
