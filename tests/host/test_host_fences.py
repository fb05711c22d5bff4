"""Fences of the host backend: strictly increasing per key across processes, restarts and a
lost counter file; kept by re-entry, none for a read; a fence that cannot be made durable
fails the acquisition with nothing held. Both engines, both mechanisms."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest

from lockmgr import LockError, NotOwnedError
from lockmgr.host import HostLockManager, HostRWLockManager

pytestmark = [pytest.mark.timeout(120), pytest.mark.posix_only]


@pytest.fixture
def fenced(host_engine: ModuleType, lock_dir: str, mechanism: str) -> Any:
    manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism, fencing=True)
    yield manager
    manager.close()


def test_fences_strictly_increase_per_key_across_processes_and_restarts(
        fenced: Any, children: Any, lock_dir: str, mechanism: str) -> None:
    child = children(f"fenced = HostLockManager({lock_dir!r}, mechanism={mechanism!r},"
                     " fencing=True)\n"
                     "def fence_once(key):\n"
                     "    with fenced.hold(key) as lease:\n"
                     "        return lease.fence\n")
    seen = []
    for _ in range(3):
        with fenced.hold("k") as lease:
            seen.append(lease.fence)
        seen.append(child.ask("fence_once('k')"))
    assert child.finish() == 0
    restarted = children(f"fenced = HostLockManager({lock_dir!r}, mechanism={mechanism!r},"
                         " fencing=True)")
    seen.append(restarted.ask("fenced.acquire('k') and fenced.fence('k')"))
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen


def test_a_lost_counter_file_never_hands_a_fence_out_again(
        fenced: Any, lock_dir: str) -> None:
    with fenced.hold("k") as lease:
        before = lease.fence
    os.remove(os.path.join(lock_dir, "fences"))  # a directory on tmpfs, after a reboot
    with fenced.hold("k") as lease:
        assert lease.fence > before


def test_reentry_keeps_the_fence_and_a_read_has_none(
        host_engine: ModuleType, lock_dir: str, mechanism: str, fenced: Any) -> None:
    assert fenced.acquire("k")
    first = fenced.fence("k")
    assert fenced.acquire("k") and fenced.fence("k") == first
    fenced.release("k")
    fenced.release("k")
    with pytest.raises(NotOwnedError):
        fenced.fence("k")
    with fenced.hold_many(["a", "b"]) as lease:
        assert set(lease.fences) == {"a", "b"}
        with pytest.raises(LockError, match="a fence for each"):
            lease.fence
    with HostRWLockManager(lock_dir, mechanism=mechanism, fencing=True) as rw:
        with rw.read("r") as lease:
            with pytest.raises(LockError, match="reading"):
                lease.fence
            with pytest.raises(LockError, match="reading"):
                rw.fence("r")
    with HostLockManager(lock_dir, mechanism=mechanism, namespace="plain") as plain:
        with plain.hold("k") as lease:
            with pytest.raises(LockError, match="fencing=True"):
                lease.fence


def test_a_fence_that_cannot_be_taken_fails_the_acquisition_holding_nothing(
        fenced: Any, children: Any, lock_dir: str, tmp_path: Any) -> None:
    child = children()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    os.symlink(target, os.path.join(lock_dir, "fences"))  # (made at the first fence)
    with pytest.raises(LockError, match="symbolic link"):
        fenced.acquire("k")
    assert not fenced.owned("k") and len(fenced) == 0
    assert child.ask("locks.acquire('k', timeout=0)") is True
    assert target.read_bytes() == b""


def test_a_counter_kept_locked_by_a_stopped_process_times_a_timed_call_out(
        fenced: Any, children: Any, lock_dir: str) -> None:
    # A process stopped (SIGSTOP) in the few instructions of its fence keeps the counter
    # locked: a timed call times out holding nothing, rather than wait for it for ever.
    child = children()
    offset = (fenced.host_key("k") % 65536) * 8
    child.ask("import fcntl, struct\n"
              f"fences = os.open(os.path.join({lock_dir!r}, 'fences'), os.O_RDWR | os.O_CREAT)\n"
              "fcntl.fcntl(fences, fcntl.F_OFD_SETLK,"
              f" struct.pack('@hhqqi4x', fcntl.F_WRLCK, 0, {offset}, 8, 0))")
    assert fenced.acquire("k", timeout=0.3) is False
    assert not fenced.owned("k") and len(fenced) == 0
    assert child.ask("locks.acquire('k', timeout=0)") is True  # the key itself was free
    child.ask("locks.release('k')")
    child.ask("os.close(fences)")
    assert fenced.acquire("k", timeout=5)
    fenced.release("k")
