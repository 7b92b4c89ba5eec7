"""A request's numbers do not depend on what the engine batches it with: log-probabilities bit for bit,
not only the greedy tokens (issue 15: the RL learner replays one sequence's computation exactly).

The prompts mix very short and long sequences, so one step holds decode rows with fewer visible
compressed entries than index_topk beside rows with more (the batched decode attends each row at its own
selection width; a Reindex row whose candidates are fewer than k keeps its unusable picks last), and
token counts whose router scores, Engram gates and mHC mixes end in a vector kernel's scalar tail
(ops.lanes)."""

import pytest

from dsv41.config import tiny
from dsv41.engine import SamplingParams
from dsv41.model.init import init_random_weights
from dsv41.model.transformer import Transformer
from tests.engine.helpers import make, prompts

LENGTHS = [3, 70, 9, 130, 2, 33]
# wider than tiny: a window and a selection of 64 each, two 64-wide blocks of the sparse attention (where a
# narrower selection list changes the second block's sums), 16 experts (router rows half a vector kernel step)
WIDE = tiny().replace(
    window_size=64, index_topk=64, candidate_topk_blocks=20, n_routed_experts=16, n_activated_experts=2
)


def _run(engine, batch, params):
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params[i])
    out: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(lp.logprob for lp in o.new_logprobs)
            if o.finished:
                tokens[o.request_id] = o.token_ids
    return [(tokens[str(i)], out[str(i)]) for i in range(len(batch))]


@pytest.mark.parametrize("cfg", [tiny(), WIDE], ids=["tiny", "wide"])
def test_logprobs_alone_equal_logprobs_in_a_batch(cfg):
    model = init_random_weights(Transformer(cfg), seed=3).eval()
    batch = prompts(LENGTHS, seed=2)
    params = [
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, ignore_eos=True, logprobs=0, seed=100 + i)
        for i in range(len(batch))
    ]
    alone = [_run(make(model), [p], [q])[0] for p, q in zip(batch, params)]
    together = _run(make(model, max_num_seqs=8), batch, params)
    for (t1, l1), (t2, l2), n in zip(alone, together, LENGTHS):
        assert t1 == t2, f"prompt of {n}: tokens differ"
        assert l1 == l2, f"prompt of {n}: log-probabilities differ"
