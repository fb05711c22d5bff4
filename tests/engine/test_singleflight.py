"""Singleflight for threads: callers asking for an equal key while a call runs share it.

Every test runs on both engines (``impl``): the flights wait in that engine's lock table.
"""

from __future__ import annotations

import functools
import gc
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from conftest import PATIENCE, wait_until

from lockmgr import DeadlockError, FlightAbortedError, LockManager, LockTimeout, Singleflight
from lockmgr._singleflight import singleflight_on


@pytest.fixture
def flight(impl: ModuleType) -> Singleflight[Any, Any]:
    return singleflight_on(impl)()


def waiting(flight: Singleflight[Any, Any]) -> int:
    """How many callers wait for a call (their reads queue in the flights' lock table)."""
    return flight._table.locks.stats().waiting


def start(target: Callable[[], object], results: list[object]) -> threading.Thread:
    """A thread appending ``target()``'s result, or its exception, to ``results``."""
    def run() -> None:
        try:
            results.append(target())
        except BaseException as error:  # handed to the test
            results.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def join(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(PATIENCE)
        assert not thread.is_alive(), "a caller did not return"


class Gate:
    """A call that counts its runs and returns once the test opens it."""

    def __init__(self, result: object = "value") -> None:
        self.runs = 0
        self.running = threading.Event()
        self.open = threading.Event()
        self.result = result

    def __call__(self, *args: object) -> object:
        self.runs += 1
        self.running.set()
        assert self.open.wait(PATIENCE)
        return (self.result, *args) if args else self.result


def test_concurrent_callers_share_one_call_and_its_result(flight: Singleflight[str, Any]) -> None:
    gate = Gate()
    results: list[object] = []
    callers = 60
    ready = threading.Barrier(callers)

    def ask() -> object:
        ready.wait(PATIENCE)  # all of them ask at once
        return flight.call("k", gate, 1, 2)

    threads = [start(ask, results) for _ in range(callers)]
    assert gate.running.wait(PATIENCE)
    wait_until(lambda: waiting(flight) == callers - 1, "every other caller waits for the call")
    gate.open.set()
    join(*threads)
    assert gate.runs == 1
    assert results == [("value", 1, 2)] * callers


def test_different_keys_run_their_own_calls(flight: Singleflight[str, Any]) -> None:
    assert flight.call("a", lambda: "A") == "A"
    assert flight.call("b", str.upper, "b") == "B"


def test_a_finished_call_leaves_nothing_and_is_not_cached(
        flight: Singleflight[object, Any]) -> None:
    class Key:
        pass

    class Result:
        pass

    key, runs = Key(), []

    def make() -> Result:
        runs.append(1)
        return Result()

    result = flight.call(key, make)
    assert flight.call(key, make) is not result  # a new call: results are not cached
    assert len(runs) == 2
    assert len(flight) == 0 and key not in flight
    assert len(flight._table.locks) == 0  # the engine's table has no entry left
    key_ref, result_ref = weakref.ref(key), weakref.ref(result)
    del key, result
    gc.collect()
    assert key_ref() is None and result_ref() is None


def test_a_running_call_is_in_the_group_until_it_ends(flight: Singleflight[str, Any]) -> None:
    gate, results = Gate(), []
    thread = start(lambda: flight.call("k", gate), results)
    assert gate.running.wait(PATIENCE)
    assert "k" in flight and len(flight) == 1 and "other" not in flight
    gate.open.set()
    join(thread)
    assert len(flight) == 0 and results == ["value"]


def test_an_exception_is_shared_as_the_same_object_with_the_call_s_traceback(
        flight: Singleflight[str, Any]) -> None:
    gate = Gate()
    failure = ValueError("backend down")

    def fail() -> None:
        gate()
        raise failure

    results: list[object] = []
    threads = [start(lambda: flight.call("k", fail), results) for _ in range(5)]
    assert gate.running.wait(PATIENCE)
    wait_until(lambda: waiting(flight) == 4, "the others wait for the call")
    gate.open.set()
    join(*threads)
    assert results == [failure] * 5 and all(error is failure for error in results)
    frames = [frame.name for frame in traceback.extract_tb(failure.__traceback__)]
    assert "fail" in frames  # where the call raised it
    assert len(flight) == 0


def test_a_waiter_s_timeout_abandons_its_wait_only(flight: Singleflight[str, Any]) -> None:
    gate, results = Gate(), []
    runner = start(lambda: flight.call("k", gate), results)
    assert gate.running.wait(PATIENCE)
    other = start(lambda: flight.call("k", gate, timeout=PATIENCE), results)
    wait_until(lambda: waiting(flight) == 1, "a caller waits for the call")
    with pytest.raises(LockTimeout, match="^the call for key 'k' did not finish within 0.05 s$"):
        flight.call("k", gate, timeout=0.05)
    with pytest.raises(LockTimeout):
        flight.call("k", gate, timeout=0)
    assert "k" in flight and waiting(flight) == 1  # the call and the other caller go on
    gate.open.set()
    join(runner, other)
    assert results == ["value", "value"] and gate.runs == 1


@pytest.mark.parametrize("ending", [KeyboardInterrupt, SystemExit])
def test_a_base_exception_is_raised_where_the_call_ran_and_the_others_get_a_clear_error(
        flight: Singleflight[str, Any], ending: type[BaseException]) -> None:
    gate = Gate()

    def interrupted() -> None:
        gate()
        raise ending

    ran: list[object] = []
    waited: list[object] = []  # (each its own: the two end at once)
    runner = start(lambda: flight.call("k", interrupted), ran)
    assert gate.running.wait(PATIENCE)
    waiter = start(lambda: flight.call("k", interrupted), waited)
    wait_until(lambda: waiting(flight) == 1, "a caller waits for the call")
    gate.open.set()
    join(runner, waiter)
    [interrupt], [aborted] = ran, waited
    assert type(interrupt) is ending
    assert isinstance(aborted, FlightAbortedError) and isinstance(aborted, RuntimeError)
    assert aborted.__cause__ is interrupt
    assert f"the call for key 'k' ended with {ending.__name__}" in str(aborted)
    assert len(flight) == 0
    assert flight.call("k", lambda: "again") == "again"  # the next caller starts anew


def test_forget_lets_the_next_caller_start_a_new_call(flight: Singleflight[str, Any]) -> None:
    first, second = Gate("first"), Gate("second")
    results: list[object] = []
    runner = start(lambda: flight.call("k", first), results)
    assert first.running.wait(PATIENCE)
    joined = start(lambda: flight.call("k", second), results)
    wait_until(lambda: waiting(flight) == 1, "a caller joined the first call")
    assert flight.forget("k") is True
    assert "k" not in flight and flight.forget("k") is False
    fresh = start(lambda: flight.call("k", second), results)
    assert second.running.wait(PATIENCE)  # a new call while the first runs
    first.open.set()
    join(runner, joined)
    assert sorted(results) == ["first", "first"]  # the first call's callers got its result
    assert "k" in flight  # forgetting the first did not retire the second
    second.open.set()
    join(fresh)
    assert results[-1] == "second" and len(flight) == 0


def test_a_call_asking_for_its_own_key_raises_deadlock_error(
        flight: Singleflight[str, Any]) -> None:
    def recurse() -> object:
        return flight.call("k", recurse)

    with pytest.raises(DeadlockError, match="the call for key 'k' is run by this caller") as caught:
        flight.call("k", recurse)
    assert caught.value.cycle == [(threading.get_ident(), "k")]
    assert len(flight) == 0 and len(flight._table.locks) == 0


def test_two_calls_waiting_for_each_other_raise_deadlock_error(
        flight: Singleflight[str, Any]) -> None:
    """The call for "a" asks for "b" while the call for "b" asks for "a": the engine sees the
    cycle of waits and refuses the wait that would close it; both calls end."""
    a_runs, b_runs = threading.Event(), threading.Event()

    def call_a() -> object:
        a_runs.set()
        assert b_runs.wait(PATIENCE)
        return flight.call("b", call_b)

    def call_b() -> object:
        b_runs.set()
        assert a_runs.wait(PATIENCE)
        return flight.call("a", call_a)

    results: list[object] = []
    threads = [start(lambda: flight.call("a", call_a), results),
               start(lambda: flight.call("b", call_b), results)]
    join(*threads)
    assert all(isinstance(error, DeadlockError) for error in results), results
    assert len(flight) == 0 and len(flight._table.locks) == 0


def test_a_cycle_through_a_lock_manager_of_the_same_engine_raises_deadlock_error(
        flight: Singleflight[str, Any], impl: ModuleType) -> None:
    """A thread holding a key waits for a call that waits for that key."""
    locks: LockManager[str] = impl.LockManager()
    holds, calling = threading.Event(), threading.Event()
    results: list[object] = []

    def takes_the_lock() -> object:
        calling.set()
        with locks["row"]:
            return "never"

    def holder() -> object:
        with locks["row"]:
            holds.set()
            assert calling.wait(PATIENCE)
            wait_until(lambda: locks.stats().waiting == 1, "the call waits for the key")
            return flight.call("k", takes_the_lock)

    runner = start(lambda: (holds.wait(PATIENCE), flight.call("k", takes_the_lock))[1], results)
    thread = start(holder, results)
    join(runner, thread)
    assert sorted(map(type, results), key=str) == sorted([DeadlockError, str], key=str), results
    assert len(flight) == 0 and len(locks) == 0


@pytest.mark.parametrize(("key", "fn", "timeout", "message"), [
    (["unhashable"], len, None, "unhashable type: 'list'"),
    ("k", "not callable", None, "the function of a flight must be callable, not str"),
    ("k", len, "soon", "cannot be interpreted"),  # as hold(timeout="soon")
])
def test_bad_input_raises_type_error_and_starts_nothing(
        flight: Singleflight[Any, Any], key: object, fn: Any, timeout: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        flight.call(key, fn, "x", timeout=timeout)
    assert len(flight) == 0 and len(flight._table.locks) == 0


def test_a_negative_timeout_other_than_minus_one_is_refused(
        flight: Singleflight[str, Any]) -> None:
    with pytest.raises(ValueError):
        flight.call("k", len, "x", timeout=-2)
    assert len(flight) == 0


def test_keyword_arguments_for_the_function_go_through_partial(
        flight: Singleflight[str, Any]) -> None:
    """``timeout`` is the caller's option, never the function's: a function taking one
    gets it through functools.partial."""
    def fetch(url: str, timeout: float = 1.0) -> tuple[str, float]:
        return url, timeout

    assert flight.call("k", functools.partial(fetch, timeout=3.0), "u", timeout=5) == ("u", 3.0)
    with pytest.raises(TypeError):
        flight.call("k", fetch, "u", retries=2)  # type: ignore[call-arg]


def test_a_decorated_function_shares_calls_by_its_key(flight: Singleflight[str, Any]) -> None:
    gate = Gate()

    @flight.shared(key=lambda url, **_: url)
    def fetch(url: str, *, tag: str = "") -> object:
        return (gate(), url, tag)

    results: list[object] = []
    runner = start(lambda: fetch("u", tag="x"), results)
    assert gate.running.wait(PATIENCE)
    waiter = start(lambda: fetch("u", tag="y"), results)
    wait_until(lambda: waiting(flight) == 1, "the second call waits for the first")
    gate.open.set()
    join(runner, waiter)
    assert results == [("value", "u", "x")] * 2 and gate.runs == 1
    assert fetch.__name__ == "fetch"
    gate.open.set()
    assert fetch("v") == ("value", "v", "") and gate.runs == 2


def test_the_decorator_refuses_a_key_that_is_not_a_function(
        flight: Singleflight[str, Any]) -> None:
    with pytest.raises(TypeError, match="key_func must be a callable"):
        flight.shared(key="url")  # type: ignore[arg-type]

    @flight.shared  # type: ignore[arg-type]
    def bare(url: str) -> str:
        return url

    with pytest.raises(TypeError, match="bare @shared"):
        bare("u")  # type: ignore[call-arg]


def test_many_threads_asking_at_once_make_exactly_one_call(
        flight: Singleflight[str, Any]) -> None:
    callers = 100  # (the benchmark asks with 1,000: here the twin with the GIL off spins)
    runs: list[int] = []
    ready = threading.Barrier(callers + 1)
    release = threading.Event()

    def backend() -> str:
        runs.append(1)
        assert release.wait(PATIENCE)
        return "payload"

    def ask() -> object:
        ready.wait(PATIENCE)
        return flight.call("hot", backend)

    results: list[object] = []
    threads = [start(ask, results) for _ in range(callers)]
    ready.wait(PATIENCE)
    wait_until(lambda: waiting(flight) == callers - 1, "every caller but the runner waits")
    release.set()
    join(*threads)
    assert runs == [1] and results == ["payload"] * callers
    assert len(flight) == 0 and len(flight._table.locks) == 0


def test_the_public_class_runs_on_the_engine_lockmgr_chose() -> None:
    import lockmgr

    flight: Singleflight[str, int] = Singleflight()
    assert type(flight._table.locks) is lockmgr.RWLockManager
    assert flight.call("k", int, "7") == 7
    assert repr(flight).startswith("<lockmgr.Singleflight flights=0 at ")


def test_a_mix_of_callers_timeouts_failures_and_forgets_leaves_nothing_behind(
        flight: Singleflight[str, Any]) -> None:
    """Threads ask for a few keys at once, some with a timeout of 0, some calls fail, some
    keys are forgotten mid-call: every caller gets its key's answer or a clear error, and
    once they are done no flight, no engine entry is left."""
    keys = ["a", "b", "c"]
    problems: list[str] = []
    go = threading.Barrier(8)

    def answer(key: str, round_: int) -> str:
        time.sleep(0.0002)  # a call long enough for others to join it (often, not always)
        if round_ % 7 == 0:
            raise ValueError(key)
        if round_ % 5 == 0:
            flight.forget(key)
        return key.upper()

    def worker(index: int) -> None:
        go.wait(PATIENCE)
        for round_ in range(150):
            key = keys[(index + round_) % len(keys)]
            try:
                got = flight.call(key, answer, key, round_,
                                  timeout=0 if (index + round_) % 4 == 0 else None)
            except (ValueError, LockTimeout) as error:
                if isinstance(error, ValueError) and error.args != (key,):
                    problems.append(f"{key}: another key's error {error!r}")
                continue
            if got != key.upper():
                problems.append(f"{key}: {got!r}")

    threads = [threading.Thread(target=worker, args=(index,), daemon=True) for index in range(8)]
    for thread in threads:
        thread.start()
    join(*threads)
    assert not problems
    assert len(flight) == 0 and len(flight._table.locks) == 0


# A storm of real SIGINTs against calls on the main thread, each asked for by another thread
# too (which joins it while it runs, or makes its own): wherever one lands, the call's hold
# and its flight go (the other caller gets an answer, never its timeout), and the private
# table ends empty. (No thread is started where an interrupt may land: Thread.start itself
# is not safe against one.)
_INTERRUPT_STORM = r"""
import queue, random, signal, sys, threading, time
import lockmgr
from lockmgr._singleflight import singleflight_on

signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
flight = singleflight_on(__import__(sys.argv[1], fromlist=["_"]))()
armed, calm, stuck = [False], threading.Event(), []
asks, answered = queue.SimpleQueue(), queue.SimpleQueue()

def interrupt(signum, frame):
    if armed[0]:
        raise KeyboardInterrupt

def kick():
    main = threading.main_thread().ident
    while not calm.is_set():
        signal.pthread_kill(main, signal.SIGINT)
        time.sleep(random.random() * 0.0002)

def other_caller():
    while (key := asks.get()) is not None:
        try:
            flight.call(key, lambda: "its own", timeout=30)
        except lockmgr.LockTimeout:
            stuck.append(key)
        except lockmgr.FlightAbortedError:  # (the call it joined was interrupted)
            pass
        answered.put(key)

def call():
    # the other caller joins while this runs, if it comes within 10 ms (either way is fine)
    until = time.monotonic() + 0.01
    while not flight._table.locks.stats().waiting and time.monotonic() < until:
        pass
    return "the call's"

signal.signal(signal.SIGINT, interrupt)
threads = [threading.Thread(target=kick), threading.Thread(target=other_caller)]
for thread in threads:
    thread.start()
interrupted = 0
for index in range(int(sys.argv[2])):
    asks.put(f"k{index}")
    try:
        armed[0] = True
        flight.call(f"k{index}", call)
    except KeyboardInterrupt:
        interrupted += 1
    finally:
        armed[0] = False
    answered.get()
calm.set()
asks.put(None)
for thread in threads:
    thread.join()
print(interrupted, len(flight), len(flight._table.locks), len(stuck))
"""


def test_a_storm_of_interrupts_on_callers_leaves_no_flight_and_no_hold(impl: ModuleType) -> None:
    done = subprocess.run([sys.executable, "-c", _INTERRUPT_STORM, impl.__name__, "1500"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    interrupted, flights, holds, stuck = map(int, done.stdout.split())
    assert interrupted > 0  # (the storm reached the calls)
    assert (flights, holds, stuck) == (0, 0, 0)
