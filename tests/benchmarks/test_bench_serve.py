"""The serving benchmark runs end to end (quick sizes) and writes its table data, JSON and plot."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_serve_quick_run(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "bench_serve.py")
    run = subprocess.run(
        [sys.executable, script, "--quick", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "serve_tiny.json").read_text())
    assert (tmp_path / "serve_tiny.png").stat().st_size > 10_000
    assert [r["batch"] for r in result["decode"]] == [1, 8]
    assert all(r["engine_tok_s"] > 0 and r["baseline_tok_s"] > 0 for r in result["decode"])
    # the packed pool holds exactly the analytic bytes per token; the baseline's bf16 containers do not
    kv = result["kv_bytes"]
    assert abs(kv["engine_measured_bytes_per_token"] / kv["analytic_bytes_per_token"] - 1) < 0.02
    assert kv["baseline_bf16_bytes_per_token"] > 3 * kv["analytic_bytes_per_token"]
    turns = result["multi_turn"]["variants"]
    for name in ("prefix cache (exact reuse)", "prefix cache, approximate reuse"):
        assert turns[name]["snapshot_hits"] == result["multi_turn"]["turns"] - 1, name
    assert turns["no prefix cache"]["hit_rate"] == 0
    if "structured_decode" in result:  # with the structured extra: both step times measured, per batch
        assert [r["batch"] for r in result["structured_decode"]] == [1, 8]
        assert all(
            r["free_step_ms"] > 0 and r["json_schema_step_ms"] > 0 and r["mask_only_ms_per_step"] > 0
            for r in result["structured_decode"]
        )
    assert "decode step time vs context" in run.stdout
