"""A step that must run whatever a signal handler raises (a flight's close in a ``finally``,
the undo of a grant in an ``except``): begun inline with ``block_handlers()``, a C call with
no check point before it blocks, and ended by ``run_blocked``. A handler raising as the
block begins, or while the step runs, cannot skip the step: its exception comes after."""

from __future__ import annotations

import ctypes
import operator
import signal
import threading
from functools import partial

import pytest

from lockmgr import _quiet
from signal_support import Interrupted, mask_now, usr1_raises  # noqa: F401  (a fixture)

pytestmark = pytest.mark.posix_only

PATIENCE = 30.0


def _begin() -> object:
    """``block_handlers()`` as the steps call it: its mask, or what a handler raised in it."""
    try:
        return _quiet.block_handlers()
    except BaseException as stopped:
        return stopped


def test_the_step_runs_with_the_handlers_blocked_and_the_own_mask_back_after(
        usr1_raises: None) -> None:
    own = {int(signal.SIGUSR2)}
    signal.pthread_sigmask(signal.SIG_SETMASK, own)
    seen: list[set[int]] = []
    _quiet.run_blocked(_begin(), lambda: seen.append(mask_now()))  # type: ignore[arg-type]
    assert seen == [own | _quiet.BLOCKABLE]
    assert mask_now() == own


def test_a_handler_raising_as_the_block_begins_comes_after_the_step(usr1_raises: None) -> None:
    # The signal trips its C handler in a C call that runs no Python handler (libc's raise),
    # and the next C call of the chain is the block: the handler runs inside it, once the
    # mask changed, as at a check point just before the step.
    # (A block that a handler stops returns no mask: the thread's own is put back as
    # lockmgr last saw it, here by a step before.)
    _quiet.run_blocked(_begin(), lambda: None)  # type: ignore[arg-type]
    libc_raise = partial(getattr(ctypes.CDLL(None), "raise"), int(signal.SIGUSR1))
    try:
        _, blocked = map(operator.call, [libc_raise, _quiet.block_handlers])  # type: ignore[attr-defined]
    except Interrupted as stopped:
        blocked = stopped
    assert isinstance(blocked, Interrupted)
    seen: list[set[int]] = []
    with pytest.raises(Interrupted) as raised:
        _quiet.run_blocked(blocked, lambda: seen.append(mask_now()))
    assert raised.value is blocked
    assert seen and _quiet.BLOCKABLE <= seen[0]  # (the step ran blocked)
    assert not _quiet.BLOCKABLE & mask_now()


def test_a_signal_arriving_during_the_step_has_its_handler_run_after_it(usr1_raises: None) -> None:
    ran: list[str] = []

    def step() -> None:
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # (blocked: held pending)
        ran.append("step")

    with pytest.raises(Interrupted):
        _quiet.run_blocked(_begin(), step)  # type: ignore[arg-type]
    assert ran == ["step"]
    assert not _quiet.BLOCKABLE & mask_now()


def test_on_a_worker_thread_the_step_runs_blocked_and_its_mask_comes_back() -> None:
    seen: list[bool] = []

    def worker() -> None:
        own = mask_now()
        inside: list[set[int]] = []
        _quiet.run_blocked(_begin(), lambda: inside.append(mask_now()))  # type: ignore[arg-type]
        seen.extend([_quiet.BLOCKABLE <= inside[0], mask_now() == own])

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(PATIENCE)
    assert not thread.is_alive()
    assert seen == [True, True]


def test_a_step_that_raises_after_a_handler_did_keeps_the_handlers_exception_first(
        usr1_raises: None) -> None:  # (for its putting the mask back)
    handlers = KeyboardInterrupt()

    def failing_step() -> None:
        raise ValueError("the step")

    with pytest.raises(KeyboardInterrupt) as raised:
        _quiet.run_blocked(handlers, failing_step)
    assert raised.value is handlers
    assert isinstance(handlers.__context__, ValueError)  # (the step's, not lost)
    assert not _quiet.BLOCKABLE & mask_now()
