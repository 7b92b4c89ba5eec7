"""The numerics benchmark runs end to end (quick sizes, tiny) and writes its JSON and plot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_numerics.py")


@pytest.mark.slow
def test_bench_numerics_quick_run(tmp_path):
    run = subprocess.run(
        [sys.executable, SCRIPT, "--quick", "--presets", "tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.path.join(ROOT, "benchmarks"),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("CPU: ")
    result = json.loads((tmp_path / "numerics.json").read_text())
    assert (tmp_path / "numerics.png").stat().st_size > 10_000
    assert len(result["ops"]) == 8 and all(r["fast_ms"] > 0 and r["reference_ms"] > 0 for r in result["ops"])
    variants = [r["variant"] for r in result["model"]]
    assert variants[0].startswith("fast") and variants[-1].startswith("reference")
    assert result["model"][0]["prefill_ratio"] == 1.0
    assert result["machine"]["cpu"] and result["machine"]["torch_capability"]
