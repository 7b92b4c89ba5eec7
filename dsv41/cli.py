"""Command line.

- `dsv41 info`: parameter and KV-cache accounting of a config;
- `dsv41 generate`: one completion, streamed, then a tokens/s line;
- `dsv41 chat`: a conversation read line by line from stdin (a terminal or a pipe), each reply
  streamed and followed by a tokens/s line; `/reset` starts over, `/exit` quits;
- `dsv41 serve MODEL`: the OpenAI-compatible server (`dsv41.server`).

generate, chat and serve all run on `dsv41.engine` (`build_engine`), whose `EngineConfig` fields are
exposed as options (`--max-num-seqs`, `--kv-pool-tokens`, ...), generated from the dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Callable, Optional

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


# ---------------------------------------------------------------------------------------------- engine


def _engine_fields():
    from dsv41.engine import EngineConfig

    return EngineConfig, dataclasses.fields(EngineConfig)


def _field_type(f: dataclasses.Field) -> Callable:
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for t in (bool, int, float, str):
        if t.__name__ in name:
            return t
    return str


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("engine options (EngineConfig)")
    try:
        _, fields = _engine_fields()
    except ImportError as exc:  # keep `dsv41 info` usable even if the engine cannot be imported
        group.description = f"unavailable: {exc}"
        return
    for f in fields:
        opt, kind = "--" + f.name.replace("_", "-"), _field_type(f)
        default = None if f.default is dataclasses.MISSING else f.default
        help_ = f"default {default}"
        try:
            if kind is bool:
                group.add_argument(opt, dest=f"engine_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                                   help=help_)
            else:
                group.add_argument(opt, dest=f"engine_{f.name}", type=kind, default=None, metavar=kind.__name__.upper(),
                                   help=help_)
        except argparse.ArgumentError:  # the name is taken by a command option; the command's wins
            continue


def _engine_config(args):
    cls, fields = _engine_fields()
    given = {f.name: getattr(args, f"engine_{f.name}") for f in fields
             if getattr(args, f"engine_{f.name}", None) is not None}
    return cls(**given)


def _model_name(args) -> str:
    name = getattr(args, "model", None) or args.preset
    if name == "flash":
        raise ValueError("flash has 763B parameters; random weights for it do not fit here. "
                         "Use --preset tiny/small or --model PATH.")
    return name


def _build_engine(args):
    from dsv41.engine import build_engine

    return build_engine(_model_name(args), engine_config=_engine_config(args), seed=args.seed)


def _sampling(args, engine):
    from dsv41.engine.types import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=list(args.stop or []), ignore_eos=args.ignore_eos)
    params.validate(engine.tokenizer.vocab_size)
    return params


@dataclasses.dataclass
class RunStats:
    prompt_tokens: int
    tokens: int
    seconds: float
    first_token_s: float
    cached_tokens: int = 0

    def line(self) -> str:
        rate = self.tokens / self.seconds if self.seconds > 0 else 0.0
        decode = (self.tokens - 1) / (self.seconds - self.first_token_s) if self.tokens > 1 and \
            self.seconds > self.first_token_s else 0.0
        return (f"[{self.tokens} tokens in {self.seconds:.2f}s: {rate:.1f} tokens/s; decode {decode:.1f} tokens/s "
                f"after a {self.first_token_s:.2f}s first token; prompt {self.prompt_tokens} tokens, "
                f"{self.cached_tokens} cached]")


def run_request(engine, request_id: str, prompt_ids: list[int], params, on_text: Callable[[str], None]):
    """Drive the engine synchronously until `request_id` finishes; returns (final output, RunStats)."""
    t0 = time.perf_counter()
    first = None
    engine.add_request(request_id, prompt_ids, params)
    final = None
    while final is None:
        if not engine.has_unfinished():
            raise RuntimeError(f"the engine dropped request {request_id}")
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if first is None and out.new_token_ids:
                first = time.perf_counter() - t0
            if out.new_text:
                on_text(out.new_text)
            if out.finished:
                final = out
    seconds = time.perf_counter() - t0
    return final, RunStats(len(prompt_ids), len(final.token_ids), seconds, first or seconds, final.num_cached_tokens)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args) -> int:
    engine = _build_engine(args)
    params = _sampling(args, engine)
    if args.chat:
        from dsv41.server.chat import build_chat_prompt

        prompt_ids = build_chat_prompt(engine.tokenizer, [{"role": "user", "content": args.prompt}],
                                       thinking=args.thinking, effort=None, tools=None)
    else:
        prompt_ids = engine.tokenizer.encode(args.prompt, add_bos=True)
    print(f"model: {engine.model_name}; prompt {len(prompt_ids)} tokens", file=sys.stderr)
    out, stats = run_request(engine, "generate-0", prompt_ids, params, _write)
    _write("\n")
    if args.show_ids:
        print(f"generated ids: {out.token_ids}")
    print(f"finish reason: {out.finish_reason}")
    print(stats.line())
    return 0


def cmd_chat(args) -> int:
    from dsv41.server.chat import ChatStreamSplitter, build_chat_prompt, resolve_thinking

    engine = _build_engine(args)
    params = _sampling(args, engine)
    effort = args.reasoning_effort
    effort = int(effort) if effort is not None and effort.strip().isdigit() else effort
    thinking, effort = resolve_thinking({"thinking": True} if args.thinking else None, effort)
    base = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(base)
    interactive = sys.stdin.isatty()
    print(f"dsv41 chat: {engine.model_name}, {'thinking' if thinking else 'non-thinking'} mode. "
          f"/reset starts over, /exit quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and not line:
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            messages = list(base)
            print("[conversation reset]")
            continue
        messages.append({"role": "user", "content": line})
        prompt_ids = build_chat_prompt(engine.tokenizer, messages, thinking=thinking, effort=effort, tools=None)
        if len(prompt_ids) + params.max_tokens > engine.max_model_len:
            messages.pop()
            print(f"[the conversation ({len(prompt_ids)} tokens) plus {params.max_tokens} new tokens does not fit "
                  f"the context of {engine.max_model_len}; /reset to start over]")
            continue
        splitter = ChatStreamSplitter(thinking=thinking, tools=False)
        label = {"reasoning": "(thinking) ", "content": "assistant> "}
        kinds = [splitter.mode]
        _write(label[splitter.mode])

        def show(pieces) -> None:
            for kind, piece in pieces:
                if kinds[-1] != kind:
                    _write("\n" + label[kind])
                    kinds.append(kind)
                _write(piece)

        _, stats = run_request(engine, f"chat-{turn}", prompt_ids, params, lambda text: show(splitter.feed(text)))
        show(splitter.finish())
        _write("\n")
        turn += 1
        reply = {"role": "assistant", "content": splitter.joined("content")}
        if thinking:
            reply["reasoning_content"] = splitter.joined("reasoning")
        messages.append(reply)
        print(stats.line())
    return 0


def cmd_serve(args) -> int:
    from dsv41.server.run import serve

    if args.model == "flash":
        raise ValueError("flash has 763B parameters; random weights for it do not fit here")
    serve(args.model, host=args.host, port=args.port, engine_config=_engine_config(args), seed=args.seed,
          max_waiting=args.max_waiting, served_model_name=args.served_model_name, log_level=args.log_level)
    return 0


# ---------------------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)

    def config_args(p):
        p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="built-in config")
        p.add_argument("--config", help="a config.json (inference or Hugging Face form); overrides --preset")

    p_info = sub.add_parser("info", help="parameter counts and KV-cache bytes per token")
    config_args(p_info)
    p_info.add_argument("--json", action="store_true", help="print one JSON object")
    p_info.set_defaults(func=cmd_info)

    def model_args(p):
        p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="built-in config, random weights")
        p.add_argument("--model", help="a checkpoint folder (config.json + *.safetensors) or a preset name; "
                       "overrides --preset")
        p.add_argument("--seed", type=int, default=0, help="weights seed (presets) and sampling seed")

    def sampling_args(p, max_tokens: int, temperature: float):
        p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=max_tokens)
        p.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0, help="0 disables")
        p.add_argument("--stop", action="append", help="a stop string (repeatable)")
        p.add_argument("--ignore-eos", action="store_true")

    p_gen = sub.add_parser("generate", help="complete one prompt on the engine (random weights for presets)")
    model_args(p_gen)
    p_gen.add_argument("--prompt", default="Hello")
    sampling_args(p_gen, max_tokens=16, temperature=0.0)
    p_gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat format)")
    p_gen.add_argument("--thinking", action="store_true", help="with --chat: thinking mode")
    p_gen.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    _add_engine_args(p_gen)
    p_gen.set_defaults(func=cmd_generate)

    p_chat = sub.add_parser("chat", help="an interactive conversation (stdin lines; works with a pipe)")
    model_args(p_chat)
    sampling_args(p_chat, max_tokens=256, temperature=1.0)
    p_chat.add_argument("--system", help="a system message")
    p_chat.add_argument("--thinking", action="store_true", help="thinking mode (reasoning before the answer)")
    p_chat.add_argument("--reasoning-effort", help="1-100 or low/high/max (implies --thinking)")
    _add_engine_args(p_chat)
    p_chat.set_defaults(func=cmd_chat)

    p_serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    p_serve.add_argument("model", metavar="MODEL", help="a checkpoint folder or a preset name (tiny, small)")
    p_serve.add_argument("--host", default="127.0.0.1")
    p_serve.add_argument("--port", type=int, default=8000)
    p_serve.add_argument("--served-model-name", help="the model id clients use (default: the engine's name)")
    p_serve.add_argument("--max-waiting", type=int, default=64,
                         help="queued requests beyond which new ones get 429 + Retry-After")
    p_serve.add_argument("--seed", type=int, default=0, help="weights seed for presets")
    p_serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_engine_args(p_serve)
    p_serve.set_defaults(func=cmd_serve)

    p_train = sub.add_parser("train", help="pre-train from scratch (V4.1 recipe; torchrun for FSDP2)")
    _add_train_args(p_train)
    p_train.set_defaults(func=cmd_train)

    sub.add_parser("data", help="build train/val token shards from offline text (dsv41 data --help)")
    return parser


def cmd_train(args) -> int:
    from dsv41.train import TrainConfig, train

    given = {f.name: getattr(args, f"train_{f.name}") for f in dataclasses.fields(TrainConfig)
             if getattr(args, f"train_{f.name}", None) is not None}
    last = train(TrainConfig(**given))
    if last:
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}
        print(json.dumps(shown))
    return 0


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from dsv41.train import TrainConfig

    for f in dataclasses.fields(TrainConfig):
        opt, kind = "--" + f.name.replace("_", "-"), _field_type(f)
        if f.name == "data":
            kind = str
        help_ = f"default {f.default}"
        if kind is bool:
            p.add_argument(opt, dest=f"train_{f.name}", action=argparse.BooleanOptionalAction, default=None, help=help_)
        else:
            p.add_argument(opt, dest=f"train_{f.name}", type=kind, default=None, help=help_)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "data":  # its own parser (python -m dsv41.data.build), options passed through
        from dsv41.data.build import main as build_main

        return build_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
