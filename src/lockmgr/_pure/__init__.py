"""The pure-Python twin of ``lockmgr._core``: the same engine, the same semantics.

It is the reference the compiled core is tested against, the fallback where no compiled
core is available (PyPy, no compiler), and what type checkers read.

The engine (the compiled core follows it name for name): a manager keeps a table of
*entries*, one per key that is held or waited on. An entry has a write holder (a per-thread
*token*, never the integer ident) with its recursion count, read holders with theirs
(RWLockManager; a SemaphoreManager's slot owners, each level a slot, at most the entry's
``limit`` levels in all, set when the entry is made; ``entry.slots`` counts them), and a
FIFO queue of *requests*. A request belongs to one waiting thread, which sleeps on its
token's ``wakeup`` lock. When a holder or a request leaves (or gives back a slot),
``_pass_on`` grants what the head of the queue allows: a run of readers together (up to
the limit), or one writer (strict FIFO: the head becomes the holder before ``release``
returns; with ``fair=False`` and a head that has waited less than ``HANDOFF_AFTER``, the key
is freed and the head woken to race for it).

Sections. Every read or write of a table, entry, request, hold or token happens in a
*section*: a function run by ``_section()`` (directly, or by ``_run_on_key``, which finds
the key's entry for it) under the one engine-wide mutex that every manager of this package
shares. Outside any section run only the public methods, ``_run_on_key``, ``_acquire`` and
the ``_acquire_*``/``_take_many``/``_release_write``/``_release_read``/``_release_many``
wrappers, ``_wait`` and ``_Unsure.settle``; every other method of ``_Engine`` runs inside
one. A section runs only the engine's own code: keys are hashed before it; a key whose
``__eq__`` could run Python code is compared after it (the section returns ``_Unsure``,
and is run again with the outcome, which it trusts only if no entry joined that hash's
chain meanwhile); errors and warnings are built after it (a section returns a *verdict*);
entries it drops wait in ``_retired`` until it has ended, so no key's ``__del__`` runs
inside. Python code can still run inside a section uninvited: the garbage collector's
finalizers and callbacks (at any bytecode), profile/trace functions, and (see below) a
signal handler. If that code calls a manager, ``_section()`` refuses with RuntimeError
(``_reentered``) instead of deadlocking on the mutex its own thread holds; such errors are
unraisable in finalizers anyway. Unlike the compiled core, sections post wakeup locks
themselves: ``Lock.release`` runs no Python code, and posting together with the state
change keeps the semaphore rule below simple.

Asynchronous exceptions. Python runs signal handlers on the main thread only, at *check
points* (a function's start, a call's return, a loop's jump back); a handler that raises
(KeyboardInterrupt) can interrupt whatever runs there. So:
- on the main thread, ``_section()`` blocks every signal that may have a Python handler
  (``_BLOCKABLE``: all but SIGKILL, SIGSTOP and those a fault raises synchronously) before
  it takes the mutex and restores the thread's mask after it has freed it. Blocking runs
  the handlers of signals already pending (after the mask changed, before anything else);
  restoring runs those that arrived meanwhile, after the section. Worker threads run no
  handlers and skip this (it costs two system calls per section);
- the mutex is the single slot ``_mutex[0]``, claimed with ``dict.setdefault`` (test-and-set
  and "who holds it" in one C call) inside the ``try`` whose ``finally`` frees it with
  ``del`` (no call, so no check point, before it): nothing can leak it;
- ``_acquire`` wraps everything from the section that decides to the outcome: an exception
  anywhere in there (the sleep between sections included, and a handler raising when a
  section restores the mask) takes the request out of the queues again or gives back what
  it was granted (``_abandon_section``, idempotent, retried if another handler raises
  meanwhile); on the main thread an immediate grant is recorded as a GRANTED request for
  that (``_granted_at_once``). Nothing stays queued or held that the caller does not know of.
The limits: a signal blocked on the main thread but delivered to another thread (a
process-directed one, such as a terminal's Ctrl-C, while the main thread is in a section)
still has its handler run on the main thread at its next check point, inside the section
(measured: within a millisecond on 3.11-3.13), and where ``pthread_sigmask`` does not exist
(Windows) nothing is blocked; an exception there stops that section's changes where they
got to. The docs' "When things go wrong" (docs/semantics.md) state this.

Lock ordering: there is one mutex, and nothing that blocks is ever called while it is held
(posting a wakeup lock does not block). A thread that finds it taken yields the GIL and
tries again; sections are short and never wait.

Invariants (each kept by the sections named):
- an entry is in its manager's table iff it has a holder or a queued request (``_pass_on``
  drops it when the last one leaves; an entry is only created to be taken or queued on in
  the same section);
- ``entry.count > 0`` iff ``entry.owner is not None``; every read count is > 0; no count
  exceeds ``MAX_COUNT`` (every section that adds levels checks first);
- in fair mode an entry whose head request could be granted has no queue: ``_pass_on``
  runs whenever a holder or a request leaves;
- with ``fair=False``, an entry without holders but with a queue has a WOKEN head, on its
  way to take the key;
- a token has at most one request, ``token.request``, from the section that queues it (or,
  on the main thread, grants it at once) until its acquiring call has the outcome
  (``_acquire`` clears it); a call that would queue another one gets NestedWaitError
  (``_NESTED`` verdict);
- a waiting multi-key request holds the levels of its re-entered keys already (*pinned*:
  taken when it queues, given back if it leaves, ordinary levels once it is granted);
  releases never take pinned levels (``_pinned``);
- a token's ``wakeup`` lock is released (posted) only on a request's WAITING -> WOKEN or
  WAITING -> GRANTED transition, inside the section that makes it (WOKEN -> GRANTED reuses
  the post already made), and the waiter consumes that post (``token.consume_post``) in the
  section where it sees the new state, before its request goes back to WAITING or ends;
  consuming twice is harmless (the lock is then simply held), so the lock acts as a binary
  semaphore whatever exceptions interrupt the wait.

Modules (the compiled core's section files, ``src/lockmgr/_c/*.pxi``, name for name), each
importing only those above it: ``_state`` (request states, verdicts, the mutex and
``_section``, tokens, requests, entries), ``_runtime`` (each thread's token, thread exit,
the fork hooks), ``_table`` (finding entries, their holders, what the contended path
measures), ``_operations`` (acquiring, the deadlock search, waiting, releasing, granting),
``_tasks`` (asyncio tasks as owners), ``_engine`` (``_Engine``: the table's, the operations'
and the tasks' methods, one class per concern stacked in that order, with its
introspection on top) and ``_managers`` (``LockManager``, ``RWLockManager``, ``KeyLock``).
Module-level state (the mutex slot, ``_retired``, the thread tokens, the managers a fork
visits) lives in exactly one of them; the classes below keep ``lockmgr._pure`` as their
module, as before the split.
"""

from __future__ import annotations

# Each name below is one that code outside this package reads from lockmgr._pure: the
# engine's (lockmgr.__init__, the engine contract's EngineModule), the classes the engine
# contract, the docs' signatures and the tests name, the mutex slot the tests check is
# free, and the functions the tests trace.
from .._aio import AsyncKeyLock as AsyncKeyLock
from ._state import _mutex as _mutex
from ._tasks import _answer as _answer
from ._tasks import _BlockRecord as _BlockRecord
from ._tasks import _task_awaitable as _task_awaitable
from ._tasks import _TaskWait as _TaskWait
from ._tasks import end_stranded_task as end_stranded_task
from ._engine import _Engine as _Engine
from ._managers import _Holding as _Holding
from ._managers import _HoldingMany as _HoldingMany
from ._managers import KeyLock as KeyLock
from ._managers import LockManager as LockManager
from ._managers import RWLockManager as RWLockManager
from ._managers import SemaphoreManager as SemaphoreManager

__all__ = ["AsyncKeyLock", "KeyLock", "LockManager", "RWLockManager", "SemaphoreManager",
           "end_stranded_task"]

for _class in (LockManager, RWLockManager, SemaphoreManager, KeyLock, _Engine, _Holding, _HoldingMany, _TaskWait,
               _BlockRecord):
    _class.__module__ = __name__  # reprs, messages and pickles name lockmgr._pure, as before
del _class
