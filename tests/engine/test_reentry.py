"""Issue 11, engine v2 (``/work/spec/engine-v2.md``): code that runs inside a wait calls the
manager again, on both engines. One regression test per item of the issue's "What goes
wrong today", plus the contract's other new rules (pinned levels, grant by re-entry, undoing
only what a grant still holds, cycles across managers, fork in the parent, counts).

Scenarios that crash an engine today run in a child interpreter (``SCRIPT`` + a body, the
engine module's name as ``sys.argv[1]``): the test asserts its exit status and the JSON
outcome it prints last. Every step waits on real state (queue lengths, owners, events);
``faulthandler`` ends a child that hangs, with every thread's stack on stderr.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from conftest import PATIENCE, wait_until, xfail_if_the_interpreter_aborted
from lockmgr import DeadlockError

POSIX_SIGNALS = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="POSIX signals")
POSIX_FORK = pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="POSIX fork")

PINNED = ("key 'a' is held only by a waiting acquire_many of the calling thread 'MainThread' "
          "(ident N)")

#: What every child script starts with.
SCRIPT = """
import faulthandler, gc, importlib, json, os, random, signal, sys, threading, time, warnings
import weakref
faulthandler.enable()
faulthandler.dump_traceback_later({hang}, exit=True)  # a hang ends the child, stacks on stderr
{early}
impl = importlib.import_module(sys.argv[1])
from lockmgr import (AbandonedLockWarning, DeadlockError, LockTimeout, NestedWaitError,
                     NotOwnedError)
warnings.simplefilter("ignore", AbandonedLockWarning)
PATIENCE = {patience}
MAIN = threading.get_ident()

class Interrupted(Exception):
    pass

def report(**fields):
    print(json.dumps(fields), flush=True)

def wait_until(condition, what):
    deadline = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > deadline:
            report(stuck="timed out waiting until " + what)
            os._exit(3)
        time.sleep(0.001)

class Worker:
    '''A thread running one call at a time on request (as in conftest).'''
    def __init__(self, name):
        self.calls, self.ready = [], threading.Condition()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self.ident = None
        self.run(lambda: None)
        self.ident = self.thread.ident
    def _run(self):
        while True:
            with self.ready:
                while not self.calls:
                    self.ready.wait()
                func, done, box = self.calls.pop(0)
            if func is None:
                return
            try:
                box.append(("ok", func()))
            except BaseException as exc:
                box.append(("error", exc))
            done.set()
    def submit(self, func):
        done, box = threading.Event(), []
        with self.ready:
            self.calls.append((func, done, box))
            self.ready.notify()
        return done, box
    def run(self, func):
        return result(self.submit(func))
    def stop(self):
        self.submit(None)
        self.thread.join(PATIENCE)

def result(call):
    done, box = call
    if not done.wait(PATIENCE):
        report(stuck="a worker's call did not finish")
        os._exit(3)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value

def outcome(call):
    '''A call's result, or the name and message of what it raised.'''
    try:
        return result(call)
    except Exception as exc:
        return [type(exc).__name__, str(exc)]

def state(manager):
    stats = manager.stats()
    return [len(manager), stats.waiting]
"""


def run_child(impl, body: str, early: str = "") -> subprocess.CompletedProcess[str]:
    """Run ``body`` after SCRIPT in a child interpreter; ``early`` runs before the engine
    (and lockmgr) is imported."""
    code = SCRIPT.format(hang=PATIENCE * 2, patience=PATIENCE, early=early) + textwrap.dedent(body)
    timeout = PATIENCE * 3
    try:
        return subprocess.run([sys.executable, "-c", code, impl.__name__], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # faulthandler should have ended it first
        raise AssertionError(f"the child hung: {exc.stderr!r}") from None


def outcome(done: subprocess.CompletedProcess[str]) -> dict:
    """The child's last JSON line, once it exited with status 0."""
    xfail_if_the_interpreter_aborted(done.returncode, done.stderr,
                                     pure=done.args[-1] == "lockmgr._pure")
    assert done.returncode == 0, (
        f"child exited with {done.returncode}\nstdout: {done.stdout[-2000:]}\n"
        f"stderr: {done.stderr[-4000:]}")
    # A thread's ident differs from run to run: messages show it as "(ident N)".
    return json.loads(re.sub(r"\(ident \d+\)", "(ident N)", done.stdout.splitlines()[-1]))


# -- 1. GC inside a section -------------------------------------------------------------------

GC_BEFORE_QUEUEING = """
TIMEOUT = {timeout}
locks = impl.LockManager()
holder = Worker("holder")
holder.run(lambda: locks.acquire("k"))
waiter_ident, seen = [], []
claim = threading.Lock()  # whoever takes it lets the holder release: the callback, or main

def collection_started(phase, info):
    # The first collection the waiter's acquire triggers (on <= 3.11: at an allocation):
    # the key's holder lets go meanwhile, so the entry the waiter found goes away.
    if phase == "start" and waiter_ident == [threading.get_ident()] and claim.acquire(False):
        seen.append(state(locks))
        result(holder.submit(lambda: locks.release("k")))  # blocks: the holder runs now

def waiter():
    gc.set_threshold(1)
    gc.collect()  # from here the next GC-tracked allocation (that is not reused from a
    # free list, which this emptied) starts a collection
    waiter_ident.append(threading.get_ident())
    try:
        acquired = locks.acquire("k", timeout=TIMEOUT)
    finally:
        gc.set_threshold(700, 10, 10)
    return [acquired, locks.owned("k"), locks.recursion_count("k"), state(locks)]

gc.callbacks.append(collection_started)
call = Worker("waiter").submit(waiter)
wait_until(lambda: call[0].is_set() or locks.stats().waiting == 1, "the waiter waits")
if not call[0].is_set() and claim.acquire(False):
    # An engine that starts no collection before queueing: release the ordinary way.
    seen.append("no collection before queueing")
    result(holder.submit(lambda: locks.release("k")))
if not call[0].wait(PATIENCE / 2):
    report(stuck="the waiter never returned", locked=locks.locked("k"), state=state(locks))
    os._exit(2)
got = result(call)
gc.callbacks.remove(collection_started)
report(seen=seen, waiter=got, locked=locks.locked("k"))
"""


@pytest.mark.parametrize("timeout", [-1, 2.0], ids=["untimed", "timed"])
def test_1_collection_between_lookup_and_queueing(impl, timeout) -> None:
    """Item 1: a finalizer run by an allocation in acquire frees the key (and the entry)
    the waiter is about to queue on. Today (compiled, <= 3.11): SIGSEGV (timed) or a sleep
    forever on a free key (untimed). The waiter must get the key, and it then holds it."""
    report = outcome(run_child(impl, GC_BEFORE_QUEUEING.format(timeout=timeout)))
    # Today: [[1, 0]], between lookup and queueing. An engine that allocates nothing there
    # collects later, in the wait ([[1, 1]], e.g. on 3.12+), or not at all.
    assert report["seen"] in ([[1, 0]], [[1, 1]], ["no collection before queueing"])
    assert report["waiter"] == [True, True, 1, [1, 0]]
    assert report["locked"] is True  # the waiter's thread still holds it (the worker lives)


GC_IN_FIND_CYCLE = """
locks = impl.LockManager()
first, second = Worker("first"), Worker("second")
first.run(lambda: locks.acquire("A"))
second.run(lambda: locks.acquire("B"))
blocked = first.submit(lambda: locks.acquire("B"))
wait_until(lambda: locks.stats().waiting == 1, "first waits for B")
armed, seen = [], []

def collection_started(phase, info):
    # While the refused request builds its cycle (or anything after the decision), the
    # other thread gets B, then lets go of A and B: the entry of A goes away.
    if phase == "start" and armed == [threading.get_ident()] and not seen:
        seen.append(state(locks))
        locks.release("B")  # hands B to first
        result(first.submit(lambda: locks.release_all()))

def refused():
    gc.set_threshold(1)
    gc.collect()  # from here the next GC-tracked allocation starts a collection
    armed.append(threading.get_ident())
    try:
        return locks.acquire("A", timeout=PATIENCE)
    finally:
        gc.set_threshold(700, 10, 10)

gc.callbacks.append(collection_started)
got = outcome(second.submit(refused))
gc.callbacks.remove(collection_started)
second.run(locks.release_all)  # B if no collection came, A if it was granted
first_got = result(blocked)
first.run(locks.release_all)
report(seen=len(seen), got=got if got is True else got[0], first=first_got,
       state=state(locks), deadlocks=locks.stats().deadlocks)
"""


def test_1_collection_in_an_acquire_that_would_deadlock(impl) -> None:
    """Item 1 ("find_cycle builds its tuples before _discard"): a collection during the
    refusal frees the entry the refused request created or used. Either the refusal stands
    (DeadlockError, decided before the collection) or, if the collection came first, the
    key was free and is granted; never a crash, nothing left behind."""
    report = outcome(run_child(impl, GC_IN_FIND_CYCLE))
    assert report["first"] is True
    assert report["seen"] == 1 or report["got"] == "DeadlockError"  # no collection: refused
    assert report["got"] in (True, "DeadlockError")
    assert report["deadlocks"] == (report["got"] == "DeadlockError")
    assert report["state"] == [0, 0]


# -- 2. teardown resurrects the engine ---------------------------------------------------------

TEARDOWN = """
doomed = impl.{cls}()
survivor = impl.LockManager()
holding, end = threading.Event(), threading.Event()

def holder():
    {take}
    survivor.acquire("s")
    holding.set()
    end.wait()  # then ends holding everything: thread exit releases it

thread = threading.Thread(target=holder)
thread.start()
holding.wait()
ended = []

def torn_down(ref):
    # Runs inside the manager's deallocation, before its entries are unlinked.
    end.set()
    thread.join(PATIENCE)
    ended.append(not thread.is_alive())

ref = weakref.ref(doomed, torn_down)
del doomed
gc.collect()
report(ended=ended, dead=ref() is None, survivor=state(survivor),
       survivor_free=survivor.acquire("s", timeout=0))
"""


@pytest.mark.parametrize("cls, take", [
    ("LockManager", 'doomed.acquire("k"); doomed.acquire_many(["k", "j"])'),
    ("RWLockManager", 'doomed.acquire_read("r"); doomed.acquire_write("w"); '
                      'doomed.acquire_read("w")'),
])
def test_2_thread_ending_during_teardown(impl, cls, take) -> None:
    """Item 2: a weakref callback of a manager being torn down lets a thread holding its
    keys end. Today (compiled): the thread's exit resurrects the dying engine, SIGSEGV."""
    report = outcome(run_child(impl, TEARDOWN.format(cls=cls, take=take)))
    assert report == {"ended": [True], "dead": True, "survivor": [0, 0], "survivor_free": True}


# -- 3. a handler releases what it was just handed, then raises --------------------------------

HANDED_THEN_RELEASED = """
sys.setswitchinterval(PATIENCE)  # with a GIL, threads switch only when one blocks
locks = impl.LockManager()
keys = {keys}
holder, following = Worker("holder"), Worker("following")
holder.run(lambda: locks.acquire_many(keys))
in_handler = []
released = threading.Event()

def handler(signum, frame):
    # With a GIL the release below comes before the main thread runs again, so it wakes
    # granted and signalled. Without one (free-threaded) the handler may start first: it
    # waits for the release, so the grant lands while it runs, and it always finds it.
    released.wait(PATIENCE)
    in_handler.append([locks.owned(key) for key in keys])
    in_handler.append({action})
    raise Interrupted

def signal_then_hand_off():
    wait_until(lambda: locks.stats().waiting == 1, "the main thread queued")
    nxt = following.submit(lambda: locks.acquire(keys[0]))
    wait_until(lambda: locks.stats().waiting == 2, "the next waiter queued")
    signal.pthread_kill(MAIN, signal.SIGUSR1)  # no thread switch (with a GIL) from here ...
    locks.release_many(keys)  # ... to here: the main thread wakes granted AND signalled
    released.set()
    return nxt

signal.signal(signal.SIGUSR1, handler)
handing = holder.submit(signal_then_hand_off)
try:
    got = {acquire}
except Interrupted:
    got = "Interrupted"
nxt = result(handing)
followed = result(nxt)
report(got=got, in_handler=in_handler, owned=[locks.owned(key) for key in keys],
       following=[followed, locks.owner(keys[0]) == following.ident],
       locked=[locks.locked(key) for key in keys], state=state(locks))
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
@pytest.mark.parametrize("keys, action, handler_result", [
    (["k"], "locks.release_all()", 1),
    (["a", "b"], "locks.release_all()", 2),
    (["a", "b"], 'locks.release("a")', None),  # undo gives back only "b"
    # A Condition's restore waits for three levels; the handler releases one: undo gives
    # back the two left, not three.
    (["k"], 'locks.release("k")', None),
], ids=["single-release_all", "many-release_all", "many-release-one", "restored-release-one"])
def test_3_handler_releases_what_it_was_handed_then_raises(impl, keys, action,
                                                           handler_result, request) -> None:
    """Item 3 and "undo only as far as the grant still exists": the wait was granted, a
    handler releases (part of) it and raises. Today: SIGSEGV (compiled), AssertionError
    (pure). The exception propagates; what the handler released is not touched again."""
    if "restored" in request.node.callspec.id:
        acquire = 'locks["k"]._acquire_restore((3, threading.get_ident()))'
    else:
        acquire = "locks.acquire_many(keys) if len(keys) > 1 else locks.acquire(keys[0])"
    report = outcome(run_child(impl, HANDED_THEN_RELEASED.format(keys=keys, action=action,
                                                                 acquire=acquire)))
    assert report["got"] == "Interrupted"
    assert report["in_handler"] == [[True] * len(keys), handler_result]
    assert report["owned"] == [False] * len(keys)
    assert report["following"] == [True, True]  # the first key went on to the next waiter
    assert report["locked"] == [True] + [False] * (len(keys) - 1)
    assert report["state"] == [1, 0]


# -- 4. acquire_many with re-entered keys: pinned levels ---------------------------------------

PINNED_SET = """
locks = impl.{cls}()
other = Worker("other")
other.run(lambda: {other_takes_b})
{main_takes_a}
in_handler = []
handled = threading.Event()

def attempt(func):
    try:
        return ["ok", func()]
    except NotOwnedError as exc:
        return ["NotOwnedError", str(exc)]

def handler(signum, frame):
    in_handler.append({count_a})
{handler_body}
    in_handler.append(state(locks))
    handled.set()
    {handler_end}

def signal_then_release():
    wait_until(lambda: locks.stats().waiting == 1, "the set queued")
    signal.pthread_kill(MAIN, signal.SIGUSR1)
    if not handled.wait(PATIENCE):
        return "the handler did not run"
    {other_releases_b}

signal.signal(signal.SIGUSR1, handler)
releasing = other.submit(signal_then_release)
try:
    got = {acquire_set}
except Interrupted:
    got = "Interrupted"
released = outcome(releasing)
after = [{count_a}, {holds_b}]
try:
    {release_set} if got is True else None
    released_set = True
except NotOwnedError as exc:
    released_set = str(exc)
released_rest = locks.release_all()
report(got=got, in_handler=in_handler, released=released, after=after,
       released_set=released_set, released_rest=released_rest, state=state(locks))
"""

LOCK_SET = dict(
    cls="LockManager",
    other_takes_b='locks.acquire("b")',
    main_takes_a='locks.acquire("a")',
    count_a='locks.recursion_count("a")',
    holds_b='locks.owned("b")',
    other_releases_b='locks.release("b")',
    acquire_set='locks.acquire_many(["a", "b"], timeout=PATIENCE)',
    release_set='locks.release_many(["a", "b"])',
    handler_end="",
)
RW_SET = dict(
    cls="RWLockManager",
    other_takes_b='locks.acquire_write("b")',
    main_takes_a='locks.acquire_read("a")',
    count_a='locks._read_count("a")',
    holds_b='locks.write_locked("b")',
    other_releases_b='locks.release_write("b")',
    acquire_set='locks.acquire_many(reads=["a"], writes=["b"], timeout=PATIENCE)',
    release_set='locks.release_many(reads=["a"], writes=["b"])',
    handler_end="",
)
RELEASE_TWICE = {
    "LockManager": '    in_handler.append(attempt(lambda: locks.release("a")))\n'
                   '    in_handler.append(attempt(lambda: locks.release("a")))\n'
                   '    in_handler.append(attempt(lambda: locks.release_many(["a"])))',
    "RWLockManager": '    in_handler.append(attempt(lambda: locks.release_read("a")))\n'
                     '    in_handler.append(attempt(lambda: locks.release_read("a")))\n'
                     '    in_handler.append(attempt(lambda: locks.release_many(reads=["a"])))',
}


@pytest.mark.posix_only
@POSIX_SIGNALS
@pytest.mark.parametrize("kind", [LOCK_SET, RW_SET], ids=["LockManager", "RWLockManager"])
def test_4_handler_releases_a_key_a_waiting_set_reenters(impl, kind) -> None:
    """Item 4 and pinned levels: the set took its re-entry level of "a" when it queued, so
    "a" has two levels while it waits; a handler may release the ordinary one, not the
    pinned one (NotOwnedError, the contract's message, nothing released). Once granted,
    the pinned level is an ordinary one. Today: the set is granted without "a" and
    release_many fails (LockManager), or the releasing thread crashes (RWLockManager)."""
    body = PINNED_SET.format(handler_body=RELEASE_TWICE[kind["cls"]], **kind)
    report = outcome(run_child(impl, body))
    assert report["in_handler"] == [
        2, ["ok", None], ["NotOwnedError", PINNED], ["NotOwnedError", PINNED], [2, 1]]
    assert report["got"] is True and report["released"] is None
    assert report["after"] == [1, True]
    assert report["released_set"] is True and report["released_rest"] == 0
    assert report["state"] == [0, 0]


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_pinned_levels_survive_release_all(impl) -> None:
    """``release_all()`` inside the wait releases every level that is not pinned and counts
    only the keys it stopped holding; "a" stays held by its pinned level."""
    kind = dict(LOCK_SET, main_takes_a='locks.acquire("a"); locks.acquire("a"); '
                                       'locks.acquire("c")')
    handler_body = ('    in_handler.append(locks.release_all())\n'
                    '    in_handler.append([locks.owned("a"), locks.recursion_count("a"), '
                    'locks.owned("c")])')
    report = outcome(run_child(impl, PINNED_SET.format(handler_body=handler_body, **kind)))
    assert report["in_handler"] == [3, 1, [True, 1, False], [2, 1]]
    assert report["got"] is True and report["after"] == [1, True]
    assert report["released_set"] is True and report["released_rest"] == 0
    assert report["state"] == [0, 0]


PINNED_GIVEN_BACK = """
locks = impl.LockManager()
other, queued = Worker("other"), Worker("queued")
other.run(lambda: locks.acquire("b"))
locks.acquire("a")
behind = queued.submit(lambda: locks.acquire("a"))
wait_until(lambda: locks.stats().waiting == 1, "a thread waits for a")
in_handler = []
handled = threading.Event()

def handler(signum, frame):
    locks.release("a")  # the ordinary level; the set's pinned one keeps "a" held
    in_handler.append([locks.recursion_count("a"), locks.owner("a") == MAIN, state(locks)])
    handled.set()
    {raise_or_not}

def signal_main():
    wait_until(lambda: locks.stats().waiting == 2, "the set queued")
    signal.pthread_kill(MAIN, signal.SIGUSR1)

signal.signal(signal.SIGUSR1, handler)
other.submit(signal_main)
try:
    got = locks.acquire_many(["a", "b"], timeout={timeout})
except Interrupted:
    got = "Interrupted"
handler_ran = handled.is_set()
report(got=got, handler_ran=handler_ran, in_handler=in_handler, behind=result(behind),
       owner=locks.owner("a") == queued.ident, owned=locks.owned("a"), state=state(locks),
       timeouts=locks.stats().timeouts)
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
@pytest.mark.parametrize("ends, timeout, raise_or_not", [
    ("timeout", 2.0, ""),
    ("exception", "PATIENCE", "raise Interrupted"),
])
def test_pinned_level_is_given_back_when_the_set_leaves(impl, ends, timeout,
                                                        raise_or_not) -> None:
    """A set that leaves without its grant (timeout, or an exception from a handler) gives
    its pinned level back; it was the last level of "a", so "a" goes to the next waiter."""
    body = PINNED_GIVEN_BACK.format(timeout=timeout, raise_or_not=raise_or_not)
    report = outcome(run_child(impl, body))
    assert report["handler_ran"] is True, "the handler ran only after the timeout: too slow"
    assert report["in_handler"] == [[1, True, [2, 2]]]
    assert report["got"] == (False if ends == "timeout" else "Interrupted")
    assert report["timeouts"] == (1 if ends == "timeout" else 0)
    assert report["behind"] is True and report["owner"] is True and report["owned"] is False
    assert report["state"] == [2, 0]  # "b" (other) and "a" (queued)


# -- 5. a thread ends while the parent forks ---------------------------------------------------

FORK_EARLY = """
def let_a_thread_end():
    # Registered before the engines are imported, so (before-hooks run last registered
    # first) it runs after their before-hooks, inside their fork window.
    end.set()
    ender.join(PATIENCE / 4)
    hook_saw.append(not ender.is_alive())
os.register_at_fork(before=let_a_thread_end)
"""

FORK_PARENT = """
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads: that is the point
ending, end = threading.Event(), threading.Event()
hook_saw = []
locks = impl.LockManager()

def holder():
    locks.acquire("k")
    ending.set()
    end.wait()  # ends holding "k"

ender = threading.Thread(target=holder)
ender.start()
ending.wait()
waiter = Worker("waiter")
waiting = waiter.submit(lambda: locks.acquire("k"))
wait_until(lambda: locks.stats().waiting == 1, "a thread waits for k")
pid = os.fork()
if pid == 0:
    os._exit(0 if locks.acquire("k", timeout=0) else 7)  # the child: "k" is free there
_, status = os.waitpid(pid, 0)
if not waiting[0].wait(PATIENCE / 2):
    report(stuck="the waiter never got k", hook_saw=hook_saw, locked=locks.locked("k"),
           state=state(locks))
    os._exit(2)
got = outcome(waiting)
report(hook_saw=hook_saw, waiter=got, owner=locks.owner("k") == waiter.ident,
       child=os.waitstatus_to_exitcode(status), state=state(locks))
"""


@pytest.mark.posix_only
@POSIX_FORK
def test_5_thread_ending_during_fork_in_the_parent(impl) -> None:
    """Item 5: a thread ends between the fork hooks in the parent. Today both engines skip
    its cleanup there ("forking"), so its key stays locked forever and the waiter never
    gets it. In the parent it is cleaned up normally: the waiter gets the key."""
    report = outcome(run_child(impl, FORK_PARENT, early=FORK_EARLY))
    assert report["child"] == 0
    assert report["waiter"] is True and report["owner"] is True
    assert report["state"] == [1, 0]


# -- 6. nested waits ---------------------------------------------------------------------------

NESTED = """
locks = impl.LockManager()
elsewhere = impl.LockManager()
x, y = Worker("x"), Worker("y")
x.run(lambda: locks.acquire("A"))
y.run(lambda: locks.acquire("B"))
y.run(lambda: elsewhere.acquire("E"))
locks.acquire("M")
in_handler = []
handled = threading.Event()

def attempt(func):
    try:
        return func()
    except NestedWaitError as exc:
        return ["NestedWaitError", str(exc)]

def handler(signum, frame):
    in_handler.append(attempt(lambda: locks.acquire("C", timeout=PATIENCE)))  # free: at once
    locks.release("C")
    in_handler.append(attempt(lambda: locks.acquire("M")))  # re-entry: at once
    locks.release("M")
    in_handler.append(attempt(lambda: locks.acquire("B", blocking=False)))  # try-lock: False
    in_handler.append(attempt(lambda: locks.acquire("B", timeout=2)))
    in_handler.append(attempt(lambda: locks.acquire_many(["B", "C"], timeout=2)))
    in_handler.append(attempt(lambda: elsewhere.acquire("E", timeout=2)))  # any manager
    stats = locks.stats()
    in_handler.append([stats.waiting, stats.timeouts, stats.deadlocks])
    handled.set()

def signal_then_close_a_cycle():
    wait_until(lambda: locks.stats().waiting == 1, "the main thread waits for A")
    signal.pthread_kill(MAIN, signal.SIGUSR1)
    if not handled.wait(PATIENCE):
        return "the handler did not run"
    try:  # x holds A, which the main thread (still) waits for: a real cycle
        return ["acquired", locks.acquire("M", timeout=5)]
    except DeadlockError as exc:
        return ["DeadlockError", exc.cycle == [(x.ident, "M"), (MAIN, "A")]]
    finally:
        locks.release("A")

signal.signal(signal.SIGUSR1, handler)
closing = x.submit(signal_then_close_a_cycle)
got = locks.acquire("A", timeout=PATIENCE)
closed = outcome(closing)
stats = locks.stats()
counts = [stats.timeouts, stats.deadlocks, stats.contended]
released = [locks.release_all(), y.run(locks.release_all), y.run(elsewhere.release_all)]
report(got=got, in_handler=in_handler, closed=closed, counts=counts, released=released,
       state=state(locks), elsewhere=state(elsewhere))
"""


def nested_message(key: str) -> str:
    return (f"cannot wait for key {key}: this thread is already waiting for a key "
            "(a signal handler or finalizer runs inside that wait)")


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_6_nested_waits_are_refused_and_the_outer_wait_stays_visible(impl) -> None:
    """Item 6: a handler inside a wait may take free keys, re-enter, try-lock; an
    acquisition that would queue raises NestedWaitError at once (any manager of the engine,
    not counted). The outer wait stays queued and visible to the detector: a thread closing
    a cycle through it gets DeadlockError. Today: the nested waits time out after 2 s each,
    clear the outer request, and the cycle ends in a silent timeout."""
    report = outcome(run_child(impl, NESTED))
    in_handler = report["in_handler"]
    assert in_handler[:4] == [True, True, False, ["NestedWaitError", nested_message("'B'")]]
    # A set: which key (or keys) the message names is not in the contract; the rest is.
    assert in_handler[4][0] == "NestedWaitError"
    assert in_handler[4][1].startswith("cannot wait for key ")
    assert in_handler[4][1].endswith(nested_message("")[len("cannot wait for key "):])
    assert in_handler[5:] == [["NestedWaitError", nested_message("'E'")], [1, 1, 0]]
    assert report["closed"] == ["DeadlockError", True]
    assert report["got"] is True
    assert report["counts"] == [1, 1, 1]  # the try-lock's timeout, the cycle, the outer wait
    assert report["released"] == [2, 1, 1]
    assert report["state"] == [0, 0] and report["elsewhere"] == [0, 0]


NESTED_CYCLE = """
locks = impl.LockManager()
x, y = Worker("x"), Worker("y")
x.run(lambda: locks.acquire("A"))
y.run(lambda: locks.acquire("B"))
locks.acquire("M")
y_waiting = y.submit(lambda: locks.acquire("M", timeout=PATIENCE))
wait_until(lambda: locks.stats().waiting == 1, "y waits for M")
in_handler = []
handled = threading.Event()

def handler(signum, frame):
    try:  # B's holder waits for M, which this thread holds: waiting would also deadlock
        in_handler.append(locks.acquire("B", timeout=2))
    except (NestedWaitError, DeadlockError) as exc:
        in_handler.append([type(exc).__name__, str(exc)])
    stats = locks.stats()
    in_handler.append([stats.waiting, stats.deadlocks, stats.timeouts])
    handled.set()

def signal_then_release():
    wait_until(lambda: locks.stats().waiting == 2, "the main thread waits for A")
    signal.pthread_kill(MAIN, signal.SIGUSR1)
    handled.wait(PATIENCE)
    locks.release("A")

signal.signal(signal.SIGUSR1, handler)
x.submit(signal_then_release)
got = locks.acquire("A", timeout=PATIENCE)
released = [locks.release_all()]
y_got = result(y_waiting)
released.append(y.run(locks.release_all))
report(got=got, in_handler=in_handler, y_got=y_got, released=released, state=state(locks),
       deadlocks=locks.stats().deadlocks)
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_6_a_nested_wait_is_refused_before_the_deadlock_check(impl) -> None:
    """NestedWaitError comes before the deadlock check: a nested wait that would also
    close a cycle is refused as nested (nothing counted). Today: DeadlockError, because
    the nested request replaced the outer one as the thread's wait."""
    report = outcome(run_child(impl, NESTED_CYCLE))
    assert report["in_handler"] == [["NestedWaitError", nested_message("'B'")], [2, 0, 0]]
    assert report["got"] is True and report["y_got"] is True
    assert report["released"] == [2, 2] and report["state"] == [0, 0]
    assert report["deadlocks"] == 0


# -- 7. fair=False, woken past the deadline ----------------------------------------------------

WOKEN_LATE = """
TIMEOUT = 0.05
RUNS = 20
# How the waiter is made to run only after its deadline, once its wake-up was posted:
# - With a GIL, the waiter is a worker thread and the releasing thread keeps the GIL (a busy
#   loop, no switch before PATIENCE) until after the deadline.
# - Without one (free-threaded, GIL off) nothing keeps a running thread off its core, but a
#   signal handler runs inside the main thread's own wait: the waiter is the main thread, and
#   its handler lets the holder release (the request is WOKEN) and runs past the deadline.
#   The engine sees the same thing: a woken request whose thread goes on after its deadline.
# A loaded machine may keep the releasing thread off a core for the whole TIMEOUT: the wait
# then ends before the release and the scenario did not happen. Such an attempt is seen (the
# release found no queued wait), counted as missed and repeated; RUNS attempts must happen.
GIL = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
if GIL:
    sys.setswitchinterval(PATIENCE)  # threads switch only when one blocks
locks = impl.LockManager(fair=False)
holder, waiter = Worker("holder"), Worker("waiter")
go, in_handler, released, returned = (threading.Event(), threading.Event(),
                                      threading.Event(), threading.Event())
started, inside_wait, queued_in_handler, handling = [], [], [], []

def release_then_stall():
    go.wait()  # runs as soon as the waiter sleeps: within HANDOFF_AFTER of its queueing
    queued = locks.stats().waiting
    locks.release("k")  # WOKEN (or, if this thread was slow, GRANTED)
    overtook = {overtake}
    while time.monotonic() < started[0] + TIMEOUT * 3:
        pass  # keeps the GIL: the waiter runs only after its deadline
    return [queued, overtook]

def wait_briefly():
    go.set()
    started.append(time.monotonic())
    return locks.acquire("k", timeout=TIMEOUT)

def handler(signum, frame):
    # A signal sent again before the first one was seen, or while this handler runs (it may
    # land inside in_handler.set(), which holds the event's lock: a second set() in a nested
    # handler would wait for it for ever): a list's append is one step, with no lock.
    if handling:
        return
    handling.append(True)
    # The main thread is in this handler, so its request stays queued until the release:
    # what the handler sees is what the release will find.
    queued_in_handler.append(locks.stats().waiting if inside_wait else 0)
    in_handler.set()
    if not inside_wait:
        return
    released.wait(PATIENCE)
    while time.monotonic() < started[0] + TIMEOUT * 3:
        pass  # the main thread's wait goes on only after its deadline

def signal_then_release():
    # Polls without sleeping: the release must come within HANDOFF_AFTER (1 ms) of the
    # queueing for the request to be WOKEN rather than handed the key.
    while locks.stats().waiting != 1:
        if returned.is_set():
            return None  # the wait ended before this thread saw it: nothing released
    queued = locks.stats().waiting
    # A signal that lands after the main thread queued but before its sleep began is only
    # seen when the sleep ends: signal again until the handler runs.
    signal.pthread_kill(MAIN, signal.SIGUSR1)
    while not in_handler.wait(0.0002):
        signal.pthread_kill(MAIN, signal.SIGUSR1)
    locks.release("k")  # WOKEN (or, if this thread was slow, GRANTED)
    overtook = {overtake}
    released.set()
    return [queued, overtook]

def wait_in_main_thread():
    started.append(time.monotonic())
    inside_wait.append(True)
    try:
        return locks.acquire("k", timeout=TIMEOUT)
    finally:
        inside_wait.clear()
        returned.set()

def on_waiter(func):
    return waiter.run(func) if GIL else func()

if not GIL:
    if not hasattr(signal, "pthread_kill"):
        report(stuck="no GIL and no POSIX signals: no way to make the waiter late")
        os._exit(3)
    signal.signal(signal.SIGUSR1, handler)
runs, missed = [], 0
while len(runs) < RUNS and missed < 10 * RUNS:
    for event in (go, in_handler, released, returned):
        event.clear()
    started.clear()
    queued_in_handler.clear()
    handling.clear()
    timeouts_before = locks.stats().timeouts
    holder.run(lambda: locks.acquire("k"))
    if GIL:
        stalling = holder.submit(release_then_stall)
        got = result(waiter.submit(wait_briefly))
    else:
        stalling = holder.submit(signal_then_release)
        got = wait_in_main_thread()
    staged = result(stalling)
    if staged is None:
        holder.run(lambda: locks.release("k"))
    happened = staged is not None and staged[0] == 1 and (GIL or queued_in_handler == [1])
    if not happened:
        missed += 1
        if got:
            on_waiter(lambda: locks.release("k"))
        if staged is not None and staged[1]:
            holder.run(lambda: locks.release("k"))
        continue
    queued, overtook = staged
    run = [queued, overtook, got, state(locks)]
    if got:
        on_waiter(lambda: locks.release("k"))
    if overtook:
        holder.run(lambda: locks.release("k"))
    # The wake-up was consumed: the waiter's next waits really wait, and posting its
    # wakeup again works (a second post of a posted lock: RuntimeError in the releaser).
    holder.run(lambda: locks.acquire("k"))
    began = time.monotonic()
    again = on_waiter(lambda: locks.acquire("k", timeout=0.1))
    waited = time.monotonic() - began >= 0.1
    releasing = holder.submit(lambda: [wait_until(lambda: locks.stats().waiting == 1,
                                                  "the waiter waits again"),
                                       locks.release("k")][1])
    later = on_waiter(lambda: locks.acquire("k", timeout=PATIENCE))
    passed = outcome(releasing)
    on_waiter(lambda: locks.release("k"))
    runs.append(run + [again, waited, passed, later,
                       locks.stats().timeouts - timeouts_before])
stats = locks.stats()
report(runs=runs, missed=missed, state=state(locks), deadlocks=stats.deadlocks,
       late_by="gil" if GIL else "handler")
"""


@pytest.mark.posix_only
@pytest.mark.parametrize("overtake", [False, True], ids=["still-free", "overtaken"])
def test_7_unfair_waiter_woken_past_its_deadline(impl, overtake) -> None:
    """Item 7: fair=False, the key is freed within HANDOFF_AFTER of the wait (WOKEN) and
    the waiter runs only after its deadline. Still free: it gets the key (the wake-up came
    in time); overtaken: it times out. Both engines alike, and the wake-up is consumed.
    With a GIL the waiter is a worker thread kept off the GIL; on a free-threaded build with
    the GIL off, the main thread kept in a signal handler inside its wait (see the script)."""
    body = WOKEN_LATE.format(
        overtake='locks.acquire("k", blocking=False)' if overtake else "False")
    report = outcome(run_child(impl, body))
    assert report["late_by"] in ("gil", "handler")
    runs = report["runs"]
    assert len(runs) == 20, f"the scenario happened {len(runs)} times in {report['missed']} tries"
    for queued, overtook, got, after, again, waited, passed, later, timeouts in runs:
        assert queued == 1
        assert got is (not overtook) and after == [1, 0]
        assert [again, waited, passed, later] == [False, True, None, True]
        # the wait meant to time out, plus (overtaken) the late waiter's timeout or, when
        # the holder ran too late to overtake, its failed try-lock
        assert timeouts == (2 if overtake else 1)
    if overtake:  # the holder ran late every time: the scenario never happened
        assert any(run[1] for run in runs), "never woken within HANDOFF_AFTER"
    assert report["state"] == [0, 0] and report["deadlocks"] == 0


WOKEN_IN_HANDLER = """
TIMEOUT = 0.5
locks = impl.LockManager(fair=False)
holder = Worker("holder")
release_now, released = threading.Event(), threading.Event()
began = []

def handler(signum, frame):
    # Runs inside the main thread's wait: the key is freed meanwhile (within HANDOFF_AFTER
    # of the queueing, so the request is WOKEN), and the deadline passes before it returns.
    release_now.set()
    released.wait(PATIENCE)
    while time.monotonic() < began[0] + TIMEOUT * 2:
        pass

def signal_then_release():
    # Waits for the real state, the main thread queued (with or without a GIL), polling
    # without sleeping: the release must come within HANDOFF_AFTER of the queueing.
    deadline = time.monotonic() + PATIENCE
    while locks.stats().waiting != 1:
        if time.monotonic() > deadline:
            return "the main thread never queued"
    queued = locks.stats().waiting
    # A signal that lands after the main thread queued but before its sleep began is only
    # seen when the sleep ends: signal again until the handler runs.
    signal.pthread_kill(MAIN, signal.SIGUSR1)
    while not release_now.wait(0.0002):
        signal.pthread_kill(MAIN, signal.SIGUSR1)
    locks.release("k")
    released.set()
    return queued

signal.signal(signal.SIGUSR1, handler)
runs = []
for attempt in range(10):
    for event in (release_now, released):
        event.clear()
    holder.run(lambda: locks.acquire("k"))
    began[:] = [time.monotonic()]
    releasing = holder.submit(signal_then_release)
    got = locks.acquire("k", timeout=TIMEOUT)
    queued = result(releasing)
    runs.append([queued, got, locks.owned("k"), state(locks)])
    if got:
        locks.release("k")
stats = locks.stats()
report(runs=runs, state=state(locks), counts=[stats.timeouts, stats.contended])
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_7_unfair_main_thread_woken_while_a_handler_runs_past_its_deadline(impl) -> None:
    """Item 7 on the path the compiled core gets wrong today: the key is freed while a
    handler runs inside the main thread's wait (the request is WOKEN after the wait checked
    its state) and the deadline passes in the handler. The key is still free when the
    thread goes on, so it is granted (the wake-up came in time); today the compiled core
    times out instead, leaving its wakeup posted, while the twin grants."""
    report = outcome(run_child(impl, WOKEN_IN_HANDLER))
    assert report["runs"] == [[1, True, True, [1, 0]]] * 10
    assert report["state"] == [0, 0] and report["counts"] == [0, 10]


# -- 8. key code under the pure twin's mutex ---------------------------------------------------

CALLING_KEYS = """
locks = impl.{cls}()
other = impl.LockManager()
calls = []

class Key:
    '''Every key hashes alike, so lookups compare; comparing and repr ask the managers.'''
    def __init__(self, name):
        self.name = name
    def __hash__(self):
        return 42
    def __eq__(self, other_key):
        calls.append(("eq", len(locks), locks.stats().held, other.acquire("side", timeout=0)))
        other.release("side")
        return isinstance(other_key, Key) and self.name == other_key.name
    def __repr__(self):
        calls.append(("repr", len(locks)))
        return "Key(%r)" % self.name

def scenario():
    one, two, three = Key(1), Key(2), Key(3)
    out = []
    out.append({acquire}(one))
    out.append({acquire}(two))  # compares two with one
    out.append({acquire}(Key(2)))  # re-entry of an equal key
    try:
        {release}(three)
    except NotOwnedError as exc:
        out.append(str(exc))
    {release}(Key(2)); {release}(two); {release}(one)
    out.append(state(locks))
    return out

worker = threading.Thread(target=lambda: box.append(scenario()), daemon=True)
box = []
worker.start()
worker.join(PATIENCE / 2)
if worker.is_alive():
    report(stuck="self-deadlock: a key's __eq__/__repr__ called the manager", calls=len(calls))
    os._exit(2)
report(out=box[0], compared=any(call[0] == "eq" for call in calls))
"""


@pytest.mark.parametrize("cls, acquire, release", [
    ("LockManager", "locks.acquire", "locks.release"),
    ("RWLockManager", "locks.acquire_write", "locks.release_write"),
])
def test_8_key_code_may_call_the_manager(impl, cls, acquire, release) -> None:
    """Item 8: a key whose ``__eq__``/``__repr__`` asks the same manager (and another) works.
    Today (pure): they run under the twin's non-reentrant mutex and self-deadlock."""
    body = CALLING_KEYS.format(cls=cls, acquire=acquire, release=release)
    report = outcome(run_child(impl, body))
    held = "held" if cls == "LockManager" else "held for writing"
    assert report["out"] == [True, True, True, f"key Key(3) is not {held} by the calling thread "
                             "'Thread-1 (<lambda>)' (ident N)", [0, 0]]
    assert report["compared"] is True


# -- 9. KeyboardInterrupt anywhere -------------------------------------------------------------

INTERRUPTED_ANYWHERE = """
locks = impl.LockManager()
rw = impl.RWLockManager()
KEYS = ["a", "b", "c"]
armed = [0]
interrupts = [0]
stop = threading.Event()

def handler(signum, frame):
    # At most BUDGET interrupts per operation: the first lands anywhere in lock code, a
    # second (BUDGET 2) also in the engine's own clean-up after the first; none can land
    # outside the loop's nested try statements.
    if armed[0] > 0:
        armed[0] -= 1
        interrupts[0] += 1
        raise KeyboardInterrupt

def signaller():
    rng = random.Random(2)
    while not stop.is_set():
        signal.pthread_kill(MAIN, signal.SIGUSR1)
        time.sleep(rng.random() * 0.001)

def contender():
    rng = random.Random(3)
    done = 0
    while not stop.is_set():
        key = rng.choice(KEYS)
        try:
            if rng.random() < 0.5:
                if locks.acquire(key, timeout=0.005):
                    locks.release(key)
            elif rw.acquire_write(key, timeout=0.005):
                rw.release_write(key)
            done += 1
        except DeadlockError:
            pass
    return done

def operation(rng):
    key = rng.choice(KEYS)
    choice = rng.random()
    try:
        if choice < 0.25:
            if locks.acquire(key, timeout=0.005):
                locks.release(key)
        elif choice < 0.4:
            with locks.hold(key, timeout=0.005):
                pass
        elif choice < 0.55:
            if locks.acquire_many(rng.sample(KEYS, 2), timeout=0.005):
                locks.release_all()
        elif choice < 0.75:
            if rw.acquire_read(key, timeout=0.005):
                if rw.acquire_write(key, timeout=0.002):
                    rw.release_write(key)
                rw.release_read(key)
        elif choice < 0.9:
            with rw.write(key, timeout=0.005):
                pass
        else:
            if rw.acquire_many(reads=[key], writes=[k for k in KEYS if k != key][:1],
                               timeout=0.005):
                rw.release_all()
    except (LockTimeout, DeadlockError):
        pass

signal.signal(signal.SIGUSR1, handler)
threads = [Worker("signaller"), Worker("contender")]
sending = threads[0].submit(signaller)
contending = threads[1].submit(contender)
rng = random.Random(1)
operations = 0
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    try:
        try:
            armed[0] = {budget}
            operation(rng)
            operations += 1
        finally:
            armed[0] = 0
    except KeyboardInterrupt:
        pass
armed[0] = 0
stop.set()
result(sending)
contended = result(contending)
# Whatever an interrupt left held is released; then nothing may be held or queued, and
# every key must still be usable from another thread (no engine mutex leaked).
locks.release_all(); rw.release_all()
usable = threads[1].run(lambda: [locks.acquire(k, timeout=PATIENCE) and rw.acquire_write(
    k, timeout=PATIENCE) for k in KEYS] + [locks.release_all(), rw.release_all()])
report(interrupts=interrupts[0], operations=operations, contended=contended > 0,
       usable=usable, state=[state(locks), state(rw)])
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
@pytest.mark.parametrize("budget", [1, 2], ids=["once", "twice"])
def test_9_keyboard_interrupt_anywhere_leaves_nothing_behind(impl, budget) -> None:
    """Item 9 (generically: the 3.14 window does not exist here): KeyboardInterrupt from a
    handler lands at many points of acquire/release/waits on the main thread, against a
    contending thread. Afterwards nothing is held or queued and every key works. A
    ``with mutex:`` whose exit is skipped, or an interrupt between queueing and the
    clean-up, leaks a key, a queued request or the mutex."""
    report = outcome(run_child(impl, INTERRUPTED_ANYWHERE.format(seconds=3.0, budget=budget)))
    assert report["interrupts"] >= 50, "too few interrupts landed to mean anything"
    assert report["operations"] > 0 and report["contended"] is True
    assert report["usable"] == [True] * 3 + [3, 3]
    assert report["state"] == [[0, 0], [0, 0]]


# -- 10. counts past sys.maxsize ---------------------------------------------------------------


def test_10_restored_count_past_maxsize_is_refused(locks) -> None:
    ident = threading.get_ident()
    with pytest.raises(OverflowError):
        locks["k"]._acquire_restore((sys.maxsize + 1, ident))
    assert not locks.locked("k") and len(locks) == 0


def test_10_restore_into_a_held_key_past_maxsize(locks) -> None:
    """Item 10: re-entering through ``_acquire_restore`` would wrap the count (compiled:
    negative, undefined behaviour; pure: a count past sys.maxsize)."""
    ident = threading.get_ident()
    locks.acquire("k")
    before = locks.stats()
    with pytest.raises(OverflowError, match=r"recursion count of key 'k' would exceed sys.maxsize"):
        locks["k"]._acquire_restore((sys.maxsize, ident))
    assert locks.recursion_count("k") == 1 and locks.stats() == before
    locks.release("k")
    assert len(locks) == 0


def test_10_reentry_at_maxsize(locks) -> None:
    """At sys.maxsize every re-entry fails with OverflowError and changes nothing."""
    ident = threading.get_ident()
    view = locks["k"]
    view._acquire_restore((sys.maxsize, ident))  # exactly the maximum: allowed
    assert locks.recursion_count("k") == sys.maxsize
    before = locks.stats()
    for reenter in (lambda: locks.acquire("k"), lambda: locks.acquire("k", timeout=0),
                    lambda: view.acquire(), lambda: locks.acquire_many(["k", "x"]),
                    lambda: locks.acquire_many(["x", "k"], timeout=0),
                    lambda: locks.hold("k").__enter__()):
        with pytest.raises(OverflowError, match="would exceed sys.maxsize"):
            reenter()
        assert locks.recursion_count("k") == sys.maxsize and not locks.locked("x")
        assert locks.stats() == before
    assert view._release_save() == (sys.maxsize, ident)
    assert len(locks) == 0


def test_10_reentry_one_below_maxsize_still_works(locks) -> None:
    ident = threading.get_ident()
    locks["k"]._acquire_restore((sys.maxsize - 1, ident))
    assert locks.acquire("k") is True
    assert locks.recursion_count("k") == sys.maxsize
    assert locks["k"]._release_save() == (sys.maxsize, ident)


# -- grant by re-entry -------------------------------------------------------------------------

GRANT_BY_REENTRY = """
locks = impl.LockManager(fair=False)
holder = Worker("holder")
holder.run(lambda: locks.acquire("k"))
released = threading.Event()
in_handler = []

def handler(signum, frame):
    # Takes the key only once it was freed: with a GIL that is already so when the handler
    # runs; without one (free-threaded) the handler may start first, and waiting for a key
    # held elsewhere inside a wait would be a nested wait (NestedWaitError).
    released.wait(PATIENCE)
    in_handler.append(locks.acquire("k", timeout=PATIENCE))

def signal_then_release():
    # The real state, polled without sleeping: the release must come within HANDOFF_AFTER
    # of the queueing (WOKEN, not handed the key).
    deadline = time.monotonic() + PATIENCE
    while locks.stats().waiting != 1:
        if time.monotonic() > deadline:
            return "the main thread never queued"
    queued = locks.stats().waiting
    signal.pthread_kill(MAIN, signal.SIGUSR1)
    locks.release("k")  # within HANDOFF_AFTER: WOKEN, free; the handler takes it first
    released.set()
    return queued

signal.signal(signal.SIGUSR1, handler)
releasing = holder.submit(signal_then_release)
got = locks.acquire("k", timeout=PATIENCE / 2)
report(got=got, queued=result(releasing), in_handler=in_handler,
       count=locks.recursion_count("k"), state=state(locks))
"""


@pytest.mark.posix_only
@POSIX_SIGNALS
def test_a_waiter_whose_handler_took_the_key_is_granted_by_reentry(impl) -> None:
    """A queued request whose thread meanwhile became the key's owner (its handler took
    the freed key) is granted as re-entry: count 2, not a wait on itself. Today (pure): the
    woken request finds its own thread owning the key and sleeps again, forever."""
    report = outcome(run_child(impl, GRANT_BY_REENTRY))
    assert report == {"got": True, "queued": 1, "in_handler": [True], "count": 2,
                      "state": [1, 0]}


# -- deadlock cycles across managers -----------------------------------------------------------


@pytest.mark.parametrize("second_kind", ["LockManager", "RWLockManager", "striped"])
def test_cycle_across_two_managers_is_detected(impl, workers, second_kind) -> None:
    """Thread 1 holds A1 of M1 and waits for B2 of M2; thread 2 holds B2 and asks for A1:
    DeadlockError with both pairs, at once. Today the search stays within one manager and
    thread 2 just times out."""
    m1 = impl.LockManager()
    if second_kind == "RWLockManager":
        m2 = impl.RWLockManager()
        take, release = m2.acquire_write, m2.release_write
    else:
        m2 = impl.LockManager(stripes=8) if second_kind == "striped" else impl.LockManager()
        take, release = m2.acquire, m2.release
    b2 = m2._table_key("B2")  # the key as M2's table stores it (a Stripe when striped)
    one, two = workers("one"), workers("two")
    one.run(lambda: m1.acquire("A1"))
    two.run(lambda: take("B2"))
    blocked = one.submit(lambda: take("B2"))
    try:
        wait_until(lambda: m2.stats().waiting == 1, "thread 1 waits in M2")
        with pytest.raises(DeadlockError) as caught:
            two.run(lambda: m1.acquire("A1", timeout=PATIENCE / 4))
        assert caught.value.cycle == [(two.thread.ident, "A1"), (one.thread.ident, b2)]
        assert (m1.stats().deadlocks, m1.stats().timeouts, m2.stats().deadlocks) == (1, 0, 0)
        assert m1.owner("A1") == one.thread.ident and m2.stats().waiting == 1
    finally:  # let thread 1 go on and clean up, whatever happened
        two.run(m1.release_all)
        two.run(m2.release_all)
        granted = blocked.result()
        one.run(m1.release_all)
        one.run(m2.release_all)
    assert granted is True
    assert (len(m1), len(m2), m2.stats().waiting) == (0, 0, 0)


def test_cycle_of_three_across_three_managers(impl, workers) -> None:
    managers = [impl.LockManager() for _ in range(3)]
    threads = [workers(f"t{i}") for i in range(3)]
    for index, worker in enumerate(threads):
        worker.run(lambda index=index: managers[index].acquire(f"K{index}"))
    pending = []
    for index in range(2):  # t0 waits for K1 (M1), t1 waits for K2 (M2)
        pending.append(threads[index].submit(
            lambda index=index: managers[index + 1].acquire(f"K{index + 1}")))
        wait_until(lambda index=index: managers[index + 1].stats().waiting == 1, "queued")
    try:
        with pytest.raises(DeadlockError) as caught:
            threads[2].run(lambda: managers[0].acquire("K0", timeout=PATIENCE / 4))
        idents = [worker.thread.ident for worker in threads]
        assert caught.value.cycle == [(idents[2], "K0"), (idents[0], "K1"), (idents[1], "K2")]
    finally:  # let the others go on and clean up, whatever happened
        threads[2].run(managers[0].release_all)
        threads[2].run(managers[2].release_all)
        results = [pending[1].result()]
        threads[1].run(managers[1].release_all)
        threads[1].run(managers[2].release_all)
        results.insert(0, pending[0].result())
        threads[0].run(managers[0].release_all)
        threads[0].run(managers[1].release_all)
    assert results == [True, True]
    assert all(len(manager) == 0 for manager in managers)


@pytest.mark.compiled
def test_engines_do_not_share_a_graph(workers) -> None:
    """The compiled core's and the pure twin's managers are separate graphs (contract):
    a cross-engine cycle is not followed, so the try-lock below just fails."""
    import lockmgr._core as core
    import lockmgr._pure as pure

    m1, m2 = core.LockManager(), pure.LockManager()
    one, two = workers("one"), workers("two")
    one.run(lambda: m1.acquire("A"))
    two.run(lambda: m2.acquire("B"))
    blocked = one.submit(lambda: m2.acquire("B"))
    wait_until(lambda: m2.stats().waiting == 1, "thread 1 waits in the pure manager")
    assert two.run(lambda: m1.acquire("A", timeout=0.05)) is False
    two.run(lambda: m2.release("B"))
    assert blocked.result() is True
    one.run(m1.release_all)
    one.run(m2.release_all)



# -- an application's at-fork handler that runs before the engine's ----------------------------

FIRST_AT_FORK_HANDLER = """
made = {}

def in_the_child():  # registered before the engine was imported: it runs first in the child
    locks = made.get("locks")
    if locks is not None:
        try:
            made["child"] = [locks.acquire("child-key", timeout=0), locks.acquire("k", timeout=0),
                             locks.owned("k"), len(locks)]
        except Exception as error:
            made["child"] = [type(error).__name__, str(error)]

os.register_at_fork(after_in_child=in_the_child)
"""

FORK_WITH_A_FIRST_HANDLER = """
locks = made["locks"] = impl.LockManager()
locks.acquire("k")
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(write, json.dumps(made.get("child")).encode())
    os._exit(0)
os.close(write)
child = json.loads(os.read(read, 1000))
os.waitpid(pid, 0)
report(child=child)
"""


@POSIX_FORK
def test_a_handler_run_in_a_forked_child_before_the_engines_own_finds_it_set_up(impl) -> None:
    """An application's at-fork handler registered before the engine was imported runs first
    in the child: a manager called there answers as the child's (it holds what the forking
    thread held, and takes free keys), on both engines."""
    report = outcome(run_child(impl, FORK_WITH_A_FIRST_HANDLER, early=FIRST_AT_FORK_HANDLER))
    assert report == {"child": [True, True, True, 2]}
