"""A host call's held-off step on each engine's masks (``lockmgr._quiet.quietly_for``): the
compiled core's C masks and the pure twin's ``signal.pthread_sigmask`` block the same
signals for the call, put the thread's own mask back after it, run the handler of a signal
arriving meanwhile after it (undoing the call), and take each other's masks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from types import ModuleType

import pytest

from lockmgr import _quiet
from signal_support import Interrupted, mask_now, usr1_raises  # noqa: F401  (a fixture)

pytestmark = pytest.mark.posix_only


def test_a_call_runs_with_the_blockable_signals_blocked_and_the_mask_back_after(
        impl: ModuleType) -> None:
    quietly = _quiet.quietly_for(impl.LockManager())
    own = {int(signal.SIGUSR2)}
    signal.pthread_sigmask(signal.SIG_SETMASK, own)
    try:
        assert quietly(mask_now) == own | _quiet.BLOCKABLE
        assert mask_now() == own
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])


def test_a_signal_arriving_in_the_call_has_its_handler_run_after_it_and_undo_run(
        impl: ModuleType, usr1_raises: None) -> None:
    quietly = _quiet.quietly_for(impl.LockManager())
    ran, undone = [], []

    def run() -> str:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # pending: blocked here
        ran.append(True)
        return "done"

    with pytest.raises(Interrupted):
        quietly(run, undo=undone.append)
    assert ran == [True] and undone == ["done"]
    assert signal.SIGUSR1 not in mask_now()


@pytest.mark.compiled
def test_the_compiled_masks_and_pthread_sigmask_take_each_others_masks() -> None:
    import lockmgr._core as core

    own = {int(signal.SIGUSR2), int(signal.SIGHUP), int(signal.SIGBUS)}  # (not BLOCKABLE's)
    signal.pthread_sigmask(signal.SIG_SETMASK, own)
    try:
        before = core.hold_handlers_off()
        assert set(before) == own
        assert mask_now() == own | _quiet.BLOCKABLE
        signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a C mask, as signal numbers
        assert mask_now() == own
        core.set_signal_mask([int(signal.SIGHUP)])  # signal numbers, into a C mask
        assert mask_now() == {int(signal.SIGHUP)}
        with pytest.raises(ValueError):
            core.set_signal_mask([0])
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, [])


# A storm of SIGUSR2s whose handler raises, against held-off calls (``quietly_for``) and the
# engine's own sections (the pure twin's block signals too) on the main thread, whose own
# mask changes between calls: whatever a handler interrupts, the thread keeps the mask it
# set itself (a handler raising as the call blocks the signals finds the call not begun).
_STORM_AGAINST_THE_MASK = r"""
import json, signal, sys, threading, time
from lockmgr import _quiet

engine = __import__(sys.argv[1], fromlist=["_"])
locks = engine.LockManager()
quietly = _quiet.quietly_for(locks)
armed, calm = [False], threading.Event()

class Interrupted(Exception):
    pass

def interrupt(signum, frame):
    if armed[0]:
        armed[0] = False
        raise Interrupted

def kick():
    main = threading.main_thread().ident
    while not calm.is_set():
        signal.pthread_kill(main, signal.SIGUSR2)
        time.sleep(0.0001)

def section():
    locks.acquire("k")
    locks.release("k")

signal.signal(signal.SIGUSR2, interrupt)
kicker = threading.Thread(target=kick)
kicker.start()
interrupted, wrong = 0, []
for index in range(int(sys.argv[2])):
    own = {int(signal.SIGUSR1)} if index % 2 else set()
    signal.pthread_sigmask(signal.SIG_SETMASK, own)
    try:
        armed[0] = True
        quietly(section) if index % 4 < 2 else section()
    except Interrupted:
        interrupted += 1
    finally:
        armed[0] = False
    now = set(map(int, signal.pthread_sigmask(signal.SIG_BLOCK, [])))
    if now != own and not wrong:
        wrong = [index, sorted(own), sorted(now)]
calm.set()
kicker.join()
locks.release_all()
print(json.dumps([interrupted, wrong]))
"""


def test_an_interrupt_as_a_held_off_call_begins_leaves_the_threads_own_mask(
        impl: ModuleType) -> None:
    done = subprocess.run([sys.executable, "-c", _STORM_AGAINST_THE_MASK, impl.__name__,
                           "100000"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    interrupted, wrong = json.loads(done.stdout)
    assert interrupted > 0  # (the storm reached the calls)
    assert wrong == []  # (else: the call's index, the mask it set, the mask after)
