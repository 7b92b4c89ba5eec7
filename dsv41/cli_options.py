"""Options shared by the command line's modules (dsv41/cli.py, dsv41/cli_training.py): options generated
from config dataclass fields (their help texts live in the fields' metadata), the engine's options, typed
integer parsers, the thread-count option and the presets a command may build."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

from dsv41.config import PRESETS

# flash has 763B parameters: random weights for it fit no machine this runs on, so the commands that build
# a model offer only the other presets (`info` still accounts flash, from shapes alone).
RUNNABLE_PRESETS = tuple(sorted(name for name in PRESETS if name != "flash"))


def engine_fields():
    from dsv41.engine import EngineConfig

    return EngineConfig, dataclasses.fields(EngineConfig)


def field_type(f: dataclasses.Field) -> Callable:
    name = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    for t in (bool, int, float, str):
        if t.__name__ in name:
            return t
    return str


def field_help(f: dataclasses.Field) -> str:
    """The field's own help text (metadata["help"]) plus its default; a None default is explained by the
    help text itself, since "None" tells a user nothing. `%` is escaped for argparse's formatting."""
    help_ = f.metadata.get("help", f.name.replace("_", " "))
    if f.default is True or f.default is False:
        help_ += f" (default: {'on' if f.default else 'off'})"
    elif f.default is not None and f.default is not dataclasses.MISSING:
        help_ += f" (default: {f.default})"
    return help_.replace("%", "%%")


def add_field_option(group, f: dataclasses.Field, dest: str, **overrides) -> None:
    """One `--field-name` option from a dataclass field: bools get --x/--no-x, others a typed value with
    the field's metavar and choices when it declares them. None means "not given": the dataclass default
    then applies."""
    opt, kind = "--" + f.name.replace("_", "-"), field_type(f)
    kw = {"dest": dest, "default": None, "help": field_help(f)}
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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("engine options (EngineConfig)")
    try:
        _, fields = engine_fields()
    except ImportError as exc:  # keep `dsv41 info` usable even if the engine cannot be imported
        group.description = f"unavailable: {exc}"
        return
    for f in fields:
        try:
            add_field_option(group, f, f"engine_{f.name}")
        except argparse.ArgumentError:  # the name is taken by a command option; the command's wins
            continue
    # the shorthand vLLM and SGLang users reach for; the same dest as --numerics, so the last one given wins
    group.add_argument(
        "--deterministic",
        dest="engine_numerics",
        action="store_const",
        const="deterministic",
        help="same as --numerics deterministic",
    )


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def set_threads(args) -> None:
    """Apply --threads before anything builds or runs the model, so every torch kernel, weight
    initialisation included, uses that many threads. Not given: torch's default stays."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


THREADS_HELP = (
    "torch CPU threads (torch.set_num_threads) for the model; default: torch's own choice, one per "
    "core. Speed collapses when other processes compete for the cores: then set N to the cores "
    "actually free"
)
