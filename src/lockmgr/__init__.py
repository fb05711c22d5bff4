"""lockmgr: lock anything by key — one manager instead of one lock per object.

>>> from lockmgr import LockManager
>>> locks: LockManager[str] = LockManager()
>>> with locks["user:42"]:
...     pass

The engine is the compiled ``lockmgr._core`` when it is available, ``LOCKMGR_NO_EXTENSIONS``
is unset or empty, and this is the main interpreter; otherwise its pure-Python twin
``lockmgr._pure``, which has identical semantics. ``lockmgr.implementation`` says which, and
``lockmgr.implementation_reason`` why.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

from ._aio import AsyncLockManager, AsyncRWLockManager, AsyncSemaphoreManager
from ._errors import (
    AbandonedLockWarning,
    DeadlockError,
    FlightAbortedError,
    LockError,
    LockLost,
    LockTimeout,
    NestedWaitError,
    NotOwnedError,
)
from ._views import KeySemaphore, LockStats
from ._flight_aio import AsyncSingleflight
from ._singleflight import Singleflight
from ._observe import Histogram, Holder, HotKey, KeyState, LockMetrics, Waiter

__all__ = [
    "AbandonedLockWarning",
    "AsyncKeyLock",
    "AsyncLockManager",
    "AsyncRWLockManager",
    "AsyncSemaphoreManager",
    "AsyncSingleflight",
    "DeadlockError",
    "FlightAbortedError",
    "Histogram",
    "Holder",
    "HotKey",
    "KeyLock",
    "KeySemaphore",
    "KeyState",
    "LockError",
    "LockLost",
    "LockManager",
    "LockMetrics",
    "LockStats",
    "LockTimeout",
    "NestedWaitError",
    "NotOwnedError",
    "RWLockManager",
    "SemaphoreManager",
    "Singleflight",
    "Waiter",
    "implementation",
    "implementation_reason",
]

implementation: str
"""``"cython"`` (the compiled core) or ``"python"`` (the pure-Python twin)."""
implementation_reason: str
"""Why ``implementation`` is what it is, in a sentence: the compiled core, or what kept it out."""
NO_EXTENSIONS = bool(os.environ.get("LOCKMGR_NO_EXTENSIONS"))


def _in_subinterpreter() -> bool:
    """Whether this is an interpreter other than the process's main one (PEP 554/734)."""
    for name in ("_interpreters", "_xxsubinterpreters"):  # 3.13+, then 3.8-3.12
        try:
            interpreters = importlib.import_module(name)
        except ImportError:
            continue
        current, main = interpreters.get_current(), interpreters.get_main()
        # 3.13+ returns (id, whence) pairs, earlier versions an id object.
        if isinstance(current, tuple):
            current, main = current[0], main[0]
        return bool(current != main)
    return False  # no subinterpreters on this Python (PyPy): always the main one


if TYPE_CHECKING or NO_EXTENSIONS:
    from ._pure import AsyncKeyLock, KeyLock, LockManager, RWLockManager, SemaphoreManager

    implementation = "python"
    implementation_reason = "LOCKMGR_NO_EXTENSIONS is set: the pure-Python twin was asked for"
elif _in_subinterpreter():
    # The compiled core keeps one engine per process in C (its tables, the thread tokens,
    # the wait-for graph) holding Python objects, so it may live in one interpreter only.
    # CPython refuses it in an isolated subinterpreter; in a legacy one Cython would load it
    # into whichever interpreter imports it first, and refuse it everywhere else, the main
    # interpreter included. Choosing here keeps it the main interpreter's, always.
    from ._pure import AsyncKeyLock, KeyLock, LockManager, RWLockManager, SemaphoreManager

    implementation = "python"
    implementation_reason = (
        "this is a subinterpreter: the compiled core is one engine per process and serves "
        "the main interpreter only, so the pure-Python twin (same semantics, slower) runs here"
    )
else:
    try:
        from ._core import AsyncKeyLock, KeyLock, LockManager, RWLockManager, SemaphoreManager
    except ImportError as error:  # pragma: no cover - built without a compiler, or on PyPy
        from ._pure import AsyncKeyLock, KeyLock, LockManager, RWLockManager, SemaphoreManager

        implementation = "python"
        implementation_reason = (
            f"the compiled core could not be imported ({error}): the pure-Python twin "
            "(same semantics, slower) runs instead"
        )
    else:
        implementation = "cython"
        implementation_reason = "the compiled core lockmgr._core"

for _exported in (
    AbandonedLockWarning, AsyncLockManager, AsyncRWLockManager, AsyncSemaphoreManager,
    AsyncSingleflight, DeadlockError, FlightAbortedError, KeySemaphore, LockError, LockLost,
    LockStats, LockTimeout, NestedWaitError, NotOwnedError, Histogram, Holder, HotKey, KeyState,
    LockMetrics, Singleflight, Waiter,
):
    _exported.__module__ = __name__
del _exported
