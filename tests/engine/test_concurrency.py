"""Behaviour between threads: exclusion, FIFO hand-off, timeouts, thread exit, signals."""

from __future__ import annotations

import random
import signal
import sys
import threading
import time

import pytest

from conftest import PATIENCE, abandoned_warnings, wait_until
from lockmgr._tuning import HANDOFF_AFTER


def run_threads(count: int, target, *args) -> None:  # type: ignore[no-untyped-def]
    """Run ``target(index, barrier, *args)`` in ``count`` threads; re-raise the first failure."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def body(index: int) -> None:
        try:
            target(index, barrier, *args)
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    # Daemons: a thread stuck in a broken engine must fail the test, not keep pytest alive.
    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + PATIENCE * 3
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
        assert not thread.is_alive(), "a thread is stuck"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("threads", [2, 8])
def test_mutual_exclusion_no_lost_updates(impl, fair, threads) -> None:
    locks = impl.LockManager(fair=fair)
    counters = dict.fromkeys(range(4), 0)
    rounds = 300

    def body(index: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for step in range(rounds):
            key = (index + step) % 4
            with locks[key]:
                value = counters[key]
                time.sleep(0)  # invite a switch inside the critical section
                counters[key] = value + 1

    run_threads(threads, body)
    assert sum(counters.values()) == threads * rounds
    assert len(locks) == 0 and locks.stats().waiting == 0
    assert locks.stats().acquisitions == threads * rounds


def test_strict_fifo_hands_off_in_arrival_order(locks, workers) -> None:
    locks.acquire("k")
    order: list[int] = []
    calls = []
    for index in range(5):
        worker = workers(f"w{index}")

        def take(index: int = index) -> None:
            with locks["k"]:
                order.append(index)

        calls.append(worker.submit(take))
        wait_until(lambda index=index: locks.stats().waiting == index + 1, f"worker {index} queued")
    locks.release("k")
    for call in calls:
        call.result()
    assert order == [0, 1, 2, 3, 4]
    assert locks.stats().contended == 5 and len(locks) == 0


@pytest.mark.parametrize("kind", ["exclusive", "write"])
def test_a_writer_handed_the_key_is_woken_at_once(impl, workers, kind) -> None:
    """The release that hands the key to a waiting writer wakes it: the writer does not find
    its grant only when its sleep runs out (the compiled core sleeps in 50 ms slices, so a
    lost wake-up shows only as latency; the pure twin's would hang)."""
    if kind == "exclusive":
        locks = impl.LockManager()
        take, give = locks.acquire, locks.release
    else:
        locks = impl.RWLockManager()
        take, give = locks.acquire_write, locks.release_write
    waiter = workers("waiter")
    delays: list[float] = []
    for _ in range(15):
        take("k")
        granted: list[float] = []
        call = waiter.submit(lambda: (take("k"), granted.append(time.monotonic())))
        wait_until(lambda: locks.stats().waiting == 1, "the writer queued")
        time.sleep(0.002)  # let it fall asleep in its wait
        released = time.monotonic()
        give("k")
        call.result()
        delays.append(granted[0] - released)
        waiter.run(lambda: give("k"))
    delays.sort()
    # Woken: well under a millisecond, even on a loaded machine far under 20 ms; found only
    # at the end of a 50 ms slice: about 45 ms every time.
    assert delays[len(delays) // 2] < 0.02, delays
    assert len(locks) == 0


def test_release_hands_off_before_returning_so_no_barging(locks, workers) -> None:
    locks.acquire("k")
    waiter = workers("waiter")
    got = waiter.submit(lambda: locks.acquire("k"))
    wait_until(lambda: locks.stats().waiting == 1, "the waiter queued")
    locks.release("k")
    # The waiter owns the key now, whether or not it has run yet.
    assert locks.owner("k") == waiter.thread.ident and locks.stats().waiting == 0
    assert locks.acquire("k", blocking=False) is False
    assert got.result() is True
    again = workers("again")
    queued = again.submit(lambda: locks.acquire("k"))
    wait_until(lambda: locks.stats().waiting == 1, "the re-acquirer queued behind")
    waiter.run(lambda: locks.release("k"))
    assert queued.result() is True
    again.run(lambda: locks.release("k"))


def test_try_lock_never_jumps_the_queue(locks, workers) -> None:
    holder, waiter, trier = workers("holder"), workers("waiter"), workers("trier")
    holder.run(lambda: locks.acquire("k"))
    queued = waiter.submit(lambda: locks.acquire("k"))
    wait_until(lambda: locks.stats().waiting == 1, "the waiter queued")
    assert trier.run(lambda: locks.acquire("k", timeout=0)) is False
    assert locks.stats().waiting == 1  # a try-lock never queues
    holder.run(lambda: locks.release("k"))
    assert queued.result() is True and locks.owner("k") == waiter.thread.ident
    waiter.run(lambda: locks.release("k"))


def test_timeout_leaves_the_queue_and_keeps_fifo_for_the_rest(locks, workers) -> None:
    locks.acquire("k")
    patient, impatient = workers("patient"), workers("impatient")
    first = patient.submit(lambda: locks.acquire("k"))
    wait_until(lambda: locks.stats().waiting == 1, "patient queued")
    started = time.monotonic()
    assert impatient.run(lambda: locks.acquire("k", timeout=0.05)) is False
    assert time.monotonic() - started >= 0.05
    assert locks.stats().waiting == 1 and locks.stats().timeouts == 1
    locks.release("k")
    assert first.result() is True
    patient.run(lambda: locks.release("k"))
    assert len(locks) == 0


def test_timed_out_waiter_on_a_held_key_leaves_no_entry(locks, workers) -> None:
    holder = workers("holder")
    holder.run(lambda: locks.acquire("k"))
    assert locks.acquire("k", timeout=0.01) is False
    holder.run(lambda: locks.release("k"))
    assert len(locks) == 0 and "k" not in locks and locks.stats().waiting == 0


def test_timeouts_racing_hand_offs_lose_nothing(impl, fair) -> None:
    locks = impl.LockManager(fair=fair)
    inside = [0]
    got = [0]
    rounds = 200

    def body(index: int, barrier: threading.Barrier) -> None:
        rng = random.Random(index)
        barrier.wait()
        for _ in range(rounds):
            if locks.acquire("hot", timeout=rng.choice([0, 0.0001, 0.0005, 0.002])):
                inside[0] += 1
                assert inside[0] == 1, "two threads inside"
                got[0] += 1
                inside[0] -= 1
                locks.release("hot")

    run_threads(6, body)
    stats = locks.stats()
    assert stats.held == 0 and stats.waiting == 0 and len(locks) == 0
    assert stats.acquisitions == got[0] and stats.acquisitions + stats.timeouts == 6 * rounds
    assert locks.acquire("hot", blocking=False)  # nobody was left owning it
    locks.release("hot")


def test_unfair_mode_hands_off_to_a_waiter_aged_past_the_bound(impl, workers) -> None:
    """fair=False: a waiter that has queued for longer than HANDOFF_AFTER owns the key before
    ``release`` returns (a younger one may only be woken to race for it)."""
    locks = impl.LockManager(fair=False)
    locks.acquire("k")
    waiter = workers("waiter")
    got = waiter.submit(lambda: locks.acquire("k"))
    wait_until(lambda: locks.stats().waiting == 1, "the waiter queued")
    queued_by = time.monotonic()  # the request's age counts from before this
    while time.monotonic() - queued_by < 20 * HANDOFF_AFTER:
        time.sleep(HANDOFF_AFTER)
    locks.release("k")
    assert locks.owner("k") == waiter.thread.ident and locks.stats().waiting == 0
    assert locks.acquire("k", blocking=False) is False  # no barging past the hand-off
    assert got.result() is True
    waiter.run(lambda: locks.release("k"))
    assert len(locks) == 0 and locks.stats().contended == 1


def test_unfair_mode_a_woken_waiter_that_is_overtaken_waits_on(impl, workers) -> None:
    """fair=False: a young waiter is only woken to race for the key; if another thread takes
    it first, the waiter queues on at the head and is handed the key at the next release."""
    locks = impl.LockManager(fair=False)
    waiter = workers("waiter")
    for _ in range(10):
        locks.acquire("k")
        got = waiter.submit(lambda: locks.acquire("k", timeout=PATIENCE / 2))
        deadline = time.monotonic() + PATIENCE
        while locks.stats().waiting != 1:  # no sleep: release while the waiter is young
            assert time.monotonic() < deadline, "the waiter did not queue"
        locks.release("k")
        if locks.acquire("k", timeout=0):  # overtook the woken waiter (if it was young)
            time.sleep(0.05)  # let it run, find the key taken and go back to sleep
            assert locks.stats().waiting == 1
            locks.release("k")  # it has waited long enough now: handed to it
            assert locks.owner("k") == waiter.thread.ident
        # Whether or not it was overtaken, it is woken with the key, not at its timeout.
        assert got.wait(PATIENCE / 4) and got.result() is True
        waiter.run(lambda: locks.release("k"))
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_fair_mode_hands_off_to_a_waiter_however_young(locks, workers) -> None:
    """Strict FIFO: even a waiter that queued a moment ago owns the key when release returns."""
    waiter = workers("waiter")
    for _ in range(30):
        locks.acquire("k")
        got = waiter.submit(lambda: locks.acquire("k"))
        deadline = time.monotonic() + PATIENCE
        while locks.stats().waiting != 1:  # no sleep: release as soon as it queued
            assert time.monotonic() < deadline, "the waiter did not queue"
        locks.release("k")
        assert locks.owner("k") == waiter.thread.ident and locks.stats().waiting == 0
        assert got.result() is True
        waiter.run(lambda: locks.release("k"))
    assert len(locks) == 0 and locks.stats().contended == 30


def test_unfair_mode_bounds_the_wait_of_a_queued_thread(impl, workers) -> None:
    locks = impl.LockManager(fair=False)
    stop = threading.Event()
    hog_rounds = [0]

    def hog() -> None:  # re-takes the key the moment it frees it
        while not stop.is_set():
            with locks["hot"]:
                hog_rounds[0] += 1

    hog_thread = threading.Thread(target=hog, daemon=True)
    hog_thread.start()
    # The waiter is not the main thread: it sleeps until posted (no 50 ms slices), so a
    # waiter that is woken, overtaken and never re-queued properly would sleep to its timeout.
    waiter = workers("waiter")

    def take_and_give_back() -> float:
        asked = time.monotonic()
        assert locks.acquire("hot", timeout=PATIENCE) is True  # it must not starve
        waited = time.monotonic() - asked
        locks.release("hot")
        return waited

    try:
        wait_until(lambda: hog_rounds[0] > 100, "the hog is running")
        for _ in range(5):
            # Handed off once it has waited HANDOFF_AFTER: milliseconds, not a timeout.
            assert waiter.run(take_and_give_back) < PATIENCE / 4
            rounds = hog_rounds[0]
            wait_until(lambda rounds=rounds: hog_rounds[0] > rounds, "the hog took it again")
    finally:
        stop.set()
        hog_thread.join(PATIENCE)
    assert not hog_thread.is_alive() and len(locks) == 0


def test_keys_whose_eq_runs_python_keep_mutual_exclusion(impl, fair) -> None:
    class SlowKey:
        """Every instance hashes alike, and comparing lets other threads run."""

        def __init__(self, name: str) -> None:
            self.name = name

        def __hash__(self) -> int:
            return 42

        def __eq__(self, other: object) -> bool:
            time.sleep(0)
            return isinstance(other, SlowKey) and other.name == self.name

    locks = impl.LockManager(fair=fair)
    counters = dict.fromkeys("abc", 0)
    rounds = 150
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)

    def body(index: int, barrier: threading.Barrier) -> None:
        barrier.wait()
        for step in range(rounds):
            name = "abc"[(index + step) % 3]
            with locks[SlowKey(name)]:  # a fresh but equal key object every time
                value = counters[name]
                time.sleep(0)
                counters[name] = value + 1

    try:
        run_threads(6, body)
    finally:
        sys.setswitchinterval(previous)
    assert sum(counters.values()) == 6 * rounds and len(locks) == 0


def test_keys_of_a_thread_that_ends_are_released_to_waiters(locks, workers) -> None:
    took, end = threading.Event(), threading.Event()

    def holder() -> None:
        locks.acquire("k")
        locks.acquire("k")
        locks.acquire("other")
        took.set()
        end.wait(PATIENCE)

    thread = threading.Thread(target=holder)
    waiter = workers("waiter")
    # The holder starts inside the block: see conftest.abandoned_warnings.
    with abandoned_warnings() as warned:
        thread.start()
        assert took.wait(PATIENCE)
        queued = waiter.submit(lambda: locks.acquire("k"))
        wait_until(lambda: locks.stats().waiting == 1, "the waiter queued")
        end.set()
        thread.join(PATIENCE)
        assert queued.result() is True
    assert sorted(str(w.message) for w in warned) == [
        f"thread {thread.name!r} (ident {thread.ident}) ended holding key 'k'; released it",
        f"thread {thread.name!r} (ident {thread.ident}) ended holding key 'other'; released it",
    ] and locks.owner("k") == waiter.thread.ident
    assert locks.recursion_count("k") == 0 and not locks.locked("other")
    waiter.run(lambda: locks.release("k"))
    assert len(locks) == 0


def test_the_warning_names_the_ended_thread_as_it_was_named_when_it_first_used_locks(
        locks) -> None:
    """The thread is gone from threading when its exit releases its keys: the engines keep
    its name from its token's creation (a later rename is not seen)."""
    def holder() -> None:
        locks.acquire("k")
        threading.current_thread().name = "renamed"

    thread = threading.Thread(target=holder, name="Worker-1")
    with abandoned_warnings() as warned:
        thread.start()
        thread.join(PATIENCE)
    assert [str(w.message) for w in warned] == [
        f"thread 'Worker-1' (ident {thread.ident}) ended holding key 'k'; released it"]
    assert len(locks) == 0


def test_a_new_thread_never_inherits_an_ended_threads_keys(locks) -> None:
    seen: list[tuple[int, bool, int]] = []
    for _ in range(5):  # idents are commonly recycled by the next thread
        first = threading.Thread(target=locks.acquire, args=("k",))
        with abandoned_warnings() as warned:
            first.start()
            first.join(PATIENCE)
        assert [str(w.message) for w in warned] == [
            f"thread {first.name!r} (ident {first.ident}) ended holding key 'k'; released it"]
        second = threading.Thread(
            target=lambda: seen.append((threading.get_ident(), locks.owned("k"),
                                        locks.recursion_count("k"))))
        second.start()
        second.join(PATIENCE)
    assert all(not owned and count == 0 for _, owned, count in seen)
    assert len(locks) == 0


class Interrupted(Exception):
    pass


@pytest.mark.posix_only
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
def test_signal_handler_that_raises_ends_the_wait_with_nothing_held(locks, workers) -> None:
    holder, signaller = workers("holder"), workers("signaller")
    holder.run(lambda: locks.acquire("k"))
    main = threading.get_ident()

    def handler(signum: int, frame: object) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        def interrupt() -> None:
            wait_until(lambda: locks.stats().waiting == 1, "the main thread queued")
            signal.pthread_kill(main, signal.SIGUSR1)

        signaller.submit(interrupt)
        with pytest.raises(Interrupted):
            locks.acquire("k")
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert locks.stats().waiting == 0 and locks.owner("k") == holder.thread.ident
    assert not locks.owned("k")
    holder.run(lambda: locks.release("k"))
    assert len(locks) == 0


@pytest.mark.posix_only
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
def test_signal_handler_that_returns_lets_the_wait_go_on(locks, workers) -> None:
    holder, signaller = workers("holder"), workers("signaller")
    holder.run(lambda: locks.acquire("k"))
    main = threading.get_ident()
    handled = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.set())
    try:
        def interrupt_then_release() -> None:
            wait_until(lambda: locks.stats().waiting == 1, "the main thread queued")
            signal.pthread_kill(main, signal.SIGUSR1)
            assert handled.wait(PATIENCE)
            assert locks.stats().waiting == 1  # still queued after the handler ran
            holder.run(lambda: locks.release("k"))

        done = signaller.submit(interrupt_then_release)
        assert locks.acquire("k", timeout=PATIENCE) is True
        done.result()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert handled.is_set()
    locks.release("k")


SHUTDOWN_WITH_BLOCKED_DAEMONS = """
import threading, sys
from {module} import LockManager
locks = LockManager()
ready = threading.Barrier(6)
def hold(key):
    locks.acquire(key)
    ready.wait()
    threading.Event().wait()
def block(key):
    locks.acquire(key)
for key in "ab":
    threading.Thread(target=hold, args=(key,), daemon=True).start()
for key in "aab":
    threading.Thread(target=lambda k=key: (ready.wait(), block(k)), daemon=True).start()
ready.wait()
while locks.stats().waiting < 3:
    pass
print("exiting with", locks.stats().waiting, "daemon waiters", flush=True)
"""


def test_interpreter_exit_with_daemon_threads_waiting_and_holding(impl) -> None:
    import subprocess

    code = SHUTDOWN_WITH_BLOCKED_DAEMONS.format(module=impl.__name__)
    for _ in range(5):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert "exiting with 3 daemon waiters" in done.stdout
