"""Across the processes of one host, no server: kernel record locks behind the lockmgr API.

``HostLockManager`` and ``HostRWLockManager`` offer the methods of ``LockManager`` and
``RWLockManager`` to every process of one host (one kernel) that names the same directory.
Within a process, threads are ordered by the in-process engine; across processes, by
record locks on the directory's files, which the kernel releases when a process ends,
however it ends (``docs/host.md``).

The map:

- ``_directory``: the directory and its files, opened and checked (what is refused);
- ``_kernel``: the record locks (OFD on Linux, POSIX elsewhere) and the doorbells a waiter
  sleeps on, with what the kernel does not give: no overtaking by a releaser, writers
  before new readers;
- ``_shared``: what the managers of one directory share in a process (its descriptors,
  which identities the process holds for which manager);
- ``_engine``: the two layers (in process, then the kernel) and each thread's levels;
- ``_tasks``: asyncio tasks as owners (``locks.aio``): each task's levels, and its waits
  for kernel locks in threads of their own, so that the event loop never blocks;
- ``_aio``: the ``aio`` views (``lockmgr._layered_aio``'s, shared with ``lockmgr.postgres``);
- ``_managers``: the public managers.

Keys (str, bytes, int and tuples of them) map to 64-bit identities as in
``lockmgr.postgres`` (``lockmgr._keyhash``): a collision can only make two keys wait for
each other, never let two holders in.
"""

from __future__ import annotations

import sys

if sys.platform == "win32":  # pragma: no cover - the wheels workflow builds no Windows test
    raise ImportError("lockmgr.host needs POSIX record locks: Windows is not supported yet")

from .._layered import Lease
from ._directory import UnsafeDirectoryError
from ._inspect import HostKeyState
from ._managers import HostKeyLock, HostLockManager, HostRWLockManager

__all__ = ["HostKeyLock", "HostKeyState", "HostLockManager", "HostRWLockManager", "Lease",
           "UnsafeDirectoryError"]
