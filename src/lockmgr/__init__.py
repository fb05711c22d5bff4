"""lockmgr: lock anything by key — one manager instead of one lock per object.

>>> from lockmgr import LockManager
>>> locks: LockManager[str] = LockManager()
>>> with locks["user:42"]:
...     pass

The engine is the compiled ``lockmgr._core`` when it is available and
``LOCKMGR_NO_EXTENSIONS`` is unset or empty; otherwise its pure-Python twin
``lockmgr._pure``, which has identical semantics. ``lockmgr.implementation`` says which.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ._common import (
    AbandonedLockWarning,
    DeadlockError,
    LockError,
    LockLost,
    LockStats,
    LockTimeout,
    NestedWaitError,
    NotOwnedError,
)

__all__ = [
    "AbandonedLockWarning",
    "DeadlockError",
    "KeyLock",
    "LockError",
    "LockLost",
    "LockManager",
    "LockStats",
    "LockTimeout",
    "NestedWaitError",
    "NotOwnedError",
    "RWLockManager",
    "implementation",
]

implementation: str
NO_EXTENSIONS = bool(os.environ.get("LOCKMGR_NO_EXTENSIONS"))

if TYPE_CHECKING or NO_EXTENSIONS:
    from ._pure import KeyLock, LockManager, RWLockManager

    implementation = "python"
else:
    try:
        from ._core import KeyLock, LockManager, RWLockManager
    except ImportError:  # pragma: no cover - built without a compiler, or on PyPy
        from ._pure import KeyLock, LockManager, RWLockManager

        implementation = "python"
    else:
        implementation = "cython"

for _exported in (
    AbandonedLockWarning, DeadlockError, LockError, LockLost, LockStats, LockTimeout,
    NestedWaitError, NotOwnedError,
):
    _exported.__module__ = __name__
del _exported
