"""dsv41.eval.recall: captured attention mass against a brute-force computation from the plain forward's
traces, the dense case (top-k covering every entry), and the outputs."""

import dataclasses
import json
import math
import os

import numpy as np
import pytest
import torch

from dsv41.config import tiny
from dsv41.eval.common import EvalModel, load_model
from dsv41.eval.recall import RecallConfig, captured_mass, indexer_recall, measure, run_recall
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from dsv41.tokenizer import ByteTokenizer


def random_tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (n,), generator=g).numpy().astype(np.int64)


def brute_force(model, tokens, positions):
    """Independent of the eval's hooks: one unchunked forward with traces gives every layer's input (from
    the hidden states), the selections and the compressed entries; the mass is summed in Python floats."""
    cfg = model.cfg
    trace = {}
    with torch.inference_mode():
        model(torch.from_numpy(tokens)[None], trace=trace)
        out = {}
        for i, layer in enumerate(model.layers):
            attn = layer.attn
            if not attn.ratio:
                continue
            h = trace.get(f"hidden.layers.{i}.engram_out", trace[f"hidden.layers.{i - 1}.out"])
            x = layer.attn_input(h, trace[f"hidden.layers.{i - 1}.pre_mix_out"])
            _, q, _ = attn.project(x, attn.rope(0, x.size(1)))  # [1, S, H, D]
            rows = trace[f"debug.layers.{attn.kv_source}.compress_kv"][0].float()
            picks = trace[f"debug.layers.{attn.index_source}.topk_idxs"][0]
            for p in positions:
                visible = (p + 1) // attn.ratio
                selected = [int(t) for t in picks[p] if t >= 0]
                heads = []
                for hd in range(cfg.n_heads):
                    scores = [float(q[0, p, hd].float() @ rows[t]) * attn.softmax_scale for t in range(visible)]
                    top = max(scores)
                    weights = [math.exp(s - top) for s in scores]
                    heads.append(sum(weights[t] for t in selected) / sum(weights))
                out[(i, p)] = sum(heads) / len(heads)
    return out


def test_captured_mass_matches_a_brute_force_computation(tiny_eval):
    model = tiny_eval.model
    tokens = random_tokens(64, seed=3)
    positions = [21, 40, 63]
    rows = measure(model, tokens, positions, chunk=64)
    expected = brute_force(model, tokens, positions)
    got = {(r["layer"], r["position"]): r for r in rows}
    assert set(got) == set(expected)  # every compressed layer (Full, Reuse, Reindex) at every position
    for key, mass in expected.items():
        assert abs(got[key]["mass"] - mass) < 1e-4, key
        assert 0.0 <= got[key]["mass"] <= got[key]["oracle"] + 1e-6 <= 1.0 + 1e-6
    assert min(r["mass"] for r in rows) < 0.9  # top-6 of up to 64 entries: a real selection, not all of them


def dense_model():
    """tiny with a top-k and candidate pool larger than any context here: every visible entry is picked."""
    cfg = dataclasses.replace(tiny(), index_topk=4096, candidate_topk_blocks=4096)
    return init_random_weights(Transformer(cfg), seed=2).eval()


def test_recall_is_one_when_topk_covers_every_visible_entry():
    em = EvalModel(dense_model(), ByteTokenizer(1024), "dense", None)
    result = indexer_recall(em, [random_tokens(96, seed=1)], [40, 96], queries=3, chunk=32)
    assert len(result["layers"]) == sum(1 for r in em.cfg.compress_ratios if r)
    for layer in result["layers"]:
        for b in layer["by_length"]:
            assert b["queries"] == 3
            assert b["mass_recall"] == pytest.approx(1.0, abs=1e-5) and b["mass_recall_min_head"] == pytest.approx(
                1.0, abs=1e-5
            )
            assert b["topk_overlap"] == 1.0 and b["picked"] == b["visible"]


def test_captured_mass_of_hand_made_entries():
    """Two heads, three entries: head 0 puts e^2 : 1 : 1 on them, head 1 is uniform; picking entry 0."""
    q = torch.tensor([[2.0, 0.0], [0.0, 0.0]])
    rows = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    m = captured_mass(q, rows, 3, torch.tensor([0, -1]), 1.0, k=1)
    e2 = math.exp(2.0)
    assert m["mass"] == pytest.approx((e2 / (e2 + 2) + 1 / 3) / 2)
    assert m["mass_min_head"] == pytest.approx(1 / 3)
    assert m["oracle"] == pytest.approx(m["mass"]) and m["overlap"] == 1.0 and m["picked"] == 1
    assert captured_mass(q, rows, 3, torch.tensor([0, 1, 2]), 1.0, k=3)["mass"] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="not visible"):
        captured_mass(q, rows, 2, torch.tensor([2]), 1.0, k=1)


def test_run_recall_writes_table_json_and_plot(tiny_eval, tmp_path, capsys):
    out = str(tmp_path)
    result = run_recall(RecallConfig(lengths="48,96", queries=2, chunk=40, out=out), tiny_eval)
    saved = json.load(open(os.path.join(out, "recall.json")))
    assert saved["lengths"] == [48, 96] and len(saved["layers"]) == 8
    values = [b["mass_recall"] for lay in saved["layers"] for b in lay["by_length"]]
    assert all(0.0 <= v <= 1.0 for v in values) and len(values) == 16
    assert {lay["mode"] for lay in saved["layers"]} == {"full", "reuse", "reindex"}
    assert open(os.path.join(out, "recall.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert result["index_topk"] == 6 and "| layer |" in capsys.readouterr().out
    with pytest.raises(ValueError, match="queries must be a positive integer"):
        run_recall(RecallConfig(queries=0, out=out), tiny_eval)
    with pytest.raises(ValueError, match="--extrapolate"):
        run_recall(RecallConfig(lengths="64K", out=out), tiny_eval)


def test_index_topk_option_serves_every_entry(tmp_path):
    """--index-topk 4096 on tiny (top-6, a 12-entry candidate pool): every layer, the Reindex one included
    (its pool widened), captures all the mass; the switch is the eval's, recorded in the result."""
    em = load_model("tiny", seed=0)  # its own copy: the option changes the model's indexers
    result = run_recall(RecallConfig(lengths="48,96", queries=2, chunk=40, index_topk=4096, out=str(tmp_path)), em)
    assert result["index_topk"] == 4096
    for layer in result["layers"]:
        for b in layer["by_length"]:
            assert b["mass_recall"] == pytest.approx(1.0, abs=1e-5), (layer["layer"], layer["mode"], b)
