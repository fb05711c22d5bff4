# cython: language_level=3, binding=False, freethreading_compatible=True, embedsignature=True, embedsignature.format=clinic
"""The compiled engine of lockmgr, built as ``lockmgr._core``.

It is ``src/lockmgr/_pure/`` in C: the same entries, requests, holds and tokens, the same
hand-off rules (that package's docstring states them). What this file adds is how the state is
kept safe from everything else that runs in a Python process.

Sections and fast paths
-----------------------
Every read or write of a table, an entry, a request, a hold or a token's lists happens in a
*section* or a *fast path*: ``noexcept nogil`` C functions, so the compiler rejects any
Python object operation in them, no Python code (a key's ``__eq__``, a finalizer, a gc
callback, a signal handler, a weakref callback) can run in the middle of a change, and
nothing in them can fail.

- A *section* runs with ``engine_mutex`` held and takes (``touch``) the mutex of each shard
  whose entries it reads, keeping them to its end. It can do anything: queue, grant, wake,
  search the wait-for graph, release what a thread holds in every manager.
- A *fast path* holds one shard's mutex and nothing else: an acquisition of a key that is
  free or re-entered, or a release that hands nothing over, by a thread that is not waiting.
  Whatever else it meets (a queue, an error, a key that needs a Python comparison) it leaves
  untouched and the operation runs as a section instead. Threads using keys of different
  shards therefore share no memory on the uncontended path (free-threaded builds have 64
  shards per table by default, builds with a GIL one; ``LOCKMGR_SHARDS`` sets it).

Every operation is written in three steps:

- *prepare* (GIL held, Python allowed): hash the key, take the thread's token, allocate
  whatever the section may need (an entry, a hold, the nodes of a set);
- *fast path or section*: decide and change; record what is left to do in an ``After``:
  entries the tables gave up (their keys are dropped later), requests to wake, a cycle found;
  or answer COMPARE: a stored key needs a Python ``__eq__`` against the caller's key — the
  section then changed nothing, prepare compares (a strong reference keeps the stored key
  alive) and runs the section again with the answer. An answer is about two objects, not
  about the table, so it stays true whatever the table did meanwhile (and the reference
  keeps the stored key's address from being reused): each stored key is compared at most
  once per lookup, so a key whose ``__eq__`` itself uses the manager cannot livelock it;
- *finish* (no mutex held): post the woken waiters' wakeup locks, drop retired keys, free
  or keep retired entries, resize shards, build errors and warnings.

Exact ``str``, ``bytes``, ``int`` and tuples of them compare inside a section
(``lockmgr_key_equal``: plain C reads of immutable objects, no Python code, cannot fail).

Who guards what (each field in ``_core.pxd`` names its guard): an entry's state, and
its shard's buckets and counters, by the shard's mutex; queues, requests, the wait-for graph,
``Table.waiting`` and the list of live tables by ``engine_mutex``; a token's lists of holds
by its own thread, which alone writes them, except that a grant made while it waits (when
its fast paths are off) writes them under ``engine_mutex``. A manager freed while another
thread holds some of its keys leaves those holds linked in that thread's lists (orphans),
drops their keys, and flags the thread, whose next section frees them: only it may change
its lists.

The mutexes and the lock-ordering rules
---------------------------------------
``engine_mutex`` (a ``PyMutex`` on 3.13+, a one-byte atomic lock before) and one one-byte
spin lock per shard (an exchange to take, a release store to give back: half the atomic
operations of a ``PyMutex`` pair, which the uncontended path pays for). Rules:

1. Sections and fast paths never block, never allocate, never call into Python and take no
   other lock, with one exception: a section takes shard mutexes. Only the holder of
   ``engine_mutex`` ever holds more than one shard mutex, and a fast path (or a resize)
   holds one and takes nothing while holding it, so shards may be taken in any order and
   a waiter for a shard waits at most for one short fast path: it spins, yielding its core.
   (They free memory with ``PyMem_RawFree``, which runs no Python and cannot fail.)
2. ``engine_mutex`` is taken only with the GIL held (attached, free-threaded), never while
   holding a shard mutex, and a thread that must wait for it releases the GIL (detaches)
   while it waits (PyMutex does; the fallback uses ``Py_BEGIN_ALLOW_THREADS``), so its
   holder, which never needs the GIL, always finishes. Nothing waits for a shard detached,
   and with a GIL no section ever finds a shard mutex taken (no section releases the GIL).
3. A thread sleeps only on its own token's ``wakeup`` lock, without the GIL and without any
   mutex. Posting one (``PyThread_release_lock``) takes at most CPython's short internal
   mutex of that lock, whose holder never needs the GIL or our mutexes.
4. Fork: a child never sees half a change, and the fork hooks take no mutex (another
   library's before-fork hook, which runs after ours, may join a thread whose exit needs
   ``engine_mutex``). With a GIL, the forking thread holds it across ``fork()`` and no
   section or fast path releases it. Free-threaded, CPython stops the world after the
   before-fork hooks, which waits for every attached thread to reach a point between
   bytecodes; sections and fast paths never detach (nothing in them waits detached: a
   shard mutex is waited for by spinning), so none is under way. The child's after-fork
   hook re-initialises every mutex.

Files
-----
This file (``lockmgr_core.pyx``, at the repository's root) is the module's root: these rules
and the imports. ``src/lockmgr/_core.pxd`` declares every structure (each field with who
writes it under which guard) and the C shim, whose code is in real headers in
``src/lockmgr/_c/``: ``lockmgr_platform.h`` (versions, builds, the clock),
``lockmgr_locks.h`` (the two kinds of mutex) and ``lockmgr_keys.h`` (hashing, and comparing
keys without Python code). The rest is included from ``src/lockmgr/_c/``: ``state.pxi``
(the module state), ``table.pxi and ``operations.pxi`` (the sections), ``runtime.pxi`` (the mutex,
finish, lookups, tokens, thread exit, fork), ``tasks.pxi`` (asyncio tasks' tokens and waits),
``engine.pxi`` (prepare/section/finish for every operation, and the engine class) and
``managers.pxi`` (the public classes).

Waiting
-------
A waiting thread's request lives in its own C stack frame; it is queued in a section and
leaves the queues in a section before the frame ends. A granting or waking section sets the
request's state and links it into its ``After``; its finish posts the waiter's wakeup lock
(a binary semaphore: one post per WAITING -> WOKEN/GRANTED transition, consumed by the
waiter before its request goes back to WAITING or ends — a waiter that finds its state
changed before it saw the post waits for the post, which is at most a finish away). The
waiter re-reads its state in a section after every wake-up and runs signal handlers (and,
on 3.12+, the garbage collector) only while it is still waiting. Code that runs there may
use any manager, with one rule: it may not start a second wait (NestedWaitError); see the
docs' "When things go wrong" (docs/semantics.md).

Seeing contention
-----------------
What ``snapshot()``, ``metrics()`` and the slow-wait log read is kept by sections too: hold
start times (``held_since``, shard), the histograms and the hot-key slots (``Table``,
engine). They are written only where a request waits or a queue exists, so fast paths pay
one store at most. A snapshot copies into memory prepare allocated (and again, larger, if
the table grew); a hot key evicted in a section is dropped by its finish; records, ``repr``s
and logging run in ``lockmgr._observe`` after the section. Wait observers (lockmgr.otel) are
read and replaced under ``engine_mutex`` (a reference taken, nothing else). The hot-key
slots are C references the manager types' ``tp_traverse``/``tp_clear`` show to the garbage
collector (``_c/managers.pxi``), which runs while no section can be under way.

Tasks
-----
An asyncio task that uses an ``aio`` view gets a token of its own (``_c/tasks.pxi``): its
"thread" is the one running its loop, where it always runs, so the rules above hold for it
unchanged. Its request lives in a ``_TaskWait`` object instead of a C stack frame, and its
wake-up is a ``Waker`` (``lockmgr._owners``) rather than a lock: a waking section takes a
reference to the ``_TaskWait`` (``Request.waiter``) and its finish posts the Waker — from
the loop's thread directly, from any other through ``call_soon_threadsafe`` — and drops the
reference, so the request's memory outlives every finish that may still read it. The post
protocol is the threads' one (``post_owed``): a task whose request changed before its post
arrived awaits the post (``AWAIT_POST``) before its request may change again. A task waits
only for its loop's thread to run it, so the deadlock search follows a task to that thread
when it waits in a synchronous acquire (``waiting_threads``). A ``_TaskWait`` is known to its
task only once its section queued it, and whether it has ended is decided in a section
(``over``), so of two threads ending it at once one does. Who is inside an ``async with``
object is recorded in the object (``_BlockRecord``: the task's owner and a depth) once the
task holds the key; its exit gives back that owner's hold, never looking at frames.
"""

cimport cython
from cpython.exc cimport PyErr_WarnEx
from cpython.mem cimport PyMem_RawCalloc, PyMem_RawFree, PyMem_RawMalloc
from cpython.object cimport Py_EQ, PyObject, PyObject_RichCompareBool, PyTypeObject
from cpython.pythread cimport (
    NOWAIT_LOCK,
    PY_LOCK_ACQUIRED,
    PY_LOCK_INTR,
    WAIT_LOCK,
    PyLockStatus,
    PyThread_acquire_lock,
    PyThread_allocate_lock,
    PyThread_free_lock,
    PyThread_get_thread_ident,
    PyThread_release_lock,
    PyThread_tss_create,
    PyThread_tss_get,
    PyThread_tss_set,
    PyThread_type_lock,
)
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from libc.math cimport ceil
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

import collections.abc
import os
import signal
import sys
import threading
from types import GenericAlias

from lockmgr._aio import AsyncLockManager, AsyncRWLockManager, AsyncSemaphoreManager
from lockmgr._aio import _wait_for_grant as wait_for_grant
from lockmgr._observe import (
    HISTOGRAM_BOUNDS,
    HOT_KEY_SLOTS as HOT_KEY_SLOTS_SHARED,
    build_metrics,
    build_snapshot,
    log_slow_wait,
    log_wait_end,
    log_waits_after_seconds,
)
from lockmgr._args import (
    Stripe,
    hold_seconds,
    many_items,
    restored_count,
    rw_items,
    slot_limit,
    stripe_count,
    wait_seconds,
)
from lockmgr._errors import (
    block_in_use,
    count_overflow,
    deadlock,
    nested_wait,
    not_entered,
    not_owned,
    pinned,
    timed_out,
    warn_abandoned,
)
from lockmgr._owners import (
    AWAIT_POST,
    AWAITED_THREAD,
    CONTEXT_TASK,
    LOOP_THREAD,
    POST_ATTEMPTS,
    WAIT_CHECK,
    Waker,
    awaits_this_thread,
    not_in_task,
)
from lockmgr._quiet import BLOCKABLE
from lockmgr._tuning import HANDOFF_AFTER, MAIN_THREAD_SLICE, shards_per_table
from lockmgr._views import (
    PICKLE_ERROR,
    KeySemaphore,
    LockStats,
    key_lock_repr,
    manager_repr,
    semaphore_repr,
    synchronized,
)

cdef object DEFAULT_TIMEOUT = -1  # the acquiring methods' default (a cached int: told by identity)

cdef extern from "Python.h":
    ctypedef long long PY_TIMEOUT_T
    const PY_TIMEOUT_T PY_TIMEOUT_MAX
    const Py_ssize_t PY_SSIZE_T_MAX
    PyLockStatus PyThread_acquire_lock_timed(
        PyThread_type_lock lock, PY_TIMEOUT_T microseconds, int intr_flag) nogil
    int PyErr_CheckSignals() except -1
    PyObject *PyThreadState_GetDict()
    PyObject *PyDict_GetItemWithError(object mapping, object key) except? NULL
    # Taking a reference runs no Python code and cannot fail: allowed inside sections.
    void lockmgr_incref "Py_INCREF"(PyObject *o) nogil
    # The garbage collector's slots, for the references a table holds in C (hot keys).
    ctypedef int (*visitproc)(PyObject *, void *) noexcept
    ctypedef int (*traverseproc)(PyObject *, visitproc, void *) noexcept
    ctypedef int (*inquiry)(PyObject *) noexcept
    ctypedef struct GCSlots "PyTypeObject":
        traverseproc tp_traverse
        inquiry tp_clear



include "src/lockmgr/_c/state.pxi"
include "src/lockmgr/_c/table.pxi"
include "src/lockmgr/_c/operations.pxi"
include "src/lockmgr/_c/runtime.pxi"
include "src/lockmgr/_c/tasks.pxi"
include "src/lockmgr/_c/engine.pxi"
include "src/lockmgr/_c/managers.pxi"
include "src/lockmgr/_c/signals.pxi"
