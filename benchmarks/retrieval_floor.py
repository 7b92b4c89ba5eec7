"""The no-retrieval floor of each task's held-out answer loss (issue 33): what the best predictor that
cannot read the far context scores on the exact held-out rows `dsv41 train --mix retrieval` evaluates.

It knows the task, the format and where in an answer it is: for every trained target it predicts the
distribution of answer tokens seen at the same (task, position within the answer run, last target of
the row) key over many *training* rows (add-0.5 smoothed over the vocabulary). A model whose
val_loss_TASK is below this number uses something the key does not give: the far context.

    python benchmarks/retrieval_floor.py DATA_DIR SEQ_LEN [EVAL_BATCHES] [BATCH_SIZE] [TRAIN_ROWS]
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
    """[(task, key, target)] of every trained target: key = (position in its run of trained targets,
    whether it is the row's last target (the EOS))."""
    out = []
    for row, task in enumerate(batch.tasks):
        y = batch.y[row].tolist()
        trained = [i for i, t in enumerate(y) if t != IGNORE]
        k = 0
        for n, i in enumerate(trained):
            k = k + 1 if n and trained[n - 1] == i - 1 else 0
            out.append((task, (k, n == len(trained) - 1), y[i]))
    return out


def main(data: str, seq_len: int, eval_batches: int = 8, batch_size: int = 8, train_rows: int = 4000) -> dict:
    meta = read_meta(data)
    tok = load_tokenizer(os.path.dirname(os.path.join(data, meta["tokenizer_path"])), meta["vocab_size"])
    vocab = meta["vocab_size"]
    train = RetrievalMix(TokenDataset.from_dir(data, "train"), tok, "train", text_fraction=0.0)
    val = RetrievalMix(TokenDataset.from_dir(data, "val"), tok, "val")
    counts: dict = defaultdict(Counter)
    for i in range(train_rows // batch_size):
        for task, key, target in keyed_targets(train.retrieval_batch(i, batch_size, seq_len, seed=12345)):
            counts[task, key][target] += 1
    nats: dict = defaultdict(lambda: [0.0, 0])
    for batch in val.sequential_batches(batch_size, seq_len, eval_batches):
        if not hasattr(batch, "tasks"):
            continue  # the text batches
        for task, key, target in keyed_targets(batch):
            c = counts[task, key]
            p = (c[target] + 0.5) / (sum(c.values()) + 0.5 * vocab)
            nats[task][0] -= math.log(p)
            nats[task][1] += 1
    return {task: round(s / n, 3) for task, (s, n) in sorted(nats.items())}


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], *map(int, args[1:]))))
