import io
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import torch

from dsv41.cli import build_parser, _engine_config, main
from dsv41.engine import EngineConfig

STATS = re.compile(r"\[(\d+) tokens in [\d.]+s: [\d.]+ tokens/s; decode [\d.]+ tokens/s after a [\d.]+s first token; "
                   r"prompt (\d+) tokens, (\d+) cached\]")


def test_info_json_flash(capsys):
    assert main(["info", "--preset", "flash", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 890
    assert out["params_total"] == 763_205_315_794
    assert 15.5e9 < out["params_active_decode"] < 16.5e9 and 7.5e9 < out["params_active_prefill"] < 8.3e9


def test_info_from_config_file(capsys):
    assert main(["info", "--config", "tests/data/golden/v41-tiny-bf16/config.json"]) == 0
    assert "bytes per token" in capsys.readouterr().out


def test_generate_tiny_prints_text_and_tokens_per_second(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt", "Hello", "--max-tokens", "3", "--ignore-eos",
                 "--show-ids", "--kv-pool-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    ids = json.loads(re.search(r"generated ids: (\[.*\])", out).group(1))
    tokens, prompt, _ = map(int, STATS.search(out).groups())
    assert len(ids) == tokens == 3 and prompt == len("Hello") + 1  # byte tokenizer + BOS
    assert "finish reason: length" in out


def test_generate_checkpoint_matches_the_reference_loop(capsys):
    """Greedy ids from the engine-backed CLI on a real checkpoint equal the plain generation loop's."""
    from dsv41.generate import generate
    from dsv41.tokenizer import load_tokenizer
    from dsv41.weights import load_model

    folder = "tests/data/golden/v41-tiny-fp8"
    assert main(["generate", "--model", folder, "--prompt", "hi", "--max-tokens", "2", "--show-ids"]) == 0
    ids = json.loads(re.search(r"generated ids: (\[.*\])", capsys.readouterr().out).group(1))
    model = load_model(folder)
    prompt = load_tokenizer(folder, model.cfg.vocab_size).encode("hi")
    ref = generate(model, torch.tensor([prompt]), 2, temperature=0.0, eos_id=1)[0].tolist()
    assert ids == ref[: len(ids)] and len(ids) >= 1


def test_chat_reads_piped_stdin_and_keeps_the_conversation(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n\nand a follow-up\n/reset\nnew topic\n"))
    assert main(["chat", "--preset", "tiny", "--max-tokens", "2", "--ignore-eos", "--kv-pool-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    turns = [tuple(map(int, m.groups())) for m in STATS.finditer(out)]
    assert len(turns) == 3 and all(t[0] == 2 for t in turns)  # the empty line is skipped
    (_, p1, _), (_, p2, _), (_, p3, _) = turns
    assert p2 >= p1 + len("and a follow-up")  # the second prompt still holds the first exchange
    assert p3 < p2  # /reset dropped it
    assert "[conversation reset]" in out and out.count("assistant> ") == 3


def test_chat_as_a_subprocess_with_a_pipe():
    r = subprocess.run([sys.executable, "-m", "dsv41.cli", "chat", "--preset", "tiny", "--max-tokens", "2",
                        "--ignore-eos", "--thinking", "--kv-pool-tokens", "4096"],
                       input="hi\n/exit\nnever read\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(STATS.findall(r.stdout)) == 1 and "(thinking) " in r.stdout


def test_engine_options_come_from_engine_config():
    args = build_parser().parse_args(["serve", "tiny", "--max-num-seqs", "3", "--no-enable-prefix-caching",
                                      "--prefill-mode", "full", "--window-ttl-s", "1.5", "--port", "9"])
    cfg = _engine_config(args)
    assert isinstance(cfg, EngineConfig)
    assert (cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.prefill_mode, cfg.window_ttl_s) == (3, False, "full", 1.5)
    assert cfg.block_size == EngineConfig().block_size and args.port == 9 and args.model == "tiny"
    assert _engine_config(build_parser().parse_args(["serve", "tiny"])) == EngineConfig()


def test_serve_subprocess_answers_openai_requests():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dsv41.cli", "serve", "tiny", "--port", str(port),
                             "--kv-pool-tokens", "4096", "--served-model-name", "my-model", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
            time.sleep(0.1)
        assert [m["id"] for m in httpx.get(base + "/v1/models").json()["data"]] == ["my-model"]
        r = httpx.post(base + "/v1/completions", json={"model": "my-model", "prompt": "hi", "max_tokens": 2,
                                                        "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_input_exits_nonzero(capsys):
    assert main(["info", "--config", "/nonexistent/config.json"]) == 2
    assert main(["generate", "--preset", "flash"]) == 2
    assert main(["generate", "--model", "/nonexistent/folder"]) == 2
    assert main(["generate", "--preset", "tiny", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "dsv41.cli", "info", "--preset", "tiny"], capture_output=True, text=True)
    assert out.returncode == 0 and "total" in out.stdout
