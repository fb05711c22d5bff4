"""The pure twin's runtime (the compiled core's ``_c/runtime.pxi``): each thread's token,
what a thread's exit releases (abandoned keys), and the fork hooks.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Hashable
from typing import TYPE_CHECKING

from .._errors import warn_abandoned
from ._state import (
    _Token, _catch_up_after_fork, _forked_from, _get_ident, _main_thread, _mutex, _section,
    _yield_gil)

if TYPE_CHECKING:
    from ._engine import _Engine


class _ThreadExit:
    """Held only by its thread's local storage, so it is finalized when the thread ends.

    It then releases whatever the thread still holds (waiters get those keys as usual).
    Entries refer to their owner's token, so the token itself may outlive its thread.
    """

    __slots__ = ("thread_name", "token")

    def __init__(self, token: _Token) -> None:
        # The thread's name when its token was made (by its first use of lockmgr): the
        # thread is gone from threading when its abandoned keys are reported. Set first:
        # __del__ reads it once ``token`` is set.
        self.thread_name = threading.current_thread().name
        self.token = token

    def __del__(self) -> None:
        token: _Token | None = getattr(self, "token", None)  # a handler may cut __init__ short
        if token is None:
            return
        if sys.is_finalizing() or token.request is not None or os.getpid() != _fork_parent_pid:
            # Interpreter teardown (this module's globals may be gone already, and nobody
            # can take the keys any more), a daemon thread gone mid-wait, or a forked child,
            # where only the forking thread lives on and _after_fork_in_child frees the rest.
            return
        # Dropping the released keys and warning run Python code (finalizers, warning
        # filters) in this thread, while its local storage is being cleared: the token stays
        # the thread's own (``_exiting``) until that code is done, and what it takes is
        # released in the next round (bounded: a finalizer may take a key each time).
        own = token.ident == _get_ident()
        if own:
            _exiting[token.ident] = token
        try:
            for _ in range(_EXIT_ROUNDS):
                if not _release_abandoned(token, self.thread_name):
                    break
        finally:
            if own:
                _exiting.pop(token.ident, None)


_EXIT_ROUNDS = 100  # bounds a finalizer that takes a key again each time it is released


def _release_abandoned(token: _Token, thread_name: str | None = None) -> bool:
    """Release every key an ending thread holds, then drop them and warn, naming
    ``thread_name`` (see warn_abandoned): all of which may run Python code. False if it
    held none."""
    managers: dict[int, _Engine] = {}  # not a set of the references: a dead one's hash
    for manager_ref in _section(_holding_managers, token):  # may be unknown
        manager = manager_ref()
        if manager is not None:  # else it is being torn down: it unlinks its entries
            managers[id(manager)] = manager
    if not managers:
        return False
    abandoned: list[Hashable] = []
    for manager in managers.values():
        abandoned += _section(manager._release_held_section, token)
    if abandoned and not sys.is_finalizing():
        warn_abandoned(token.ident, abandoned, thread_name)
    return True


def _holding_managers(token: _Token) -> list[weakref.ref[_Engine]]:
    """In a section: the managers (references) whose keys ``token`` holds."""
    return [*token.held.values(), *token.reads.values()]


_local = threading.local()
_thread_tokens: weakref.WeakValueDictionary[int, _Token] = weakref.WeakValueDictionary()
_exiting: dict[int, _Token] = {}  # ident -> token of a thread whose exit runs (_ThreadExit)
_managers: weakref.WeakSet[_Engine] = weakref.WeakSet()  # every live manager (for fork)
_fork_parent_pid = os.getpid()  # the process whose threads' exits release their keys


def _current_token() -> _Token:
    if _exiting:  # before _local: an ending thread's local storage is being cleared
        exiting = _exiting.get(_get_ident())
        if exiting is not None:
            return exiting
    try:
        token: _Token = _local.guard.token
    except AttributeError:
        token = _Token()
        _local.guard = _ThreadExit(token)
        _thread_tokens[token.ident] = token  # a cycle through a task may pass this thread
    return token


def _existing_token() -> _Token | None:
    if _exiting:
        exiting = _exiting.get(_get_ident())
        if exiting is not None:
            return exiting
    guard: _ThreadExit | None = getattr(_local, "guard", None)
    return None if guard is None else guard.token


def _before_fork() -> None:
    """Hold the engine mutex across fork(), so the child sees whole tables."""
    ident = _get_ident()
    while _mutex.setdefault(0, ident) != ident:
        _yield_gil(0)
    _forked_from[0] = os.getpid()


def _after_fork_in_parent() -> None:
    ident = _get_ident()
    _forked_from[0] = 0
    if 0 in _mutex and _mutex[0] == ident:
        del _mutex[0]


def _after_fork_in_child() -> None:
    """The child holds only what the forking thread held (and keeps its request, if it forked
    from inside a wait); the rest is free, the other queued requests are gone."""
    global _fork_parent_pid
    if not _forked_from[0]:  # set up already: an earlier handler called a manager
        return
    _forked_from[0] = 0
    _mutex.clear()
    _fork_parent_pid = os.getpid()
    _main_thread[0] = _get_ident()  # the forking thread is the child's main thread
    survivor = _existing_token()
    if survivor is not None:
        survivor.is_main = True
    for manager in list(_managers):
        _section(manager._keep_only, survivor)


_catch_up_after_fork[0] = _after_fork_in_child

if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)
