"""Command line: `dsv41 info` (parameter and KV-cache accounting) and `dsv41 generate`."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dsv41.accounting import account, format_table
from dsv41.config import PRESETS, ModelConfig, preset


def _config(args) -> tuple[str, ModelConfig]:
    if args.config:
        return args.config, ModelConfig.from_file(args.config)
    return args.preset, preset(args.preset)


def cmd_info(args) -> int:
    name, cfg = _config(args)
    acc = account(cfg)
    if args.json:
        print(json.dumps({"config": name, **acc}, indent=2))
    else:
        print(format_table(name, acc))
    return 0


def cmd_generate(args) -> int:
    from dsv41.generate import generate
    from dsv41.model.init import init_random_weights
    from dsv41.model.transformer import Transformer
    from dsv41.tokenizer import ByteTokenizer
    from dsv41.weights import load_model

    torch.manual_seed(args.seed)
    if args.model:
        model = load_model(args.model)
        source = args.model
    else:
        name, cfg = _config(args)
        if name == "flash":
            print("error: flash has 763B parameters; random weights for it do not fit here. "
                  "Use --preset tiny/small or --model PATH.", file=sys.stderr)
            return 2
        model = init_random_weights(Transformer(cfg), seed=args.seed).eval()
        source = f"preset {name}, random weights (seed {args.seed})"
    tok = ByteTokenizer(model.cfg.vocab_size)
    prompt = torch.tensor([tok.encode(args.prompt)])
    t0 = time.perf_counter()
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_p, eos_id=tok.eos_id, seed=args.seed)
    seconds = time.perf_counter() - t0
    ids = out[0].tolist()
    print(f"model: {source}")
    print(f"prompt ({prompt.size(1)} tokens): {args.prompt!r}")
    print(f"generated ids: {ids}")
    print(f"generated text (byte tokenizer): {tok.decode(ids)!r}")
    print(f"{len(ids)} tokens in {seconds:.2f}s ({len(ids) / seconds:.1f} tok/s including prefill)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    def model_args(p):
        p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="built-in config")
        p.add_argument("--config", help="a config.json (inference or Hugging Face form); overrides --preset")

    p_info = sub.add_parser("info", help="parameter counts and KV-cache bytes per token")
    model_args(p_info)
    p_info.add_argument("--json", action="store_true", help="print one JSON object")
    p_info.set_defaults(func=cmd_info)

    p_gen = sub.add_parser("generate", help="generate text (random weights for presets, or --model PATH)")
    model_args(p_gen)
    p_gen.add_argument("--model", help="a folder with config.json and *.safetensors")
    p_gen.add_argument("--prompt", default="Hello")
    p_gen.add_argument("--max-new-tokens", type=int, default=16)
    p_gen.add_argument("--temperature", type=float, default=0.0)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--seed", type=int, default=0)
    p_gen.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
