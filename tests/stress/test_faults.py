"""The bad day: deadlocks, Ctrl-C and signals during waits, fork."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import PATIENCE, wait_until
from lockmgr import DeadlockError, LockError

POSIX_SIGNALS = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")


# -- deadlock detection -------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [-1, 5.0])
def test_opposite_order_gets_deadlock_error_at_once(locks, workers, timeout) -> None:
    first, second = workers("first"), workers("second")
    first.run(lambda: locks.acquire("A"))
    second.run(lambda: locks.acquire("B"))
    blocked = first.submit(lambda: locks.acquire("B"))
    wait_until(lambda: locks.stats().waiting == 1, "first waits for B")
    started = time.monotonic()
    with pytest.raises(DeadlockError) as caught:
        second.run(lambda: locks.acquire("A", timeout=timeout))
    assert time.monotonic() - started < PATIENCE / 2  # at once, not after the timeout
    error = caught.value
    assert isinstance(error, LockError) and isinstance(error, RuntimeError)
    assert error.cycle == [(second.thread.ident, "A"), (first.thread.ident, "B")]
    assert "'A'" in str(error) and "'B'" in str(error) and str(first.thread.ident) in str(error)
    # The refused request changed nothing; the other thread goes on once B is free.
    stats = locks.stats()
    assert (stats.waiting, stats.held, stats.deadlocks, stats.timeouts) == (1, 2, 1, 0)
    assert locks.owner("B") == second.thread.ident and locks.owner("A") == first.thread.ident
    second.run(lambda: locks.release("B"))
    assert blocked.result() is True
    assert first.run(locks.release_all) == 2 and len(locks) == 0


def test_cycle_of_three_names_every_thread_and_key(locks, workers) -> None:
    threads = [workers(f"t{i}") for i in range(3)]
    keys = ["A", "B", "C"]
    for worker, key in zip(threads, keys, strict=True):
        worker.run(lambda key=key: locks.acquire(key))
    pending = []
    for index in range(2):  # t0 waits for B, t1 waits for C
        pending.append(threads[index].submit(lambda index=index: locks.acquire(keys[index + 1])))
        wait_until(lambda index=index: locks.stats().waiting == index + 1, "queued")
    with pytest.raises(DeadlockError) as caught:
        threads[2].run(lambda: locks.acquire("A"))
    idents = [worker.thread.ident for worker in threads]
    assert caught.value.cycle == [(idents[2], "A"), (idents[0], "B"), (idents[1], "C")]
    threads[2].run(lambda: locks.release("C"))
    assert pending[1].result() is True
    threads[1].run(locks.release_all)
    assert pending[0].result() is True
    threads[0].run(locks.release_all)
    assert len(locks) == 0 and locks.stats().deadlocks == 1


def test_a_chain_without_a_cycle_waits_normally(locks, workers) -> None:
    first, second, third = workers("first"), workers("second"), workers("third")
    first.run(lambda: locks.acquire("A"))
    second.run(lambda: locks.acquire("B"))
    chained = first.submit(lambda: locks.acquire("B"))
    wait_until(lambda: locks.stats().waiting == 1, "first waits for B")
    waiting = third.submit(lambda: locks.acquire("A"))  # waits for first, who waits for second
    wait_until(lambda: locks.stats().waiting == 2, "third waits for A")
    assert locks.stats().deadlocks == 0
    second.run(lambda: locks.release("B"))
    assert chained.result() is True
    first.run(locks.release_all)
    assert waiting.result() is True
    third.run(locks.release_all)


@pytest.mark.parametrize("timeout", [-1, 5.0])
def test_a_soft_edge_to_a_set_queued_on_a_free_key_is_a_deadlock(locks, workers, timeout) -> None:
    """A set waiting for "b" is queued on free "a" too: asking for "a" while holding "b" waits
    behind the set (a soft edge), and the set waits for "b" (a hard edge): a cycle."""
    holder, grouped = workers("holder"), workers("grouped")
    holder.run(lambda: locks.acquire("b"))
    taking = grouped.submit(lambda: locks.acquire_many(["a", "b"]))
    wait_until(lambda: locks.stats().waiting == 1, "the set queued")
    assert not locks.locked("a")
    with pytest.raises(DeadlockError) as caught:
        holder.run(lambda: locks.acquire("a", timeout=timeout))
    assert caught.value.cycle == [(holder.thread.ident, "a"), (grouped.thread.ident, "b")]
    stats = locks.stats()
    assert (stats.waiting, stats.held, stats.deadlocks, stats.timeouts) == (1, 1, 1, 0)
    assert holder.run(lambda: locks.acquire("a", timeout=0)) is False  # a try-lock just fails
    holder.run(lambda: locks.release("b"))
    assert taking.result() is True
    assert locks.owner("a") == locks.owner("b") == grouped.thread.ident
    grouped.run(lambda: locks.release_many(["a", "b"]))
    assert len(locks) == 0 and locks.stats().waiting == 0


def test_a_write_request_waits_for_reads_queued_ahead_of_it(impl, workers) -> None:
    """Soft edges of a writer include the *read* requests queued ahead of it: here the only
    path of the cycle back to the caller."""
    rw = impl.RWLockManager()
    owner, grouped, me = workers("owner"), workers("grouped"), workers("me")
    owner.run(lambda: rw.acquire_write("k"))
    me.run(lambda: rw.acquire_write("z"))
    # The set reads "k" (write-held by owner) and writes "z" (held by me).
    taking = grouped.submit(lambda: rw.acquire_many(reads=["k"], writes=["z"]))
    wait_until(lambda: rw.stats().waiting == 1, "the set queued")
    # me -> owner (hard, holds k) does not close a cycle; me -> grouped (soft: its read of k
    # is queued ahead of my write) and grouped -> me (hard: z) does.
    with pytest.raises(DeadlockError) as caught:
        me.run(lambda: rw.acquire_write("k", timeout=5))
    assert caught.value.cycle == [(me.thread.ident, "k"), (grouped.thread.ident, "z")]
    assert rw.stats().deadlocks == 1 and rw.stats().waiting == 1
    me.run(lambda: rw.release_write("z"))
    owner.run(lambda: rw.release_write("k"))
    assert taking.result() is True and rw.readers("k") == 1 and rw.write_locked("z")
    grouped.run(lambda: rw.release_many(reads=["k"], writes=["z"]))
    assert len(rw) == 0


def test_try_locks_never_report_deadlock(locks, workers) -> None:
    first, second = workers("first"), workers("second")
    first.run(lambda: locks.acquire("A"))
    second.run(lambda: locks.acquire("B"))
    blocked = first.submit(lambda: locks.acquire("B"))
    wait_until(lambda: locks.stats().waiting == 1, "first waits for B")
    assert second.run(lambda: locks.acquire("A", blocking=False)) is False
    assert second.run(lambda: locks.acquire("A", timeout=0)) is False
    assert locks.stats().deadlocks == 0
    second.run(lambda: locks.release("B"))
    assert blocked.result() is True
    first.run(locks.release_all)


def test_condition_restore_joins_the_deadlock_check(locks, workers) -> None:
    other = workers("other")
    other.run(lambda: locks.acquire("B"))
    view = locks["A"]
    locks.acquire("A")
    blocked = other.submit(lambda: locks.acquire("A"))
    wait_until(lambda: locks.stats().waiting == 1, "other waits for A")
    with pytest.raises(DeadlockError):
        locks.acquire("B")
    assert locks.owned("A") and locks.stats().waiting == 1
    view.release()
    assert blocked.result() is True
    other.run(locks.release_all)


# -- signals ------------------------------------------------------------------------------------

SIGNAL_CHILD = """
import json, os, signal, sys, threading, time
from {module} import LockManager
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
locks = LockManager()
held, end, finished = threading.Event(), threading.Event(), threading.Event()
def holder():
    locks.acquire("k")
    held.set()
    end.wait()
    locks.release("k")
threading.Thread(target=holder, daemon=True).start()
held.wait()
sent = []
def interrupt():
    while locks.stats().waiting != 1:
        time.sleep(0.001)
    sent.append(time.monotonic())
    {send}
    if not finished.wait({patience}):  # a wait that never notices the signal: fail, not hang
        print(json.dumps({{"hung": locks.stats().waiting}}), flush=True)
        os._exit(3)
threading.Thread(target=interrupt, daemon=True).start()
try:
    locks.acquire("k")
    outcome = "acquired"
except KeyboardInterrupt:
    outcome = "interrupted"
caught = time.monotonic()
finished.set()
stats = locks.stats()
print(json.dumps({{"outcome": outcome, "delay": caught - sent[0], "waiting": stats.waiting,
                  "owned": locks.owned("k"), "held": stats.held}}), flush=True)
"""

#: How long a Ctrl-C may take to end a wait in these tests: the main thread wakes every
#: MAIN_THREAD_SLICE (50 ms) to run handlers; this bound only has to survive a loaded machine.
#: (Typical latency is measured by the benchmark, not asserted here.)
CTRL_C_BOUND = 2.0


@pytest.mark.posix_only
@POSIX_SIGNALS
@pytest.mark.parametrize("send", [
    "os.kill(os.getpid(), signal.SIGINT)",  # any thread may take it
    "signal.pthread_kill(threading.get_ident(), signal.SIGINT)",  # not the main thread
], ids=["to-process", "to-other-thread"])
def test_ctrl_c_ends_a_blocking_wait_promptly(impl, send) -> None:
    code = SIGNAL_CHILD.format(module=impl.__name__, send=send, patience=PATIENCE / 2)
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=PATIENCE * 3)
        assert done.returncode == 0, (done.stdout, done.stderr)
        report = json.loads(done.stdout)
        assert report["outcome"] == "interrupted"
        assert (report["waiting"], report["owned"], report["held"]) == (0, False, 1)
        assert report["delay"] < CTRL_C_BOUND, report


FORKED_SIGNAL_CHILD = """
import json, os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: that is the point
from {module} import LockManager
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
locks = LockManager()
def fork_then_wait():
    {before_fork}
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        print(json.dumps({{"child_status": status}}), flush=True)
        return
    try:  # the child: this thread is its main thread now
        held, finished = threading.Event(), threading.Event()
        def holder():
            locks.acquire("k")
            held.set()
            threading.Event().wait()
        threading.Thread(target=holder, daemon=True).start()
        held.wait()
        sent = []
        def interrupt():
            while locks.stats().waiting != 1:
                time.sleep(0.001)
            sent.append(time.monotonic())
            signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # not to the waiter
            if not finished.wait({patience}):
                print(json.dumps({{"hung": locks.stats().waiting}}), flush=True)
                os._exit(3)
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            locks.acquire("k")
            outcome = "acquired"
        except KeyboardInterrupt:
            outcome = "interrupted"
        caught = time.monotonic()
        finished.set()
        print(json.dumps({{"outcome": outcome, "delay": caught - sent[0],
                          "waiting": locks.stats().waiting, "owned": locks.owned("k"),
                          "main": threading.current_thread() is threading.main_thread()}}),
              flush=True)
        os._exit(0)
    except BaseException as exc:
        print(json.dumps({{"error": repr(exc)}}), flush=True)
        os._exit(4)
t = threading.Thread(target=fork_then_wait)
t.start()
t.join()
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
@pytest.mark.parametrize("before_fork", [
    'locks.acquire("mine"); locks.release("mine")',  # the forking thread used the manager
    "pass",  # it meets the manager first in the child
], ids=["used-before-fork", "first-use-in-child"])
def test_ctrl_c_ends_a_wait_in_a_child_forked_from_another_thread(impl, before_fork) -> None:
    code = FORKED_SIGNAL_CHILD.format(module=impl.__name__, before_fork=before_fork,
                                      patience=PATIENCE / 2)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=PATIENCE * 3)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    child, parent = (json.loads(line) for line in done.stdout.splitlines())
    assert parent == {"child_status": 0}, child
    assert child["outcome"] == "interrupted" and child["main"] is True, child
    assert (child["waiting"], child["owned"]) == (0, False), child
    assert child["delay"] < CTRL_C_BOUND, child


class Interrupted(Exception):
    pass


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_handler_that_returns_keeps_the_remaining_timeout(locks, workers) -> None:
    holder, signaller = workers("holder"), workers("signaller")
    holder.run(lambda: locks.acquire("k"))
    main = threading.get_ident()
    calls: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    try:
        def interrupt() -> None:
            wait_until(lambda: locks.stats().waiting == 1, "the main thread queued")
            signal.pthread_kill(main, signal.SIGUSR1)

        signaller.submit(interrupt)
        started = time.monotonic()
        assert locks.acquire("k", timeout=0.5) is False
        elapsed = time.monotonic() - started
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert calls == [signal.SIGUSR1]
    assert 0.5 <= elapsed < 0.5 + PATIENCE / 4  # the wait went on, and was not restarted
    assert locks.stats().waiting == 0
    holder.run(lambda: locks.release("k"))


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_hand_off_racing_a_raising_handler_goes_to_the_next_waiter(locks, workers) -> None:
    holder, next_in_line = workers("holder"), workers("next")
    holder.run(lambda: locks.acquire("k"))
    main = threading.get_ident()
    passed_on = []

    def raise_interrupted(signum: int, frame: object) -> None:
        raise Interrupted

    def signal_then_hand_off() -> None:
        wait_until(lambda: locks.stats().waiting == 1, "the main thread queued")
        passed_on.append(next_in_line.submit(lambda: locks.acquire("k")))
        wait_until(lambda: locks.stats().waiting == 2, "the next waiter queued")
        # No thread switch between these two: the main thread wakes to both at once.
        signal.pthread_kill(main, signal.SIGUSR1)
        locks.release("k")  # hands the key to the main thread

    previous_handler = signal.signal(signal.SIGUSR1, raise_interrupted)
    previous_interval = sys.getswitchinterval()
    sys.setswitchinterval(PATIENCE)
    try:
        holder.submit(signal_then_hand_off)
        with pytest.raises(Interrupted):
            locks.acquire("k")
    finally:
        sys.setswitchinterval(previous_interval)
        signal.signal(signal.SIGUSR1, previous_handler)
    assert passed_on[0].result() is True  # the grant went on, not lost
    assert locks.owner("k") == next_in_line.thread.ident and not locks.owned("k")
    assert locks.stats().waiting == 0
    next_in_line.run(lambda: locks.release("k"))


# -- fork ---------------------------------------------------------------------------------------

FORK_CHILD = """
import json, os, sys, threading, warnings
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: that is the point
warnings.simplefilter("error", RuntimeWarning)
from {module} import LockManager
locks = LockManager()
held, end = threading.Event(), threading.Event()
def other_holder():
    locks.acquire("theirs")
    held.set()
    end.wait()
threading.Thread(target=other_holder, daemon=True).start()
held.wait()
def fork_and_check():
    locks.acquire("mine")
    locks.acquire("mine")
    waiter = threading.Thread(target=lambda: locks.acquire("mine") and locks.release("mine"))
    waiter.start()
    while locks.stats().waiting != 1:
        pass
    pid = os.fork()
    if pid == 0:
        stats = locks.stats()
        report = {{
            "mine": [locks.owned("mine"), locks.recursion_count("mine")],
            "theirs_locked": locks.locked("theirs"),
            "waiting": stats.waiting, "held": stats.held, "len": len(locks),
            "is_main": threading.current_thread() is threading.main_thread(),
        }}
        report["theirs_try"] = locks.acquire("theirs", timeout=0)
        locks.release("theirs")
        locks.release("mine"); locks.release("mine")
        report["after"] = len(locks)
        print(json.dumps(report), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    parent = locks.stats()
    print(json.dumps({{"child_status": status, "parent": [parent.waiting, parent.held,
                      locks.owned("mine"), locks.locked("theirs")]}}), flush=True)
    locks.release("mine"); locks.release("mine")
    waiter.join()
{run}
"""


@pytest.mark.posix_only
@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
@pytest.mark.parametrize("run", [
    "fork_and_check()",
    "t = threading.Thread(target=fork_and_check); t.start(); t.join()",
], ids=["from-main-thread", "from-other-thread"])
def test_fork_child_keeps_only_the_forking_threads_keys(impl, run) -> None:
    code = FORK_CHILD.format(module=impl.__name__, run=run)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    child, parent = (json.loads(line) for line in done.stdout.splitlines())
    assert child == {"mine": [True, 2], "theirs_locked": False, "theirs_try": True,
                     "waiting": 0, "held": 1, "len": 1, "is_main": True, "after": 0}
    assert parent == {"child_status": 0, "parent": [1, 2, True, True]}


FORK_JOINS_A_WORKER = """
import faulthandler, os, threading
faulthandler.dump_traceback_later({patience}, exit=True)  # a hang prints the stacks, exits 1
stop = threading.Event()
workers = []

def stop_workers_before_fork():  # another library quiescing its threads before a fork
    stop.set()
    for worker in workers:
        worker.join()

os.register_at_fork(before=stop_workers_before_fork)
from {module} import LockManager  # registered after it: lockmgr's before-fork hook runs first

locks = LockManager()
used = threading.Event()

def work():
    while not stop.is_set():
        with locks["k"]:
            used.set()
    locks.acquire("left")  # its exit has a key to release, and a warning to give

workers.append(threading.Thread(target=work))
workers[0].start()
assert used.wait({patience})
pid = os.fork()
if pid == 0:
    os._exit(0 if not locks.locked("left") else 3)
_, status = os.waitpid(pid, 0)
assert status == 0, status
assert not locks.locked("left") and len(locks) == 0
print("forked")
"""


@pytest.mark.posix_only
@pytest.mark.compiled
@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX fork")
def test_a_fork_hook_may_join_a_thread_that_used_lockmgr() -> None:
    """The compiled core's fork hooks take no mutex: a later hook that joins a thread still
    using a manager (whose exit releases keys) does not deadlock the fork. (The pure twin
    holds its mutex across fork(), since the GIL can switch threads inside its sections:
    README, "When things go wrong".)"""
    code = FORK_JOINS_A_WORKER.format(module="lockmgr._core", patience=PATIENCE)
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                          text=True, timeout=PATIENCE * 3)
    assert done.returncode == 0 and done.stdout.strip() == "forked", done.stderr
