"""What the pure twin must survive because it is Python: key code, finalizers and
asynchronous exceptions that run in the middle of its own bookkeeping.

Every scenario that could hang or corrupt the engine runs in a subprocess with a timeout; the
parent asserts the exit status and what the child reports.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from conftest import xfail_if_the_interpreter_aborted

TIMEOUT = 120  # seconds for a child; each one needs well under a second when it works


def run_child(code: str) -> dict:  # type: ignore[type-arg]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT)
    xfail_if_the_interpreter_aborted(done.returncode, done.stderr, pure=True)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr  # nothing failed unseen
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


# -- keys whose __eq__ / __hash__ use the manager ----------------------------------------------

KEY_CALLS_THE_MANAGER = """
import json, threading
from {module} import LockManager, RWLockManager
calls = []

class Chatty:
    # Every instance hashes alike; hashing or comparing one uses the manager it is in.
    manager = None
    def __hash__(self):
        "hash-side" in Chatty.manager
        return 7
    def __init__(self, name):
        self.name = name
    def __eq__(self, other):
        manager = Chatty.manager
        if isinstance(manager, LockManager):
            manager.acquire("eq-side")
            calls.append(manager.owner("eq-side") == threading.get_ident())
            manager.release("eq-side")
        else:
            manager.acquire_write("eq-side")
            calls.append(manager.write_locked("eq-side") and manager.readers("x") == 0)
            manager.release_write("eq-side")
        return isinstance(other, Chatty) and other.name == self.name

locks = Chatty.manager = LockManager()
a, b = Chatty("a"), Chatty("b")
locks.acquire(a)
locks.acquire(b)  # collides with ``a``: compared outside the engine's bookkeeping
locks.acquire(Chatty("a"))  # re-entry through an equal key
report = {{"count_a": locks.recursion_count(Chatty("a")), "owned_b": locks.owned(Chatty("b")),
          "in": Chatty("a") in locks, "len": len(locks)}}
locks.release(Chatty("a")); locks.release(a); locks.release(b)
assert locks.acquire_many([Chatty("a"), Chatty("b"), 7]) is True
locks.release_many([Chatty("b"), 7, Chatty("a")])
report["after"] = len(locks)

rw = Chatty.manager = RWLockManager()
rw.acquire_read(a); rw.acquire_read(Chatty("a")); rw.acquire_write(Chatty("b"))
report["readers"] = [rw.readers(Chatty("a")), rw._read_count(a), rw.write_locked(Chatty("b"))]
rw.release_read(a); rw.release_read(Chatty("a")); rw.release_write(b)
report["rw_after"] = len(rw)
report["calls_ok"] = bool(calls) and all(calls)
print(json.dumps(report))
"""


def test_a_key_whose_eq_and_hash_use_the_manager_never_deadlocks(impl) -> None:
    report = run_child(KEY_CALLS_THE_MANAGER.format(module=impl.__name__))
    assert report == {"count_a": 2, "owned_b": True, "in": True, "len": 2, "after": 0,
                      "readers": [1, 2, True], "rw_after": 0, "calls_ok": True}


# -- Python code that runs inside a section -------------------------------------------------------

FINALIZER_IN_A_SECTION = """
import dataclasses, json, sys, threading
import lockmgr._pure as pure
locks = pure.LockManager()
outcomes = []

def profile(frame, event, arg):
    # A C call made while this thread is inside a section: stands for a finalizer or a
    # gc callback, which the collector may run at any bytecode.
    if event == "c_call" and pure._mutex.get(0) == threading.get_ident() and not outcomes:
        try:
            locks.locked("other")
            outcomes.append("ran")
        except RuntimeError as error:
            outcomes.append(str(error))

held, done = threading.Event(), threading.Event()
def hold_busy():
    locks.acquire("busy")
    held.set()
    done.wait()
    locks.release("busy")
other = threading.Thread(target=hold_busy)
other.start()
held.wait()
sys.setprofile(profile)
try:
    acquired = locks.acquire("k")
    tried = locks.acquire("busy", timeout=0)
finally:
    sys.setprofile(None)
locks.release("k")
done.set()
other.join()
print(json.dumps({{"outcomes": outcomes, "acquired": acquired, "tried": tried,
                  "mutex_free": not pure._mutex, "len": len(locks),
                  "stats": dataclasses.astuple(locks.stats())}}))
"""


def test_a_call_from_inside_a_section_is_refused_not_deadlocked() -> None:
    report = run_child(FINALIZER_IN_A_SECTION.format())
    assert len(report["outcomes"]) == 1
    assert "finalizer or signal handler called a lock manager" in report["outcomes"][0]
    assert report["acquired"] is True and report["tried"] is False
    assert report["mutex_free"] and report["len"] == 0
    assert report["stats"] == [0, 0, 2, 0, 1, 0]


GC_FINALIZERS_DURING_CONTENTION = """
import gc, json, sys, threading, warnings
import lockmgr._pure as pure
warnings.simplefilter("error")
locks = pure.LockManager()
outcomes = {{"ran": 0, "refused": 0, "other": []}}

class Garbage:
    def __init__(self):
        self.cycle = self  # only the collector frees it, at whatever bytecode it runs
    def __del__(self):
        try:
            if locks.acquire(("finalizer", id(self)), timeout=0):
                locks.release(("finalizer", id(self)))
            locks.locked("k0")
            outcomes["ran"] += 1
        except RuntimeError as error:
            if "finalizer or signal handler" in str(error):
                outcomes["refused"] += 1
            else:
                outcomes["other"].append(repr(error))

def work(index):
    for round in range(300):
        Garbage()
        key = "k%d" % (round % 3)
        if locks.acquire(key, timeout=5):
            Garbage()
            locks.release(key)
        assert locks.acquire_many(["m0", "m1"], timeout=5)
        Garbage()
        locks.release_many(["m1", "m0"])

gc.set_threshold(1)
threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
gc.set_threshold(700)
gc.collect()
stats = locks.stats()
print(json.dumps({{"outcomes": outcomes, "held": stats.held, "waiting": stats.waiting,
                  "len": len(locks), "mutex_free": not pure._mutex}}))
"""


def test_gc_finalizers_that_use_the_manager_during_contention() -> None:
    report = run_child(GC_FINALIZERS_DURING_CONTENTION.format())
    outcomes = report["outcomes"]
    assert outcomes["other"] == [] and outcomes["ran"] + outcomes["refused"] > 0
    assert (report["held"], report["waiting"], report["len"]) == (0, 0, 0)
    assert report["mutex_free"]


# -- an exception landing on any line -------------------------------------------------------------

EXCEPTION_AT_EVERY_CHECK_POINT = """
import json, os, sys, threading, time, warnings
import lockmgr._pure as pure
warnings.simplefilter("ignore")  # the actor may end holding "k": AbandonedLockWarning
SOURCE = os.path.dirname(pure.__file__)  # the engine's package: every module of it

def scenario(locks, profile):
    # A fresh thread (a fresh token), profiled by ``profile``, waits for "k", which another
    # thread hands over once it sees the wait, then releases it.
    held, actor_done = threading.Event(), threading.Event()
    def holder():
        locks.acquire("k")
        held.set()
        while locks.stats().waiting == 0 and not actor_done.is_set():
            time.sleep(0.0005)
        locks.release("k")
    def actor():
        try:
            sys.setprofile(profile)
            try:
                if locks.acquire("k", timeout=30):
                    locks.release("k")
            finally:
                sys.setprofile(None)
        except KeyboardInterrupt:
            pass
        finally:
            actor_done.set()
    first = threading.Thread(target=holder)
    first.start()
    held.wait()
    second = threading.Thread(target=actor)
    second.start()
    second.join(30)
    first.join(30)
    return second.is_alive() or first.is_alive()

def check_points(frame, event):
    # Where a signal handler's exception can land: a function's start, a C call's return.
    return ((event == "call" or event == "c_return")
            and os.path.dirname(frame.f_code.co_filename) == SOURCE)

results = {{"inside": 0, "outside": 0, "bad": []}}
point = 0
while True:
    point += 1
    seen, fired = [0], []
    def inject(frame, event, arg):
        if check_points(frame, event):
            seen[0] += 1
            if seen[0] == point:
                fired.append(pure._mutex.get(0) == threading.get_ident())
                raise KeyboardInterrupt
    locks = pure.LockManager()
    stuck = scenario(locks, inject)
    if not fired and not stuck:
        break  # the scenario ran to its end before reaching this point
    problems = ["stuck"] if stuck else []
    if pure._mutex:
        problems.append("mutex leaked")
    if fired and not fired[0]:  # outside the sections: the wait was left or undone exactly
        deadline = time.monotonic() + 10
        while (locks.stats().held or len(locks)) and time.monotonic() < deadline:
            time.sleep(0.001)  # the actor's thread exit releases what it still held
        stats = locks.stats()
        if (stats.held, stats.waiting, len(locks)) != (0, 0, 0):
            problems.append(repr(stats))
    if fired:
        results["inside" if fired[0] else "outside"] += 1
    if problems:
        results["bad"].append([point, problems])
    if stuck:
        break
print(json.dumps(results))
"""


def test_keyboard_interrupt_at_any_check_point_of_a_wait_never_leaks_or_hangs() -> None:
    """A KeyboardInterrupt raised (by a profile function) where a signal handler's could be:
    at the start of each engine function and after each C call the engine makes.

    Everywhere: the engine mutex is free afterwards and nothing hangs. Outside the sections
    (the wait loop, the sleep, the calls around them): nothing is left held or queued.
    """
    report = run_child(EXCEPTION_AT_EVERY_CHECK_POINT.format())
    assert report["bad"] == []
    assert report["inside"] > 10 and report["outside"] > 10


SIGNALS_AT_THE_MAIN_THREAD = """
import json, random, signal, threading, time
import lockmgr._pure as pure
from lockmgr import DeadlockError, LockTimeout
MAIN = threading.get_ident()
locks, rw = pure.LockManager(), pure.RWLockManager()
seen = {{"handled": 0, "inside": 0, "raised": 0}}
stop, armed = threading.Event(), [False]

RELEASES = {{"release", "release_many", "release_read", "release_write", "__exit__"}}

def releasing(frame):
    # Whether the main thread is inside a release (or a with-block's exit). An exception
    # raised there before the release has run leaves the key held, as with any lock (the
    # caller's, not the engine's): handlers raise only outside releases. Decided from the
    # interrupted stack itself, not from a flag the main thread sets around its calls.
    while frame is not None:
        if frame.f_code.co_name in RELEASES:
            return True
        frame = frame.f_back
    return False

def handler(signum, frame):
    seen["handled"] += 1
    if pure._mutex.get(0) == MAIN:
        seen["inside"] += 1
    if armed[0] and random.random() < 0.5 and not releasing(frame):
        seen["raised"] += 1
        raise KeyboardInterrupt

def signaller():
    while not stop.is_set():
        signal.pthread_kill(MAIN, signal.SIGUSR1)
        time.sleep(random.random() * 0.0005)

def contender():
    while not stop.is_set():
        for key in "ab":
            if locks.acquire(key, timeout=0.002):
                locks.release(key)

signal.signal(signal.SIGUSR1, handler)
others = [threading.Thread(target=signaller), threading.Thread(target=contender)]
for thread in others:
    thread.start()
end = time.monotonic() + 2
while time.monotonic() < end:
    try:
        try:
            armed[0] = True
            with locks.hold("a", timeout=0.002), rw.read("a"):
                locks.acquire_many(["a", "b"], timeout=0.002) and locks.release_many(["a", "b"])
                locks.locked("b")
        except (LockTimeout, DeadlockError):
            pass
        finally:
            armed[0] = False
    except KeyboardInterrupt:
        pass
stop.set()
for thread in others:
    thread.join()
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print(json.dumps({{"seen": seen, "mutex_free": not pure._mutex,
                  "state": [len(locks), locks.stats().waiting, len(rw), rw.stats().waiting],
                  "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}}))
"""


@pytest.mark.posix_only
@pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
def test_signals_sent_to_the_main_thread_are_handled_between_sections() -> None:
    """Handlers of signals aimed at the main thread run before or after a section, never
    inside one; those that raise leave nothing held or queued, and the mask as it was."""
    report = run_child(SIGNALS_AT_THE_MAIN_THREAD.format())
    seen = report["seen"]
    assert seen["handled"] >= 50 and seen["raised"] > 0, seen
    assert seen["inside"] == 0, seen
    assert report["mutex_free"] and report["state"] == [0, 0, 0, 0]
    assert report["mask"] == []
