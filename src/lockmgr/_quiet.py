"""Signal handlers held off while a call changes what its thread holds (``quietly``), and let
in again while it waits (``let_in``).

Python runs signal handlers on the main thread only, at check points between bytecodes (a
function's start, a call's return, a loop's jump back), and a handler that raises (Ctrl-C's
KeyboardInterrupt) stops whatever ran there. A call that takes a lock in the kernel and then
records it in Python, or gives it back and then forgets it, must not be split there: the lock
would stay taken, known to nobody. So, on the main thread, ``quietly`` runs such a call with
every signal blocked that may have a Python handler (``BLOCKABLE``: all but SIGKILL,
SIGSTOP and those a fault raises synchronously), as the pure engine's sections do:

- blocking runs the handlers of signals already pending (after the mask changed, before the
  call): one that raises stops the call before it started;
- handlers of signals that arrive meanwhile run once the mask is restored, after the call:
  one that raises there makes the call undo what it did (``undo``, itself run with the
  handlers held off), so that an interrupted call has done nothing;
- a wait inside the call (for another process, on a doorbell) lets them in for its length
  (``let_in``): a handler that raises there stops the wait, and the call gives back what it
  took with them held off again.

Worker threads run no handlers: there the call runs as it is. Nested calls run as they are
(the outer one holds the handlers off). The limits are the pure engine's: a signal delivered
to another thread (a process-directed one, such as a terminal's Ctrl-C, while the main
thread holds it off) still has its handler run on the main thread at its next check point,
and where ``pthread_sigmask`` does not exist (Windows) nothing is held off.

A manager changes the mask with its engine's calls (``quietly_for``): the compiled core's
keep masks as C values (``lockmgr._core.hold_handlers_off``), where ``signal.pthread_sigmask``
converts a set of Python ints each way on every call (the pure twin's: ``quietly``). Both run
the handlers at the same points, and each takes the other's masks.

``MAIN_THREAD_MASK`` is the main thread's own mask, as last seen outside these calls and the
pure engine's sections (which share it): restored if blocking itself raises.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, NamedTuple, Protocol, TypeVar

R = TypeVar("R")

# (``_signal``'s C functions take and return ints: no enum conversion on every call)
_signal: Any = sys.modules.get("_signal", signal)
_set_mask = getattr(_signal, "pthread_sigmask", None)  # None: Windows
_SIG_BLOCK = getattr(_signal, "SIG_BLOCK", 0)
_SIG_SETMASK = getattr(_signal, "SIG_SETMASK", 0)
BLOCKABLE = frozenset(map(int, _signal.valid_signals())) - {
    getattr(_signal, name) for name in
    ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS")
    if hasattr(_signal, name)
}
MAIN_THREAD_MASK: list[Iterable[int]] = [()]


class Masks(NamedTuple):
    """How a quiet call changes the main thread's mask."""

    # Block BLOCKABLE; the mask before. Handlers run after the change: one that raises
    # leaves the mask as it was (the quiet call has not begun).
    hold_off: Callable[[], Iterable[int]]
    set_mask: Callable[[Iterable[int]], object]  # the mask given (handlers run)
    # Block BLOCKABLE again inside a quiet call (after ``let_in``, for an undo): a handler
    # that raises after the change leaves it blocked.
    hold_off_again: Callable[[], object]


def hold_handlers_off() -> Iterable[int]:
    """``Masks.hold_off`` on ``signal.pthread_sigmask``: the mask read first (a handler
    raising there has changed nothing), then blocked, and put back if a handler raises."""
    assert _set_mask is not None
    before = _set_mask(_SIG_BLOCK, ())
    try:
        _set_mask(_SIG_BLOCK, BLOCKABLE)
    except BaseException:
        _set_mask(_SIG_SETMASK, before)
        raise
    return before  # type: ignore[no-any-return]


#: ``signal.pthread_sigmask``'s: each call converts a set of Python ints to a C mask and
#: back (the pure engine's). The compiled core has its own (``lockmgr._core``'s
#: ``hold_handlers_off`` and ``set_signal_mask``), on C masks: ``quietly_for``.
PYTHON_MASKS = None if _set_mask is None else Masks(
    hold_handlers_off, partial(_set_mask, _SIG_SETMASK),
    partial(_set_mask, _SIG_BLOCK, BLOCKABLE))

_get_ident = threading.get_ident
_main = [threading.main_thread().ident]  # a forked child's is the forking thread
# The masks of the quiet call the main thread is inside (its handlers held off), or None.
_quiet: list[Masks | None] = [None]
# The main thread's own mask while it is inside ``quietly``, for ``let_in``: the pure engine's
# sections run inside write the held-off one in MAIN_THREAD_MASK (put back as the call ends).
_outside: list[Iterable[int]] = [()]


def _after_fork_in_child() -> None:
    _main[0] = _get_ident()
    _quiet[0] = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Quietly(Protocol):
    def __call__(self, run: Callable[..., R], *args: Any,
                 undo: Callable[[R], object] | None = None) -> R: ...


def quietly_with(masks: Masks | None) -> Quietly:
    """``quietly`` changing the mask with ``masks`` (None: where nothing can be held off,
    the call as it is)."""
    if masks is None:
        def as_it_is(run: Callable[..., R], *args: Any,
                     undo: Callable[[R], object] | None = None) -> R:
            return run(*args)
        return as_it_is
    hold_off, set_mask, _ = masks

    def quietly(run: Callable[..., R], *args: Any,
                undo: Callable[[R], object] | None = None) -> R:
        """``run(*args)`` with the main thread's signal handlers held off (see the module
        docstring); if one raises as they are let in again after it, ``undo(result)`` runs
        (held off) and the exception propagates."""
        if _quiet[0] is not None or _get_ident() != _main[0]:
            return run(*args)
        mask = hold_off()  # (a handler raising here: nothing changed, the mask neither)
        MAIN_THREAD_MASK[0] = _outside[0] = mask
        _quiet[0] = masks
        try:
            done = run(*args)
        except BaseException:
            _let_in_after(mask, set_mask)  # (a handler raising here replaces the exception)
            raise
        try:
            # (``_let_in_after``, inline: the common path's one call fewer)
            _quiet[0] = None
            MAIN_THREAD_MASK[0] = mask
            set_mask(mask)
        except BaseException:
            if undo is None:
                raise
            # No check point before the mask is blocked again (a C call, whose handlers run
            # after the mask changed): nothing can stop the undo from running held off.
            _quiet[0] = masks
            try:
                try:
                    masks.hold_off_again()
                finally:
                    undo(done)
            finally:
                _let_in_after(mask, set_mask)
            raise
        return done

    return quietly


def _let_in_after(mask: Iterable[int], set_mask: Callable[[Iterable[int]], object]) -> None:
    """End a quiet call: the main thread's own mask back (its pending handlers run here)."""
    _quiet[0] = None
    MAIN_THREAD_MASK[0] = mask  # (sections of the pure engine run inside saw the quiet one)
    set_mask(mask)


#: The held-off step with ``signal.pthread_sigmask`` (the pure engine's managers').
quietly = quietly_with(PYTHON_MASKS)


def quietly_for(engine: object) -> Quietly:
    """The held-off step for the managers of ``engine``: on C masks if it is the compiled
    core's (``lockmgr._core``), ``quietly`` otherwise. Both run the handlers at the same
    points (after each change of the mask)."""
    module = sys.modules.get(type(engine).__module__)
    hold_off = getattr(module, "hold_handlers_off", None)
    if PYTHON_MASKS is None or hold_off is None:
        return quietly
    return quietly_with(Masks(hold_off, getattr(module, "set_signal_mask"),
                              getattr(module, "hold_handlers_off_again")))


def let_in(wait: Callable[..., R], *args: Any) -> R:
    """Inside ``quietly``: ``wait(*args)`` with the main thread's handlers let in (its own
    mask back), held off again after, whether it returns or raises. For waits that take
    nothing: a handler raising as it returns would lose what it took."""
    masks = _quiet[0]
    if masks is None or _get_ident() != _main[0]:
        return wait(*args)
    _quiet[0] = None
    try:
        masks.set_mask(_outside[0])
        return wait(*args)
    finally:
        _quiet[0] = masks
        masks.hold_off_again()


#: Blocks the handlers as one C call (``functools.partial`` of ``pthread_sigmask``), returning
#: the mask before; handlers of signals already pending run inside it, after the mask changed.
#: For a step that must run whatever a handler raises (a close in a ``finally``, the undo of
#: a grant in an ``except``), called inline there: a Python function's start is a check
#: point, where a handler's exception would skip the step; a C call has none before its work.
#: Its result, or the exception a handler raised in it (blocked then too), goes to
#: ``run_blocked``. (Where nothing can be blocked: ``tuple``, an empty mask.)
block_handlers: Callable[[], Iterable[int]] = (
    tuple if _set_mask is None else partial(_set_mask, _SIG_BLOCK, BLOCKABLE))


def run_blocked(blocked: Iterable[int] | BaseException, run: Callable[..., object],
                *args: Any) -> None:
    """The rest of a step begun by ``block_handlers()`` (its result or its exception):
    ``run(*args)`` with the handlers blocked, the thread's own mask back after (its pending
    handlers run then), and the handler's exception from the block raised at the end. A
    nested ``quietly`` runs as it is. The handler's exception is raised even if the step
    (or a handler as the mask comes back) raised too: that one is its ``__context__``.

    The limits, besides the module's (a process-directed signal received by another thread
    has its handler run on the main thread at its next check point, blocked or not): the
    handlers of several signals pending at one moment run one per check point, so after a
    raising one, the next runs at this function's start, where its exception skips the
    step (one signal, however often repeated, is covered); and a block that a handler
    stopped returned no mask, so the thread's own is put back as lockmgr last saw it
    (``MAIN_THREAD_MASK``: a mask changed since by the thread itself is not seen)."""
    try:
        _run_with_blocked_mask(blocked, run, args)
    finally:
        if isinstance(blocked, BaseException):
            raise blocked  # (what the step or a later handler raised: its __context__)


def _run_with_blocked_mask(blocked: Iterable[int] | BaseException, run: Callable[..., object],
                           args: tuple[Any, ...]) -> None:
    if not handlers_run_here():
        # (a worker thread runs no handler: its block returned; inside ``quietly`` the mask
        # was blocked already, and stays so)
        try:
            run(*args)
        finally:
            if _set_mask is not None and not isinstance(blocked, BaseException):
                _set_mask(_SIG_SETMASK, blocked)
    else:
        assert PYTHON_MASKS is not None
        # (the block raised with the mask changed: the thread's own, as last seen)
        own = MAIN_THREAD_MASK[0] if isinstance(blocked, BaseException) else blocked
        MAIN_THREAD_MASK[0] = _outside[0] = own
        _quiet[0] = PYTHON_MASKS
        try:
            run(*args)
        finally:
            _let_in_after(own, PYTHON_MASKS.set_mask)


def handlers_run_here() -> bool:
    """Whether a signal handler can run on the calling thread now: the main thread, outside
    ``quietly``, where masks exist (elsewhere a close needs no block)."""
    return _set_mask is not None and _quiet[0] is None and _get_ident() == _main[0]


def held_off() -> bool:
    """Whether the calling thread is the main thread inside ``quietly``."""
    return _quiet[0] is not None and _get_ident() == _main[0]


def _nothing() -> None:
    pass


def let_pending_in() -> None:
    """Inside ``quietly``: run the handlers of the signals that arrived meanwhile (a check
    point of a long wait made in slices with them held off); what they raise propagates."""
    let_in(_nothing)
