"""Single-thread behaviour of LockManager and KeyLock, on both engines."""

from __future__ import annotations

import asyncio
import gc
import math
import pickle
import re
import subprocess
import sys
import threading
import weakref

import pytest

import lockmgr
from conftest import PATIENCE, wait_until
from lockmgr import (
    DeadlockError,
    FlightAbortedError,
    LockError,
    LockStats,
    LockTimeout,
    NotOwnedError,
    Singleflight,
)


def test_public_names() -> None:
    assert set(lockmgr.__all__) >= {
        "LockManager", "KeyLock", "LockStats", "LockError", "LockTimeout",
        "NotOwnedError", "DeadlockError", "implementation", "Singleflight",
        "AsyncSingleflight", "FlightAbortedError", "SemaphoreManager",
        "KeySemaphore", "AsyncSemaphoreManager",
    }
    assert issubclass(LockTimeout, TimeoutError) and issubclass(LockTimeout, LockError)
    assert issubclass(NotOwnedError, RuntimeError) and issubclass(NotOwnedError, LockError)
    assert issubclass(DeadlockError, RuntimeError) and issubclass(DeadlockError, LockError)
    assert LockTimeout.__module__ == "lockmgr"
    assert issubclass(FlightAbortedError, RuntimeError) and issubclass(FlightAbortedError, LockError)
    assert Singleflight.__module__ == "lockmgr"


@pytest.mark.parametrize(("env", "expected"), [
    pytest.param("", "cython", marks=pytest.mark.compiled), ("1", "python"), ("yes", "python"),
])
def test_selector_honours_no_extensions(env: str, expected: str) -> None:
    code = "import lockmgr; print(lockmgr.implementation, lockmgr.LockManager.__module__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={"LOCKMGR_NO_EXTENSIONS": env, "PATH": ""},
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()
    assert out == [expected, {"cython": "lockmgr._core", "python": "lockmgr._pure"}[expected]]


def test_acquire_release_roundtrip(locks) -> None:
    assert locks.acquire("k") is True
    assert locks.locked("k") and locks.owned("k") and "k" in locks and len(locks) == 1
    assert locks.owner("k") == threading.get_ident()
    assert locks.recursion_count("k") == 1
    assert locks.release("k") is None
    assert not locks.locked("k") and not locks.owned("k") and "k" not in locks
    assert locks.owner("k") is None and locks.recursion_count("k") == 0 and len(locks) == 0


def test_reentrant_with_count(locks) -> None:
    for level in range(1, 4):
        assert locks.acquire("k")
        assert locks.recursion_count("k") == level
    for level in range(2, -1, -1):
        locks.release("k")
        assert locks.recursion_count("k") == level
    assert not locks.locked("k")
    with pytest.raises(NotOwnedError):
        locks.release("k")


def test_try_lock_and_zero_timeout_on_free_and_own_key(locks) -> None:
    assert locks.acquire("k", blocking=False)
    assert locks.acquire("k", timeout=0)
    assert locks.acquire("k", False)
    assert locks.recursion_count("k") == 3
    assert locks.release_all() == 1


def test_keys_are_independent(locks) -> None:
    keys = ["a", 1, 2.5, ("t", 1), b"b", frozenset({1}), None]
    for key in keys:
        locks.acquire(key)
    assert len(locks) == len(keys) and all(key in locks for key in keys)
    for key in keys:
        locks.release(key)
    assert len(locks) == 0


def test_equal_keys_are_one_key(locks) -> None:
    locks.acquire(1)
    assert locks.owned(1.0) and locks.owned(True)
    locks.release(1.0)
    assert not locks.locked(1)
    first = "".join(["us", "er"])
    locks.acquire(first)
    locks.release("user")  # a distinct but equal str object
    assert len(locks) == 0


def test_release_not_held_raises_and_changes_nothing(locks, workers) -> None:
    with pytest.raises(NotOwnedError, match="'nobody'"):
        locks.release("nobody")
    other = workers("holder")
    other.run(lambda: locks.acquire("k"))
    with pytest.raises(NotOwnedError) as caught:
        locks.release("k")
    assert isinstance(caught.value, RuntimeError)
    assert locks.owner("k") == other.thread.ident and locks.recursion_count("k") == 0
    other.run(lambda: locks.release("k"))
    assert len(locks) == 0


def test_not_owned_message_shortens_long_keys(locks) -> None:
    with pytest.raises(NotOwnedError) as caught:
        locks.release("x" * 10_000)
    assert len(str(caught.value)) < 200


def test_release_all_counts_keys_not_levels(locks, workers) -> None:
    assert locks.release_all() == 0
    locks.acquire("a")
    locks.acquire("a")
    locks.acquire("b")
    other = workers("other")
    other.run(lambda: locks.acquire("c"))
    assert locks.release_all() == 2
    assert not locks.locked("a") and not locks.locked("b") and locks.locked("c")
    assert other.run(locks.release_all) == 1
    assert len(locks) == 0


def test_release_all_only_touches_this_manager(impl) -> None:
    first, second = impl.LockManager(), impl.LockManager()
    first.acquire("k")
    second.acquire("k")
    assert first.release_all() == 1
    assert second.owned("k")
    second.release("k")


def test_stats_counts(locks, workers) -> None:
    assert locks.stats() == LockStats(0, 0, 0, 0, 0, 0)
    locks.acquire("a")
    locks.acquire("a")
    locks.acquire("b")
    other = workers("other")
    assert other.run(lambda: locks.acquire("a", timeout=0)) is False
    assert other.run(lambda: locks.acquire("a", timeout=0.01)) is False
    stats = locks.stats()
    assert (stats.held, stats.waiting, stats.acquisitions, stats.timeouts) == (2, 0, 3, 2)
    assert stats.contended == 0 and stats.deadlocks == 0
    with pytest.raises(AttributeError):
        stats.held = 5  # type: ignore[misc]
    locks.release_all()


# -- argument checking mirrors threading.Lock.acquire -----------------------------------------

BAD_ACQUIRE_ARGS = [
    {"blocking": False, "timeout": 1},
    {"blocking": False, "timeout": 0},
    {"timeout": -2},
    {"timeout": -0.5},
    {"timeout": math.nan},
    {"timeout": threading.TIMEOUT_MAX * 2},
    {"timeout": 2**80},
    {"timeout": "1"},
    {"timeout": None},
]


@pytest.mark.parametrize("kwargs", BAD_ACQUIRE_ARGS, ids=repr)
def test_acquire_rejects_what_threading_rejects(locks, kwargs) -> None:
    with pytest.raises(Exception) as expected:
        threading.Lock().acquire(**kwargs)
    with pytest.raises(expected.type):
        locks.acquire("k", **kwargs)
    with pytest.raises(expected.type):
        locks["k"].acquire(**kwargs)
    assert len(locks) == 0 and locks.stats().acquisitions == 0


@pytest.mark.parametrize("kwargs", [{"timeout": -1}, {"timeout": -1.0}, {"timeout": 0.0},
                                    {"timeout": 5}, {"blocking": 1}, {"blocking": False, "timeout": -1}])
def test_acquire_accepts_what_threading_accepts(locks, kwargs) -> None:
    assert locks.acquire("k", **kwargs) is True
    locks.release("k")


@pytest.mark.parametrize(("timeout", "error"), [(-2, ValueError), (-0.1, ValueError),
                                                (math.nan, ValueError), ("1", TypeError),
                                                (threading.TIMEOUT_MAX * 2, OverflowError)])
def test_hold_rejects_bad_timeouts(locks, timeout, error) -> None:
    with pytest.raises(error):
        locks.hold("k", timeout)
    assert len(locks) == 0


def test_hold_waits_forever_tries_once_or_times_out(locks, workers) -> None:
    for timeout in (None, -1, 0, 0.5):
        with locks.hold("k", timeout=timeout) as entered:
            assert entered is True and locks.owned("k")
        assert not locks.locked("k")
    other = workers("holder")
    other.run(lambda: locks.acquire("k"))
    with pytest.raises(LockTimeout, match="'k'"):
        with locks.hold("k", timeout=0):
            pytest.fail("entered the block without the key")
    with pytest.raises(TimeoutError):
        with locks.hold("k", timeout=0.02):
            pytest.fail("entered the block without the key")
    assert locks.owner("k") == other.thread.ident and locks.stats().waiting == 0
    other.run(lambda: locks.release("k"))


def test_hold_releases_on_exception(locks) -> None:
    with pytest.raises(KeyError):
        with locks.hold("k"):
            raise KeyError("boom")
    assert len(locks) == 0


# -- bad keys ----------------------------------------------------------------------------------


class BadHash:
    def __hash__(self) -> int:
        raise ArithmeticError("no hash")


class BadEq:
    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        if self.fail or getattr(other, "fail", False):
            raise ArithmeticError("no eq")
        return self is other


def test_unhashable_key_is_a_type_error_and_changes_nothing(locks) -> None:
    for call in (locks.acquire, locks.release, locks.locked, locks.owned, locks.hold,
                 locks.__getitem__, locks.owner, locks.recursion_count):
        with pytest.raises(TypeError):
            call([])
    assert locks.stats() == LockStats(0, 0, 0, 0, 0, 0)


def test_raising_hash_and_eq_propagate_with_table_intact(locks) -> None:
    with pytest.raises(ArithmeticError):
        locks.acquire(BadHash())
    good = BadEq(fail=False)
    locks.acquire(good)
    locks.acquire(7)  # same hash as ``good``: one bucket
    with pytest.raises(ArithmeticError):
        locks.acquire(BadEq(fail=True))
    with pytest.raises(ArithmeticError):
        locks.release(BadEq(fail=True))
    assert locks.owned(good) and locks.owned(7) and len(locks) == 2
    assert locks.stats().acquisitions == 2
    locks.release(good)
    locks.release(7)
    assert len(locks) == 0


# -- the per-key view ---------------------------------------------------------------------------


def test_key_lock_behaves_like_rlock(locks) -> None:
    view = locks["user:42"]
    assert isinstance(view, type(locks["x"]))
    assert view.key == "user:42" and view.manager is locks
    assert view.acquire() is True and view.acquire(False) is True and view.acquire(timeout=0.1)
    assert view.locked() and view._is_owned() and view._recursion_count() == 3
    assert locks.recursion_count("user:42") == 3
    view.release()
    view.release()
    view.release()
    assert not view.locked() and not view._is_owned()
    with pytest.raises(RuntimeError):
        view.release()
    with view as entered:
        assert entered is True and view._recursion_count() == 1
    assert not view.locked()


def test_key_lock_repr_matches_rlock_style(locks) -> None:
    view = locks["user:42"]
    assert re.fullmatch(r"<unlocked lockmgr\.KeyLock object key='user:42' owner=0 count=0 "
                        r"at 0x[0-9a-f]+>", repr(view))
    with view, view:
        assert re.fullmatch(rf"<locked lockmgr\.KeyLock object key='user:42' "
                            rf"owner={threading.get_ident()} count=2 at 0x[0-9a-f]+>", repr(view))
    assert "x" * 100 not in repr(locks["x" * 1000])


def test_views_of_one_key_are_one_lock(locks) -> None:
    first, second = locks["k"], locks["k"]
    assert first == second and hash(first) == hash(second)
    assert first != locks["other"] and first != type(locks)()["k"]
    first.acquire()
    assert second._is_owned() and second._recursion_count() == 1
    second.release()
    assert not first.locked()


def test_views_are_weakrefable_and_not_kept_by_manager(locks) -> None:
    view = locks["k"]
    ref = weakref.ref(view)
    del view
    gc.collect()
    assert ref() is None


def test_view_keeps_manager_alive(impl) -> None:
    manager = impl.LockManager()
    ref = weakref.ref(manager)
    view = manager["k"]
    del manager
    gc.collect()
    assert ref() is not None
    with view:
        assert view.locked()
    del view
    gc.collect()
    assert ref() is None


def test_condition_on_a_key_preserves_recursion_level(locks, workers) -> None:
    view = locks["k"]
    condition = threading.Condition(view)
    ready: list[int] = []
    notifier = workers("notifier")
    with condition:
        with condition:  # level 2 across wait()
            notifier.submit(lambda: _notify_when_free(locks, condition, ready))
            assert condition.wait_for(lambda: ready, timeout=20)
            assert view._recursion_count() == 2 and locks.recursion_count("k") == 2
        assert view._recursion_count() == 1
    assert not locks.locked("k")


def _notify_when_free(locks, condition: threading.Condition, ready: list[int]) -> None:
    with condition:  # only possible while the waiter has saved and released its levels
        assert locks.recursion_count("k") == 1
        ready.append(1)
        condition.notify()


def test_release_save_restore_roundtrip(locks) -> None:
    locks.acquire("k")
    locks.acquire("k")
    state = locks["k"]._release_save()
    assert state == (2, threading.get_ident()) and not locks.locked("k")
    with pytest.raises(ValueError):
        locks["k"]._acquire_restore((0, 0))
    assert not locks.locked("k")
    locks["k"]._acquire_restore(state)
    assert locks.recursion_count("k") == 2
    with pytest.raises(NotOwnedError):
        locks["other"]._release_save()
    locks.release_all()


# -- the manager object --------------------------------------------------------------------------


def test_generic_subscription_and_fair_option(impl) -> None:
    manager = impl.LockManager[str](fair=False)
    assert manager.fair is False and impl.LockManager().fair is True
    assert impl.KeyLock[int] is not None
    with pytest.raises(TypeError):
        impl.LockManager(True)  # options are keyword-only


def test_manager_repr(locks) -> None:
    locks.acquire("k")
    assert re.fullmatch(r"<lockmgr\.LockManager fair=True held=1 waiting=0 at 0x[0-9a-f]+>",
                        repr(locks))
    locks.release("k")


def test_managers_and_views_do_not_pickle(locks) -> None:
    with pytest.raises(TypeError):
        pickle.dumps(locks)
    with pytest.raises(TypeError):
        pickle.dumps(locks["k"])


def test_dropping_a_manager_with_keys_held_is_safe(impl) -> None:
    manager = impl.LockManager()
    for i in range(100):
        manager.acquire(f"key-{i}")
    ref = weakref.ref(manager)
    del manager
    gc.collect()
    assert ref() is None
    fresh = impl.LockManager()  # the thread's token is still sound
    fresh.acquire("key-1")
    assert fresh.release_all() == 1


def test_synchronized_locks_per_argument(locks) -> None:
    seen: list[tuple[str, bool, int]] = []

    @locks.synchronized(lambda natural_id, **_: natural_id)
    def create_if_missing(natural_id: str, *, extra: int = 0) -> str:
        """Docstring kept."""
        seen.append((natural_id, locks.owned(natural_id), locks.recursion_count(natural_id)))
        return natural_id.upper()

    assert create_if_missing("abc", extra=1) == "ABC"
    assert seen == [("abc", True, 1)] and not locks.locked("abc")
    assert create_if_missing.__doc__ == "Docstring kept." and create_if_missing.__name__ == "create_if_missing"


def test_synchronized_passes_keyword_arguments_to_key_func(locks) -> None:
    seen: list[bool] = []

    @locks.synchronized(lambda account, *, region: (region, account))
    def transfer(account: int, *, region: str) -> str:
        seen.append(locks.owned((region, account)) and not locks.owned(account))
        return f"{region}/{account}"

    assert transfer(7, region="eu") == "eu/7"
    assert transfer(account=8, region="us") == "us/8"
    assert seen == [True, True] and len(locks) == 0


def test_synchronized_rejects_bad_use(locks) -> None:
    with pytest.raises(TypeError, match=r"lambda \*args, \*\*kwargs: KEY"):
        locks.synchronized("not callable")

    async def coroutine(x: int) -> None: ...

    with pytest.raises(TypeError, match="coroutine"):
        locks.synchronized(lambda x: x)(coroutine)


def test_synchronized_written_bare_refuses_the_call_and_says_how_to_write_it(locks) -> None:
    ran: list[object] = []

    @locks.synchronized  # forgot the key function: the decorator replaced the function
    def create(natural_id: str) -> None:
        ran.append(natural_id)

    for call in (lambda: create("abc"), lambda: create(natural_id="abc"), lambda: create()):
        with pytest.raises(TypeError, match=r"'.*create' decorated with a bare "
                                            r"@synchronized\? Write @synchronized\(lambda"):
            call()
    assert ran == [] and len(locks) == 0 and locks.stats().acquisitions == 0


def test_synchronized_written_bare_over_a_coroutine_function_is_refused_at_once(locks) -> None:
    with pytest.raises(TypeError, match=r"'.*create', a coroutine function, as its key "
                                        r"function: a bare @synchronized over it\?"):
        @locks.synchronized
        async def create(natural_id: str) -> None: ...


def test_synchronized_releases_when_the_call_raises(locks) -> None:
    @locks.synchronized(lambda key: key)
    def fail(key: str) -> None:
        raise LookupError(key)

    with pytest.raises(LookupError):
        fail("k")
    assert len(locks) == 0


def test_refused_releases_name_the_caller_and_the_mode(impl) -> None:
    """Both engines word them alike: the thread by name and ident, the task by name, and an
    RWLockManager's mode (a read-held key is not "not held")."""
    me = f"the calling thread {threading.current_thread().name!r} (ident {threading.get_ident()})"
    locks = impl.LockManager()
    with pytest.raises(NotOwnedError, match=f"^key 'k' is not held by {re.escape(me)}$"):
        locks.release("k")
    rw = impl.RWLockManager()
    rw.acquire_read("k")
    with pytest.raises(NotOwnedError, match=f"^key 'k' is not held for writing by {re.escape(me)}$"):
        rw.release_write("k")
    with pytest.raises(NotOwnedError, match="^key 'k' is not held for writing by the calling thread"):
        rw.release_many(writes=["k"])
    rw.release_read("k")

    async def task_releases() -> None:
        with pytest.raises(NotOwnedError, match="^key 'k' is not held by the calling task 'worker'$"):
            locks.aio.release("k")
        with pytest.raises(NotOwnedError, match="^key 'k' is not held by the calling task 'worker'$"):
            locks.aio["k"].release()
        await rw.aio.acquire_write("w")
        with pytest.raises(NotOwnedError,
                           match="^key 'w' is not held for reading by the calling task 'worker'$"):
            rw.aio.release_read("w")
        with pytest.raises(NotOwnedError,
                           match="^key 'x' is not held for reading by the calling task 'worker'$"):
            rw.aio.release_many(reads=["x"])
        rw.aio.release_write("w")

    async def main() -> None:
        await asyncio.create_task(task_releases(), name="worker")

    asyncio.run(main())
    assert len(locks) == 0 and len(rw) == 0


def test_deadlock_error_names_threads_by_name(impl) -> None:
    locks = impl.LockManager()
    holds_b, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        with locks["b"]:
            holds_b.set()
            try:
                locks.acquire("a")
                locks.release("a")
            except BaseException as error:  # pragma: no cover - the test fails on it below
                errors.append(error)
            done.wait(PATIENCE)

    with locks["a"]:
        thread = threading.Thread(target=other, name="other-worker")
        thread.start()
        try:
            assert holds_b.wait(PATIENCE)
            wait_until(lambda: locks.stats().waiting == 1, "the other thread waits for a")
            with pytest.raises(DeadlockError) as caught:
                locks.acquire("b")
        finally:
            done.set()
    thread.join(PATIENCE)
    text = str(caught.value)
    assert f"thread 'MainThread' (ident {threading.get_ident()}) waits for key 'b'" in text
    assert f"thread 'other-worker' (ident {thread.ident}) waits for key 'a'" in text
    assert errors == []
