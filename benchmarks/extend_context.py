"""Serve a checkpoint past its training length with YaRN (issue 33's extrapolation rows).

    python benchmarks/extend_context.py CHECKPOINT OUT --factor 4 --original 320

writes OUT: the checkpoint's files linked (not copied) and a config.json whose compressed layers' RoPE
(spec §3 "RoPE tables": every ratio > 0 layer rotates with YaRN on `compress_rope_theta`) is YaRN with
`original_seq_len` = the training length and `rope_factor` = the extension, the same edit a Hugging Face
user makes in `rope_scaling` to stretch a model. Pairs whose wavelength fits the training length many
times keep their frequency; pairs that turn less than once over it are divided by the factor, so at
factor x the training length they turn no further than training showed them (beta_fast / beta_slow,
32 / 1 as the release, set the blend between). Ratio-0 layers keep plain RoPE, as the spec has it.
No weight changes; the blended pairs move a little at short range too, so compare the in-distribution
rows with and without it.

A checkpoint already using YaRN (original_seq_len > 0) is refused: stacking two extensions is not YaRN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def extend(checkpoint: str, out: str, factor: float, original: int) -> dict:
    config_path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{checkpoint} has no config.json; give a checkpoint folder")
    with open(config_path) as f:
        config = json.load(f)
    if "original_seq_len" not in config:
        raise ValueError(
            "config.json is not a dsv41 config (no original_seq_len); Hugging Face configs set rope_scaling themselves"
        )
    if config["original_seq_len"] > 0:
        raise ValueError(
            f"the checkpoint already uses YaRN (original_seq_len {config['original_seq_len']}, factor "
            f"{config['rope_factor']}); extend the unscaled checkpoint instead"
        )
    if factor <= 1 or original <= 0:
        raise ValueError("--factor must be > 1 and --original > 0")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(checkpoint):
        src, dst = os.path.join(checkpoint, name), os.path.join(out, name)
        if name == "config.json" or not os.path.isfile(src):
            continue
        if os.path.lexists(dst):
            os.remove(dst)
        try:
            os.link(src, dst)
        except OSError:  # another file system: a symbolic link
            os.symlink(os.path.abspath(src), dst)
    config.update(
        original_seq_len=original,
        rope_factor=float(factor),
        max_position_embeddings=max(config.get("max_position_embeddings", 0), int(original * factor)),
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("out")
    ap.add_argument("--factor", type=float, required=True, help="how many times the training length to reach")
    ap.add_argument("--original", type=int, required=True, help="the training length (tokens)")
    args = ap.parse_args(argv)
    try:
        config = extend(args.checkpoint, args.out, args.factor, args.original)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: YaRN factor {config['rope_factor']} over {config['original_seq_len']} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
