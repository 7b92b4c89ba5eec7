"""dsv41.eval.perplexity against an independent computation, and its input checks."""

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsv41.eval.common import held_out
from dsv41.eval.perplexity import PerplexityConfig, perplexity, run_perplexity


def test_perplexity_equals_exp_mean_nll_of_the_plain_forward(tiny_eval, text_file):
    """The eval (windows in batches of 2, each prefilled in 24-token chunks over one cache) gives the
    perplexity of one plain forward per window scored with cross_entropy, bucket by bucket."""
    tokens = held_out(tiny_eval, None, text_file).tokens
    seq_len, n_windows = 64, 3
    result = perplexity(tiny_eval, tokens, seq_len, max_tokens=seq_len * n_windows, batch_size=2, chunk=24, buckets=4)

    nll = []
    with torch.inference_mode():
        for w in range(n_windows):  # window w: inputs tokens[w*L : w*L+L], targets shifted by one
            window = torch.from_numpy(tokens[w * seq_len : w * seq_len + seq_len + 1])
            logits = tiny_eval.model(window[None, :-1])[0]  # a fresh cache, one call
            nll.append(F.cross_entropy(logits, window[1:], reduction="none").double())
    nll = torch.stack(nll)  # [windows, L]
    expected = math.exp(float(nll.mean()))
    assert result["windows"] == n_windows and result["tokens"] == n_windows * seq_len
    assert abs(result["ppl"] / expected - 1) < 1e-5  # equal up to GEMM-shape rounding (exact on this CPU)
    for bucket, lo in zip(result["nll_by_position"], range(0, seq_len, 16)):
        assert (bucket["from"], bucket["to"]) == (lo, lo + 15)
        assert abs(bucket["nll"] - float(nll[:, lo : lo + 16].mean())) < 1e-4
    # ASCII under the byte tokenizer: one byte per scored token, so bits per byte = bits per token
    assert result["bytes"] == result["tokens"]
    assert abs(result["bits_per_byte"] - float(nll.mean()) / math.log(2)) < 1e-4


def test_run_writes_table_json_and_plot(tiny_eval, text_file, tmp_path, capsys):
    out = str(tmp_path / "ppl")
    result = run_perplexity(
        PerplexityConfig(text=text_file, seq_len=32, max_tokens=64, chunk=16, buckets=2, out=out), tiny_eval
    )
    saved = json.load(open(os.path.join(out, "ppl.json")))
    assert saved["ppl"] == pytest.approx(result["ppl"]) and saved["windows"] == 2
    assert open(os.path.join(out, "ppl.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert "| positions |" in capsys.readouterr().out


def write_data_folder(folder, tokens, vocab_size, tokenizer_json=False):
    """A minimal `dsv41 data`-style folder: meta.json + val.bin (+ an optional tokenizer.json)."""
    os.makedirs(folder, exist_ok=True)
    np.asarray(tokens, dtype="<u2").tofile(os.path.join(folder, "val.bin"))
    meta = {"vocab_size": vocab_size, "dtype": "uint16", "files": {"val": {"path": "val.bin"}}}
    json.dump(meta, open(os.path.join(folder, "meta.json"), "w"))
    if tokenizer_json:
        open(os.path.join(folder, "tokenizer.json"), "w").write("{}")
    return str(folder)


def test_a_data_folder_is_scored_and_a_foreign_one_refused(tiny_eval, text_file, tmp_path):
    tokens = held_out(tiny_eval, None, text_file).tokens[:200]
    good = write_data_folder(tmp_path / "good", tokens, 1024)
    from_data = run_perplexity(
        PerplexityConfig(data=good, seq_len=32, max_tokens=96, out=str(tmp_path / "o")), tiny_eval
    )
    from_array = perplexity(tiny_eval, tokens, 32, 96)
    assert from_data["ppl"] == pytest.approx(from_array["ppl"], rel=1e-9)

    foreign = write_data_folder(tmp_path / "bpe", tokens, 1024, tokenizer_json=True)
    with pytest.raises(ValueError, match="tokenizer.json"):
        run_perplexity(PerplexityConfig(data=foreign, seq_len=32, out=str(tmp_path / "o")), tiny_eval)
    wide = write_data_folder(tmp_path / "wide", tokens, 8192)
    with pytest.raises(ValueError, match="8192 ids"):
        run_perplexity(PerplexityConfig(data=wide, seq_len=32, out=str(tmp_path / "o")), tiny_eval)


def test_bad_input_is_refused_with_a_clear_error(tiny_eval, text_file, tmp_path):
    out = str(tmp_path)
    with pytest.raises(ValueError, match="--data DIR"):
        run_perplexity(PerplexityConfig(out=out), tiny_eval)
    with pytest.raises(ValueError, match="not both"):
        run_perplexity(PerplexityConfig(text=text_file, data=out, out=out), tiny_eval)
    short = tmp_path / "short.txt"
    short.write_text("Only a few words here.")
    with pytest.raises(ValueError, match="lower --seq-len"):
        run_perplexity(PerplexityConfig(text=str(short), seq_len=64, out=out), tiny_eval)
    with pytest.raises(ValueError, match="--extrapolate"):
        run_perplexity(PerplexityConfig(text=text_file, seq_len=5000, out=out), tiny_eval)
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        run_perplexity(PerplexityConfig(text=text_file, chunk=0, out=out), tiny_eval)
    with pytest.raises(ValueError, match="no such file"):
        run_perplexity(PerplexityConfig(text=str(tmp_path / "missing.txt"), out=out), tiny_eval)
