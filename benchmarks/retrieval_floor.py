"""The no-retrieval floor of each task's held-out answer loss (issue 33): what the best predictor that
cannot read the far context scores on the exact held-out rows `dsv41 train --mix retrieval` evaluates.

It knows the task, the format, where in an answer it is, the answer tokens before it (teacher forcing
shows the model those too) and how the held-out values are distributed, but not the row's own value:
for every trained target it predicts the distribution of answer tokens seen after the same previous
target at the same (task, position within the answer run, last target of the row) key over many other
rows of the *same* split drawn under another seed, backed off to the key without the previous token
(weight 2), then add-0.5 over the vocabulary (the split's
values are disjoint from train's by construction, so train rows would give their tokens too little
mass). A model whose val_loss_TASK is below this number uses what the key does not give: the far context.

    python benchmarks/retrieval_floor.py DATA_DIR SEQ_LEN [EVAL_BATCHES] [BATCH_SIZE] [ROWS]
"""

import json
import math
import os
import sys
from collections import Counter, defaultdict

from dsv41.data import TokenDataset, read_meta
from dsv41.data.retrieval_tasks import IGNORE, RetrievalMix
from dsv41.tokenizer import load_tokenizer


def keyed_targets(batch):
    """[(task, key, previous, target)] of every trained target: key = (position in its run of trained
    targets, whether it is the row's last target (the EOS)); previous: the run's previous target or None."""
    out = []
    for row, task in enumerate(batch.tasks):
        y = batch.y[row].tolist()
        trained = [i for i, t in enumerate(y) if t != IGNORE]
        k = 0
        for n, i in enumerate(trained):
            k = k + 1 if n and trained[n - 1] == i - 1 else 0
            out.append((task, (k, n == len(trained) - 1), y[i - 1] if k else None, y[i]))
    return out


def main(data: str, seq_len: int, eval_batches: int = 8, batch_size: int = 8, rows: int = 4000) -> dict:
    meta = read_meta(data)
    tok = load_tokenizer(os.path.dirname(os.path.join(data, meta["tokenizer_path"])), meta["vocab_size"])
    vocab = meta["vocab_size"]
    val = RetrievalMix(TokenDataset.from_dir(data, "val"), tok, "val")
    counts: dict = defaultdict(Counter)
    for i in range(rows // batch_size):
        for task, key, prev, target in keyed_targets(val.retrieval_batch(i, batch_size, seq_len, seed=12345)):
            counts[task, key][target] += 1
            counts[task, key, prev][target] += 1
    nats: dict = defaultdict(lambda: [0.0, 0])
    for batch in val.sequential_batches(batch_size, seq_len, eval_batches):
        if not hasattr(batch, "tasks"):
            continue  # the text batches
        for task, key, prev, target in keyed_targets(batch):
            c, b = counts[task, key], counts[task, key, prev]
            back = (c[target] + 0.5) / (sum(c.values()) + 0.5 * vocab)
            p = (b[target] + 2 * back) / (sum(b.values()) + 2)
            nats[task][0] -= math.log(p)
            nats[task][1] += 1
    return {task: round(s / n, 3) for task, (s, n) in sorted(nats.items())}


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], *map(int, args[1:]))))
