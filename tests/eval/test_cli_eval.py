"""`dsv41 eval ...` on tiny: every subcommand runs and writes its files; bad arguments exit 2 with one line."""

import json
import os

import pytest

from dsv41.cli import main


def run_main(argv):
    try:
        return main(argv)
    except SystemExit as exc:  # argparse usage errors
        return exc.code


def files(out, stem):
    return [os.path.join(out, f"{stem}.{ext}") for ext in ("json", "md", "png")]


def test_each_subcommand_runs_on_tiny_and_writes_its_files(tmp_path, text_file, capsys):
    cases = [
        (["ppl", "--text", text_file, "--seq-len", "32", "--max-tokens", "64", "--chunk", "16"], "ppl"),
        (
            ["passkey", "--lengths", "300", "--depths", "0.5", "--samples", "1", "--prefill-chunk-size", "128"],
            "passkey",
        ),
        (
            ["niah", "--lengths", "520", "--depths", "0,1", "--samples", "1", "--keys", "2", "--queries", "2"],
            "niah_k2_q2",
        ),
        (
            [
                "vartrack",
                "--lengths",
                "400",
                "--depths",
                "0.5",
                "--samples",
                "1",
                "--hops",
                "2",
                "--prefill-mode",
                "full",
            ],
            "vartrack",
        ),
        (["recall", "--lengths", "64", "--queries", "2"], "recall"),
        (["cost", "--lengths", "24", "--samples", "1", "--continuation", "4", "--text", text_file], "cost"),
    ]
    for args, stem in cases:
        out = str(tmp_path / stem)
        assert run_main(["eval", *args, "--out", out, "--threads", "1"]) == 0, args
        assert all(os.path.isfile(f) for f in files(out, stem)), (args, os.listdir(out))
        assert json.load(open(files(out, stem)[0]))["model"] == "dsv41-tiny"
    vartrack = json.load(open(files(str(tmp_path / "vartrack"), "vartrack")[0]))
    assert vartrack["engine"]["prefill_mode"] == "full" and vartrack["options"]["hops"] == 2


def test_all_runs_every_eval_into_one_folder(tmp_path, text_file):
    out = str(tmp_path / "all")
    argv = [
        "eval",
        "all",
        "--text",
        text_file,
        "--lengths",
        "600",
        "--depths",
        "0.5",
        "--samples",
        "1",
        "--seq-len",
        "32",
        "--max-tokens",
        "64",
        "--out",
        out,
    ]
    assert run_main(argv) == 0
    summary = json.load(open(os.path.join(out, "all.json")))
    assert list(summary["evals"]) == ["ppl", "passkey", "niah", "niah_multikey", "vartrack", "recall", "cost"]
    for stem in ("ppl", "passkey", "niah", "niah_k4_q1", "vartrack", "recall", "cost"):
        assert all(os.path.isfile(f) for f in files(out, stem)), stem
    tables = open(os.path.join(out, "all.md")).read()
    assert tables.count("## ") == 7 and "| depth \\ length | 600 |" in tables


@pytest.mark.parametrize(
    "args,message",
    [
        (["passkey", "--depths", "2"], "fractions"),
        (["ppl"], "--data DIR"),
        (["cost", "--compare", "x:y"], "not A:B"),
        (["niah", "--keys", "1", "--queries", "2"], "--queries 2"),
        (["passkey", "--lengths", "8K"], "--extrapolate"),
        (["all", "--skip", "bogus"], "unknown eval"),
        (["recall", "--model", "/no/such/folder"], "neither a preset"),
        (["ppl", "--text", "/no/such/file.txt"], "no such file"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_error(args, message, tmp_path, capsys):
    assert run_main(["eval", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_usage_errors_name_the_option(capsys):
    assert run_main(["eval", "recall", "--queries", "many"]) == 2
    assert "--queries" in capsys.readouterr().err
    assert run_main(["eval", "passkey", "--keys", "3"]) == 2  # a niah option: not offered by passkey
    assert "unrecognized arguments: --keys" in capsys.readouterr().err
