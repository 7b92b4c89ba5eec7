"""Start-up of a multi-process server (dsv41.server.run): a rank that dies while the others wait in a collective."""

import threading
import time
import types

import pytest

from dsv41.server import run


def test_a_dead_rank_is_reported_once_the_collective_in_flight_has_ended():
    """The collective (here a call that fails a moment after its peer is gone, as gloo's does once the dead rank's
    socket closes) has ended when the error is raised: the caller then never tears the process group down under
    a call still running, which aborted the process at exit instead of giving the one clear error."""
    ended = threading.Event()

    def collective():
        time.sleep(0.5)
        ended.set()
        raise RuntimeError("connection closed by peer")

    dead = types.SimpleNamespace(exitcode=1)
    with pytest.raises(ChildProcessError, match=r"rank 1 exited \(code 1\) while building its engine"):
        run._while_ranks_live(collective, [dead], "building its engine")
    assert ended.is_set()
    assert not any(t.name == "dsv41-rendezvous" and t.is_alive() for t in threading.enumerate())


def test_a_collective_that_never_ends_bounds_the_wait(monkeypatch):
    """A rank that died before it ever connected leaves the others' rendezvous waiting for the store's timeout:
    the error comes after the grace period, not after that."""
    monkeypatch.setattr(run, "RENDEZVOUS_GRACE_S", 0.3)
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(ChildProcessError, match="while joining the process group"):
        run._while_ranks_live(
            lambda: release.wait(30), [types.SimpleNamespace(exitcode=1)], "joining the process group"
        )
    assert time.monotonic() - start < 5
    release.set()
