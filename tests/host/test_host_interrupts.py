"""Ctrl-C anywhere in a host call leaves nothing held: a storm of real SIGINTs, each raising
KeyboardInterrupt in a child's main thread wherever it lands, against loops of acquires and
releases, reads, writes, upgrades and downgrades, many keys at once, tasks, and waits for keys
another process holds. After the storm the child holds nothing (in its threads' levels, its
tasks', its in-process engine and its kernel table), has no wait published and none queued,
and another process takes every key the loop used at once, without waiting. Each test on
both engines (``impl``) and both kernel mechanisms."""

from __future__ import annotations

import fcntl
import os
from types import ModuleType
from typing import Any

import pytest

from lockmgr.host import HostLockManager, HostRWLockManager
from lockmgr.host._fences import FENCE_SLOTS, FENCES
from lockmgr.host._kernel import place

pytestmark = [pytest.mark.timeout(300), pytest.mark.posix_only]

# Each round uses keys of its own, so that a key left locked by one round is never taken
# and given back again by a later one (the kernel lets a process re-take its own lock):
# whatever a round leaks stays leaked until the check.
ROUNDS = 1500

# ``storm(operation, manager, rounds, gap)``: runs ``operation(i)`` for each round while another
# thread sends SIGINT to the main thread at random intervals of up to ``gap``; the handler raises
# KeyboardInterrupt while an operation runs (and nowhere else: the loop itself must go on).
# Returns how many rounds were interrupted.
_STORM = r"""
import random

armed = [False]  # whether a SIGINT raises now

def storm(operation, manager, rounds, gap=0.0002):
    def interrupt(signum, frame):
        if armed[0]:
            raise KeyboardInterrupt
    main = threading.main_thread().ident
    calm = threading.Event()
    def kick():
        while not calm.is_set():
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(random.random() * gap)
    previous = signal.signal(signal.SIGINT, interrupt)
    kicker = threading.Thread(target=kick)
    kicker.start()
    interrupted = 0
    try:
        for index in range(rounds):
            try:
                armed[0] = True
                operation(index)
            except KeyboardInterrupt:
                armed[0] = False
                interrupted += 1
                # A release interrupted before it began leaves its key held, and known
                # (owned): given back, as a caller would; a key held unknown stays.
                manager.release_all()
            finally:
                armed[0] = False
    finally:
        calm.set()
        kicker.join()
        signal.signal(signal.SIGINT, previous)
    return interrupted

def left_held(manager):
    # what the child still holds through manager, by layer (nothing: an empty dict)
    manager._tasks.sweep()  # (what a new task's first call runs once records pile up)
    left = {"owned": len(manager._levels().held),
            "by tasks": sum(1 for levels in manager._tasks.levels.values() if levels.held),
            "in process": len(manager),
            "in the kernel table": len(manager._shared._idents)}
    return {layer: count for layer, count in left.items() if count}

def exclusive(index):
    key = f"k{index}"
    locks.acquire(key)
    locks.release(key)

def shared(index):
    key = f"k{index}"
    with rw.read(key):
        pass
    with rw.write(key):
        pass

def upgraded(index):
    key = f"k{index}"
    rw.acquire_read(key)
    try:
        rw.acquire_write(key)  # an upgrade
        rw.release_write(key)  # back to reading
    finally:
        rw.release_read(key)

def many(index):
    with locks.hold_many([f"k{index}", f"m{index}", f"n{index}"]):
        pass

def many_rw(index):
    with rw.hold_many(reads=[f"k{index}"], writes=[f"m{index}", f"n{index}"]):
        pass

def tasks(index):
    # (interrupts land in the task only: one landing in asyncio.run's own setup or
    # teardown may lose the loop's pending callbacks, the engine's task records with them)
    async def body():
        armed[0] = True
        try:
            key = f"k{index}"
            await locks.aio.acquire(key)
            await locks.aio.release(key)
            async with locks.aio.hold_many([f"m{index}", f"n{index}"]):
                pass
        finally:
            armed[0] = False
    armed[0] = False
    asyncio.run(body())

def waited(index):  # for a key another process holds: every round waits until interrupted
    assert not locks.acquire(f"hot{index}", timeout=60)

def waited_rw(index):
    assert not (rw.acquire_read if index % 2 else rw.acquire_write)(f"hot{index}", timeout=60)

def published():  # this process's waits in the directory's table (both managers')
    return [wait for wait in locks._shared.waits.live().values() if wait[1] == os.getpid()]
"""

_OPERATIONS = {  # operation -> (the child's manager, keys per round)
    "exclusive": ("locks", ("k",)),
    "shared": ("rw", ("k",)),
    "upgraded": ("rw", ("k",)),
    "many": ("locks", ("k", "m", "n")),
    "many_rw": ("rw", ("k", "m", "n")),
    "tasks": ("locks", ("k", "m", "n")),
}


@pytest.mark.parametrize("operation", sorted(_OPERATIONS))
def test_a_storm_of_interrupts_leaves_no_key_held(
        host_engine: ModuleType, lock_dir: str, mechanism: str, children: Any,
        operation: str) -> None:
    manager_name, prefixes = _OPERATIONS[operation]
    child = children("import asyncio\n" + _STORM)
    interrupted = child.ask(f"storm({operation}, {manager_name}, {ROUNDS})")
    assert interrupted > 0  # (the storm did land)
    keys = [f"{prefix}{index}" for index in range(ROUNDS) for prefix in prefixes]
    assert child.ask(f"left_held({manager_name})") == {}
    other: HostLockManager[str] | HostRWLockManager[str] = (
        HostLockManager(lock_dir, mechanism=mechanism) if manager_name == "locks"
        else HostRWLockManager(lock_dir, mechanism=mechanism, namespace="rw"))
    try:
        assert untakeable(other, keys) == []
    finally:
        other.close()
    assert child.finish() == 0


def untakeable(other: Any, keys: list[str]) -> list[str]:
    """The keys of ``keys`` that ``other`` (another process's manager) cannot take at once;
    then, none left out, all of them at once."""
    rw = isinstance(other, HostRWLockManager)
    take = other.acquire_write if rw else other.acquire
    give = other.release_write if rw else other.release
    left_out = []
    for key in keys:
        if take(key, blocking=False):
            give(key)
        else:
            left_out.append(key)
    if not left_out:
        assert (other.acquire_many(writes=keys, blocking=False) if rw
                else other.acquire_many(keys, blocking=False)) is True
        other.release_many(writes=keys) if rw else other.release_many(keys)
    return left_out


@pytest.mark.parametrize("operation", ["waited", "waited_rw"])
def test_a_storm_of_interrupts_in_waits_for_another_process_leaves_nothing_behind(
        host_engine: ModuleType, lock_dir: str, mechanism: str, children: Any,
        operation: str) -> None:
    # Each wait publishes itself for the deadlock looks after a few milliseconds here (not
    # 0.25 s), queues behind the holder (its queue and writer bytes) and sleeps on the
    # doorbell: interrupts land in all of it.
    manager_name = "locks" if operation == "waited" else "rw"
    manager: HostLockManager[str] | HostRWLockManager[str] = (
        HostLockManager(lock_dir, mechanism=mechanism) if manager_name == "locks"
        else HostRWLockManager(lock_dir, mechanism=mechanism, namespace="rw"))
    keys = [f"hot{index}" for index in range(ROUNDS)]  # (each round's own, as above)
    try:
        assert (manager.acquire_many(keys) if isinstance(manager, HostLockManager)
                else manager.acquire_many(writes=keys))
        child = children("import asyncio\n" + _STORM
                         + "from lockmgr.host import _waits\n_waits.LOOK_EVERY = 0.0002\n")
        assert child.ask(f"storm({operation}, {manager_name}, {ROUNDS}, gap=0.0005)") > 0
        assert child.ask(f"left_held({manager_name})") == {}
        assert child.ask("published()") == []
        assert [key for key in keys if queued_for(manager, key)] == []
        assert child.finish() == 0
    finally:
        manager.release_all()
        manager.close()


def queued_for(manager: Any, key: str) -> bool:
    """Whether another process queues for ``key`` (its queue byte) or waits to write it (its
    writer byte)."""
    shard, start = place(manager.host_key(key))
    kernel = manager._shared.kernel
    return bool(kernel.others_lock(shard, start + 1) or kernel.others_lock(shard, start + 2))


# In a held-off call, the in-process engine's sections (the pure twin's block the signals
# themselves) run first, then a wait lets the handlers in: a SIGINT sent meanwhile must end
# the wait itself, not wait until the call ends. (The hang bound: the wait ends in 30 s.)
_WAIT_AFTER_SECTIONS = r"""
from lockmgr._quiet import let_in, quietly

def interrupted_where():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ended = threading.Event()
    def body():
        locks._engine.acquire("k")
        locks._engine.release("k")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # (held off)
        bound = threading.Timer(30, ended.set)
        bound.start()
        try:
            let_in(ended.wait)
        except KeyboardInterrupt:
            return "in the wait"
        finally:
            bound.cancel()
        return "not in the wait"
    try:
        return quietly(body)
    except KeyboardInterrupt:
        return "after the call"
"""


def test_a_wait_let_in_after_the_engines_sections_answers_ctrl_c(
        host_engine: ModuleType, children: Any) -> None:
    child = children(_WAIT_AFTER_SECTIONS)
    assert child.ask("interrupted_where()") == "in the wait"
    assert child.finish() == 0


# A handler let in while the main thread waits for a key that another manager of the same
# directory in this process holds may call a manager of that directory itself: it is
# answered, and the wait goes on (the hang bound: the child's answer within its patience).
_HANDLER_CALLS_A_MANAGER = r"""
def a_handler_calls_a_manager_during_a_wait():
    holder = HostLockManager(locks.directory, mechanism=locks.mechanism)
    taken, done = threading.Event(), threading.Event()
    def hold():
        holder.acquire("a")
        taken.set()
        done.wait()
        holder.release("a")
    threading.Thread(target=hold).start()
    taken.wait()
    answers = []
    def handler(signum, frame):
        answers.append(locks.acquire("b", timeout=5))
        locks.release("b")
        done.set()  # the holder gives "a" back: the wait ends
    def signal_the_wait():
        while not locks._shared._waiting and not done.is_set():  # (the main thread's wait)
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Thread(target=signal_the_wait).start()
        got = locks.acquire("a", timeout=30)
        locks.release("a")
    finally:
        signal.signal(signal.SIGUSR1, previous)
        done.set()
    holder.close()
    return [got, answers]
"""


def test_a_handler_run_during_a_wait_may_call_a_manager_of_the_directory(
        host_engine: ModuleType, children: Any) -> None:
    child = children(_HANDLER_CALLS_A_MANAGER)
    assert child.ask("a_handler_calls_a_manager_during_a_wait()") == [True, [True]]
    assert child.finish() == 0


# A handler let in while its thread waits for another process's fence counter, asking for a
# fence of the same directory itself, is refused at once (it would wait for its own thread).
_HANDLER_ASKS_FOR_A_FENCE = r"""
def a_handler_asks_for_a_fence_during_a_fence_wait():
    fenced = HostLockManager(locks.directory, mechanism=locks.mechanism, fencing=True)
    answers = []
    def handler(signum, frame):
        try:
            answers.append(fenced.acquire("g", timeout=5))
        except RuntimeError as error:
            answers.append(str(error))
    def signal_the_wait():
        while not fenced._shared.fences._taker:  # (the main thread waits for the counter)
            time.sleep(0.001)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        threading.Thread(target=signal_the_wait).start()
        got = fenced.acquire("f", timeout=3)  # the parent keeps the counter locked
    finally:
        signal.signal(signal.SIGUSR1, previous)
    left = [len(fenced), len(fenced._shared._idents)]
    fenced.close()
    return [got, answers, left]
"""


def test_a_handler_asking_for_a_fence_while_its_thread_waits_for_one_is_refused(
        host_engine: ModuleType, children: Any, lock_dir: str, mechanism: str) -> None:
    manager: HostLockManager[Any] = HostLockManager(lock_dir, mechanism=mechanism, fencing=True)
    offset = (manager.host_key("f") % FENCE_SLOTS) * 8
    with manager.hold("f"):  # (the counters' file made)
        pass
    fd = os.open(os.path.join(lock_dir, FENCES), os.O_RDWR)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 8, offset)  # another process's take
        child = children(_HANDLER_ASKS_FOR_A_FENCE)
        got, answers, left = child.ask("a_handler_asks_for_a_fence_during_a_fence_wait()")
    finally:
        os.close(fd)
        manager.close()
    assert got is False and left == [0, 0]
    assert len(answers) == 1 and "asked for a fence while its thread" in answers[0]
    assert child.finish() == 0
