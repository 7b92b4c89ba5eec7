"""The training benchmark runs end to end (quick sizes) and writes its JSON."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_train_quick_run(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "bench_train.py")
    run = subprocess.run(
        [sys.executable, script, "--quick", "--threads", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "train_step_tiny.json").read_text())["rows"]
    assert len(rows) == 5 and all(r["fwd_bwd_s"] > 0 and r["optimizer_s"] > 0 for r in rows)
    assert rows[-1]["tokens_per_step"] == 4 * rows[0]["tokens_per_step"]
    assert "vs recipe" in run.stdout
