"""Build and load the C++ CPU kernels beside this file (moe_cpu.cpp, index_cpu.cpp, attn_cpu.cpp, and the
header they share, cpu_bf16.h).

Each is built once per machine with the machine's own instruction set (`c++ -O3 -march=native -fopenmp`
against the running torch's headers, a few seconds), cached under ~/.cache/dsv41/kernels keyed by the source,
the compiler, the flags and the torch version, and loaded with `torch.ops.load_library`: its ops register
themselves from C++ under `torch.ops.dsv41`, so a compiled graph calls them through the dispatcher. A build
that fails, a cache that cannot be written or a library that will not load gives None, never an error: the
callers then keep their reference paths.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

HEADER = os.path.join(os.path.dirname(__file__), "cpu_bf16.h")  # included by every kernel source here
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20")


def _compiler() -> str | None:
    return os.environ.get("CXX") or next((shutil.which(c) for c in ("c++", "g++", "clang++") if shutil.which(c)), None)


def cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "dsv41", "kernels")


def _torch_flags() -> list[str]:
    """Headers, libraries and ABI of the torch this process runs."""
    from torch.utils import cpp_extension  # imports setuptools (~0.1 s): only when a build is wanted

    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        abi,
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-lc10",
        "-ltorch_cpu",
    ]


@functools.cache
def _target(name: str) -> tuple[str, str] | None:
    """(compiler, the library's cache path) for `<name>.cpp` here; None without a C++ compiler. The key covers
    the source, the compiler, the flags and the torch build (its version, folder and ABI), without importing
    torch's extension helpers (~0.2 s): a process that only asks whether a build exists stays cheap."""
    cxx = _compiler()
    if cxx is None:
        return None
    source = b""
    for path in (_source(name), HEADER):  # a change to the shared header rebuilds every kernel
        with open(path, "rb") as f:
            source += f.read()
    torch_build = (torch.__version__, os.path.dirname(torch.__file__), str(torch._C._GLIBCXX_USE_CXX11_ABI))
    key = hashlib.sha256(source + "\0".join((cxx, *torch_build, *FLAGS)).encode()).hexdigest()[:16]
    return cxx, os.path.join(cache_dir(), f"{name}-{key}.so")


def _source(name: str) -> str:
    return os.path.join(os.path.dirname(__file__), f"{name}.cpp")


def is_built(name: str) -> bool:
    """Is there a build of this source for this machine in the cache already (nothing is built)?"""
    target = _target(name)
    return target is not None and os.path.exists(target[1])


@functools.cache
def load(name: str) -> str | None:
    """Build (if this machine has no build of this source yet) and load `<name>.cpp` from this folder; the
    library's path, or None where it cannot be built or loaded (no C++ compiler, a compiler error, no
    writable cache)."""
    target = _target(name)
    if target is None:
        return None
    cxx, path = target
    source_path = _source(name)
    if not os.path.exists(path):
        flags = [*FLAGS, *_torch_flags()]
        tmp = None
        try:  # built beside the target, then renamed: a process never loads another's half-written file
            os.makedirs(cache_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
            os.close(fd)
            subprocess.run([cxx, source_path, "-o", tmp, *flags], check=True, capture_output=True, timeout=600)
            os.replace(tmp, path)
        except (OSError, subprocess.SubprocessError):
            return None
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError):
        return None
    return path
