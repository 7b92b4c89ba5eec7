"""The speed benchmark runs end to end (quick sizes, tiny) and writes its JSON and plot; the long-prompt
curve mode records one point per chunk and a decode step at the end."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_speed.py")


@pytest.mark.slow
def test_bench_speed_quick_run(tmp_path):
    run = subprocess.run([sys.executable, SCRIPT, "--quick", "--preset", "tiny", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "speed_tiny.json").read_text())
    assert (tmp_path / "speed_tiny.png").stat().st_size > 10_000
    assert sorted({(r["batch"], r["context"]) for r in result["decode"]}) == [(1, 512), (1, 2048), (8, 512), (8, 2048)]
    assert all(r["engine_tok_s"] > 0 and r["plain_tok_s"] > 0 for r in result["decode"])
    assert [p["prompt"] for p in result["prefill"]] == [512, 2048]
    assert all(p["engine"]["peak_rss_gb"] > 0.05 for p in result["prefill"])
    kv = [r["engine_resident_kv_bytes"] for r in result["decode_step_vs_context"]]
    assert kv[1] > 3 * kv[0]  # the pool holds the context: 4x the tokens, about 4x the bytes
    # the plain loop's bf16 containers take several times the packed pool's bytes at the same context
    assert all(r["plain_container_bytes"] > 2 * r["engine_resident_kv_bytes"] for r in result["decode_step_vs_context"])


@pytest.mark.slow
def test_bench_speed_prefill_curve(tmp_path):
    run = subprocess.run([sys.executable, SCRIPT, "--preset", "tiny", "--out", str(tmp_path), "--prefill-curve", "3000"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads((tmp_path / "prefill_curve_tiny_3000.json").read_text())
    positions = [p["position"] for p in result["points"]]
    assert positions[-1] >= 3000 and positions == sorted(positions)
    assert len(result["decode_step_s"]) == 5 and result["resident_kv_bytes"] > 0
    curve = str(tmp_path / "prefill_curve_tiny_3000.json")
    run = subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path), "--plot-curve", curve],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    fit = json.loads((tmp_path / "prefill_curve_tiny_3000.json").read_text())["extrapolation"]
    assert fit["target"] == 1 << 20 and fit["prefill_s"] > result["prefill_s"]
    assert (tmp_path / "prefill_curve_tiny_3000.png").stat().st_size > 10_000
