"""Random acquire / try / timeout / release / release_all sequences over several threads,
checked step by step against a model of owners, counts and FIFO queues."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from conftest import Call, Worker, wait_until
from lockmgr import DeadlockError, NotOwnedError
from lockmgr._args import READ, WRITE

THREADS = 3
KEYS = ("a", "b", 3)

#: How long one model step may take: a call the model expects to return (or to queue) does so
#: within this, or the step fails. Short, so a wrong block fails fast and hypothesis can shrink
#: it to a counterexample (rather than each replay waiting PATIENCE); long enough for a
#: loaded 2-core machine, where an uncontended call takes microseconds.
STEP = 5.0

F = TypeVar("F", bound=Callable[..., Any])


def step(func: F) -> F:
    """Mark the machine broken while a rule or invariant runs: if it raises, teardown only
    abandons the workers (one may be stuck in a wrong block) instead of draining the model."""

    @functools.wraps(func)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.broken = True
        result = func(self, *args, **kwargs)
        self.broken = False
        return result

    return run  # type: ignore[return-value]


class Machine(RuleBasedStateMachine):
    """Workers that run the model's calls, each step bounded by STEP."""

    workers: list[Worker]
    broken = False

    def _stats(self) -> Any:
        raise NotImplementedError

    def _run(self, thread: int, func: Callable[[], object], may_queue: bool = False) -> object:
        """Run a call the model expects to return without waiting for another thread (unless
        ``may_queue``: a short timeout). One that queues instead fails the step at once."""
        waiting = self._stats().waiting
        call = self.workers[thread].submit(func)
        if not may_queue and not call.wait(0.05):
            wait_until(lambda: call.done() or self._stats().waiting > waiting,
                       "the call returned or queued", patience=STEP)
            assert call.done() or self._stats().waiting <= waiting, \
                "the call queued where the model expects it to return"
        return call.result(STEP)

    def _queued(self, count: Callable[[], int], expected: int) -> None:
        wait_until(lambda: count() == expected, "it queued", patience=STEP)

    def _stop_workers(self, manager: Any) -> None:
        if not self.broken:
            for worker in self.workers:
                worker.stop(STEP)
            return
        # A step failed: a worker may be stuck in a wrong block. Release what the others hold
        # (their exit would warn) and abandon the stuck one quickly.
        for worker in self.workers:
            worker.submit(manager.release_all)
        for worker in self.workers:
            worker.stop(0.2, check=False)


class LockModel(Machine):
    engine: Any = None
    fair = True

    def __init__(self) -> None:
        super().__init__()
        self.locks = self.engine.LockManager(fair=self.fair)
        self._stats = self.locks.stats  # type: ignore[method-assign]
        self.workers = [Worker(f"model-{i}") for i in range(THREADS)]
        self.owner: dict[object, tuple[int, int]] = {}  # key -> (thread, count)
        self.queue: dict[object, list[int]] = {key: [] for key in KEYS}
        self.blocked: dict[int, Call] = {}  # thread -> its pending acquire
        self.deadlocks = 0

    def teardown(self) -> None:
        try:
            while self.owner and not self.broken:  # let every queued thread through
                thread = next(owner for owner, _ in self.owner.values() if self._idle(owner))
                self.release_all(thread)
        finally:
            self._stop_workers(self.locks)

    def _waits_for(self, key: object, ahead_of: int | None) -> set[int]:
        """Threads a request on ``key`` waits for: the owner, and everyone queued ahead."""
        queued = self.queue[key]
        ahead = queued if ahead_of is None else queued[:queued.index(ahead_of)]
        owner = {self.owner[key][0]} if key in self.owner else set()
        return owner | set(ahead)

    def _would_deadlock(self, thread: int, key: object) -> bool:
        """Whether ``thread`` waiting for ``key`` closes a cycle of waiting threads."""
        waiting_on = {t: k for k, queued in self.queue.items() for t in queued}
        seen: set[int] = set()
        frontier = self._waits_for(key, None)
        while frontier:
            other = frontier.pop()
            if other == thread:
                return True
            if other in seen or other not in waiting_on:
                continue
            seen.add(other)
            frontier |= self._waits_for(waiting_on[other], other)
        return False

    def _expect_deadlock(self, thread: int, key: object, **how: Any) -> None:
        with pytest.raises(DeadlockError) as caught:
            self._run(thread, lambda: self.locks.acquire(key, **how))
        assert caught.value.cycle[0] == (self.workers[thread].thread.ident, key)
        self.deadlocks += 1

    def _hand_off(self, key: object) -> None:
        """The model of release: the key is free; the head of its queue gets it."""
        del self.owner[key]
        if self.queue[key]:
            head = self.queue[key].pop(0)
            ident = self.workers[head].thread.ident
            if self.fair:  # strict FIFO: the head owns the key before release returns
                assert self.locks.owner(key) == ident, "not handed to the head"
            else:  # the head may have been woken to take it: nobody else competes here
                wait_until(lambda: self.locks.owner(key) is not None, "taken", patience=STEP)
                assert self.locks.owner(key) == ident, "taken by another than the head"
            assert self.blocked.pop(head).result(STEP) is True
            self._take(head, key)

    def _free_for(self, thread: int, key: object) -> bool:
        return key not in self.owner or self.owner[key][0] == thread

    def _take(self, thread: int, key: object) -> None:
        count = self.owner[key][1] if key in self.owner else 0
        self.owner[key] = (thread, count + 1)

    def _release(self, thread: int, key: object) -> None:
        self._run(thread, lambda: self.locks.release(key))
        owner, count = self.owner[key]
        if count > 1:
            self.owner[key] = (owner, count - 1)
        else:
            self._hand_off(key)

    def _idle(self, thread: int) -> bool:
        return thread not in self.blocked

    @rule(thread=st.integers(0, THREADS - 1), key=st.sampled_from(KEYS))
    @step
    def acquire(self, thread: int, key: object) -> None:
        if not self._idle(thread):
            return
        if not self._free_for(thread, key) and self._would_deadlock(thread, key):
            self._expect_deadlock(thread, key)
            return
        call = self.workers[thread].submit(lambda: self.locks.acquire(key))
        if self._free_for(thread, key):
            assert call.result(STEP) is True
            self._take(thread, key)
        else:
            self.blocked[thread] = call
            self.queue[key].append(thread)
            self._queued(lambda: self.locks.stats().waiting, len(self.blocked))

    @rule(thread=st.integers(0, THREADS - 1), key=st.sampled_from(KEYS),
          how=st.sampled_from([{"blocking": False}, {"timeout": 0}, {"timeout": 0.005}]))
    @step
    def try_acquire(self, thread: int, key: object, how: dict[str, Any]) -> None:
        if not self._idle(thread):
            return
        expected = self._free_for(thread, key)
        if not expected and how.get("timeout", 0) > 0 and self._would_deadlock(thread, key):
            self._expect_deadlock(thread, key, **how)
            return
        may_queue = how.get("timeout", 0) > 0
        assert self._run(thread, lambda: self.locks.acquire(key, **how), may_queue) is expected
        if expected:
            self._take(thread, key)

    @rule(thread=st.integers(0, THREADS - 1), key=st.sampled_from(KEYS))
    @step
    def release(self, thread: int, key: object) -> None:
        if not self._idle(thread):
            return
        if key in self.owner and self.owner[key][0] == thread:
            self._release(thread, key)
        else:
            with pytest.raises(NotOwnedError):
                self._run(thread, lambda: self.locks.release(key))

    @rule(thread=st.integers(0, THREADS - 1))
    @step
    def release_all(self, thread: int) -> None:
        if not self._idle(thread):
            return
        mine = [key for key, (owner, _) in self.owner.items() if owner == thread]
        assert self._run(thread, self.locks.release_all) == len(mine)
        for key in mine:
            self._hand_off(key)

    @invariant()
    @step
    def matches_the_model(self) -> None:
        for key in KEYS:
            expected = self.owner.get(key)
            ident = None if expected is None else self.workers[expected[0]].thread.ident
            assert self.locks.owner(key) == ident
            assert (key in self.locks) is (expected is not None)
        stats = self.locks.stats()
        assert stats.held == len(self.owner) == len(self.locks)
        assert stats.waiting == len(self.blocked)
        assert stats.deadlocks == self.deadlocks

    @invariant()
    @step
    def counts_match_the_model(self) -> None:
        for key, (thread, count) in self.owner.items():
            if self._idle(thread):
                counted = self._run(thread, lambda key=key: self.locks.recursion_count(key))
                assert counted == count


def _machine(engine: Any, fair: bool) -> Any:
    machine = type(f"Model_{engine.__name__}_{fair}", (LockModel,), {"engine": engine, "fair": fair})
    case = machine.TestCase
    case.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    return case


#: Hypothesis stops shrinking after 5 minutes of it; the test must outlive that so a failure
#: ends with its counterexample, not with pytest-timeout's 300 s.
SHRINK_ROOM = pytest.mark.timeout(900)


@SHRINK_ROOM
@pytest.mark.parametrize("fair", [True, False], ids=["fair", "unfair"])
def test_engine_matches_model(impl, fair) -> None:
    _machine(impl, fair)("runTest").runTest()
    assert threading.active_count() < 50  # workers were stopped


class RWModel(Machine):
    """The same for RWLockManager: read/write/upgrade/downgrade, FIFO batches, deadlocks."""

    engine: Any = None

    def __init__(self) -> None:
        super().__init__()
        self.rw = self.engine.RWLockManager()
        self._stats = self.rw.stats  # type: ignore[method-assign]
        self.workers = [Worker(f"rw-model-{i}") for i in range(THREADS)]
        self.writer: dict[object, tuple[int, int]] = {}  # key -> (thread, write count)
        self.readers: dict[object, dict[int, int]] = {key: {} for key in KEYS}
        self.queue: dict[object, list[tuple[int, int]]] = {key: [] for key in KEYS}  # (thread, mode)
        self.blocked: dict[int, tuple[object, Call]] = {}
        self.deadlocks = 0

    def teardown(self) -> None:
        try:
            while not self.broken and (self.blocked or self.writer or any(self.readers.values())):
                thread = next(t for t in range(THREADS) if t not in self.blocked and self._holds(t))
                self.release_all(thread)
        finally:
            self._stop_workers(self.rw)

    def _holds(self, thread: int) -> bool:
        return any(t == thread for t, _ in self.writer.values()) or any(
            thread in readers for readers in self.readers.values())

    def _conflicts(self, key: object, thread: int, mode: int, ahead: list[tuple[int, int]]) -> set[int]:
        """Threads a ``mode`` request of ``thread`` on ``key`` waits for (hard and soft edges)."""
        waits = {self.writer[key][0]} if key in self.writer else set()
        if mode == WRITE:
            waits |= set(self.readers[key])
        waits |= {t for t, m in ahead if mode == WRITE or m == WRITE}
        return waits - {thread}

    def _would_deadlock(self, thread: int, key: object, mode: int, upgrade: bool) -> bool:
        frontier = self._conflicts(key, thread, mode, [] if upgrade else self.queue[key])
        seen: set[int] = set()
        while frontier:
            other = frontier.pop()
            if other == thread:
                return True
            if other in seen or other not in self.blocked:
                continue
            seen.add(other)
            waiting_key = self.blocked[other][0]
            queued = self.queue[waiting_key]
            position = next(i for i, (t, _) in enumerate(queued) if t == other)
            other_mode = queued[position][1]
            frontier |= self._conflicts(waiting_key, other, other_mode, queued[:position])
        return False

    def _grant_from_queue(self, key: object) -> None:
        """The model of a release: grant what the head of the queue allows, check the engine
        did (at once: hand-off is strict FIFO), then that the granted calls return."""
        queued = self.queue[key]
        granted = []
        while queued and key not in self.writer:
            thread, mode = queued[0]
            if mode == WRITE and set(self.readers[key]) - {thread}:
                break
            queued.pop(0)
            granted.append(self.blocked.pop(thread)[1])
            if mode == READ:
                self.readers[key][thread] = 1
            else:
                self.writer[key] = (thread, 1)
        if granted:
            assert self.rw.write_locked(key) is (key in self.writer)
            assert self.rw.readers(key) == len(self.readers[key])
        for call in granted:
            assert call.result(STEP) is True

    def _request(self, thread: int, key: object, mode: int, how: dict[str, Any]) -> None:
        readers, writer = self.readers[key], self.writer.get(key)
        acquire = self.rw.acquire_read if mode == READ else self.rw.acquire_write
        upgrade = mode == WRITE and thread in readers
        if mode == READ:
            immediate = thread in readers or (writer is not None and writer[0] == thread) or (
                writer is None and not self.queue[key])
        else:
            immediate = (writer is not None and writer[0] == thread) or (writer is None and (
                (not readers and not self.queue[key]) or (upgrade and set(readers) == {thread})))
        waits = how.get("timeout", -1) != 0 and how.get("blocking", True)
        if not immediate and waits and self._would_deadlock(thread, key, mode, upgrade):
            with pytest.raises(DeadlockError):
                self._run(thread, lambda: acquire(key, **how))
            self.deadlocks += 1
            return
        if immediate:
            assert self._run(thread, lambda: acquire(key, **how)) is True
            if mode == READ:
                readers[thread] = readers.get(thread, 0) + 1
            else:
                self.writer[key] = (thread, (writer[1] if writer else 0) + 1)
        elif not waits:
            assert self._run(thread, lambda: acquire(key, **how)) is False
        else:
            call = self.workers[thread].submit(lambda: acquire(key))
            self.blocked[thread] = (key, call)
            if upgrade:
                self.queue[key].insert(0, (thread, mode))
            else:
                self.queue[key].append((thread, mode))
            self._queued(lambda: self.rw.stats().waiting, len(self.blocked))

    @rule(thread=st.integers(0, THREADS - 1), key=st.sampled_from(KEYS),
          mode=st.sampled_from([READ, WRITE]),
          how=st.sampled_from([{}, {"blocking": False}, {"timeout": 0}]))
    @step
    def acquire(self, thread: int, key: object, mode: int, how: dict[str, Any]) -> None:
        if thread not in self.blocked:
            self._request(thread, key, mode, how)

    @rule(thread=st.integers(0, THREADS - 1), key=st.sampled_from(KEYS),
          mode=st.sampled_from([READ, WRITE]))
    @step
    def release(self, thread: int, key: object, mode: int) -> None:
        if thread in self.blocked:
            return
        if mode == READ:
            held = self.readers[key].get(thread, 0)
            if not held:
                with pytest.raises(NotOwnedError):
                    self._run(thread, lambda: self.rw.release_read(key))
                return
            self._run(thread, lambda: self.rw.release_read(key))
            if held == 1:
                del self.readers[key][thread]
            else:
                self.readers[key][thread] = held - 1
        else:
            writer = self.writer.get(key)
            if writer is None or writer[0] != thread:
                with pytest.raises(NotOwnedError):
                    self._run(thread, lambda: self.rw.release_write(key))
                return
            self._run(thread, lambda: self.rw.release_write(key))
            if writer[1] == 1:
                del self.writer[key]
            else:
                self.writer[key] = (thread, writer[1] - 1)
        self._grant_from_queue(key)

    @rule(thread=st.integers(0, THREADS - 1))
    @step
    def release_all(self, thread: int) -> None:
        if thread in self.blocked:
            return
        keys = [key for key in KEYS if thread in self.readers[key] or self.writer.get(key, (None,))[0] == thread]
        assert self._run(thread, self.rw.release_all) == len(keys)
        for key in keys:
            self.readers[key].pop(thread, None)
            if self.writer.get(key, (None,))[0] == thread:
                del self.writer[key]
            self._grant_from_queue(key)

    @invariant()
    @step
    def matches_the_model(self) -> None:
        for key in KEYS:
            assert self.rw.write_locked(key) is (key in self.writer)
            assert self.rw.readers(key) == len(self.readers[key])
        stats = self.rw.stats()
        held = sum(1 for key in KEYS if key in self.writer or self.readers[key])
        assert (stats.held, stats.waiting, stats.deadlocks) == (held, len(self.blocked), self.deadlocks)


@SHRINK_ROOM
def test_rw_engine_matches_model(impl) -> None:
    machine = type(f"RWModel_{impl.__name__}", (RWModel,), {"engine": impl})
    case = machine.TestCase
    case.settings = settings(max_examples=100, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
    case("runTest").runTest()
