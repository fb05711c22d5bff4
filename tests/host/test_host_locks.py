"""Host locks across real processes: exclusion, reentrancy, timeouts, many keys at once,
readers and writers, a holder killed, Ctrl-C in a wait, fork, and managers sharing a
directory in one process. Each test on both engines (``impl``) and both kernel mechanisms
(OFD, POSIX), the other processes spawned."""

from __future__ import annotations

import os
import subprocess
import sys
import signal
import threading
import time
import warnings
from types import ModuleType
from typing import Any

import pytest

from conftest import abandoned_warnings, wait_until
from host_fixtures import SRC, counted
from lockmgr import AbandonedLockWarning, LockTimeout, NotOwnedError
from lockmgr.host import HostLockManager, HostRWLockManager, Lease

pytestmark = [pytest.mark.timeout(120), pytest.mark.posix_only]


@pytest.fixture
def locks(host_engine: ModuleType, lock_dir: str,
          mechanism: str) -> Any:
    manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    yield manager
    manager.close()


@pytest.fixture
def rw(host_engine: ModuleType, lock_dir: str, mechanism: str) -> Any:
    manager: HostRWLockManager[Any] = HostRWLockManager(lock_dir, mechanism=mechanism,
                                                        namespace="rw")
    yield manager
    manager.close()


def test_a_key_held_in_one_process_is_taken_in_another_only_once_released(
        locks: Any, children: Any) -> None:
    child = children()
    assert locks.acquire("k")
    assert child.ask("locks.acquire('k', timeout=0)") is False
    assert child.ask("locks.acquire('k', timeout=0.05)") is False
    assert child.ask("locks.locked('k')") is True
    child.send("locks.acquire('k')")
    time.sleep(0.05)  # (any moment: the child's wait is what is tested, not its timing)
    assert not child.answered()
    locks.release("k")
    assert child.answer() is True
    assert locks.acquire("k", timeout=0) is False
    assert child.ask("locks.release('k')") is None
    assert locks.acquire("k", timeout=0) is True
    locks.release("k")


def test_a_counter_in_a_file_loses_no_increment_across_four_processes(
        locks: Any, children: Any, lock_dir: str) -> None:
    bump = ("def bump(times):\n"
            "    for _ in range(times):\n"
            "        with locks['counter']:\n"
            "            with open(counter) as file:\n"
            "                value = int(file.read())\n"
            "            with open(counter, 'w') as file:\n"
            "                file.write(str(value + 1))\n")
    assert counted(children, lock_dir, bump, "bump(500)", 4) == 2000


def test_reentry_takes_the_kernel_lock_once_and_the_last_release_frees_it(
        locks: Any, children: Any) -> None:
    child = children()
    assert locks.acquire("k") and locks.acquire("k")
    assert locks.recursion_count("k") == 2 and locks.owned("k")
    locks.release("k")
    assert child.ask("locks.acquire('k', timeout=0)") is False
    locks.release("k")
    assert not locks.owned("k")
    assert child.ask("locks.acquire('k', timeout=0)") is True
    with pytest.raises(NotOwnedError):
        locks.release("k")


def test_a_timed_wait_gives_up_holding_nothing(locks: Any, children: Any) -> None:
    child = children()
    assert child.ask("locks.acquire('k')") is True
    assert locks.acquire("k", timeout=0.1) is False
    with pytest.raises(LockTimeout):
        with locks.hold("k", timeout=0.1):
            pass
    assert not locks.owned("k") and len(locks) == 0
    child.ask("locks.release('k')")
    assert locks.acquire("k", timeout=0) is True
    locks.release("k")


def test_bad_keys_and_arguments_change_nothing(locks: Any) -> None:
    with pytest.raises(TypeError):
        locks.acquire(1.5)
    with pytest.raises(TypeError):
        locks.acquire_many(["a", object()])
    with pytest.raises(ValueError):
        locks.acquire("a", timeout=float("nan"))
    with pytest.raises(ValueError):
        locks.acquire("a", blocking=False, timeout=1)
    assert len(locks) == 0 and not locks.locked("a")


def test_hold_many_takes_all_or_none_within_one_deadline(locks: Any, children: Any) -> None:
    child = children()
    assert child.ask("locks.acquire('b')") is True
    assert locks.acquire_many(["a", "b", "c"], timeout=0.1) is False
    assert not locks.owned("a") and not locks.owned("c")
    assert child.ask("locks.acquire_many(['a', 'c'], timeout=0)") is True
    child.ask("locks.release_many(['a', 'b', 'c'])")
    with locks.hold_many(["a", "b", "c"]) as lease:
        assert isinstance(lease, Lease) and set(lease.keys) == {"a", "b", "c"}
        assert child.ask("locks.acquire('c', timeout=0)") is False
    assert child.ask("locks.acquire_many(['a', 'b', 'c'], timeout=0)") is True


def test_hold_many_of_overlapping_sets_in_random_orders_never_deadlocks(
        children: Any, impl: ModuleType) -> None:
    body = ("import random\n"
            "def storm(rounds, seed):\n"
            "    chooser = random.Random(seed)\n"
            "    for _ in range(rounds):\n"
            "        keys = chooser.sample('abcdef', 3)\n"
            "        with locks.hold_many(keys):\n"
            "            pass\n"
            "    return rounds\n")
    workers = [children(body) for _ in range(4)]
    for seed, worker in enumerate(workers):
        worker.send(f"storm(300, {seed})")
    assert [worker.answer() for worker in workers] == [300] * 4


def test_a_killed_holders_key_goes_to_a_waiter_warned_of_it(locks: Any, children: Any) -> None:
    child = children()
    assert child.ask("locks.acquire('k')") is True

    def kill_once_waited_for() -> None:
        wait_until(lambda: bool(locks.snapshot()), "the waiter holds the key in process")
        child.kill()

    killing = threading.Thread(target=kill_once_waited_for)
    killing.start()
    with pytest.warns(AbandonedLockWarning,
                      match=f"process {child.pid} ended holding key 'k'") as warned:
        assert locks.acquire("k", timeout=30)
    assert [record.filename for record in warned] == [__file__]  # (at the acquiring call)
    killing.join(60)
    locks.release("k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # released as it should be: the next one is not warned
        assert locks.acquire("k", timeout=0)
    locks.release("k")


def test_a_warning_made_an_error_fails_the_acquisition_holding_nothing(
        locks: Any, children: Any) -> None:
    child = children()
    assert child.ask("locks.acquire('k')") is True
    child.kill()
    with warnings.catch_warnings():
        warnings.simplefilter("error", AbandonedLockWarning)
        with pytest.raises(AbandonedLockWarning):
            locks.acquire("k")
    assert not locks.owned("k") and len(locks) == 0
    assert children().ask("locks.acquire('k', timeout=0)") is True


def test_a_thread_that_ends_holding_a_key_frees_it_across_processes(
        locks: Any, children: Any) -> None:
    child = children()
    with abandoned_warnings() as warned:
        worker = threading.Thread(target=locks.acquire, args=("k",))
        worker.start()
        worker.join()
        del worker
    assert warned
    wait_until(lambda: child.ask("locks.acquire('k', timeout=0)") is True,
               "another process takes the key")


def test_ctrl_c_in_a_kernel_wait_leaves_nothing_held(children: Any) -> None:
    holder, waiter = children(), children()
    assert holder.ask("locks.acquire('k')") is True
    waiter.send("threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
                "try:\n"
                "    locks.acquire('k')\n"
                "except KeyboardInterrupt:\n"
                "    interrupted = True\n")
    assert waiter.answer() is None
    assert waiter.ask("interrupted and not locks.owned('k') and len(locks) == 0") is True
    holder.ask("locks.release('k')")
    assert waiter.ask("locks.acquire('k', timeout=0)") is True
    assert holder.ask("locks.acquire('k', timeout=0)") is False


def test_a_writer_waiting_keeps_new_readers_of_other_processes_out(
        rw: Any, children: Any) -> None:
    reader, writer, late = children(), children(), children()
    assert reader.ask("rw.acquire_read('doc')") is True
    assert late.ask("rw.acquire_read('doc', timeout=0)") is True  # readers share it
    late.ask("rw.release_read('doc')")
    writer.send("rw.acquire_write('doc', timeout=30)")
    probe = "(rw.release_read('doc') or 'in') if rw.acquire_read('doc', timeout=0) else 'out'"
    wait_until(lambda: late.ask(probe) == "out",
               "the waiting writer keeps a new reader out")
    assert late.ask("rw.acquire_read('doc', timeout=0.1)") is False  # waits behind it
    assert rw.acquire_read("doc", timeout=0.1) is False
    reader.ask("rw.release_read('doc')")
    assert writer.answer() is True
    assert rw.write_locked("doc")
    writer.ask("rw.release_write('doc')")
    assert late.ask("rw.acquire_read('doc', timeout=0)") is True


def test_an_upgrade_waits_for_other_processes_readers_and_a_downgrade_lets_them_in(
        rw: Any, children: Any) -> None:
    other = children()
    assert rw.acquire_read("doc")
    assert other.ask("rw.acquire_read('doc')") is True
    assert rw.acquire_write("doc", timeout=0.1) is False
    assert rw.readers("doc") == 1  # still reading
    other.ask("rw.release_read('doc')")
    assert rw.acquire_write("doc", timeout=0)
    assert other.ask("rw.acquire_read('doc', timeout=0)") is False
    rw.release_write("doc")  # back to reading only
    assert other.ask("rw.acquire_read('doc', timeout=0)") is True
    other.ask("rw.release_read('doc')")
    rw.release_read("doc")


def test_two_managers_of_one_directory_in_a_process_exclude_each_other(
        host_engine: ModuleType, lock_dir: str, mechanism: str, children: Any) -> None:
    first: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    second: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    child = children()
    try:
        assert first.acquire("k")
        assert second.locked("k")
        results: list[bool] = []
        other = threading.Thread(target=lambda: results.append(second.acquire("k", timeout=0)))
        other.start()
        other.join()
        assert results == [False]
        second.close()  # closing one leaves the other's locks held (POSIX locks included)
        assert child.ask("locks.acquire('k', timeout=0)") is False
        first.release("k")
        assert child.ask("locks.acquire('k', timeout=0)") is True
    finally:
        first.close()
        second.close()


def test_every_manager_of_a_directory_in_one_process_uses_one_mechanism(
        host_engine: ModuleType, lock_dir: str) -> None:
    with HostLockManager(lock_dir, mechanism="posix"):
        with pytest.raises(ValueError, match="mechanism"):
            HostLockManager(lock_dir, mechanism="ofd")
    with pytest.raises(ValueError, match="mechanism"):
        HostLockManager(lock_dir, mechanism="flock")


def test_a_forked_child_holds_none_of_its_parents_keys(locks: Any, children: Any) -> None:
    other = children()
    assert locks.acquire("k")
    read, write = os.pipe()
    with warnings.catch_warnings():  # (3.12+: a fork with threads running warns; meant here)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: it reports, and never returns into pytest
        status = 1
        try:
            owned = locks.owned("k")
            try:
                locks.release("k")
                released = "no error"
            except Exception as error:
                released = type(error).__name__
            took_at_once = locks.acquire("k", timeout=0)  # the parent still holds it
            os.write(write, f"{owned} {released} {took_at_once}".encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    report = os.read(read, 100).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert report == "False LockLost False", report
    # The child's exit and its release left the parent's lock as it was.
    assert other.ask("locks.acquire('k', timeout=0)") is False
    locks.release("k")
    assert other.ask("locks.acquire('k', timeout=0)") is True


def test_a_torn_writer_record_warns_nobody(locks: Any, children: Any) -> None:
    # Two writers of keys sharing a slot of the table may write their records at once: one
    # torn between them fails its check word and reads as no record, never as a dead writer.
    from lockmgr.host._directory import HOLDER_SLOT, HOLDER_SLOTS, HOLDERS
    child = children()
    assert child.ask("locks.acquire('k')") is True
    child.kill()  # its record stays: the next writer would be warned
    offset = HOLDERS + (locks.host_key("k") % HOLDER_SLOTS) * HOLDER_SLOT
    registry = locks._shared.directory.registry
    registry[offset + 8:offset + 12] = (child.pid + 1).to_bytes(4, "little")  # torn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert locks.acquire("k", timeout=30)
    locks.release("k")


def test_a_stopped_waiter_keeps_no_try_from_a_free_key(locks: Any, children: Any) -> None:
    holder, waiter = children(), children()
    assert holder.ask("locks.acquire('k')") is True
    waiter.send("locks.acquire('k', timeout=60)")
    wait_until(lambda: any(waiter.pid in state.waiting for state in locks.snapshot(host=True)),
               "the waiter waits in the kernel")
    os.kill(waiter.pid, signal.SIGSTOP)
    try:
        holder.ask("locks.release('k')")
        assert locks.acquire("k", blocking=False)  # free: a stopped waiter does not keep it
        locks.release("k")
        assert locks.acquire("k", timeout=1)  # a wait stands back one slice, then takes it
        locks.release("k")
    finally:
        os.kill(waiter.pid, signal.SIGCONT)


FORK_WHILE_A_THREAD_OPENS = r"""
import os, signal, sys, tempfile, threading
from lockmgr.host import HostLockManager, _shared
base = tempfile.mkdtemp()
inside, finish = threading.Event(), threading.Event()
real_open = _shared.open_lock_directory

def slow_open(*args, **kwargs):  # the state a fork during a real open leaves
    inside.set()
    finish.wait(60)
    return real_open(*args, **kwargs)

_shared.open_lock_directory = slow_open
opener = threading.Thread(target=lambda: HostLockManager(os.path.join(base, "one")).close())
opener.start()
inside.wait(60)
pid = os.fork()
if pid == 0:
    signal.alarm(30)  # a hang bound
    _shared.open_lock_directory = real_open
    HostLockManager(os.path.join(base, "two")).close()
    os._exit(0)
finish.set()
opener.join()
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_fork_while_another_thread_opens_a_directory_leaves_the_child_working() -> None:
    done = subprocess.run([sys.executable, "-c", FORK_WHILE_A_THREAD_OPENS],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr


def test_closing_the_last_manager_leaves_its_keys_held_until_released(
        host_engine: ModuleType, lock_dir: str, mechanism: str, children: Any) -> None:
    child = children()
    locks: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism)
    assert locks.acquire("k")
    locks.close()
    assert child.ask("locks.acquire('k', timeout=0)") is False
    locks.release("k")
    assert child.ask("locks.acquire('k', timeout=0)") is True
