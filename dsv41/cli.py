"""Command line.

- `dsv41 info`: parameter and KV-cache accounting of a config;
- `dsv41 plan`: per-device weight bytes and KV capacity of each serving layout (`dsv41.distributed.plan`);
- `dsv41 generate`: one completion, streamed, then a tokens/s line;
- `dsv41 chat`: a conversation read line by line from stdin (a terminal or a pipe), each reply
  streamed and followed by a tokens/s line; `/reset` starts over, `/exit` quits;
- `dsv41 serve MODEL`: the OpenAI-compatible server (`dsv41.server`); with `--data-parallel-size D
  [--expert-parallel-size D]` over D engine ranks (`dsv41.distributed`); with `--disaggregation-mode
  prefill|decode` a worker behind `dsv41 router --prefill URL... --decode URL...` (`dsv41.server.router`);
- `dsv41 train`: pre-training (`dsv41.train`), every `TrainConfig` field an option;
- `dsv41 data`: a training data folder (`dsv41.data.build`, which has its own parser);
- `dsv41 eval ppl|passkey|niah|vartrack|recall|cost|all`: evaluations of a model (`dsv41.eval`,
  docs/eval.md), every field of the eval's config dataclass an option.

generate, chat and serve all run on `dsv41.engine` (`build_engine`), whose `EngineConfig` fields are
exposed as options (`--max-num-seqs`, `--kv-pool-tokens`, ...), generated from the dataclass; their help
texts live in the dataclass fields' metadata, next to the defaults they explain.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import os
import sys
import time
from typing import Callable, Optional

from dsv41.accounting import account, format_table
from dsv41.config import PRESETS, ModelConfig, preset

# flash has 763B parameters: random weights for it fit no machine this runs on, so the commands that build
# a model offer only the other presets (`info` still accounts flash, from shapes alone).
RUNNABLE_PRESETS = tuple(sorted(name for name in PRESETS if name != "flash"))


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


def cmd_plan(args) -> int:
    from dsv41.distributed.plan import format_plan, parse_size, plan, sequences_note

    if args.preset:
        name, cfg = args.preset, preset(args.preset)
    else:
        path = args.model
        name, cfg = path, ModelConfig.from_file(path)
    memory = parse_size(args.device_memory)
    rows = plan(cfg, args.devices, memory, args.memory_utilization)
    if args.json:
        print(json.dumps({"config": name, "devices": args.devices, "device_memory": memory,
                          "memory_utilization": args.memory_utilization, "layouts": rows}, indent=2))
    else:
        print(format_plan(name, args.devices, memory, args.memory_utilization, rows))
        print(sequences_note(rows))
    return 0 if any(r["fits"] and r["built"] for r in rows) else 1  # 1: nothing this engine runs fits


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


def _field_help(f: dataclasses.Field) -> str:
    """The field's own help text (metadata["help"]) plus its default; a None default is explained by the
    help text itself, since "None" tells a user nothing. `%` is escaped for argparse's formatting."""
    help_ = f.metadata.get("help", f.name.replace("_", " "))
    if f.default is True or f.default is False:
        help_ += f" (default: {'on' if f.default else 'off'})"
    elif f.default is not None and f.default is not dataclasses.MISSING:
        help_ += f" (default: {f.default})"
    return help_.replace("%", "%%")


def _add_field_option(group, f: dataclasses.Field, dest: str, **overrides) -> None:
    """One `--field-name` option from a dataclass field: bools get --x/--no-x, others a typed value with
    the field's metavar and choices when it declares them. None means "not given": the dataclass default
    then applies."""
    opt, kind = "--" + f.name.replace("_", "-"), _field_type(f)
    kw = {"dest": dest, "default": None, "help": _field_help(f)}
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = overrides.pop("type", kind)
        choices = overrides.pop("choices", f.metadata.get("choices"))
        if choices:
            kw["choices"] = list(choices)
        else:
            kw["metavar"] = f.metadata.get("metavar", kw["type"].__name__.upper())
    group.add_argument(opt, **kw, **overrides)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("engine options (EngineConfig)")
    try:
        _, fields = _engine_fields()
    except ImportError as exc:  # keep `dsv41 info` usable even if the engine cannot be imported
        group.description = f"unavailable: {exc}"
        return
    for f in fields:
        try:
            _add_field_option(group, f, f"engine_{f.name}")
        except argparse.ArgumentError:  # the name is taken by a command option; the command's wins
            continue


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    from dsv41.distributed.config import ParallelConfig

    group = p.add_argument_group(
        "parallel layout (vLLM's option names)",
        "--data-parallel-size D runs D engine ranks, one process each (spawned by serve; torchrun also works: "
        "every process runs the same command and rank 0 serves HTTP). --expert-parallel-size D splits every MoE "
        "layer's routed experts over those D ranks (EP over the DP ranks, as vLLM's --enable-expert-parallel "
        "does); it must be 1 or D. --tensor-parallel-size T splits each engine's attention heads over T ranks "
        "(D x T processes).")
    for f in dataclasses.fields(ParallelConfig):
        if "help" in f.metadata:
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=_positive_int, default=f.default,
                               metavar="N", help=f"{f.metadata['help']} (default: {f.default})")


def _parallel_config(args):
    from dsv41.distributed.config import ParallelConfig

    config = ParallelConfig(data_parallel_size=args.data_parallel_size,
                            expert_parallel_size=args.expert_parallel_size,
                            tensor_parallel_size=args.tensor_parallel_size)
    config.validate()
    return config


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _set_threads(args) -> None:
    """Apply --threads before anything builds or runs the model, so every torch kernel, weight
    initialisation included, uses that many threads. Not given: torch's default stays."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _build_engine(args):
    from dsv41.engine import build_engine

    _set_threads(args)
    if getattr(args, "engine_fused_kernels", "") is None:
        # generate and chat are short processes: building the fused kernels costs 3-6 s (warm compiler
        # cache; 15-30 s cold) and saves ~5 ms per decode step, so it repays only after ~1,000 tokens,
        # and on a background thread it competes with decoding for the GIL (docs/engine-speed.md)
        args.engine_fused_kernels = "off"
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


def run_request(engine, request_id: str, prompt_ids: list[int], params, on_text: Callable[[str], None],
                images: Optional[list] = None):
    """Drive the engine synchronously until `request_id` finishes; returns (final output, RunStats)."""
    t0 = time.perf_counter()
    first = None
    engine.add_request(request_id, prompt_ids, params, images)
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
    loader, pending_images = None, []
    if args.image:  # attached to the first user turn, as image_url parts before its text
        from dsv41.vision.inputs import ImageLoader

        if not engine.model_config.vision_enabled:
            print(f"error: {engine.model_name} has no vision tower; --image needs a model with one", file=sys.stderr)
            return 2
        loader = ImageLoader.from_config(engine.model_config)
        for path in args.image:
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError as exc:
                print(f"error: --image {path}: {exc}", file=sys.stderr)
                return 2
            pending_images.append({"type": "image_url",
                                   "image_url": {"url": "data:image/*;base64," + base64.b64encode(data).decode()}})
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
        content = pending_images + [{"type": "text", "text": line}] if pending_images else line
        messages.append({"role": "user", "content": content})
        spans: list = []
        try:
            prompt_ids = build_chat_prompt(engine.tokenizer, messages, thinking=thinking, effort=effort, tools=None,
                                           image_loader=loader, spans=spans)
        except ValueError as exc:
            messages.pop()
            print(f"error: {exc}", file=sys.stderr)
            return 2
        pending_images = []
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

        _, stats = run_request(engine, f"chat-{turn}", prompt_ids, params, lambda text: show(splitter.feed(text)),
                               spans)
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
    if args.engine_fused_kernels is None:  # ready to answer at once; the kernels arrive a few seconds later
        args.engine_fused_kernels = "background"
    engine_config = _engine_config(args)
    parallel = _parallel_config(args)
    if parallel.world_size > 1:
        from dsv41.server.run import serve_data_parallel

        serve_data_parallel(args.model, parallel, host=args.host, port=args.port, engine_config=engine_config,
                            seed=args.seed, max_waiting=args.max_waiting, served_model_name=args.served_model_name,
                            log_level=args.log_level, api_key=args.api_key or None,
                            max_request_bytes=args.max_request_bytes, threads=args.threads,
                            disaggregation_mode=args.disaggregation_mode)
        return 0
    _set_threads(args)
    serve(args.model, host=args.host, port=args.port, engine_config=engine_config, seed=args.seed,
          max_waiting=args.max_waiting, served_model_name=args.served_model_name, log_level=args.log_level,
          api_key=args.api_key or None, max_request_bytes=args.max_request_bytes, max_choices=args.max_choices,
          max_stored_responses=args.max_stored_responses,
          disaggregation_mode=args.disaggregation_mode)
    return 0


def cmd_router(args) -> int:
    import uvicorn

    from dsv41.server.router import RouterConfig, create_router
    from dsv41.server.run import bind, uvicorn_config

    config = RouterConfig(prefill=args.prefill, decode=args.decode, timeout_s=args.timeout,
                          cache_aware=args.policy == "cache_aware")
    app = create_router(config)
    sock = bind(args.host, args.port)
    print(f"dsv41: router on http://{args.host}:{sock.getsockname()[1]}/v1 over {len(args.prefill)} prefill and "
          f"{len(args.decode)} decode worker(s)", flush=True)
    try:
        uvicorn.Server(uvicorn_config(app, args.log_level, timeout_graceful_shutdown=5)).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


# ---------------------------------------------------------------------------------------------- parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dsv41")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from dsv41 import __version__

        return __version__


THREADS_HELP = ("torch CPU threads (torch.set_num_threads) for the model; default: torch's own choice, one per "
                "core. Speed collapses when other processes compete for the cores: then set N to the cores "
                "actually free")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in PyTorch")
    parser.add_argument("--version", action="version", version=f"dsv41 {_version()}",
                        help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_info = sub.add_parser("info", help="parameter counts and KV-cache bytes per token of a config")
    p_info.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="built-in config to account: flash (the release), tiny or small (default: tiny)")
    p_info.add_argument("--config", metavar="PATH",
                        help="a config.json (inference or Hugging Face form) to account instead of --preset")
    p_info.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p_info.set_defaults(func=cmd_info)

    p_plan = sub.add_parser("plan", help="per-device weight bytes and KV capacity of each serving layout")
    source = p_plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config (flash: the release)")
    source.add_argument("--model", metavar="PATH", help="a checkpoint folder or config.json")
    p_plan.add_argument("--devices", type=_positive_int, required=True, metavar="N", help="devices (one rank each)")
    p_plan.add_argument("--device-memory", required=True, metavar="SIZE",
                        help="memory of one device, e.g. 141GB (10^9 bytes) or 80GiB (2^30)")
    p_plan.add_argument("--memory-utilization", type=float, default=0.9, metavar="F",
                        help="fraction of each device for weights + KV cache; the rest is left to activations "
                             "and the runtime (vLLM's gpu_memory_utilization; default: 0.9)")
    p_plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p_plan.set_defaults(func=cmd_plan)

    def model_args(p):
        p.add_argument("--preset", default="tiny", choices=RUNNABLE_PRESETS,
                       help="built-in model shape with random weights (its replies are noise; for trying the "
                            "engine) (default: tiny)")
        p.add_argument("--model", metavar="PATH",
                       help="a checkpoint folder (config.json + *.safetensors, e.g. a `dsv41 train` run's "
                            "checkpoint/) or a preset name; overrides --preset")
        p.add_argument("--seed", type=int, default=0, metavar="N",
                       help="seed of a preset's random weights and of sampling (default: 0)")
        p.add_argument("--threads", type=_positive_int, metavar="N", help=THREADS_HELP)

    def sampling_args(p, max_tokens: int, temperature: float):
        p.add_argument("--max-tokens", "--max-new-tokens", dest="max_tokens", type=int, default=max_tokens,
                       metavar="N", help=f"most tokens to generate per reply (default: {max_tokens})")
        p.add_argument("--temperature", type=float, default=temperature, metavar="T",
                       help=f"sampling temperature; 0 always picks the most likely token (default: {temperature})")
        p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                       help="sample only from the most likely tokens whose probabilities add up to P; 1 disables "
                            "(default: 1.0)")
        p.add_argument("--top-k", type=int, default=0, metavar="K",
                       help="sample only from the K most likely tokens; 0 disables (default: 0)")
        p.add_argument("--stop", action="append", metavar="TEXT",
                       help="end the reply where this string appears (repeatable)")
        p.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token, up to --max-tokens (for timing)")

    p_gen = sub.add_parser("generate", help="complete one prompt on the engine (random weights for presets)")
    model_args(p_gen)
    p_gen.add_argument("--prompt", default="Hello", metavar="TEXT", help="the text to complete (default: Hello)")
    sampling_args(p_gen, max_tokens=16, temperature=0.0)
    p_gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat format)")
    p_gen.add_argument("--thinking", action="store_true", help="with --chat: thinking mode")
    p_gen.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    _add_engine_args(p_gen)
    p_gen.set_defaults(func=cmd_generate)

    p_chat = sub.add_parser("chat", help="an interactive conversation (stdin lines; works with a pipe)")
    model_args(p_chat)
    sampling_args(p_chat, max_tokens=256, temperature=1.0)
    p_chat.add_argument("--system", metavar="TEXT", help="a system message put before the conversation")
    p_chat.add_argument("--image", metavar="PATH", action="append",
                        help="an image file (PNG, JPEG, WebP, ...) shown with the first message; repeat for more "
                             "(needs a model with a vision tower)")
    p_chat.add_argument("--thinking", action="store_true", help="thinking mode (reasoning before the answer)")
    p_chat.add_argument("--reasoning-effort", metavar="EFFORT",
                        help="how much to reason: 1-100 or low/high/max (implies --thinking)")
    _add_engine_args(p_chat)
    p_chat.set_defaults(func=cmd_chat)

    p_serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    p_serve.add_argument("model", metavar="MODEL",
                         help="a checkpoint folder (config.json + *.safetensors) or a preset name with random "
                              f"weights: {', '.join(RUNNABLE_PRESETS)}")
    p_serve.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                         help="address to listen on; the default 127.0.0.1 only accepts local connections; "
                              "use 0.0.0.0 to accept others (set --api-key then)")
    p_serve.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port to listen on (default: 8000)")
    p_serve.add_argument("--api-key", default=os.environ.get("DSV41_API_KEY") or None, metavar="KEY",
                         help="when set, every /v1 route requires `Authorization: Bearer KEY`; /health and "
                              "/metrics stay open; default: $DSV41_API_KEY")
    p_serve.add_argument("--served-model-name", metavar="NAME",
                         help="the model id clients send and /v1/models lists (default: the engine's name)")
    p_serve.add_argument("--max-waiting", type=int, default=64, metavar="N",
                         help="queued requests beyond which new ones get 429 + Retry-After (default: 64)")
    p_serve.add_argument("--seed", type=int, default=0, metavar="N",
                         help="seed of a preset's random weights (default: 0)")
    p_serve.add_argument("--max-request-bytes", type=_positive_int, metavar="BYTES",
                         help="request bodies larger than this get 413 (default: 8 MiB, or 32 bytes per token of "
                              "the context when that is more)")
    p_serve.add_argument("--max-choices", type=_positive_int, default=16, metavar="N",
                         help="the most choices one request may ask for with n or best_of; each is an engine "
                              "request of its own (default: 16)")
    p_serve.add_argument("--max-stored-responses", type=_non_negative_int, default=256, metavar="N",
                         help="the most finished /v1/responses results kept in memory for previous_response_id "
                              "and GET /v1/responses/{id}, least recently used dropped first; 0 keeps none "
                              "(default: 256)")
    p_serve.add_argument("--threads", type=_positive_int, metavar="N", help=THREADS_HELP)
    p_serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                         help="server log verbosity (default: info)")
    p_serve.add_argument("--disaggregation-mode", choices=["prefill", "decode"], default=None,
                         help="run as a prefill or decode worker behind `dsv41 router` (prefill/decode "
                              "disaggregation; the ordinary routes keep working)")
    _add_parallel_args(p_serve)
    _add_engine_args(p_serve)
    p_serve.set_defaults(func=cmd_serve)

    p_router = sub.add_parser("router", help="the OpenAI front of prefill/decode disaggregation: prompts to "
                                             "prefill workers, KV hand-offs to decode workers")
    p_router.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                          help="prefill workers (`dsv41 serve MODEL --disaggregation-mode prefill`), e.g. "
                               "http://127.0.0.1:8001")
    p_router.add_argument("--decode", nargs="+", required=True, metavar="URL",
                          help="decode workers (`dsv41 serve MODEL --disaggregation-mode decode`)")
    p_router.add_argument("--host", default="127.0.0.1", metavar="ADDRESS",
                          help="address to listen on (default: 127.0.0.1, this machine only). Clients' "
                               "Authorization headers are passed to the workers, which check their own --api-key")
    p_router.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port to listen on (default: 8000)")
    p_router.add_argument("--timeout", type=float, default=600.0, metavar="S",
                          help="longest wait in seconds for a worker's next bytes (default: 600)")
    p_router.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                          help="router log verbosity (default: info)")
    p_router.add_argument("--policy", default="cache_aware", choices=["cache_aware", "round_robin"],
                          help="choice of prefill worker: the one that was sent the longest start of this prompt "
                               "(its prefix cache holds it; else the least busy), or round robin "
                               "(default: cache_aware)")
    p_router.set_defaults(func=cmd_router)

    p_train = sub.add_parser("train", help="pre-train from scratch (V4.1 recipe; torchrun for FSDP2)")
    _add_train_args(p_train)
    p_train.set_defaults(func=cmd_train)

    p_draft = sub.add_parser("train-drafter", help="train a DSpark drafter (mtp.*) for a trained checkpoint, "
                                                    "backbone frozen; then serve it with --speculative")
    _add_drafter_args(p_draft)
    p_draft.set_defaults(func=cmd_train_drafter)

    p_rl = sub.add_parser("rl", help="post-training with reasoning effort: sft warm-start, graded GRPO, on-policy "
                                     "distillation, evaluation per effort (dsv41 rl COMMAND --help)")
    rl_sub = p_rl.add_subparsers(dest="rl_command", required=True, metavar="COMMAND",
                                help="the post-training step to run: sft, grpo, distill, eval or choice")
    p_sft = rl_sub.add_parser("sft", help="warm-start a model on effort-tagged chat samples (arithmetic, direct or "
                                          "scratchpad replies), the base for `dsv41 rl grpo`")
    _add_train_args(p_sft)
    p_sft.add_argument("--task", default="arithmetic", choices=["arithmetic"], help="the samples' task (default: arithmetic)")
    p_sft.add_argument("--min-digits", type=_positive_int, default=2, metavar="N", help="fewest digits per operand (default: 2)")
    p_sft.add_argument("--max-digits", type=_positive_int, default=4, metavar="N", help="most digits per operand (default: 4)")
    p_sft.add_argument("--vocab-size", type=_positive_int, metavar="N", help=(
        "vocabulary of the byte-level model (at least 266: bytes, BOS/EOS/PAD and the chat markers; default: "
        "the preset's)"))
    p_sft.add_argument("--effort-echo", type=float, default=0.0, metavar="P", help=(
        "fraction of samples asking 'What is your reasoning effort?', answered '{b}</think>{b}': the model learns "
        "to read its effort line where a reply starts, never what to do with it (default: 0)"))
    p_sft.add_argument("--style-effort-slope", type=float, default=0.0, metavar="S", help=(
        "P(scratchpad | b) = 0.5 + S (b - 50.5) / 99: 0 draws the two styles independently of the effort b, a "
        "negative S makes long replies less likely at high effort (default: 0)"))
    p_sft.add_argument("--effort-line", action=argparse.BooleanOptionalAction, default=False, help=(
        "every reply opens its reasoning with its effort as three digits ('025' + newline), the styles still "
        "drawn independently of it (default: off)"))
    p_sft.add_argument("--effort-set", default="25,50,75,100", metavar="B,...", help=(
        "the efforts --effort-set-share draws from, RL's set (default: 25,50,75,100)"))
    p_sft.add_argument("--effort-set-share", type=float, default=0.0, metavar="P", help=(
        "fraction of samples whose effort comes from --effort-set instead of uniformly from 1..100 (default: 0)"))
    p_sft.set_defaults(func=cmd_rl_sft)
    for name, text in (("grpo", "graded GRPO with reasoning effort on verifiable tasks (rollouts from the engine, "
                                 "grades from the sandbox, router replay); torchrun for several learner processes"),
                       ("distill", "on-policy distillation: the student samples, --teachers score every token "
                                   "(full-vocabulary reverse KL)"),
                       ("eval", "held-out accuracy and response length of --model at every effort")):
        p = rl_sub.add_parser(name, help=text)
        _add_rl_args(p)
        p.set_defaults(func=cmd_rl, rl_algorithm=name)

    p_choice = rl_sub.add_parser("choice", help=(
        "P(</think> next) right after the effort line, per effort: how much the model's choice between a "
        "scratchpad and a direct answer depends on b (exact probabilities, no sampling)"))
    p_choice.add_argument("--model", required=True, metavar="PATH", help="a checkpoint folder (or a preset name)")
    p_choice.add_argument("--efforts", default="1,25,50,75,100", metavar="B,...",
                          help="the efforts to probe (default: 1,25,50,75,100)")
    p_choice.add_argument("--prompts", type=_positive_int, default=16, metavar="N",
                          help="held-out arithmetic tasks averaged over (default: 16)")
    p_choice.add_argument("--min-digits", type=_positive_int, default=2, metavar="N",
                          help="fewest digits per operand of the held-out additions (default: 2)")
    p_choice.add_argument("--max-digits", type=_positive_int, default=2, metavar="N",
                          help="most digits per operand of the held-out additions (default: 2)")
    p_choice.add_argument("--effort-line", action=argparse.BooleanOptionalAction, default=True, help=(
        "probe after the reply's effort line, as `rl sft --effort-line` models write it; --no-effort-line "
        "probes right after <think> (default: on)"))
    p_choice.add_argument("--threads", type=_positive_int, metavar="N", help=THREADS_HELP)
    p_choice.set_defaults(func=cmd_rl_choice)

    p_eval = sub.add_parser("eval", help="evaluate a model: perplexity, passkey / needle-in-a-haystack / variable "
                                         "tracking over lengths and depths, indexer recall, the cost of bounded "
                                         "replay and FP4 KV (dsv41 eval COMMAND --help)")
    eval_sub = p_eval.add_subparsers(dest="eval_command", required=True, metavar="COMMAND",
                                     help="the evaluation to run: ppl, passkey, niah, vartrack, recall, cost or all")
    for name, text in EVAL_HELP.items():
        p = eval_sub.add_parser(name, help=text)
        _add_eval_args(p, name)
        p.set_defaults(func=cmd_eval, eval_name=name)

    sub.add_parser("data", help="build a training data folder (tokenizer + token shards) from public-domain text "
                                "it downloads, or from this Python's standard library offline (dsv41 data --help)")
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


def _effort_list(text: str, option: str = "--effort-set") -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise SystemExit(f"error: {option} must be comma-separated integers, got {text!r}") from None


def cmd_rl_sft(args) -> int:
    from dsv41.config import preset
    from dsv41.rl.sft import EffortTaskText
    from dsv41.tokenizer import ByteTokenizer
    from dsv41.train import TrainConfig, train

    given = {f.name: getattr(args, f"train_{f.name}") for f in dataclasses.fields(TrainConfig)
             if getattr(args, f"train_{f.name}", None) is not None}
    cfg = TrainConfig(**given)
    tokenizer = ByteTokenizer(args.vocab_size or preset(cfg.preset).vocab_size)
    sets = tuple(EffortTaskText(split, tokenizer, args.task, args.min_digits, args.max_digits, args.effort_echo,
                                args.style_effort_slope, args.effort_line, _effort_list(args.effort_set),
                                args.effort_set_share) for split in ("train", "val"))
    last = train(cfg, sets)
    if last:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}))
    return 0


def cmd_rl_choice(args) -> int:
    from dsv41.engine.build import build_model
    from dsv41.rl.probe import direct_probabilities

    _set_threads(args)
    efforts = _effort_list(args.efforts, "--efforts")
    try:  # bad efforts or digit bounds are refused by the probe and the task maker
        model, tokenizer, _ = build_model(args.model)
        probs = direct_probabilities(model, tokenizer, efforts, args.prompts, args.min_digits, args.max_digits,
                                     with_line=args.effort_line)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    print("| effort | P(direct) |\n|---|---|")
    for b, p in probs.items():
        print(f"| {b} | {p:.3f} |")
    print(json.dumps({"model": args.model, "prompts": args.prompts, "p_direct": probs}))
    return 0


def cmd_rl(args) -> int:
    from dsv41.rl.trainer import RLConfig, RLTrainer, write_effort_report

    given = {f.name: getattr(args, f"rl_{f.name}") for f in dataclasses.fields(RLConfig)
             if getattr(args, f"rl_{f.name}", None) is not None}
    if args.rl_algorithm != "eval":
        given["algorithm"] = args.rl_algorithm
        last = RLTrainer(RLConfig(**given)).run()
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in last.items()}))
        return 0
    trainer = RLTrainer(RLConfig(**given))
    result = {"step": 0, **trainer.evaluate()}
    trainer.close()
    efforts = trainer.gcfg.efforts
    print("| effort | accuracy | mean grade | mean length | reasoning share |\n|---|---|---|---|---|")
    for b in efforts:
        print(f"| {b} | {result[f'eval_accuracy_{b}']:.3f} | {result[f'eval_grade_{b}']:.3f} | "
              f"{result[f'eval_length_{b}']:.1f} | {result[f'eval_reasoning_{b}']:.2f} |")
    def style(kind: str) -> str:
        grade, length = result[f"eval_grade_{kind}"], result[f"eval_length_{kind}"]
        return "-" if grade is None else f"{grade:.3f} (mean length {length:.1f})"
    print(f"mean grade of the responses that reason: {style('reasoning')}; that answer directly: {style('direct')}")
    if result["eval_grade_reasoning"] is not None and result["eval_grade_direct"] is not None:
        from dsv41.rl.grpo import shared_push, style_gaps

        gaps = style_gaps((result["eval_grade_reasoning"], result["eval_length_reasoning"]),
                          (result["eval_grade_direct"], result["eval_length_direct"]), trainer.gcfg)
        push = shared_push(gaps, {b: result[f"eval_reasoning_{b}"] for b in efforts})
        result.update({f"style_gap_{b}": gap for b, gap in gaps.items()}, shared_push=push)
        print("reward of reasoning minus direct under this penalty: "
              + ", ".join(f"b={b} {gap:+.2f}" for b, gap in gaps.items())
              + f"; shared push {push:+.3f} (> 0: every effort towards reasoning, < 0: towards direct answers)")
    with open(os.path.join(trainer.cfg.out, "eval.json"), "w") as f:
        json.dump(result, f, indent=2)
    return 0


def _add_rl_args(p: argparse.ArgumentParser) -> None:
    from dsv41.rl.trainer import RLConfig

    for f in dataclasses.fields(RLConfig):
        if f.name == "algorithm":
            continue  # the subcommand
        _add_field_option(p, f, f"rl_{f.name}", **({"type": str} if f.name in ("model", "ray_address") else {}))


EVAL_HELP = {
    "ppl": "perplexity of held-out text (--data or --text) and NLL by position in the context",
    "passkey": "passkey retrieval over a grid of prompt lengths x needle depths (heat map)",
    "niah": "needle in a haystack over lengths x depths: one needle, or --keys N distinct ones of which the "
            "question asks for --queries",
    "vartrack": "RULER-style variable tracking (a chain of --hops assignments) over lengths x depths",
    "recall": "indexer recall: the share of the dense attention mass over the compressed cache that the "
              "selected top-k captures, per layer and context length",
    "cost": "what bounded-replay prefill and FP4 KV cost against full prefill and a bf16 KV cache on the same "
            "prompts (continuation NLL, KL, greedy agreement)",
    "all": "every evaluation above in one run (ppl only with --data or --text), tables in OUT/all.md",
}


def _add_eval_args(p: argparse.ArgumentParser, name: str) -> None:
    from dsv41.eval.suite import EVALS

    cls, _, engine = EVALS[name]
    # the subcommand is the task; the other tasks' shape options do not apply
    left_out = {"task"} | {"passkey": {"keys", "queries", "hops"}, "niah": {"hops"},
                           "vartrack": {"keys", "queries"}}.get(name, set())
    for f in dataclasses.fields(cls):
        if f.name in left_out:
            continue
        _add_field_option(p, f, f"eval_{f.name}")
    p.add_argument("--threads", type=_positive_int, metavar="N", help=THREADS_HELP)
    if engine:
        _add_engine_args(p)


def cmd_eval(args) -> int:
    from dsv41.eval.suite import EVALS

    cls, run, engine = EVALS[args.eval_name]
    given = {f.name: getattr(args, f"eval_{f.name}") for f in dataclasses.fields(cls)
             if getattr(args, f"eval_{f.name}", None) is not None}
    if "task" in {f.name for f in dataclasses.fields(cls)}:
        given["task"] = args.eval_name
    _set_threads(args)
    cfg = cls(**given)
    if engine:
        _, fields = _engine_fields()
        overrides = {f.name: getattr(args, f"engine_{f.name}") for f in fields
                     if getattr(args, f"engine_{f.name}", None) is not None}
        run(cfg, overrides)
    else:
        run(cfg)
    return 0


def cmd_train_drafter(args) -> int:
    from dsv41.train.drafter import DrafterConfig, train_drafter

    given = {f.name: getattr(args, f"drafter_{f.name}") for f in dataclasses.fields(DrafterConfig)
             if getattr(args, f"drafter_{f.name}", None) is not None}
    last = train_drafter(DrafterConfig(**given))
    print(json.dumps({"step": last["step"], "draft_loss": round(last["draft_loss"], 4), **last.get("val", {})}))
    return 0


def _add_drafter_args(p: argparse.ArgumentParser) -> None:
    from dsv41.train.drafter import DrafterConfig

    for f in dataclasses.fields(DrafterConfig):
        _add_field_option(p, f, f"drafter_{f.name}", **({"type": str} if f.name in ("model", "data") else {}))


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from dsv41.train import TrainConfig

    overrides = {"preset": {"choices": RUNNABLE_PRESETS}, "data": {"type": str}}
    for f in dataclasses.fields(TrainConfig):
        _add_field_option(p, f, f"train_{f.name}", **overrides.get(f.name, {}))


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "data":  # its own parser (python -m dsv41.data.build), options passed through
        from dsv41.data.build import main as build_main

        return build_main(argv[1:], prog="dsv41 data")
    parser = build_parser()
    if not argv:  # like git and pip: the command list, not just "the following arguments are required"
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # bad input, missing files, a port in use: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
