"""The OpenAPI schema is the server's contract: schemathesis (`st run --checks all`) against `dsv41 serve
tiny` finds no request the schema describes that the server refuses, no answer it does not list, no
undocumented status, content type or allowed method. Bounded and deterministic (5 examples per operation,
derandomized generation); a couple of minutes on a shared CPU, so in the slow tier.

The server runs with an API key (the schema then documents the bearer scheme and 401s, which schemathesis
checks), a 128-token context (so generations stay short) and `--max-choices 2`: its schema states those
limits. Refusals for the rules no JSON schema can state (tests/server/contract_hooks.py) are not failures.
`pip install -e ".[contract]"`; skipped without schemathesis unless DSV41_REQUIRE_OPTIONAL names it.
"""

import os
import subprocess
import sys
import time

import httpx
import pytest

from dsv41.server.run import _free_port
from tests.conftest import optional_import

optional_import("schemathesis")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEY = "contract-test-key"
PYTHONPATH = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1")
    args = ["serve", "tiny", "--port", str(port), "--api-key", KEY, "--max-model-len", "128", "--max-choices", "2"]
    args += ["--kv-pool-tokens", "4096", "--log-level", "warning", "--threads", "1", "--compile-decode", "off"]
    proc = subprocess.Popen([sys.executable, "-m", "dsv41.cli", *args], env=env, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow
def test_schemathesis_finds_no_contract_failure(server, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        server + "/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        "5",
        "--generation-deterministic",
        "--header",
        f"Authorization: Bearer {KEY}",
        "--request-timeout",
        "60",
        "--max-response-time",
        "60",
        "--no-color",
    ]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, SCHEMATHESIS_HOOKS="tests.server.contract_hooks")
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-20000:] + r.stderr[-5000:]
    assert "11 selected" in r.stdout  # every operation was tested
