import json
import subprocess
import sys

from dsv41.cli import main


def test_info_json_flash(capsys):
    assert main(["info", "--preset", "flash", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 890
    assert out["params_total"] == 763_205_315_794
    assert 15.5e9 < out["params_active_decode"] < 16.5e9 and 7.5e9 < out["params_active_prefill"] < 8.3e9


def test_info_from_config_file(capsys):
    assert main(["info", "--config", "tests/data/golden/v41-tiny-bf16/config.json"]) == 0
    assert "bytes per token" in capsys.readouterr().out


def test_generate_tiny_random_weights(capsys):
    assert main(["generate", "--preset", "tiny", "--prompt", "Hello", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "generated ids" in out


def test_generate_golden_checkpoint_is_deterministic(capsys):
    args = ["generate", "--model", "tests/data/golden/v41-tiny-fp8", "--prompt", "hi", "--max-new-tokens", "4"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out.split("generated ids")[1].split("\n")[0] == first.split("generated ids")[1].split("\n")[0]


def test_bad_input_exits_nonzero(capsys):
    assert main(["info", "--config", "/nonexistent/config.json"]) == 2
    assert main(["generate", "--preset", "flash"]) == 2


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "dsv41.cli", "info", "--preset", "tiny"], capture_output=True, text=True)
    assert out.returncode == 0 and "total" in out.stdout
