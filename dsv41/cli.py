"""Command line.

- `dsv41 info`: parameter and KV-cache accounting of a config;
- `dsv41 plan`: per-device weight bytes and KV capacity of each serving layout (`dsv41.distributed.plan`);
- `dsv41 generate`: one completion, streamed, then a tokens/s line;
- `dsv41 chat`: a conversation read line by line from stdin (a terminal or a pipe), each reply
  streamed and followed by a tokens/s line; `/reset` starts over, `/exit` quits;
- `dsv41 serve MODEL`: the OpenAI-compatible server (`dsv41.server`); with `--data-parallel-size D
  [--expert-parallel-size D]` over D engine ranks (`dsv41.distributed`); with `--disaggregation-mode
  prefill|decode` a worker behind `dsv41 router --prefill URL... --decode URL...` (`dsv41.server.router`);
- `dsv41 train`, `train-drafter`, `rl ...`, `eval ...`: the training-side commands (dsv41/cli_training.py);
- `dsv41 data`: a training data folder (`dsv41.data.build`, which has its own parser);
- `dsv41 export-tokenizer FOLDER`: the files `transformers.AutoTokenizer` loads, into a checkpoint folder.
Options generated from dataclass fields, the engine's options and the typed parsers are in dsv41/cli_options.py.

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
from collections.abc import Callable

from dsv41.accounting import account, format_table
from dsv41.cli_options import (
    RUNNABLE_PRESETS,
    THREADS_HELP,
    add_engine_args,
    engine_fields,
    non_negative_int,
    positive_int,
    set_threads,
)
from dsv41.cli_training import add_training_commands
from dsv41.config import PRESETS, ModelConfig, preset

# sampling when neither an option nor the model's generation_config.json sets it: generate is greedy
SAMPLING_DEFAULTS = {
    "generate": {"temperature": 0.0, "top_p": 1.0, "top_k": 0},
    "chat": {"temperature": 1.0, "top_p": 1.0, "top_k": 0},
}
DEFAULT_MODEL_HELP = (
    "the small trained model shipped with the package (dsv41/checkpoints/shakespeare-chat: 8.4M "
    "parameters trained on Shakespeare's plays as conversations; it answers a line with lines of a play)"
)


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
        print(
            json.dumps(
                {
                    "config": name,
                    "devices": args.devices,
                    "device_memory": memory,
                    "memory_utilization": args.memory_utilization,
                    "layouts": rows,
                },
                indent=2,
            )
        )
    else:
        print(format_plan(name, args.devices, memory, args.memory_utilization, rows))
        print(sequences_note(rows))
    return 0 if any(r["fits"] and r["built"] for r in rows) else 1  # 1: nothing this engine runs fits


# ---------------------------------------------------------------------------------------------- engine


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    from dsv41.distributed.config import ParallelConfig

    group = p.add_argument_group(
        "parallel layout (vLLM's option names)",
        "--data-parallel-size D runs D engine ranks, one process each (spawned by serve; torchrun also works: "
        "every process runs the same command and rank 0 serves HTTP). --expert-parallel-size D splits every MoE "
        "layer's routed experts over those D ranks (EP over the DP ranks, as vLLM's --enable-expert-parallel "
        "does); it must be 1 or D. --tensor-parallel-size T splits each engine's attention heads over T ranks "
        "(D x T processes).",
    )
    for f in dataclasses.fields(ParallelConfig):
        if "choices" in f.metadata:
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                choices=f.metadata["choices"],
                default=f.default,
                help=f"{f.metadata['help']} (default: {f.default})",
            )
        elif "help" in f.metadata:
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                dest=f.name,
                type=positive_int,
                default=f.default,
                metavar="N",
                help=f"{f.metadata['help']} (default: {f.default})",
            )


def _parallel_config(args):
    from dsv41.distributed.config import ParallelConfig

    config = ParallelConfig(
        data_parallel_size=args.data_parallel_size,
        expert_parallel_size=args.expert_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        engram_sharding=args.engram_sharding,
        engram_memory=args.engram_memory,
    )
    config.validate()
    return config


def _engine_config(args):
    cls, fields = engine_fields()
    given = {
        f.name: getattr(args, f"engine_{f.name}") for f in fields if getattr(args, f"engine_{f.name}", None) is not None
    }
    return cls(**given)


def _default_model() -> str:
    """The checkpoint generate, chat and serve run when given neither a model nor a preset: the small
    trained model shipped in the package (dsv41/checkpoints)."""
    from dsv41.checkpoints import checkpoint_path, default_checkpoint

    path = default_checkpoint()
    if path is None:
        raise ValueError(
            f"this install lacks its default checkpoint ({checkpoint_path()}); "
            "give --model PATH or --preset NAME (random weights)"
        )
    return path


def _model_name(args) -> str:
    name = getattr(args, "model", None) or args.preset or _default_model()
    if name == "flash":
        raise ValueError(
            "flash has 763B parameters; random weights for it do not fit here. Use --preset tiny/small or --model PATH."
        )
    return name


def _build_engine(args):
    from dsv41.engine import build_engine

    set_threads(args)
    if getattr(args, "engine_fused_kernels", "") is None:
        # generate and chat are short processes: building the fused kernels costs 3-6 s (warm compiler
        # cache; 15-30 s cold) and saves ~5 ms per decode step, so it repays only after ~1,000 tokens,
        # and on a background thread it competes with decoding for the GIL (docs/engine-speed.md)
        args.engine_fused_kernels = "off"
    args.model_source = _model_name(args)
    return build_engine(args.model_source, engine_config=_engine_config(args), seed=args.seed)


GENERATION_FIELDS = ("temperature", "top_p", "top_k")  # what a generation_config.json may set here


def generation_defaults(model: str) -> dict:
    """The sampling defaults a model folder's `generation_config.json` gives (the Hugging Face file,
    which vLLM also applies by default): temperature, top_p, top_k where present; {} for a preset."""
    path = os.path.join(model, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {k: data[k] for k in GENERATION_FIELDS if isinstance(data.get(k), (int, float))}


def _sampling(args, engine, chat: bool = False):
    """Sampling parameters: the options given, else the model's generation_config.json, else the command's
    defaults (`SAMPLING_DEFAULTS`). A chat reply also ends where the model opens another turn (a User,
    Assistant or System marker the tokenizer holds as one id), unless --ignore-eos."""
    from dsv41.engine.types import SamplingParams
    from dsv41.tokenizer import ASSISTANT_TOKEN, SYSTEM_TOKEN, USER_TOKEN

    given = generation_defaults(args.model_source)
    chosen = {
        name: getattr(args, name) if getattr(args, name) is not None else given.get(name, default)
        for name, default in SAMPLING_DEFAULTS[args.command].items()
    }
    stop_ids = []
    if chat and not args.ignore_eos:
        marks = (engine.tokenizer.token_to_id(t) for t in (USER_TOKEN, ASSISTANT_TOKEN, SYSTEM_TOKEN))
        stop_ids = [i for i in marks if i is not None]
    params = SamplingParams(
        temperature=chosen["temperature"],
        top_p=chosen["top_p"],
        top_k=int(chosen["top_k"]),
        seed=args.seed,
        max_tokens=args.max_tokens,
        stop=list(args.stop or []),
        stop_token_ids=stop_ids,
        ignore_eos=args.ignore_eos,
    )
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
        decode = (
            (self.tokens - 1) / (self.seconds - self.first_token_s)
            if self.tokens > 1 and self.seconds > self.first_token_s
            else 0.0
        )
        return (
            f"[{self.tokens} tokens in {self.seconds:.2f}s: {rate:.1f} tokens/s; decode {decode:.1f} tokens/s "
            f"after a {self.first_token_s:.2f}s first token; prompt {self.prompt_tokens} tokens, "
            f"{self.cached_tokens} cached]"
        )


def run_request(
    engine,
    request_id: str,
    prompt_ids: list[int],
    params,
    on_text: Callable[[str], None],
    images: list | None = None,
):
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
    params = _sampling(args, engine, chat=args.chat)
    if args.chat:
        from dsv41.server.chat import build_chat_prompt

        prompt_ids = build_chat_prompt(
            engine.tokenizer,
            [{"role": "user", "content": args.prompt}],
            thinking=args.thinking,
            effort=None,
            tools=None,
        )
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
    params = _sampling(args, engine, chat=True)
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
            pending_images.append(
                {"type": "image_url", "image_url": {"url": "data:image/*;base64," + base64.b64encode(data).decode()}}
            )
    print(
        f"dsv41 chat: {engine.model_name}, {'thinking' if thinking else 'non-thinking'} mode. "
        f"/reset starts over, /exit quits.",
        file=sys.stderr,
    )
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
            prompt_ids = build_chat_prompt(
                engine.tokenizer,
                messages,
                thinking=thinking,
                effort=effort,
                tools=None,
                image_loader=loader,
                spans=spans,
            )
        except ValueError as exc:
            messages.pop()
            print(f"error: {exc}", file=sys.stderr)
            return 2
        pending_images = []
        if len(prompt_ids) + params.max_tokens > engine.max_model_len:
            messages.pop()
            print(
                f"[the conversation ({len(prompt_ids)} tokens) plus {params.max_tokens} new tokens does not fit "
                f"the context of {engine.max_model_len}; /reset to start over]"
            )
            continue
        splitter = ChatStreamSplitter(thinking=thinking, tools=False)
        label = {"reasoning": "(thinking) ", "content": "assistant> "}
        kinds = [splitter.mode]
        _write(label[splitter.mode])

        def show(pieces, kinds=kinds, label=label) -> None:
            for kind, piece in pieces:
                if kinds[-1] != kind:
                    _write("\n" + label[kind])
                    kinds.append(kind)
                _write(piece)

        _, stats = run_request(
            engine, f"chat-{turn}", prompt_ids, params, lambda text, splitter=splitter: show(splitter.feed(text)), spans
        )
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

    if args.model is None:
        args.model = _default_model()
    if args.model == "flash":
        raise ValueError("flash has 763B parameters; random weights for it do not fit here")
    if args.engine_fused_kernels is None:  # ready to answer at once; the kernels arrive a few seconds later
        args.engine_fused_kernels = "background"
    if args.engine_compile_decode is None:  # a server lives long enough to repay compiling its decode steps;
        # until a bucket is built its steps run eager. Deterministic numerics compile only when asked: their
        # compiled tiles give other bits than the eager ops (docs/numerics.md), which a user comparing a
        # server with `generate` or the Python API would otherwise meet unannounced
        fast = getattr(args, "engine_numerics", None) in (None, "fast")
        args.engine_compile_decode = "background" if fast else "off"
    engine_config = _engine_config(args)
    parallel = _parallel_config(args)
    if parallel.world_size > 1:
        from dsv41.server.run import serve_data_parallel

        serve_data_parallel(
            args.model,
            parallel,
            host=args.host,
            port=args.port,
            engine_config=engine_config,
            seed=args.seed,
            max_waiting=args.max_waiting,
            served_model_name=args.served_model_name,
            log_level=args.log_level,
            api_key=args.api_key or None,
            max_request_bytes=args.max_request_bytes,
            threads=args.threads,
            disaggregation_mode=args.disaggregation_mode,
        )
        return 0
    set_threads(args)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        engine_config=engine_config,
        seed=args.seed,
        max_waiting=args.max_waiting,
        served_model_name=args.served_model_name,
        log_level=args.log_level,
        api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        max_choices=args.max_choices,
        max_stored_responses=args.max_stored_responses,
        disaggregation_mode=args.disaggregation_mode,
    )
    return 0


def cmd_router(args) -> int:
    import uvicorn

    from dsv41.server.router import RouterConfig, create_router
    from dsv41.server.run import bind, uvicorn_config

    config = RouterConfig(
        prefill=args.prefill, decode=args.decode, timeout_s=args.timeout, cache_aware=args.policy == "cache_aware"
    )
    app = create_router(config)
    sock = bind(args.host, args.port)
    print(
        f"dsv41: router on http://{args.host}:{sock.getsockname()[1]}/v1 over {len(args.prefill)} prefill and "
        f"{len(args.decode)} decode worker(s)",
        flush=True,
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in PyTorch")
    parser.add_argument(
        "--version", action="version", version=f"dsv41 {_version()}", help="print the installed version and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p_info = sub.add_parser("info", help="parameter counts and KV-cache bytes per token of a config")
    p_info.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="built-in config to account: flash (the release), tiny or small (default: tiny)",
    )
    p_info.add_argument(
        "--config", metavar="PATH", help="a config.json (inference or Hugging Face form) to account instead of --preset"
    )
    p_info.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p_info.set_defaults(func=cmd_info)

    p_plan = sub.add_parser("plan", help="per-device weight bytes and KV capacity of each serving layout")
    source = p_plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config (flash: the release)")
    source.add_argument("--model", metavar="PATH", help="a checkpoint folder or config.json")
    p_plan.add_argument("--devices", type=positive_int, required=True, metavar="N", help="devices (one rank each)")
    p_plan.add_argument(
        "--device-memory",
        required=True,
        metavar="SIZE",
        help="memory of one device, e.g. 141GB (10^9 bytes) or 80GiB (2^30)",
    )
    p_plan.add_argument(
        "--memory-utilization",
        type=float,
        default=0.9,
        metavar="F",
        help="fraction of each device for weights + KV cache; the rest is left to activations "
        "and the runtime (vLLM's gpu_memory_utilization; default: 0.9)",
    )
    p_plan.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p_plan.set_defaults(func=cmd_plan)

    def model_args(p):
        p.add_argument(
            "--preset",
            choices=RUNNABLE_PRESETS,
            help="built-in model shape with random weights (its replies are noise; for trying the "
            f"engine). Without --preset and --model: {DEFAULT_MODEL_HELP}",
        )
        p.add_argument(
            "--model",
            metavar="PATH",
            help="a checkpoint folder (config.json + *.safetensors, e.g. a `dsv41 train` run's "
            "checkpoint/) or a preset name; overrides --preset",
        )
        p.add_argument(
            "--seed",
            type=int,
            default=0,
            metavar="N",
            help="seed of a preset's random weights and of sampling (default: 0)",
        )
        p.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)

    def sampling_args(p, max_tokens: int, command: str):
        defaults = SAMPLING_DEFAULTS[command]
        model_file = "the model folder's generation_config.json, else"
        p.add_argument(
            "--max-tokens",
            "--max-new-tokens",
            dest="max_tokens",
            type=int,
            default=max_tokens,
            metavar="N",
            help=f"most tokens to generate per reply (default: {max_tokens})",
        )
        p.add_argument(
            "--temperature",
            type=float,
            metavar="T",
            help="sampling temperature; 0 always picks the most likely token "
            f"(default: {model_file} {defaults['temperature']})",
        )
        p.add_argument(
            "--top-p",
            type=float,
            metavar="P",
            help="sample only from the most likely tokens whose probabilities add up to P; 1 disables "
            f"(default: {model_file} {defaults['top_p']})",
        )
        p.add_argument(
            "--top-k",
            type=int,
            metavar="K",
            help=f"sample only from the K most likely tokens; 0 disables (default: {model_file} {defaults['top_k']})",
        )
        p.add_argument(
            "--stop", action="append", metavar="TEXT", help="end the reply where this string appears (repeatable)"
        )
        p.add_argument(
            "--ignore-eos",
            action="store_true",
            help="keep generating past the end-of-sequence token, up to --max-tokens (for timing)",
        )

    p_gen = sub.add_parser("generate", help="complete one prompt on the engine (random weights for presets)")
    model_args(p_gen)
    p_gen.add_argument("--prompt", default="Hello", metavar="TEXT", help="the text to complete (default: Hello)")
    sampling_args(p_gen, max_tokens=16, command="generate")
    p_gen.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat format)")
    p_gen.add_argument("--thinking", action="store_true", help="with --chat: thinking mode")
    p_gen.add_argument("--show-ids", action="store_true", help="also print the generated token ids")
    add_engine_args(p_gen)
    p_gen.set_defaults(func=cmd_generate)

    p_chat = sub.add_parser("chat", help="an interactive conversation (stdin lines; works with a pipe)")
    model_args(p_chat)
    sampling_args(p_chat, max_tokens=256, command="chat")
    p_chat.add_argument("--system", metavar="TEXT", help="a system message put before the conversation")
    p_chat.add_argument(
        "--image",
        metavar="PATH",
        action="append",
        help="an image file (PNG, JPEG, WebP, ...) shown with the first message; repeat for more "
        "(needs a model with a vision tower)",
    )
    p_chat.add_argument("--thinking", action="store_true", help="thinking mode (reasoning before the answer)")
    p_chat.add_argument(
        "--reasoning-effort", metavar="EFFORT", help="how much to reason: 1-100 or low/high/max (implies --thinking)"
    )
    add_engine_args(p_chat)
    p_chat.set_defaults(func=cmd_chat)

    p_serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    p_serve.add_argument(
        "model",
        metavar="MODEL",
        nargs="?",
        help="a checkpoint folder (config.json + *.safetensors) or a preset name with random "
        f"weights: {', '.join(RUNNABLE_PRESETS)}. Left out: {DEFAULT_MODEL_HELP}",
    )
    p_serve.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address to listen on; the default 127.0.0.1 only accepts local connections; "
        "use 0.0.0.0 to accept others (set --api-key then)",
    )
    p_serve.add_argument("--port", type=int, default=8000, metavar="PORT", help="TCP port to listen on (default: 8000)")
    p_serve.add_argument(
        "--api-key",
        default=os.environ.get("DSV41_API_KEY") or None,
        metavar="KEY",
        help="when set, every /v1 route requires `Authorization: Bearer KEY`; /health and "
        "/metrics stay open; default: $DSV41_API_KEY",
    )
    p_serve.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model id clients send and /v1/models lists (default: the engine's name)",
    )
    p_serve.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        metavar="N",
        help="queued requests beyond which new ones get 429 + Retry-After (default: 64)",
    )
    p_serve.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seed of a preset's random weights (default: 0)"
    )
    p_serve.add_argument(
        "--max-request-bytes",
        type=positive_int,
        metavar="BYTES",
        help="request bodies larger than this get 413 (default: 8 MiB, or 32 bytes per token of "
        "the context when that is more)",
    )
    p_serve.add_argument(
        "--max-choices",
        type=positive_int,
        default=16,
        metavar="N",
        help="the most choices one request may ask for with n or best_of; each is an engine "
        "request of its own (default: 16)",
    )
    p_serve.add_argument(
        "--max-stored-responses",
        type=non_negative_int,
        default=256,
        metavar="N",
        help="the most finished /v1/responses results kept in memory for previous_response_id "
        "and GET /v1/responses/{id}, least recently used dropped first; 0 keeps none "
        "(default: 256)",
    )
    p_serve.add_argument("--threads", type=positive_int, metavar="N", help=THREADS_HELP)
    p_serve.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log verbosity (default: info)",
    )
    p_serve.add_argument(
        "--disaggregation-mode",
        choices=["prefill", "decode"],
        default=None,
        help="run as a prefill or decode worker behind `dsv41 router` (prefill/decode "
        "disaggregation; the ordinary routes keep working)",
    )
    _add_parallel_args(p_serve)
    add_engine_args(p_serve)
    p_serve.set_defaults(func=cmd_serve)

    p_router = sub.add_parser(
        "router",
        help="the OpenAI front of prefill/decode disaggregation: prompts to "
        "prefill workers, KV hand-offs to decode workers",
    )
    p_router.add_argument(
        "--prefill",
        nargs="+",
        required=True,
        metavar="URL",
        help="prefill workers (`dsv41 serve MODEL --disaggregation-mode prefill`), e.g. http://127.0.0.1:8001",
    )
    p_router.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode workers (`dsv41 serve MODEL --disaggregation-mode decode`)",
    )
    p_router.add_argument(
        "--host",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="address to listen on (default: 127.0.0.1, this machine only). Clients' "
        "Authorization headers are passed to the workers, which check their own --api-key",
    )
    p_router.add_argument(
        "--port", type=int, default=8000, metavar="PORT", help="TCP port to listen on (default: 8000)"
    )
    p_router.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="longest wait in seconds for a worker's next bytes (default: 600)",
    )
    p_router.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="router log verbosity (default: info)",
    )
    p_router.add_argument(
        "--policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin"],
        help="choice of prefill worker: the one that was sent the longest start of this prompt "
        "(its prefix cache holds it; else the least busy), or round robin "
        "(default: cache_aware)",
    )
    p_router.set_defaults(func=cmd_router)

    add_training_commands(sub)

    p_tok = sub.add_parser(
        "export-tokenizer",
        help="write the tokenizer files transformers.AutoTokenizer loads "
        "(tokenizer.json, tokenizer_config.json with the chat template) "
        "into a checkpoint folder written before",
    )
    p_tok.add_argument(
        "folder", help="the checkpoint folder to write the files into (its tokenizer.json, if it has one, is kept)"
    )
    p_tok.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="the model's vocabulary size, which picks the byte or DeepSeek tokenizer for a folder "
        "without tokenizer.json (default: read from the folder's config.json)",
    )
    p_tok.set_defaults(func=cmd_export_tokenizer)

    sub.add_parser(
        "data",
        help="build a training data folder (tokenizer + token shards) from public-domain text "
        "it downloads, or from this Python's standard library offline (dsv41 data --help)",
    )
    return parser


def cmd_export_tokenizer(args) -> int:
    from dsv41.tokenizer_files import export_command

    return export_command(args.folder, args.vocab_size)


def main(argv: list[str] | None = None) -> int:
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
