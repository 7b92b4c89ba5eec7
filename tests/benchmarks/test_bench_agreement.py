"""The agreement benchmark runs end to end (quick sizes) and writes its JSON: every mode meets the targets."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_agreement.py")


@pytest.mark.slow
def test_bench_agreement_quick_run(tmp_path):
    run = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=os.path.join(ROOT, "benchmarks"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "agreement.json").read_text())
    rows = result["rows"]
    assert [(r["mode"], r["path"].split(",")[0]) for r in rows] == [
        (mode, path) for mode in ("fast", "fast-compiled", "deterministic") for path in ("prefill", "prefill", "decode")
    ]
    for r in rows:
        assert r["positions"] > 0 and r["top1"] >= 0.99 and r["kl_mean"] <= 2e-3, r
        if r["path"].startswith("prefill"):
            assert abs(r["ppl_ratio"] - 1) <= 0.005, r
    assert result["machine"]["cpu"]
