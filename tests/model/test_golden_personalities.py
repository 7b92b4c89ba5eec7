"""Golden parity does not depend on the CPU: every public set passes bit for bit under the personalities
the sets were made under (slow tier; the default tier runs the plain one, tests/model/test_golden.py).

Each personality is a subprocess with its own environment: one thread; ATen held to AVX2 kernels with MKL
and oneDNN held to AVX2; ATen's scalar (`default`) kernels. Canonical
numerics make the kernel choice irrelevant, so each must PASS with every logit and capture identical. A
first check in each subprocess shows the personality took effect (torch's capability, its thread count)."""

import os
import subprocess
import sys

import pytest

from tests.conftest import GOLDEN_FOLDERS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (environment, the CPU capability torch must report or None for any, threads or None for any)
PERSONALITIES = {
    "one-thread": ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, None, 1),
    "avx2": (
        {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
        "AVX2",
        None,
    ),
    "scalar": ({"ATEN_CPU_CAPABILITY": "default"}, "DEFAULT", None),
}


def _env(extra: dict) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "ATEN_CPU_CAPABILITY",
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS",
            "MKL_ENABLE_INSTRUCTIONS",
            "ONEDNN_MAX_CPU_ISA",
        )
    }
    env.update(extra)
    return env


@pytest.mark.slow
@pytest.mark.parametrize("personality", list(PERSONALITIES))
def test_every_public_set_passes_under_each_personality(personality):
    extra, capability, threads = PERSONALITIES[personality]
    env = _env(extra)
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    got_capability, got_threads = probe.stdout.split()
    if capability is not None:
        assert got_capability == capability, probe.stdout
    if threads is not None:
        assert int(got_threads) == threads, probe.stdout
    for folder in GOLDEN_FOLDERS:
        run = subprocess.run(
            [sys.executable, "-m", "dsv41.golden", folder],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        lines = run.stdout.strip().splitlines()
        assert run.returncode == 0 and lines[-1].startswith("PASS"), (
            personality,
            folder,
            run.stdout[-3000:],
            run.stderr[-2000:],
        )
        assert "first differing capture: none (all captures identical)" in run.stdout, (personality, folder)
        assert "max abs overall 0.000e+00" in run.stdout, (personality, folder)
