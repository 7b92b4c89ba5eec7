"""dsv41.train.compare: the table of runs read from their metrics.jsonl."""

import json

import pytest

from dsv41.train.compare import load_runs, main, markdown_table, summarize


def write_run(folder, rows):
    folder.mkdir()
    with open(folder / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(folder)


def row(step, loss, val=None, tokens_per_s=10.0):
    r = {"step": step, "loss": loss, "tokens": step * 100, "tokens_per_s": tokens_per_s, "max_load_ratio": 2.0}
    if val is not None:
        r["val_loss"] = val
    return r


def test_shared_eval_steps_and_resumed_duplicates(tmp_path):
    a = write_run(tmp_path / "a", [row(1, 5.0), row(2, 4.0, val=4.5), row(3, 3.0), row(4, 2.0, val=3.5)])
    # b was resumed at step 2: the repeated step counts once, with its last record
    b = write_run(tmp_path / "b", [row(1, 5.0), row(2, 9.0, val=9.0), row(2, 4.2, val=4.6), row(3, 3.1)])
    s = summarize(load_runs([a, b], ["A", "B"]))
    assert s["eval_steps"] == [2]
    assert s["runs"]["A"]["val_loss"] == [4.5] and s["runs"]["B"]["val_loss"] == [4.6]
    assert s["runs"]["B"]["steps"] == 3 and s["runs"]["A"]["final_train_loss_last10"] == 3.5
    assert "| A | 4.500 |" in markdown_table(s)
    assert main([a, b, "--out", str(tmp_path / "out" / "cmp")]) == 0
    assert (tmp_path / "out" / "cmp.png").stat().st_size > 5000


def test_bad_runs_are_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        load_runs([str(tmp_path)])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        load_runs([str(bad)])
