"""``snapshot(host=True)``: the writers and waiting processes of the host's keys, named when
this process knows them. Both engines, both mechanisms, spawned processes."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import pytest

from conftest import wait_until
from lockmgr.host import HostKeyState, HostLockManager

pytestmark = [pytest.mark.timeout(120), pytest.mark.posix_only]


@pytest.fixture
def locks(host_engine: ModuleType, lock_dir: str, mechanism: str) -> Any:
    manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    yield manager
    manager.close()


def test_the_host_snapshot_shows_each_keys_writer_and_waiting_processes(
        locks: Any, children: Any) -> None:
    writer, waiter, other = children(), children(), children()
    assert writer.ask("locks.acquire('k')") is True
    assert other.ask("locks.acquire('unnamed')") is True
    waiter.send("locks.acquire('k')")
    wait_until(lambda: any(state.waiting for state in locks.snapshot(host=True)),
               "the wait is published")
    states = locks.snapshot(host=True, keys=["k"])
    assert HostKeyState("k", locks.host_key("k"), writer.pid, (waiter.pid,)) in states
    assert HostKeyState(None, locks.host_key("unnamed"), other.pid, ()) in states
    assert locks.snapshot() == []  # this process holds nothing
    writer.ask("locks.release('k')")
    assert waiter.answer() is True
    wait_until(lambda: [state.writer for state in locks.snapshot(host=True, keys=["k"])
                        if state.key == "k"] == [waiter.pid], "the waiter writes it")


def test_a_key_written_here_is_named_and_one_given_back_is_gone(locks: Any) -> None:
    with locks.hold(("invoice", 881)):
        assert [(state.key, state.writer) for state in locks.snapshot(host=True)] == [
            (("invoice", 881), os.getpid())]
    assert locks.snapshot(host=True) == []
    with pytest.raises(TypeError):
        locks.snapshot(host=True, keys=[1.5])
