# cython: language_level=3, binding=False, freethreading_compatible=True
"""The compiled engine of lockmgr, built as ``lockmgr._core``.

It is ``src/lockmgr/_pure.py`` in C: the same entries, requests, holds and tokens, the same
hand-off rules (that file's docstring states them). What this file adds is how the state is
kept safe from everything else that runs in a Python process.

Sections
--------
Every read or write of a table, an entry, a request, a hold or a token's lists happens in a
*section*: a ``noexcept nogil`` C function, called with ``engine_mutex`` held. The compiler
rejects any Python object operation in such a function, so no Python code (a key's
``__eq__``, a finalizer, a gc callback, a signal handler, a weakref callback, another thread
on a free-threaded build) can run in the middle of a change, and nothing in a section can
fail. Every operation is written in three steps:

- *prepare* (GIL held, Python allowed): hash the key, take the thread's token, allocate
  whatever the section may need (an entry, a hold, the nodes of a set);
- *section* (mutex held): decide and change; record what is left to do in an ``After``:
  entries the tables gave up (their keys are dropped later), requests to wake, a cycle found;
  or answer COMPARE: a stored key needs a Python ``__eq__`` against the caller's key — the
  section then changed nothing, prepare compares (a strong reference keeps the stored key
  alive) and runs the section again with the answer. An answer is about two objects, not
  about the table, so it stays true whatever the table did meanwhile (and the reference
  keeps the stored key's address from being reused): each stored key is compared at most
  once per lookup, so a key whose ``__eq__`` itself uses the manager cannot livelock it;
- *finish* (mutex released): post the woken waiters' wakeup locks, drop retired keys, free
  or keep retired entries, resize a table, build errors and warnings.

Exact ``str``, ``bytes``, ``int`` and tuples of them compare inside a section
(``lockmgr_key_equal``: plain C reads of immutable objects, no Python code, cannot fail).

The mutex and the lock-ordering rules
-------------------------------------
One mutex, ``engine_mutex``, guards every table of every manager of this module and every
token (a ``PyMutex`` on 3.13+, a one-byte atomic lock before). Engine-wide rather than per
manager: thread exit, teardown, fork and the deadlock search touch several tables at once,
and one uncontended mutex costs the same as one per manager under the GIL (measured by the
benchmark). Rules:

1. Sections never block, never allocate, never call into Python, and never take another lock
   (they free memory with ``PyMem_RawFree``, which runs no Python and cannot fail).
2. The mutex is taken only with the GIL held (in prepare/finish code), and a thread that must
   wait for it releases the GIL while it waits (PyMutex detaches; the fallback uses
   ``Py_BEGIN_ALLOW_THREADS``), so its holder, which never needs the GIL, always finishes.
3. A thread sleeps only on its own token's ``wakeup`` lock, without the GIL and without the
   mutex. Posting one (``PyThread_release_lock``) takes at most CPython's short internal
   mutex of that lock, whose holder never needs the GIL or ``engine_mutex``.
4. Fork: a child never sees half a change. With a GIL, the forking thread holds the GIL
   across ``fork()``, so no other thread is inside a section; the mutex is not held across
   it (a thread ending in the parent while another library's fork hook runs must not block).
   Free-threaded, the before-fork hook takes the mutex and the parent's after hook releases
   it. The child's after hook re-initialises it either way.

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
README's "When things go wrong".
"""

cimport cython
from cpython.mem cimport PyMem_RawCalloc, PyMem_RawFree, PyMem_RawMalloc
from cpython.object cimport Py_EQ, PyObject, PyObject_RichCompareBool
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
from cpython.ref cimport Py_XDECREF
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

import os
import threading
from types import GenericAlias

from lockmgr._common import (
    HANDOFF_AFTER,
    MAIN_THREAD_SLICE,
    PICKLE_ERROR,
    LockStats,
    count_overflow,
    deadlock,
    hold_seconds,
    key_lock_repr,
    manager_repr,
    many_items,
    nested_wait,
    not_owned,
    pinned,
    restored_count,
    rw_items,
    Stripe,
    stripe_count,
    synchronized,
    timed_out,
    wait_seconds,
    warn_abandoned,
)

cdef extern from "Python.h":
    ctypedef long long PY_TIMEOUT_T
    const PY_TIMEOUT_T PY_TIMEOUT_MAX
    const Py_ssize_t PY_SSIZE_T_MAX
    PyLockStatus PyThread_acquire_lock_timed(
        PyThread_type_lock lock, PY_TIMEOUT_T microseconds, int intr_flag) nogil
    int PyErr_CheckSignals() except -1
    PyObject *PyThreadState_GetDict()
    # Taking a reference runs no Python code and cannot fail: allowed inside sections.
    void lockmgr_incref "Py_INCREF"(PyObject *o) nogil

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #  define lockmgr_is_finalizing() Py_IsFinalizing()
    #else
    #  define lockmgr_is_finalizing() _Py_IsFinalizing()
    #endif

    /* The engine mutex: PyMutex where CPython has it (3.13+, and every free-threaded
       build), else a one-byte atomic lock whose waiters release the GIL while they spin.
       Taken only with the GIL held (attached thread state). */
    #if PY_VERSION_HEX >= 0x030D0000
    typedef PyMutex lockmgr_mutex;
    #  define lockmgr_mutex_lock(m) PyMutex_Lock(m)
    #  define lockmgr_mutex_unlock(m) PyMutex_Unlock(m)
    #else
    typedef struct { char locked; } lockmgr_mutex;
    #  if defined(_MSC_VER)
    #    include <intrin.h>
    #    define LOCKMGR_XCHG(p, v) _InterlockedExchange8((p), (v))
    #    define LOCKMGR_YIELD() SwitchToThread()
    #  else
    #    include <sched.h>
    #    define LOCKMGR_XCHG(p, v) __atomic_exchange_n((p), (v), __ATOMIC_ACQUIRE)
    #    define LOCKMGR_YIELD() sched_yield()
    #  endif
    static void lockmgr_mutex_lock(lockmgr_mutex *m) {
        if (!LOCKMGR_XCHG(&m->locked, 1)) return;
        Py_BEGIN_ALLOW_THREADS
        while (LOCKMGR_XCHG(&m->locked, 1)) LOCKMGR_YIELD();
        Py_END_ALLOW_THREADS
    }
    #  if defined(_MSC_VER)
    #    define lockmgr_mutex_unlock(m) ((void)_InterlockedExchange8(&(m)->locked, 0))
    #  else
    #    define lockmgr_mutex_unlock(m) __atomic_store_n(&(m)->locked, 0, __ATOMIC_RELEASE)
    #  endif
    #endif
    #define lockmgr_mutex_forget(m) memset((m), 0, sizeof(lockmgr_mutex))
    #ifdef Py_GIL_DISABLED
    #  define LOCKMGR_FREE_THREADED 1
    #else
    #  define LOCKMGR_FREE_THREADED 0
    #endif

    /* The platform shim: a monotonic clock in seconds (time.monotonic()'s clock). */
    #if defined(_WIN32)
    #  ifndef WIN32_LEAN_AND_MEAN
    #    define WIN32_LEAN_AND_MEAN
    #  endif
    #  include <windows.h>
    static double lockmgr_monotonic(void) {
        LARGE_INTEGER frequency, now;  /* the frequency is fixed at boot */
        QueryPerformanceFrequency(&frequency);
        QueryPerformanceCounter(&now);
        return (double)now.QuadPart / (double)frequency.QuadPart;
    }
    #else
    #  include <time.h>
    static double lockmgr_monotonic(void) {
        struct timespec now;
        clock_gettime(CLOCK_MONOTONIC, &now);
        return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
    }
    #endif

    /* Key equality without Python code: 1 equal, 0 unequal, -1 unknown (a type whose
       comparison is Python code, an int too big for a long long, nesting too deep).
       Exact str, bytes, int and tuples of them are immutable and compare by plain reads. */
    static int lockmgr_exact(PyTypeObject *t) {
        return t == &PyUnicode_Type || t == &PyBytes_Type || t == &PyLong_Type
            || t == &PyTuple_Type;
    }
    static int lockmgr_key_equal_at(PyObject *a, PyObject *b, int depth) {
        PyTypeObject *type = Py_TYPE(a);
        Py_ssize_t i, n;
        int overflow_a, overflow_b, item, unknown = 0;
        long long value_a, value_b;
        if (a == b) return 1;
        if (type != Py_TYPE(b)) return lockmgr_exact(type) && lockmgr_exact(Py_TYPE(b)) ? 0 : -1;
        if (type == &PyUnicode_Type) {
    #if PY_VERSION_HEX < 0x030C0000
            if (!PyUnicode_IS_READY(a) || !PyUnicode_IS_READY(b)) return -1;
    #endif
            n = PyUnicode_GET_LENGTH(a);
            if (n != PyUnicode_GET_LENGTH(b) || PyUnicode_KIND(a) != PyUnicode_KIND(b)) return 0;
            return memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), (size_t)n * PyUnicode_KIND(a)) == 0;
        }
        if (type == &PyBytes_Type) {
            n = PyBytes_GET_SIZE(a);
            return n == PyBytes_GET_SIZE(b)
                && memcmp(PyBytes_AS_STRING(a), PyBytes_AS_STRING(b), (size_t)n) == 0;
        }
        if (type == &PyLong_Type) {  /* never fails for an exact int: overflow is reported */
            value_a = PyLong_AsLongLongAndOverflow(a, &overflow_a);
            value_b = PyLong_AsLongLongAndOverflow(b, &overflow_b);
            if (overflow_a || overflow_b) return -1;
            return value_a == value_b;
        }
        if (type == &PyTuple_Type && depth < 16) {
            n = PyTuple_GET_SIZE(a);
            if (n != PyTuple_GET_SIZE(b)) return 0;
            for (i = 0; i < n; i++) {
                item = lockmgr_key_equal_at(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i), depth + 1);
                if (item == 0) return unknown ? -1 : 0;  /* Python compares in order */
                if (item < 0) unknown = 1;
            }
            return unknown ? -1 : 1;
        }
        return -1;
    }
    #define lockmgr_key_equal(a, b) lockmgr_key_equal_at((a), (b), 0)
    """
    ctypedef struct lockmgr_mutex:
        pass
    void lockmgr_mutex_lock(lockmgr_mutex *m)
    void lockmgr_mutex_unlock(lockmgr_mutex *m)
    void lockmgr_mutex_forget(lockmgr_mutex *m)
    int lockmgr_is_finalizing()
    const bint LOCKMGR_FREE_THREADED
    double lockmgr_monotonic() nogil
    int lockmgr_key_equal(PyObject *a, PyObject *b) nogil


cdef enum RequestState:
    WAITING = 0  # queued, asleep or about to sleep
    WOKEN = 1    # fair=False: the key was freed and this request was told to race for it
    GRANTED = 2  # the key was handed to this request; its thread holds it now
    LEFT = 3     # timed out or cancelled: out of every queue


cdef enum Mode:
    READ = 1   # shared: any number of threads at once (RWLockManager)
    WRITE = 2  # exclusive (every LockManager request)


cdef enum Outcome:  # what a section decided; the caller acts on it after the mutex is released
    DONE        # granted at once, released, or (a wait) granted
    BUSY        # a try-lock found the key taken (counted as a timeout)
    QUEUED      # a request was queued: the caller waits
    TIMED_OUT   # a waiting request's deadline passed: it left
    STILL       # a waiting request is still waiting
    NEED_POST   # the request's state changed but its wake-up post is not consumed yet
    COMPARE     # a stored key needs a Python __eq__ against the caller's (nothing changed)
    NOT_OWNED   # a release of a key the thread does not hold (nothing changed)
    PINNED      # a release of a level only a waiting set of the thread holds (nothing changed)
    OVERFLOW    # a recursion level would pass PY_SSIZE_T_MAX (nothing changed)
    NESTED      # a thread that is waiting would wait again (nothing changed)
    DEADLOCK    # waiting would close a cycle: the cycle is in the After (nothing changed)
    LONG_CYCLE  # as DEADLOCK, but the After's buffer is too short for it (nothing changed)


# Every field below says who writes it. "mutex": only in sections (engine_mutex held).

cdef struct Token:
    # One per thread that used lockmgr; ownership means this object, never the ident.
    unsigned long ident          # threading.get_ident() of its thread; set at creation
    bint is_main                 # its thread is the main thread (signal handlers run there);
                                 # set at creation and by the after-fork child hook
    Entry *held                  # mutex: entries it write-holds in any manager (held_next)
    Hold *reads                  # mutex: its read holds in any manager (token_next)
    Request *request             # mutex: the request its thread waits in, or NULL
    PyThread_type_lock wakeup    # created by its thread before its first wait; posted by
                                 # finishes, consumed by its thread: a binary semaphore
    Entry *spare_entry           # its thread only: memory for the next entry it inserts
    Hold *spare_hold             # its thread only: memory for the next read hold it takes
    unsigned long long visit     # mutex: number of the last deadlock search that reached it
    Token *reached_from          # mutex: in that search, the thread whose wait led here
    Entry *reached_via           # mutex: in that search, the entry that thread waits for
    Token *search_next           # mutex: in that search, the next thread still to follow


cdef struct Hold:
    # One thread's read hold of one entry; linked in the entry's and the token's lists.
    Token *token                 # the reading thread; set when linked
    Entry *entry                 # the entry it reads; set when linked
    Py_ssize_t count             # mutex: its read recursion level (> 0 while linked)
    Py_ssize_t pinned            # mutex: levels taken by a waiting set of the thread (<= count)
    Hold *entry_prev             # mutex: neighbour among the entry's read holds (newest first)
    Hold *entry_next             # mutex
    Hold *token_prev             # mutex: neighbour among the token's read holds (newest first)
    Hold *token_next             # mutex


cdef struct Request:
    # A waiting acquisition; lives in its thread's C stack (or the nodes array of a set) and
    # is out of every queue before that frame ends.
    Request *prev                # mutex: neighbour towards the head of the entry's queue
    Request *next                # mutex: neighbour towards the tail
    Token *token                 # the waiting thread; set before queueing
    Entry *entry                 # the entry whose queue it is (or would be) in
    Mode mode                    # what it asks for
    Hold *hold                   # READ: memory for the hold a grant links in (from prepare;
                                 # a grant takes it, the waiter frees what is left)
    Py_ssize_t count             # recursion level a grant installs
    RequestState state           # mutex: set by granting/waking sections and by the waiter
    double since                 # monotonic time it queued (fair=False's hand-off rule)
    bint at_head                 # an upgrade: queued before every other request
    Request *lead                # multi-key: the first node, whose state speaks for all
    Py_ssize_t nodes             # how many nodes the request has (1 for a single request)
    bint queued                  # multi-key: it waits in its entry's queue; else it
                                 # re-enters a key its thread holds (a pinned level)
    Request *wake_next           # mutex: next request in the After that is to wake it


cdef struct Entry:
    # One key held or waited on; in its table from its first use to its last.
    PyObject *key                # strong reference to the key as first given
    Py_hash_t hash               # hash(key)
    Entry *bucket_next           # mutex: next entry in its bucket; once retired, in the After
    Table *table                 # the table it belongs to (it never outlives its table)
    Token *owner                 # mutex: the write holder, or NULL
    Py_ssize_t count             # mutex: the owner's write level; 0 iff owner is NULL
    Py_ssize_t pinned            # mutex: write levels a waiting set of the owner took (<= count)
    Entry *held_prev             # mutex: neighbour in the owner's list of write-held entries
    Entry *held_next             # mutex
    Hold *readers                # mutex: read holds, one per reading thread (newest first)
    Py_ssize_t nreaders          # mutex: how many read holds
    Request *head                # mutex: oldest waiting request (an upgrade goes first)
    Request *tail                # mutex: newest waiting request
    Py_ssize_t inflight          # mutex: requests of calls still running that point here
                                 # (queued, or granted and not returned yet)


cdef struct Table:
    # One per manager, inside the manager object. Invariant: an entry is in the table iff
    # it has a holder or inflight requests.
    Entry **buckets              # mutex: chained hash table; mask + 1 buckets
    size_t mask                  # mutex: bucket count - 1 (a power of two)
    Py_ssize_t entries           # mutex: entries in the table
    bint fair                    # set at creation: strict FIFO hand-off, or eventual fairness
    Py_ssize_t held              # mutex: entries with a write or read holder
    Py_ssize_t waiting           # mutex: requests (a set counts once) queued in its entries
    unsigned long long acquisitions  # mutex: successful acquisitions, reentrant ones included
    unsigned long long contended     # mutex: acquisitions that had to wait
    unsigned long long timeouts      # mutex: acquisitions that gave up (try-locks included)
    unsigned long long deadlocks     # mutex: acquisitions refused to avoid a deadlock
    Table *previous_table        # mutex: neighbour in the list of live tables (for fork)
    Table *next_table            # mutex


cdef struct CycleStep:
    unsigned long ident          # a thread of the cycle
    PyObject *key                # strong reference: the key it waits for


cdef struct After:
    # What a section left for its finish; on the caller's C stack.
    Entry *retired               # entries unlinked from their table (bucket_next list)
    Request *woken               # requests to post (wake_next list)
    CycleStep *cycle             # DEADLOCK: the cycle, refused request first
    Py_ssize_t cycle_length      # DEADLOCK/LONG_CYCLE: how many steps the cycle has
    Py_ssize_t cycle_room        # how many steps ``cycle`` has room for
    Table *resize                # a table whose bucket count should change, or NULL


cdef struct Compared:
    PyObject *key                # strong reference to a stored key compared in prepare
    bint equal                   # what its __eq__ said


cdef struct Lookup:
    # A key being looked up, with what prepare learnt by comparing stored keys in Python.
    PyObject *key                # the caller's key (borrowed: the caller keeps it alive)
    Py_hash_t hash               # hash(key)
    PyObject *candidate          # set by a COMPARE section: the stored key to compare (strong)
    Compared *compared           # answers so far (prepare's memory)
    Py_ssize_t ncompared         # how many answers
    Py_ssize_t room              # room in ``compared``


cdef enum:
    MIN_BUCKETS = 8   # a table never shrinks below this

cdef double handoff_after = HANDOFF_AFTER
cdef double main_thread_slice = MAIN_THREAD_SLICE
cdef object FOREVER = -1  # the default timeout object, so the fast path can test identity
cdef unsigned long main_ident = threading.main_thread().ident

cdef lockmgr_mutex engine_mutex           # see the module docstring
cdef Py_tss_t token_key                   # per thread: its Token*, or NULL before first use
cdef unsigned long long searches = 0      # mutex: numbers deadlock searches (Token.visit)
cdef Table *tables = NULL                 # mutex: every live table (previous/next_table)
cdef long forking_pid = 0                 # between os.fork()'s hooks: the parent's pid
memset(&engine_mutex, 0, sizeof(engine_mutex))
if PyThread_tss_create(&token_key) != 0:
    raise MemoryError("cannot create the thread-specific key for lockmgr tokens")


cdef inline size_t spread(Py_hash_t h) noexcept nogil:
    """Mix a hash so its low bits depend on all of it (lockmgr._common.stripe_index)."""
    cdef uint64_t mixed = <uint64_t>h * 0x9E3779B97F4A7C15ULL
    return <size_t>(mixed ^ (mixed >> 32))


# == sections: every function from here to "finish" is noexcept nogil and runs under the
# mutex (the compiler rejects Python object operations in them) ===========================

# -- the table ----------------------------------------------------------------------------

cdef inline size_t bucket_of(Table *table, Py_hash_t h) noexcept nogil:
    return spread(h) & table.mask  # spread: consecutive ints must not share low bits


cdef int known_answer(Lookup *lookup, PyObject *stored) noexcept nogil:
    """What prepare's comparison said of ``stored``: 1, 0, or -1 (not asked yet)."""
    cdef Py_ssize_t i
    for i in range(lookup.ncompared):
        if lookup.compared[i].key == stored:
            return lookup.compared[i].equal
    return -1


cdef Entry* find(Table *table, Lookup *lookup) noexcept nogil:
    """The entry for ``lookup``'s key, or NULL: absent, or (``lookup.candidate`` set) a
    stored key must be compared in Python first."""
    cdef Entry *entry = table.buckets[bucket_of(table, lookup.hash)]
    cdef int equal
    while entry is not NULL:
        if entry.hash == lookup.hash:
            if entry.key == lookup.key:
                return entry
            equal = lockmgr_key_equal(entry.key, lookup.key)
            if equal < 0:
                equal = known_answer(lookup, entry.key)
            if equal > 0:
                return entry
            if equal < 0:
                lockmgr_incref(entry.key)
                lookup.candidate = entry.key
                return NULL
        entry = entry.bucket_next
    return NULL


cdef Entry* insert(Table *table, Lookup *lookup, Entry *entry, After *after) noexcept nogil:
    """Put ``entry`` (memory from prepare) in the table for ``lookup``'s key."""
    cdef size_t bucket = bucket_of(table, lookup.hash)
    lockmgr_incref(lookup.key)
    entry.key = lookup.key
    entry.hash = lookup.hash
    entry.table = table
    entry.owner = NULL
    entry.count = 0
    entry.pinned = 0
    entry.readers = NULL
    entry.nreaders = 0
    entry.head = NULL
    entry.tail = NULL
    entry.inflight = 0
    entry.bucket_next = table.buckets[bucket]
    table.buckets[bucket] = entry
    table.entries += 1
    if <size_t>table.entries > table.mask + 1:
        after.resize = table
    return entry


cdef void remove(Table *table, Entry *entry, After *after) noexcept nogil:
    """Unlink an unused ``entry``; its key and memory go to the After."""
    cdef Entry **link = &table.buckets[bucket_of(table, entry.hash)]
    while link[0] != entry:
        link = &link[0].bucket_next
    link[0] = entry.bucket_next
    entry.bucket_next = after.retired
    after.retired = entry
    table.entries -= 1
    if table.mask + 1 > MIN_BUCKETS and <size_t>table.entries * 4 < table.mask + 1:
        after.resize = table


cdef inline bint unused(Entry *entry) noexcept nogil:
    return entry.owner is NULL and entry.nreaders == 0 and entry.inflight == 0


cdef size_t wanted_buckets(Table *table) noexcept nogil:
    """The bucket count ``table`` should have, or 0 if its current one is fine."""
    cdef size_t buckets = table.mask + 1
    if <size_t>table.entries > buckets:
        while <size_t>table.entries > buckets:
            buckets *= 2
        return buckets
    if buckets > MIN_BUCKETS and <size_t>table.entries * 4 < buckets:
        while buckets > MIN_BUCKETS and <size_t>table.entries * 2 < buckets:
            buckets //= 2
        return buckets
    return 0


cdef Entry** rehash(Table *table, Entry **fresh, size_t buckets) noexcept nogil:
    """Move every entry into ``fresh`` (``buckets`` zeroed slots); returns the old array."""
    cdef Entry **old = table.buckets
    cdef size_t old_count = table.mask + 1, i
    cdef Entry *entry
    cdef Entry *following
    table.buckets = fresh
    table.mask = buckets - 1
    for i in range(old_count):
        entry = old[i]
        while entry is not NULL:
            following = entry.bucket_next
            entry.bucket_next = fresh[bucket_of(table, entry.hash)]
            fresh[bucket_of(table, entry.hash)] = entry
            entry = following
    return old


# -- holders ------------------------------------------------------------------------------

cdef inline void own(Table *table, Entry *entry, Token *token, Py_ssize_t count) noexcept nogil:
    if entry.nreaders == 0:
        table.held += 1
    entry.owner = token
    entry.count = count
    entry.pinned = 0
    entry.held_prev = NULL
    entry.held_next = token.held
    if token.held is not NULL:
        token.held.held_prev = entry
    token.held = entry
    table.acquisitions += 1


cdef inline void disown(Table *table, Entry *entry) noexcept nogil:
    if entry.held_prev is not NULL:
        entry.held_prev.held_next = entry.held_next
    else:
        entry.owner.held = entry.held_next
    if entry.held_next is not NULL:
        entry.held_next.held_prev = entry.held_prev
    entry.owner = NULL
    entry.count = 0
    entry.pinned = 0
    if entry.nreaders == 0:
        table.held -= 1


cdef inline Hold* read_hold(Entry *entry, Token *token) noexcept nogil:
    cdef Hold *hold = entry.readers
    while hold is not NULL and hold.token != token:
        hold = hold.entry_next
    return hold


cdef void add_read(Table *table, Entry *entry, Token *token, Hold *hold,
                   Py_ssize_t count) noexcept nogil:
    if entry.owner is NULL and entry.nreaders == 0:
        table.held += 1
    hold.token = token
    hold.entry = entry
    hold.count = count
    hold.pinned = 0
    hold.entry_prev = NULL
    hold.entry_next = entry.readers
    if entry.readers is not NULL:
        entry.readers.entry_prev = hold
    entry.readers = hold
    entry.nreaders += 1
    hold.token_prev = NULL
    hold.token_next = token.reads
    if token.reads is not NULL:
        token.reads.token_prev = hold
    token.reads = hold
    table.acquisitions += 1


cdef void drop_read(Table *table, Entry *entry, Hold *hold) noexcept nogil:
    if hold.entry_prev is not NULL:
        hold.entry_prev.entry_next = hold.entry_next
    else:
        entry.readers = hold.entry_next
    if hold.entry_next is not NULL:
        hold.entry_next.entry_prev = hold.entry_prev
    if hold.token_prev is not NULL:
        hold.token_prev.token_next = hold.token_next
    else:
        hold.token.reads = hold.token_next
    if hold.token_next is not NULL:
        hold.token_next.token_prev = hold.token_prev
    entry.nreaders -= 1
    if entry.owner is NULL and entry.nreaders == 0:
        table.held -= 1
    PyMem_RawFree(hold)


cdef inline bint room_for(Py_ssize_t level, Py_ssize_t more) noexcept nogil:
    return level <= PY_SSIZE_T_MAX - more


# -- queues -------------------------------------------------------------------------------

cdef inline void enqueue(Entry *entry, Request *request) noexcept nogil:
    if request.at_head:  # an upgrade: no writer behind could get in before it anyway
        request.prev = NULL
        request.next = entry.head
        if entry.head is not NULL:
            entry.head.prev = request
        else:
            entry.tail = request
        entry.head = request
    else:
        request.next = NULL
        request.prev = entry.tail
        if entry.tail is not NULL:
            entry.tail.next = request
        else:
            entry.head = request
        entry.tail = request


cdef inline void dequeue(Entry *entry, Request *request) noexcept nogil:
    if request.prev is not NULL:
        request.prev.next = request.next
    else:
        entry.head = request.next
    if request.next is not NULL:
        request.next.prev = request.prev
    else:
        entry.tail = request.prev


# -- grants -------------------------------------------------------------------------------

cdef bint grantable(Entry *entry, Request *request) noexcept nogil:
    """Whether ``request`` may take ``entry`` now (queue position aside)."""
    cdef Hold *hold
    if entry.owner == request.token:  # its thread took the key meanwhile: re-entry
        if request.mode == WRITE:
            return room_for(entry.count, request.count)
        hold = read_hold(entry, request.token)
        return hold is NULL or room_for(hold.count, request.count)
    if entry.owner is not NULL:
        return False
    return request.mode == READ or entry.nreaders == 0 or (
        entry.nreaders == 1 and entry.readers.token == request.token)


cdef void take(Table *table, Entry *entry, Request *request) noexcept nogil:
    """Give ``request`` its key (``grantable`` said it may)."""
    cdef Hold *hold
    if request.mode == WRITE:
        if entry.owner == request.token:
            entry.count += request.count
            table.acquisitions += 1
        else:
            own(table, entry, request.token, request.count)
        return
    hold = read_hold(entry, request.token)
    if hold is not NULL:
        hold.count += request.count
        table.acquisitions += 1
    else:
        add_read(table, entry, request.token, request.hold, request.count)
        request.hold = NULL


cdef inline void wake(Request *request, After *after) noexcept nogil:
    request.wake_next = after.woken
    after.woken = request


cdef void grant(Table *table, Entry *entry, Request *request) noexcept nogil:
    """A single request takes its key and leaves the queue (its wake-up is the caller's)."""
    dequeue(entry, request)
    take(table, entry, request)
    table.waiting -= 1
    request.state = GRANTED


cdef bint node_ready(Request *node) noexcept nogil:
    return node.entry.owner == node.token and grantable(node.entry, node) or (
        node.entry.head == node and grantable(node.entry, node))


cdef bint group_grantable(Request *lead) noexcept nogil:
    """Every queued node of a set is at the head of its queue (or re-enters) and compatible."""
    cdef Py_ssize_t i
    for i in range(lead.nodes):
        if lead[i].queued and not node_ready(lead + i):
            return False
    return True


cdef void grant_nodes(Table *table, Request *lead, bint was_queued) noexcept nogil:
    """Give a set every key at once: queued nodes take their entries; the others re-enter
    keys its thread holds (their levels were pinned when it queued, or are taken now)."""
    cdef Py_ssize_t i
    cdef Request *node
    cdef Hold *hold
    for i in range(lead.nodes):
        node = lead + i
        if node.queued:
            if was_queued:
                dequeue(node.entry, node)
            take(table, node.entry, node)
        elif was_queued:
            if node.mode == WRITE:
                node.entry.pinned -= 1
            else:
                read_hold(node.entry, node.token).pinned -= 1
            table.acquisitions += 1
        else:
            take(table, node.entry, node)
    lead.state = GRANTED


cdef void pass_on(Table *table, Entry *entry, After *after) noexcept nogil:
    """A holder or a request left ``entry``: grant what the head of its queue allows (a run
    of readers together, or one writer), or drop the entry if nothing uses it."""
    cdef Request *head
    cdef Request *lead
    cdef RequestState was
    cdef Py_ssize_t i
    while True:
        head = entry.head
        if head is NULL:
            if unused(entry):
                remove(table, entry, after)
            return
        if head.lead is not NULL:  # a set: all of its keys or none
            lead = head.lead
            if lead.state != WAITING or not group_grantable(lead):
                return
            grant_nodes(table, lead, True)
            table.waiting -= 1
            wake(lead, after)
            for i in range(lead.nodes):  # readers queued behind its read nodes may follow
                if lead[i].queued and lead[i].entry != entry and lead[i].mode == READ:
                    pass_on(table, lead[i].entry, after)  # never drops it: it is held now
            if head.mode == WRITE:
                return
            continue
        if not grantable(entry, head):
            return
        was = head.state
        if head.mode == READ or table.fair or entry.owner == head.token \
                or lockmgr_monotonic() - head.since >= handoff_after:
            # Also when already WOKEN: a woken thread may wait long for the GIL while
            # others keep taking the key; granting it is what bounds its wait.
            grant(table, entry, head)
        elif was == WAITING:
            head.state = WOKEN
        if was == WAITING:  # a WOKEN head has its post already
            wake(head, after)
        if head.mode == WRITE:
            return


# -- the wait-for graph -------------------------------------------------------------------

cdef struct Search:
    unsigned long long number  # this search's number, marked on each token it reaches
    Token *me                  # the thread about to wait: reaching it again closes a cycle
    Token *stack               # reached threads whose own waits are still to be followed


cdef bint reach(Search *search, Token *thread, Token *successor, Entry *waits_for) noexcept nogil:
    """``thread`` waits for ``successor`` in ``waits_for``; True if that closes the cycle."""
    if successor is NULL or successor == thread:
        return False
    if successor == search.me:
        successor.reached_from = thread
        successor.reached_via = waits_for
        return True
    if successor.visit == search.number:
        return False
    successor.visit = search.number
    successor.reached_from = thread
    successor.reached_via = waits_for
    successor.search_next = search.stack
    search.stack = successor
    return False


cdef bint reach_waited_for(Search *search, Token *thread, Request *node, bint enqueued) noexcept nogil:
    """Reach every thread a request (node) of ``thread`` waits for: the holders it conflicts
    with (hard edges), then the conflicting requests queued ahead of it (soft edges)."""
    cdef Entry *waits_for = node.entry
    cdef Hold *hold = waits_for.readers
    cdef Request *ahead = waits_for.head
    cdef Request *own_place = node if enqueued else NULL
    if reach(search, thread, waits_for.owner, waits_for):
        return True
    if node.mode == WRITE:
        while hold is not NULL:
            if reach(search, thread, hold.token, waits_for):
                return True
            hold = hold.entry_next
    if node.at_head:
        return False
    while ahead is not NULL and ahead != own_place:
        if (node.mode == WRITE or ahead.mode == WRITE) and reach(search, thread, ahead.token, waits_for):
            return True
        ahead = ahead.next
    return False


cdef bint reach_request(Search *search, Token *thread, Request *request, bint enqueued) noexcept nogil:
    """Reach every thread ``request`` (single, or a set's lead) waits for."""
    cdef Py_ssize_t i
    for i in range(request.nodes):
        if request[i].queued and reach_waited_for(search, thread, request + i, enqueued):
            return True
    return False


cdef Outcome refuse_if_cycle(Token *me, Request *request, After *after) noexcept nogil:
    """DEADLOCK (the cycle in ``after``) if queueing ``request`` would close a cycle of waits,
    else QUEUED. The graph spans every manager: a request waits for the holders it conflicts
    with and the conflicting requests ahead of it (PostgreSQL's hard and soft edges); with
    soft edges a hand-off never adds an edge, so checking each new wait finds every cycle."""
    global searches
    cdef Search search
    cdef Token *thread
    cdef Request *own
    cdef bint closed
    cdef Py_ssize_t length = 0, i
    searches += 1
    search.number = searches
    search.me = me
    search.stack = NULL
    me.visit = searches
    closed = reach_request(&search, me, request, False)
    while not closed and search.stack is not NULL:
        thread = search.stack
        search.stack = thread.search_next
        own = thread.request
        if own is not NULL and (own.state == WAITING or own.state == WOKEN):
            closed = reach_request(&search, thread, own, True)
    if not closed:
        return QUEUED
    thread = me
    while True:  # whoever reached ``thread`` waits for it in ``reached_via``
        length += 1
        thread = thread.reached_from
        if thread == me:
            break
    after.cycle_length = length
    if length > after.cycle_room:
        return LONG_CYCLE
    i = length
    thread = me
    while i:  # walk back, filling the cycle from its end: it starts with the refused request
        i -= 1
        after.cycle[i].ident = thread.reached_from.ident
        after.cycle[i].key = thread.reached_via.key
        lockmgr_incref(thread.reached_via.key)
        thread = thread.reached_from
    return DEADLOCK


# -- acquiring ----------------------------------------------------------------------------

cdef Outcome acquire_write(Table *table, Lookup *lookup, Token *token, Py_ssize_t count,
                           bint try_only, Request *request, After *after) noexcept nogil:
    cdef Entry *entry = find(table, lookup)
    cdef bint upgrade
    if lookup.candidate is not NULL:
        return COMPARE
    if entry is NULL:
        entry = insert(table, lookup, token.spare_entry, after)
        token.spare_entry = NULL
        own(table, entry, token, count)
        return DONE
    if entry.owner == token:
        if not room_for(entry.count, count):
            return OVERFLOW
        entry.count += count
        table.acquisitions += 1
        return DONE
    upgrade = entry.nreaders and read_hold(entry, token) is not NULL
    if entry.owner is NULL and (
            (entry.nreaders == 0 and (entry.head is NULL or entry.head.state == WOKEN))
            or (upgrade and entry.nreaders == 1)):
        # Free and nobody queued (with fair=False, a woken head that has not run yet may be
        # overtaken), or the caller is the only reader: an upgrade goes at once.
        own(table, entry, token, count)
        return DONE
    return queue_single(table, entry, token, WRITE, count, upgrade, try_only, request, after)


cdef Outcome acquire_read(Table *table, Lookup *lookup, Token *token, bint try_only,
                          Request *request, After *after) noexcept nogil:
    cdef Entry *entry = find(table, lookup)
    cdef Hold *hold
    if lookup.candidate is not NULL:
        return COMPARE
    if entry is not NULL:
        hold = read_hold(entry, token)
        if hold is not NULL:  # reentrant, even past queued writers (else it self-deadlocks)
            if not room_for(hold.count, 1):
                return OVERFLOW
            hold.count += 1
            table.acquisitions += 1
            return DONE
    if entry is NULL:
        entry = insert(table, lookup, token.spare_entry, after)
        token.spare_entry = NULL
    if entry.owner == token or (entry.owner is NULL and entry.head is NULL):
        add_read(table, entry, token, token.spare_hold, 1)
        token.spare_hold = NULL
        return DONE
    return queue_single(table, entry, token, READ, 1, False, try_only, request, after)


cdef Outcome queue_single(Table *table, Entry *entry, Token *token, Mode mode, Py_ssize_t count,
                          bint upgrade, bint try_only, Request *request,
                          After *after) noexcept nogil:
    """The key is taken: give up (try-lock), refuse, or queue ``request``."""
    if try_only:
        table.timeouts += 1
        return BUSY
    if token.request is not NULL:
        return NESTED
    memset(request, 0, sizeof(Request))
    request.token = token
    request.entry = entry
    request.mode = mode
    request.count = count
    request.at_head = upgrade
    request.nodes = 1
    request.queued = True
    return queue(table, request, after)


cdef Outcome queue(Table *table, Request *request, After *after) noexcept nogil:
    """Queue ``request`` (single, or a set's lead) unless that would close a cycle."""
    cdef Outcome outcome = refuse_if_cycle(request.token, request, after)
    cdef Py_ssize_t i
    cdef Request *node
    if outcome != QUEUED:
        if outcome == DEADLOCK:
            table.deadlocks += 1
        return outcome
    if request.mode == READ and request.lead is NULL:
        request.hold = request.token.spare_hold  # the grant links it in
        request.token.spare_hold = NULL
    request.since = lockmgr_monotonic()
    for i in range(request.nodes):
        node = request + i
        node.state = WAITING
        node.entry.inflight += 1
        if node.queued:
            enqueue(node.entry, node)
        else:
            pin(table, node)
    table.waiting += 1
    request.token.request = request
    return QUEUED


cdef void pin(Table *table, Request *node) noexcept nogil:
    """A set re-enters a key its thread holds: take that level now, pinned while it waits."""
    cdef Hold *hold
    if node.mode == WRITE:
        node.entry.count += 1
        node.entry.pinned += 1
        return
    hold = read_hold(node.entry, node.token)
    if hold is NULL:  # reads a key it writes
        add_read(table, node.entry, node.token, node.hold, 0)
        table.acquisitions -= 1  # counted when the set is granted
        node.hold = NULL
        hold = node.entry.readers
    hold.count += 1
    hold.pinned += 1


cdef void unpin_and_give_back(Table *table, Request *node) noexcept nogil:
    """A waiting set leaves: give back a level it pinned."""
    cdef Entry *entry = node.entry
    cdef Hold *hold
    if node.mode == WRITE:
        entry.pinned -= 1
        entry.count -= 1
        if entry.count == 0:
            disown(table, entry)
        return
    hold = read_hold(entry, node.token)
    hold.pinned -= 1
    hold.count -= 1
    if hold.count == 0:
        drop_read(table, entry, hold)


cdef Outcome acquire_many(Table *table, Lookup *lookups, Request *nodes, Py_ssize_t n,
                          Entry **fresh, bint try_only, After *after) noexcept nogil:
    """Take every node's key at once, or queue the set, or refuse it. ``fresh``: memory
    for entries (a slot is set to NULL when used)."""
    cdef Token *token = nodes.token
    cdef Py_ssize_t i
    cdef Request *node
    cdef Entry *entry
    cdef Hold *hold
    cdef bint ready = True
    cdef Outcome outcome
    for i in range(n):
        nodes[i].entry = find(table, lookups + i)
        if lookups[i].candidate is not NULL:
            return COMPARE
    for i in range(n):  # nothing changes unless every level fits
        entry = nodes[i].entry
        if entry is NULL:
            continue
        if nodes[i].mode == WRITE and entry.owner == token and not room_for(entry.count, 1):
            return OVERFLOW
        hold = read_hold(entry, token)
        if nodes[i].mode == READ and hold is not NULL and not room_for(hold.count, 1):
            return OVERFLOW
    for i in range(n):
        node = nodes + i
        if node.entry is NULL:
            node.entry = insert(table, lookups + i, fresh[i], after)
            fresh[i] = NULL
        entry = node.entry
        node.queued = True
        node.at_head = False
        if node.mode == WRITE:
            if entry.owner == token:
                node.queued = False
            else:
                node.at_head = entry.nreaders and read_hold(entry, token) is not NULL
                ready = ready and entry.owner is NULL and (
                    (entry.nreaders == 0 and entry.head is NULL)
                    or (node.at_head and entry.nreaders == 1))
        elif entry.owner == token or read_hold(entry, token) is not NULL:
            node.queued = False
        else:
            ready = ready and entry.owner is NULL and entry.head is NULL
    if ready:
        grant_nodes(table, nodes, False)
        return DONE
    if try_only:
        table.timeouts += 1
        outcome = BUSY
    elif token.request is not NULL:
        outcome = NESTED
    else:
        outcome = queue(table, nodes, after)
        if outcome == QUEUED:
            return QUEUED
    for i in range(n):  # nothing was queued: drop the entries it made
        if unused(nodes[i].entry):
            remove(table, nodes[i].entry, after)
    return outcome


# -- waiting ------------------------------------------------------------------------------

cdef void end_request(Table *table, Request *request, After *after) noexcept nogil:
    """The waiter's call is about to return: the request stops pointing at its entries."""
    cdef Py_ssize_t i
    request.token.request = NULL
    for i in range(request.nodes):
        request[i].entry.inflight -= 1
    for i in range(request.nodes):
        pass_on(table, request[i].entry, after)  # only drops an entry nobody uses now


cdef void leave(Table *table, Request *request, After *after) noexcept nogil:
    """A waiting (or woken) request gives up: out of every queue, pinned levels given back."""
    cdef Py_ssize_t i
    for i in range(request.nodes):
        if request[i].queued:
            dequeue(request[i].entry, request + i)
        else:
            unpin_and_give_back(table, request + i)
    table.waiting -= 1
    request.state = LEFT
    end_request(table, request, after)


cdef void undo_grant(Table *table, Request *request, After *after) noexcept nogil:
    """An exception ends a granted wait: give back what the grant gave, as far as the thread
    still holds it (code that ran inside the wait may have released some of it)."""
    cdef Py_ssize_t i, levels
    cdef Request *node
    cdef Entry *entry
    cdef Hold *hold
    for i in range(request.nodes):
        node = request + i
        entry = node.entry
        if node.mode == WRITE:
            if entry.owner != node.token:
                continue
            levels = min(node.count, entry.count - entry.pinned)
            entry.count -= levels
            if entry.count == 0:
                disown(table, entry)
        else:
            hold = read_hold(entry, node.token)
            if hold is NULL:
                continue
            levels = min(node.count, hold.count - hold.pinned)
            hold.count -= levels
            if hold.count == 0:
                drop_read(table, entry, hold)
        if levels:
            table.acquisitions -= 1
    end_request(table, request, after)


cdef Outcome settle(Table *table, Request *request, bint posted, double deadline,
                    After *after) noexcept nogil:
    """The waiter woke (posted: it consumed a wake-up post): decide what its wait became."""
    cdef Entry *entry = request.entry
    if request.state != WAITING and not posted:
        return NEED_POST
    if request.state == WOKEN:  # single requests only
        if grantable(entry, request):
            grant(table, entry, request)
        else:
            request.state = WAITING  # overtaken: sleep again at the head
    elif request.state == WAITING:  # its own thread may have made it grantable (re-entry)
        if request.lead is NULL:
            if grantable(entry, request) and (entry.owner == request.token or entry.head == request):
                grant(table, entry, request)
        elif group_grantable(request):
            grant_nodes(table, request, True)
            table.waiting -= 1
    if request.state == GRANTED:  # the waiter runs handlers, then completes or undoes it
        return DONE
    if deadline >= 0 and lockmgr_monotonic() >= deadline:
        leave(table, request, after)
        table.timeouts += 1
        return TIMED_OUT
    return STILL


cdef void complete(Table *table, Request *request, After *after) noexcept nogil:
    """A granted wait returns."""
    table.contended += 1
    end_request(table, request, after)


cdef Outcome abandon(Table *table, Request *request, bint posted, After *after) noexcept nogil:
    """An exception ends the wait: leave, or undo a grant that raced it."""
    if request.state != WAITING and not posted:
        return NEED_POST
    if request.state == GRANTED:
        undo_grant(table, request, after)
    else:
        leave(table, request, after)
    return DONE


# -- releasing ----------------------------------------------------------------------------

cdef Outcome release_write(Table *table, Lookup *lookup, Token *token, bint fully,
                           Py_ssize_t *released, After *after) noexcept nogil:
    """Undo one write level (``fully``: every level; ``released[0]`` gets how many)."""
    cdef Entry *entry = find(table, lookup)
    if lookup.candidate is not NULL:
        return COMPARE
    if entry is NULL or token is NULL or entry.owner != token:
        return NOT_OWNED
    if entry.pinned and (fully or entry.count == entry.pinned):
        return PINNED
    released[0] = entry.count if fully else 1
    entry.count -= released[0]
    if entry.count == 0:
        disown(table, entry)
        pass_on(table, entry, after)
    return DONE


cdef Outcome release_read(Table *table, Lookup *lookup, Token *token, After *after) noexcept nogil:
    cdef Entry *entry = find(table, lookup)
    cdef Hold *hold = NULL
    if lookup.candidate is not NULL:
        return COMPARE
    if entry is not NULL and token is not NULL:
        hold = read_hold(entry, token)
    if hold is NULL:
        return NOT_OWNED
    if hold.count == hold.pinned:
        return PINNED
    hold.count -= 1
    if hold.count == 0:
        drop_read(table, entry, hold)
        pass_on(table, entry, after)
    return DONE


cdef Outcome release_many(Table *table, Lookup *lookups, Mode *modes, Entry **entries,
                          Py_ssize_t n, Token *token, Py_ssize_t *failed,
                          After *after) noexcept nogil:
    """Undo one acquire_many: every level, or (``failed[0]``: the key that is not held as
    asked) none. ``entries``: room for n entry pointers."""
    cdef Py_ssize_t i
    cdef Entry *entry
    cdef Hold *hold
    for i in range(n):
        entries[i] = find(table, lookups + i)
        if lookups[i].candidate is not NULL:
            return COMPARE
    for i in range(n):
        entry = entries[i]
        failed[0] = i
        if entry is NULL or token is NULL:
            return NOT_OWNED
        if modes[i] == WRITE:
            if entry.owner != token:
                return NOT_OWNED
            if entry.count == entry.pinned:
                return PINNED
        else:
            hold = read_hold(entry, token)
            if hold is NULL:
                return NOT_OWNED
            if hold.count == hold.pinned:
                return PINNED
    for i in range(n):
        entry = entries[i]
        if modes[i] == WRITE:
            entry.count -= 1
            if entry.count == 0:
                disown(table, entry)
        else:
            hold = read_hold(entry, token)
            hold.count -= 1
            if hold.count == 0:
                drop_read(table, entry, hold)
        pass_on(table, entry, after)
    return DONE


cdef Py_ssize_t release_token(Token *token, Table *only, PyObject **keys, Py_ssize_t room,
                              After *after) noexcept nogil:
    """Release every level ``token`` holds (in ``only``'s entries, unless it is NULL) except
    levels pinned by a waiting set; returns how many keys it stopped holding (a key read and
    written counts once). The first ``room`` of those keys go to ``keys`` (strong refs)."""
    cdef Py_ssize_t released = 0
    cdef Entry *entry
    cdef Entry *following
    cdef Hold *hold = token.reads
    cdef Hold *next_hold
    while hold is not NULL:  # reads first, so a write-held key is counted with its write
        next_hold = hold.token_next  # survives: it is another entry's hold
        entry = hold.entry
        if only is NULL or entry.table == only:
            if hold.pinned:
                hold.count = hold.pinned
            else:
                if entry.owner != token:
                    released += keep_key(entry, released, keys, room)
                drop_read(entry.table, entry, hold)
                pass_on(entry.table, entry, after)
        hold = next_hold
    entry = token.held
    while entry is not NULL:
        following = entry.held_next  # survives: only ``entry`` is unlinked or removed below
        if only is NULL or entry.table == only:
            if entry.pinned:
                entry.count = entry.pinned
            else:
                if read_hold(entry, token) is NULL:  # else a pinned read keeps it held
                    released += keep_key(entry, released, keys, room)
                disown(entry.table, entry)
                pass_on(entry.table, entry, after)
        entry = following
    return released


cdef inline Py_ssize_t keep_key(Entry *entry, Py_ssize_t index, PyObject **keys,
                                Py_ssize_t room) noexcept nogil:
    if index < room:
        lockmgr_incref(entry.key)
        keys[index] = entry.key
    return 1


cdef Py_ssize_t count_holds(Token *token) noexcept nogil:
    """Entries ``token`` holds in any manager, read and write counted apart (an upper bound
    of release_token's result)."""
    cdef Py_ssize_t count = 0
    cdef Entry *entry = token.held
    cdef Hold *hold = token.reads
    while entry is not NULL:
        count += 1
        entry = entry.held_next
    while hold is not NULL:
        count += 1
        hold = hold.token_next
    return count


cdef void tear_down(Table *table, After *after) noexcept nogil:
    """A manager is being freed (nobody waits in it: a waiter's call keeps it alive): unlink
    its holds from their threads' lists, hand every entry to the After, leave the live list."""
    cdef size_t i
    cdef Entry *entry
    cdef Entry *following
    global tables
    if table.previous_table is not NULL:
        table.previous_table.next_table = table.next_table
    else:
        tables = table.next_table
    if table.next_table is not NULL:
        table.next_table.previous_table = table.previous_table
    for i in range(table.mask + 1):
        entry = table.buckets[i]
        while entry is not NULL:
            following = entry.bucket_next
            if entry.owner is not NULL:
                disown(table, entry)
            while entry.readers is not NULL:
                drop_read(table, entry, entry.readers)
            entry.bucket_next = after.retired
            after.retired = entry
            entry = following
        table.buckets[i] = NULL
    table.entries = 0


cdef void keep_only(Table *table, Token *survivor, After *after) noexcept nogil:
    """In a forked child: keep what ``survivor`` (the forking thread) holds and its waiting
    request, if it forked from inside a wait; every other thread is gone."""
    cdef size_t i
    cdef Entry *entry
    cdef Entry *following
    cdef Request *request
    cdef Request *next_request
    cdef Hold *hold
    cdef Hold *next_hold
    cdef Request *kept = survivor.request if survivor is not NULL else NULL
    table.waiting = 0
    for i in range(table.mask + 1):
        entry = table.buckets[i]
        while entry is not NULL:
            entry.inflight = 0
            request = entry.head
            while request is not NULL:
                next_request = request.next
                if request.token != survivor:
                    request.token.request = NULL  # its thread is gone
                    dequeue(entry, request)
                request = next_request
            if entry.owner is not NULL and entry.owner != survivor:
                disown(table, entry)
            hold = entry.readers
            while hold is not NULL:
                next_hold = hold.entry_next
                if hold.token != survivor:
                    drop_read(table, entry, hold)
                hold = next_hold
            entry = entry.bucket_next
    if kept is not NULL:
        for i in range(kept.nodes):
            if kept[i].entry.table == table:
                kept[i].entry.inflight += 1
        if kept.entry.table == table:
            table.waiting = 1
    for i in range(table.mask + 1):
        entry = table.buckets[i]
        while entry is not NULL:
            following = entry.bucket_next
            if unused(entry):
                remove(table, entry, after)
            entry = following


cdef void read_stats(Table *table, unsigned long long *counters) noexcept nogil:
    counters[0] = table.held
    counters[1] = table.waiting
    counters[2] = table.acquisitions
    counters[3] = table.contended
    counters[4] = table.timeouts
    counters[5] = table.deadlocks


# == end of sections ======================================================================

cdef inline void lock() noexcept:
    lockmgr_mutex_lock(&engine_mutex)


cdef inline void unlock() noexcept:
    lockmgr_mutex_unlock(&engine_mutex)


# -- finish -------------------------------------------------------------------------------

cdef inline void after_init(After *after, CycleStep *cycle, Py_ssize_t room) noexcept:
    after.retired = NULL
    after.woken = NULL
    after.cycle = cycle
    after.cycle_length = 0
    after.cycle_room = room
    after.resize = NULL


cdef int finish(After *after, Token *keeper) except -1:
    """Do what a section left: wake, then drop retired keys (which may run ``__del__``),
    keeping one retired entry's memory as ``keeper``'s spare, then resize a table."""
    cdef Request *request = after.woken
    cdef Request *following
    cdef Entry *entry
    cdef PyThread_type_lock wakeup
    after.woken = NULL
    while request is not NULL:
        following = request.wake_next  # read first: once posted, the request may be gone
        wakeup = request.token.wakeup
        PyThread_release_lock(wakeup)
        request = following
    if after.resize is not NULL:
        resize(after.resize)
        after.resize = NULL
    while after.retired is not NULL:
        entry = after.retired
        after.retired = entry.bucket_next
        Py_XDECREF(entry.key)
        if keeper is not NULL and keeper.spare_entry is NULL:
            keeper.spare_entry = entry
        else:
            PyMem_RawFree(entry)
    return 0


cdef void resize(Table *table) noexcept:
    """Give ``table`` the bucket count its size wants (memory is taken outside the section,
    and the size is checked again inside it); if memory is short, keep the current one."""
    cdef size_t buckets
    cdef Entry **fresh
    cdef Entry **unneeded
    lock()
    buckets = wanted_buckets(table)
    unlock()
    if buckets == 0:
        return
    fresh = <Entry**>PyMem_RawCalloc(buckets, sizeof(Entry*))
    if fresh is NULL:
        return
    lock()
    if wanted_buckets(table) == buckets:
        unneeded = rehash(table, fresh, buckets)
    else:
        unneeded = fresh
    unlock()
    PyMem_RawFree(unneeded)


cdef list cycle_list(After *after):
    """The DEADLOCK cycle as ``[(thread ident, key), ...]``; drops the After's key refs."""
    cdef Py_ssize_t i
    cycle = []
    for i in range(after.cycle_length):
        cycle.append((after.cycle[i].ident, <object>after.cycle[i].key))
        Py_XDECREF(after.cycle[i].key)
    return cycle


# -- prepare: lookups ---------------------------------------------------------------------

cdef inline void lookup_init(Lookup *lookup, object key, Py_hash_t h) noexcept:
    lookup.key = <PyObject*>key
    lookup.hash = h
    lookup.candidate = NULL
    lookup.compared = NULL
    lookup.ncompared = 0
    lookup.room = 0


cdef int compare_candidate(Lookup *lookup) except -1:
    """A section asked for ``lookup.candidate`` to be compared with the key in Python."""
    cdef PyObject *candidate = lookup.candidate
    cdef Compared *grown
    cdef int equal
    lookup.candidate = NULL
    try:
        equal = PyObject_RichCompareBool(<object>candidate, <object>lookup.key, Py_EQ)
        if lookup.ncompared == lookup.room:
            grown = <Compared*>PyMem_RawMalloc((lookup.room * 2 + 4) * sizeof(Compared))
            if grown is NULL:
                raise MemoryError()
            if lookup.ncompared:
                memcpy(grown, lookup.compared, lookup.ncompared * sizeof(Compared))
            PyMem_RawFree(lookup.compared)
            lookup.compared = grown
            lookup.room = lookup.room * 2 + 4
    except BaseException:
        Py_XDECREF(candidate)
        raise
    lookup.compared[lookup.ncompared].key = candidate  # keeps the reference
    lookup.compared[lookup.ncompared].equal = equal
    lookup.ncompared += 1
    return 0


cdef inline void lookup_clear(Lookup *lookup) noexcept:
    cdef Py_ssize_t i
    if lookup.compared is NULL:
        return
    for i in range(lookup.ncompared):
        Py_XDECREF(lookup.compared[i].key)
    PyMem_RawFree(lookup.compared)
    lookup.compared = NULL
    lookup.ncompared = 0


# -- tokens -------------------------------------------------------------------------------

cdef inline Token* current_token() except NULL:
    cdef Token *token = <Token*>PyThread_tss_get(&token_key)
    if token is NULL:
        token = new_token()
    return token


cdef inline Token* existing_token() noexcept:
    return <Token*>PyThread_tss_get(&token_key)


cdef Token* new_token() except NULL:
    cdef PyObject *state = PyThreadState_GetDict()
    if state is NULL:
        raise RuntimeError("lockmgr needs a Python thread state in the calling thread")
    cdef Token *token = <Token*>PyMem_RawCalloc(1, sizeof(Token))
    if token is NULL:
        raise MemoryError()
    token.ident = PyThread_get_thread_ident()
    token.is_main = token.ident == main_ident
    cdef _ThreadExit guard = _ThreadExit.__new__(_ThreadExit)
    guard.token = token  # from here on the guard frees the token
    (<object>state)[_ThreadExit] = guard
    PyThread_tss_set(&token_key, token)
    return token


cdef int ensure_memory(void **slot, size_t size) except -1:
    """Fill an empty spare slot of a token (memory a section may take)."""
    if slot[0] is NULL:
        slot[0] = PyMem_RawMalloc(size)
        if slot[0] is NULL:
            raise MemoryError()
    return 0


cdef int wakeup_lock(Token *token) except -1:
    if token.wakeup is NULL:
        token.wakeup = PyThread_allocate_lock()
        if token.wakeup is NULL:
            raise MemoryError("cannot allocate a wakeup lock")
        PyThread_acquire_lock(token.wakeup, NOWAIT_LOCK)  # locked = nothing posted
    return 0


cdef void free_token(Token *token) noexcept:
    if token.wakeup is not NULL:
        PyThread_free_lock(token.wakeup)
    PyMem_RawFree(token.spare_entry)
    PyMem_RawFree(token.spare_hold)
    PyMem_RawFree(token)


@cython.final
cdef class _ThreadExit:
    """Sits in its thread's state dict, so CPython destroys it when the thread ends.

    It then releases whatever the thread still holds (waiters are handed those keys as
    usual) and frees the thread's token. Ownership is the token, so a new thread that is
    given a recycled ident starts with a new token and never inherits anything. It touches
    only C structures under the mutex, never a manager object, so a manager being torn
    down at the same moment is never resurrected.
    """
    cdef Token *token  # the token of the thread whose state dict holds this guard

    def __dealloc__(self):
        cdef Token *token = self.token
        cdef After after
        cdef PyObject **keys = NULL
        cdef Py_ssize_t room, released, i
        if token is NULL:
            return
        if PyThread_tss_get(&token_key) == token:
            PyThread_tss_set(&token_key, NULL)
        if token.request is not NULL:
            # Only at interpreter shutdown or in a forked child, which clear the states of
            # threads still blocked in a wait: their stacks still use the token, so keep it.
            return
        if forking_pid and forking_pid != os.getpid():
            return  # a forked child's dead thread: the after-fork hook frees its keys
        after_init(&after, NULL, 0)
        lock()
        room = count_holds(token)
        unlock()
        if room:
            keys = <PyObject**>PyMem_RawMalloc(room * sizeof(PyObject*))
            if keys is NULL:
                room = 0  # release all the same; only the warning loses its keys
        lock()
        released = release_token(token, NULL, keys, room, &after)
        unlock()
        ident = token.ident
        free_token(token)
        finish(&after, NULL)
        abandoned = []
        for i in range(min(released, room)):
            abandoned.append(<object>keys[i])
            Py_XDECREF(keys[i])
        PyMem_RawFree(keys)
        if abandoned and not lockmgr_is_finalizing():
            warn_abandoned(ident, abandoned)


# -- fork ---------------------------------------------------------------------------------

def _before_fork():
    global forking_pid
    forking_pid = os.getpid()
    if LOCKMGR_FREE_THREADED:  # with a GIL, the forking thread's GIL already excludes sections
        lock()


def _after_fork_in_parent():
    global forking_pid
    if LOCKMGR_FREE_THREADED:
        unlock()
    forking_pid = 0


def _after_fork_in_child():
    """The child holds only what the forking thread held; the rest is free, queues are empty."""
    global forking_pid, main_ident
    cdef Token *survivor = existing_token()
    cdef Table *table
    cdef After after
    lockmgr_mutex_forget(&engine_mutex)  # held by the forking thread, which is this one
    main_ident = PyThread_get_thread_ident()
    if survivor is not NULL:
        survivor.is_main = True  # the forking thread is the child's main thread
    after_init(&after, NULL, 0)
    lock()
    table = tables
    while table is not NULL:
        keep_only(table, survivor, &after)
        table = table.next_table
    unlock()
    forking_pid = 0
    finish(&after, survivor)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


cdef inline PY_TIMEOUT_T sleep_microseconds(double deadline, bint is_main) noexcept:
    """How long the next sleep may last: until ``deadline`` (-1: none), in slices on the main thread."""
    cdef double seconds = -1.0
    if deadline >= 0:
        seconds = deadline - lockmgr_monotonic()
        if seconds < 0:
            seconds = 0
    if is_main and (seconds < 0 or seconds > main_thread_slice):
        seconds = main_thread_slice
    if seconds < 0:
        return -1
    if seconds * 1e6 >= <double>PY_TIMEOUT_MAX:
        return PY_TIMEOUT_MAX
    return <PY_TIMEOUT_T>(seconds * 1e6)


cdef struct Peek:
    bint found           # the key has an entry
    unsigned long owner  # the write holder's ident (0: none)
    Py_ssize_t count     # the write holder's level
    bint mine            # the caller is the write holder
    Py_ssize_t readers   # read holds
    Py_ssize_t my_reads  # the caller's read level


cdef Outcome peek(Table *table, Lookup *lookup, Token *token, Peek *seen) noexcept nogil:
    """Copy out what ``lookup``'s key looks like now (one section: a consistent view)."""
    cdef Entry *entry = find(table, lookup)
    cdef Hold *hold
    if lookup.candidate is not NULL:
        return COMPARE
    memset(seen, 0, sizeof(Peek))
    if entry is NULL:
        return DONE
    seen.found = True
    if entry.owner is not NULL:
        seen.owner = entry.owner.ident
        seen.count = entry.count
        seen.mine = entry.owner == token
    seen.readers = entry.nreaders
    if token is not NULL:
        hold = read_hold(entry, token)
        if hold is not NULL:
            seen.my_reads = hold.count
    return DONE


cdef inline Py_ssize_t held_count(Table *table) noexcept nogil:
    return table.held


cdef enum Kind:  # which section an Op runs
    ACQUIRE_WRITE
    ACQUIRE_READ
    ACQUIRE_MANY
    RELEASE_WRITE
    RELEASE_READ
    RELEASE_MANY
    PEEK


cdef struct Op:
    # One operation on a table: its arguments, the memory prepare took for it, its result.
    Kind kind
    Table *table
    Token *token
    Lookup *lookups         # the keys (one, or a set's)
    Py_ssize_t n            # how many keys
    Py_ssize_t count        # ACQUIRE_WRITE: levels to take
    bint try_only           # acquisitions: give up rather than queue
    bint fully              # RELEASE_WRITE: every level
    Request *request        # acquisitions: the request (a set's nodes) to queue
    Entry **fresh           # ACQUIRE_MANY: memory for entries
    Entry **entries         # RELEASE_MANY: room for the entries found
    Mode *modes             # RELEASE_MANY: each key's mode
    Peek *seen              # PEEK: where the view goes
    Py_ssize_t result       # RELEASE_WRITE: levels released; RELEASE_MANY: the failing key
    After after             # what the section left for finish


cdef Outcome run(Op *op) noexcept nogil:
    """The section of ``op`` (the mutex is held)."""
    if op.kind == ACQUIRE_WRITE:
        return acquire_write(op.table, op.lookups, op.token, op.count, op.try_only, op.request,
                             &op.after)
    if op.kind == RELEASE_WRITE:
        return release_write(op.table, op.lookups, op.token, op.fully, &op.result, &op.after)
    if op.kind == ACQUIRE_READ:
        return acquire_read(op.table, op.lookups, op.token, op.try_only, op.request, &op.after)
    if op.kind == RELEASE_READ:
        return release_read(op.table, op.lookups, op.token, &op.after)
    if op.kind == ACQUIRE_MANY:
        return acquire_many(op.table, op.lookups, op.request, op.n, op.fresh, op.try_only,
                            &op.after)
    if op.kind == RELEASE_MANY:
        return release_many(op.table, op.lookups, op.modes, op.entries, op.n, op.token,
                            &op.result, &op.after)
    return peek(op.table, op.lookups, op.token, op.seen)


cdef inline void op_init(Op *op, Kind kind, Table *table, Token *token, Lookup *lookups,
                         Py_ssize_t n) noexcept:
    op.kind = kind
    op.table = table
    op.token = token
    op.lookups = lookups
    op.n = n
    op.result = 0
    # No room for a cycle: a section that finds one answers LONG_CYCLE and prepare makes
    # room (deadlocks are rare; the fast path stays small).
    after_init(&op.after, NULL, 0)


cdef inline int execute(Op *op) except -1:
    """Run ``op``'s section until it decides (returns the Outcome): after comparing keys in
    Python when it asks, with room for a cycle when it found one."""
    cdef Outcome outcome
    lock()
    outcome = run(op)
    unlock()
    if outcome == COMPARE or outcome == LONG_CYCLE:
        return execute_again(op, outcome)
    return outcome


cdef int execute_again(Op *op, Outcome outcome) except -1:
    cdef Py_ssize_t i
    try:
        while True:
            if outcome == COMPARE:
                for i in range(op.n):
                    if op.lookups[i].candidate is not NULL:
                        compare_candidate(op.lookups + i)
            elif outcome == LONG_CYCLE:
                make_cycle_room(op)
            else:
                return outcome
            lock()
            outcome = run(op)
            unlock()
    finally:
        for i in range(op.n):  # the answers hold only for this operation
            lookup_clear(op.lookups + i)


cdef int make_cycle_room(Op *op) except -1:
    cdef Py_ssize_t i
    PyMem_RawFree(op.after.cycle)
    op.after.cycle_room = 0
    op.after.cycle = <CycleStep*>PyMem_RawMalloc(op.after.cycle_length * 2 * sizeof(CycleStep))
    if op.after.cycle is NULL:
        raise MemoryError()
    op.after.cycle_room = op.after.cycle_length * 2
    if op.kind == ACQUIRE_MANY:  # the entries it made went back: make them again
        finish(&op.after, NULL)
        for i in range(op.n):
            if op.fresh[i] is NULL:
                op.fresh[i] = <Entry*>PyMem_RawMalloc(sizeof(Entry))
                if op.fresh[i] is NULL:
                    raise MemoryError()
    return 0


cdef inline int finish_if_needed(After *after, Token *keeper) except -1:
    cdef Entry *entry = after.retired
    if after.woken is NULL and after.resize is NULL and (entry is NULL or (
            entry.bucket_next is NULL and keeper is not NULL and keeper.spare_entry is NULL)):
        if entry is not NULL:  # the common release: one key given up, its memory kept
            after.retired = NULL
            keeper.spare_entry = entry
            Py_XDECREF(entry.key)
        return 0
    return finish(after, keeper)


# -- the engine ---------------------------------------------------------------------------

cdef class _Engine:
    """The table, holds, queues, grants and waits that every manager shares."""
    cdef Table table                      # this manager's lock table (see struct Table)
    cdef tuple stripe_keys                # striped: one Stripe key per stripe; None: exact keys
    cdef size_t stripe_mask               # striped: stripe count - 1 (the count is a power of two)
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        global tables
        cdef Entry **buckets = <Entry**>PyMem_RawCalloc(MIN_BUCKETS, sizeof(Entry*))
        if buckets is NULL:
            raise MemoryError()
        self.table.buckets = buckets
        self.table.mask = MIN_BUCKETS - 1
        self.table.fair = True
        lock()
        self.table.next_table = tables
        if tables is not NULL:
            tables.previous_table = &self.table
        tables = &self.table
        unlock()

    def __dealloc__(self):
        cdef After after
        if self.table.buckets is NULL:  # __cinit__ failed before allocating anything
            return
        after_init(&after, NULL, 0)
        lock()
        tear_down(&self.table, &after)
        unlock()
        finish(&after, NULL)
        PyMem_RawFree(self.table.buckets)
        self.table.buckets = NULL

    __class_getitem__ = classmethod(GenericAlias)

    def __repr__(self):
        stats = self.stats()
        return manager_repr(self, self.table.fair, stats.held, stats.waiting)

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)

    def __sizeof__(self):
        cdef size_t buckets, entries
        lock()
        buckets = self.table.mask + 1
        entries = self.table.entries
        unlock()
        return sizeof(LockManager) + buckets * sizeof(Entry*) + entries * sizeof(Entry)

    def __len__(self):
        """Keys currently held (with stripes: stripes)."""
        cdef Py_ssize_t held
        lock()
        held = held_count(&self.table)
        unlock()
        return held

    @property
    def stripes(self):
        """How many stripes keys map onto, or None: one lock per key."""
        return None if self.stripe_keys is None else len(self.stripe_keys)

    def stripe_of(self, key):
        """The stripe ``key`` maps onto (None without stripes): keys that share one share a lock."""
        if self.stripe_keys is None:
            return None
        return spread(hash(key)) & self.stripe_mask

    cdef int _use_stripes(self, stripes) except -1:
        count = stripe_count(stripes)
        if count is not None:
            self.stripe_keys = tuple([Stripe(index) for index in range(count)])
            self.stripe_mask = count - 1
        return 0

    cdef inline object _lock_key(self, object key, Py_hash_t *h):
        """The key the table uses for ``key`` (hashed to ``h[0]``): the key itself, or its
        stripe; ``h[0]`` becomes that key's hash."""
        cdef size_t index
        if self.stripe_keys is None:
            return key
        index = spread(h[0]) & self.stripe_mask
        h[0] = <Py_hash_t>index
        return self.stripe_keys[index]

    def _table_key(self, key):
        """``_lock_key`` for Python callers (the multi-key argument normalisers)."""
        cdef Py_hash_t h = hash(key)
        return self._lock_key(key, &h)

    cdef int _peek(self, object key, Peek *seen) except -1:
        cdef Py_hash_t h = hash(key)
        cdef Lookup lookup
        cdef Op op
        key = self._lock_key(key, &h)
        lookup_init(&lookup, key, h)
        op_init(&op, PEEK, &self.table, existing_token(), &lookup, 1)
        op.seen = seen
        execute(&op)
        return 0

    def stats(self):
        """A snapshot of this manager's counters (read at one instant)."""
        cdef unsigned long long counters[6]
        lock()
        read_stats(&self.table, counters)
        unlock()
        return LockStats(
            held=counters[0],
            waiting=counters[1],
            acquisitions=counters[2],
            contended=counters[3],
            timeouts=counters[4],
            deadlocks=counters[5],
        )

    def release_all(self):
        """Release every key of this manager the calling thread holds, all levels; returns how many.

        Levels that a waiting ``acquire_many`` of this thread took (only code running inside
        that wait can see them) stay until that call ends.
        """
        cdef Token *token = existing_token()
        cdef After after
        cdef Py_ssize_t released
        if token is NULL:
            return 0
        after_init(&after, NULL, 0)
        lock()
        released = release_token(token, &self.table, NULL, 0, &after)
        unlock()
        finish(&after, token)
        return released

    # -- acquiring ------------------------------------------------------------------------

    cdef bint _acquire_write(self, object key, Py_hash_t h, double seconds,
                             Py_ssize_t count) except -1:
        """Acquire ``count`` write levels of ``key``, waiting at most ``seconds`` (-1: forever)."""
        cdef Token *token = current_token()
        cdef Lookup lookup
        cdef Request request
        cdef Op op
        cdef Outcome outcome
        if token.spare_entry is NULL:
            ensure_memory(<void**>&token.spare_entry, sizeof(Entry))
        if token.wakeup is NULL and seconds != 0:
            wakeup_lock(token)
        lookup_init(&lookup, key, h)
        op_init(&op, ACQUIRE_WRITE, &self.table, token, &lookup, 1)
        op.count = count
        op.try_only = seconds == 0
        op.request = &request
        outcome = <Outcome>execute(&op)
        if outcome == DONE and op.after.resize is NULL:
            return True
        return self._resolve(&op, outcome, key, seconds)

    cdef bint _acquire_read(self, object key, Py_hash_t h, double seconds) except -1:
        cdef Token *token = current_token()
        cdef Lookup lookup
        cdef Request request
        cdef Op op
        cdef Outcome outcome
        ensure_memory(<void**>&token.spare_entry, sizeof(Entry))
        ensure_memory(<void**>&token.spare_hold, sizeof(Hold))
        if seconds != 0:
            wakeup_lock(token)
        lookup_init(&lookup, key, h)
        op_init(&op, ACQUIRE_READ, &self.table, token, &lookup, 1)
        op.try_only = seconds == 0
        op.request = &request
        request.hold = NULL
        outcome = <Outcome>execute(&op)
        try:
            return self._resolve(&op, outcome, key, seconds)
        finally:
            if outcome == QUEUED and request.hold is not NULL:  # the grant did not need it
                if token.spare_hold is NULL:
                    token.spare_hold = request.hold
                else:
                    PyMem_RawFree(request.hold)

    cdef bint _acquire_many(self, list items, double seconds) except -1:
        """Take every distinct ``(key, mode)`` of ``items`` at once, or none of them."""
        cdef Py_ssize_t n = len(items), i
        cdef Token *token
        cdef Lookup *lookups = NULL
        cdef Request *nodes = NULL
        cdef Entry **fresh = NULL
        cdef Op op
        cdef Outcome outcome
        if n == 0:
            return True
        token = current_token()
        if seconds != 0:
            wakeup_lock(token)
        try:
            lookups = <Lookup*>PyMem_RawCalloc(n, sizeof(Lookup))
            nodes = <Request*>PyMem_RawCalloc(n, sizeof(Request))
            fresh = <Entry**>PyMem_RawCalloc(n, sizeof(Entry*))
            if lookups is NULL or nodes is NULL or fresh is NULL:
                raise MemoryError()
            op_init(&op, ACQUIRE_MANY, &self.table, token, lookups, n)
            op.try_only = seconds == 0
            op.request = nodes
            op.fresh = fresh
            for i in range(n):
                key, mode = items[i]  # ``items`` keeps the keys alive
                lookup_init(lookups + i, key, hash(key))
                nodes[i].token = token
                nodes[i].lead = nodes
                nodes[i].count = 1
                nodes[i].mode = READ if mode == READ else WRITE
                fresh[i] = <Entry*>PyMem_RawMalloc(sizeof(Entry))
                if fresh[i] is NULL:
                    raise MemoryError()
                if nodes[i].mode == READ:
                    nodes[i].hold = <Hold*>PyMem_RawMalloc(sizeof(Hold))
                    if nodes[i].hold is NULL:
                        raise MemoryError()
            nodes.nodes = n
            outcome = <Outcome>execute(&op)
            keys = tuple([key for key, _ in items]) if outcome in (NESTED, OVERFLOW) else None
            return self._resolve(&op, outcome, keys, seconds)
        finally:
            if nodes is not NULL:
                for i in range(n):
                    PyMem_RawFree(nodes[i].hold)
            if fresh is not NULL:
                for i in range(n):
                    PyMem_RawFree(fresh[i])
            PyMem_RawFree(lookups)
            PyMem_RawFree(nodes)
            PyMem_RawFree(fresh)

    cdef bint _resolve(self, Op *op, Outcome outcome, object key, double seconds) except -1:
        """Act on what an acquiring section decided (off the fast path)."""
        try:
            finish(&op.after, op.token)
            if outcome == DONE:
                return True
            if outcome == BUSY:
                return False
            if outcome == QUEUED:
                return self._wait(op.request, seconds)
            if outcome == NESTED:
                raise nested_wait(key)
            if outcome == OVERFLOW:
                raise count_overflow(key)
            raise deadlock(cycle_list(&op.after))
        finally:
            PyMem_RawFree(op.after.cycle)

    cdef bint _wait(self, Request *request, double seconds) except -1:
        """Sleep until the queued ``request`` is granted or its time runs out."""
        cdef Token *token = request.token
        cdef double deadline = -1.0
        cdef bint posted = False
        cdef PY_TIMEOUT_T microseconds
        cdef PyLockStatus status
        cdef Outcome outcome
        if seconds > 0:
            deadline = request.since + seconds
        try:
            while True:
                microseconds = sleep_microseconds(deadline, token.is_main)
                with nogil:
                    status = PyThread_acquire_lock_timed(token.wakeup, microseconds, 1)
                if status == PY_LOCK_ACQUIRED:
                    posted = True
                outcome = self._settle(request, &posted, deadline, False)
                if outcome == TIMED_OUT:
                    return False
                if outcome == STILL:
                    posted = False  # any post was consumed
                # Handlers (and on 3.12+ the GC) run here; one that raises ends the wait,
                # and a grant that raced it is passed on.
                PyErr_CheckSignals()
                if outcome == DONE:
                    self._complete(request)
                    return True
        except BaseException:
            self._settle(request, &posted, deadline, True)
            raise

    cdef Outcome _settle(self, Request *request, bint *posted, double deadline,
                         bint abandoning) except *:
        """One section after a wake-up (or, ``abandoning``, after an exception), after
        consuming a post that is due but was not seen yet."""
        cdef After after
        cdef Outcome outcome
        after_init(&after, NULL, 0)
        while True:
            lock()
            if abandoning:
                outcome = abandon(&self.table, request, posted[0], &after)
            else:
                outcome = settle(&self.table, request, posted[0], deadline, &after)
            unlock()
            if outcome != NEED_POST:
                break
            with nogil:  # the post is at most one finish away
                PyThread_acquire_lock(request.token.wakeup, WAIT_LOCK)
            posted[0] = True
        finish(&after, request.token)
        return outcome

    cdef int _complete(self, Request *request) except -1:
        cdef After after
        after_init(&after, NULL, 0)
        lock()
        complete(&self.table, request, &after)
        unlock()
        finish(&after, request.token)
        return 0

    # -- releasing ------------------------------------------------------------------------

    cdef Py_ssize_t _release_write(self, object key, Py_hash_t h, bint fully) except -1:
        """Undo one write level of ``key`` (``fully``: all of them; returns how many)."""
        cdef Token *token = existing_token()
        cdef Lookup lookup
        cdef Op op
        cdef Outcome outcome
        lookup_init(&lookup, key, h)
        op_init(&op, RELEASE_WRITE, &self.table, token, &lookup, 1)
        op.fully = fully
        outcome = <Outcome>execute(&op)
        finish_if_needed(&op.after, token)
        if outcome == DONE:
            return op.result
        raise not_owned(key) if outcome == NOT_OWNED else pinned(key)

    cdef int _release_read(self, object key, Py_hash_t h) except -1:
        cdef Token *token = existing_token()
        cdef Lookup lookup
        cdef Op op
        cdef Outcome outcome
        lookup_init(&lookup, key, h)
        op_init(&op, RELEASE_READ, &self.table, token, &lookup, 1)
        outcome = <Outcome>execute(&op)
        finish_if_needed(&op.after, token)
        if outcome == DONE:
            return 0
        raise not_owned(key) if outcome == NOT_OWNED else pinned(key)

    cdef int _release_many(self, list items) except -1:
        """Undo one ``_acquire_many`` of ``items``: all of them, or (if one is not held as
        asked) none, with NotOwnedError."""
        cdef Py_ssize_t n = len(items), i
        cdef Token *token = existing_token()
        cdef Lookup *lookups = <Lookup*>PyMem_RawCalloc(n + 1, sizeof(Lookup))
        cdef Mode *modes = <Mode*>PyMem_RawCalloc(n + 1, sizeof(Mode))
        cdef Entry **entries = <Entry**>PyMem_RawCalloc(n + 1, sizeof(Entry*))
        cdef Op op
        cdef Outcome outcome = DONE
        try:
            if lookups is NULL or modes is NULL or entries is NULL:
                raise MemoryError()
            op_init(&op, RELEASE_MANY, &self.table, token, lookups, n)
            op.modes = modes
            op.entries = entries
            for i in range(n):
                key, mode = items[i]
                lookup_init(lookups + i, key, hash(key))
                modes[i] = READ if mode == READ else WRITE
            if n:
                outcome = <Outcome>execute(&op)
                finish_if_needed(&op.after, token)
        finally:
            PyMem_RawFree(lookups)
            PyMem_RawFree(modes)
            PyMem_RawFree(entries)
        if outcome == NOT_OWNED:
            raise not_owned(items[op.result][0])
        if outcome == PINNED:
            raise pinned(items[op.result][0])
        return 0


# -- the managers -------------------------------------------------------------------------

@cython.final
cdef class LockManager(_Engine):
    """Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

    Memory grows only with the keys currently held or waited on.
    """

    def __cinit__(self, *, fair=True, stripes=None):
        self.table.fair = bool(fair)
        self._use_stripes(stripes)

    @property
    def fair(self):
        """True for strict FIFO hand-off, False for eventual fairness."""
        return self.table.fair

    def acquire(self, key, blocking=True, timeout=FOREVER):
        """Lock ``key`` for the calling thread, like ``threading.RLock.acquire``.

        Returns True once held (reentrant: a holder always succeeds at once), False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first.
        """
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        return self._acquire_write(key, h, seconds, 1)

    def release(self, key):
        """Undo one ``acquire`` of ``key``; raises NotOwnedError if the caller does not hold it."""
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        self._release_write(key, h, False)

    def hold(self, key, timeout=None):
        """A context manager holding ``key`` for its block.

        ``timeout``: None or -1 waits forever, 0 tries once; LockTimeout if not acquired.
        """
        cdef double seconds = hold_seconds(timeout)
        cdef KeyLock view = self._view(key)
        view.seconds = seconds
        return view

    def __getitem__(self, key):
        """The per-key lock view: behaves like a ``threading.RLock`` for this one key."""
        return self._view(key)

    def synchronized(self, key_func):
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs."""
        return synchronized(self, key_func)

    def acquire_many(self, keys, blocking=True, timeout=FOREVER):
        """Lock every key of ``keys`` at once, or none: True, or False on timeout.

        Duplicates count once; keys the caller holds are re-entered. The request queues
        FIFO on every key it needs and keeps its place there, so it cannot starve, and it
        never deadlocks against other multi-key calls, whatever the order of the keys.
        """
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(many_items(keys, self._table_key), seconds)

    def release_many(self, keys):
        """Undo one ``acquire_many(keys)``; NotOwnedError (nothing released) if one is not held."""
        self._release_many(many_items(keys, self._table_key))

    def hold_many(self, keys, timeout=None):
        """A context manager holding every key of ``keys`` for its block (LockTimeout)."""
        return _HoldingMany(self, many_items(keys, self._table_key), hold_seconds(timeout))

    def locked(self, key):
        """Whether any thread holds ``key``."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.owner != 0

    def owned(self, key):
        """Whether the calling thread holds ``key``."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.mine

    def owner(self, key):
        """The ``threading.get_ident()`` of the thread holding ``key``, or None."""
        return self._owner_and_count(key)[0]

    def recursion_count(self, key):
        """How many times the calling thread holds ``key`` (0 if it does not)."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.count if seen.mine else 0

    def __contains__(self, key):
        """Whether ``key`` is currently held (by any thread)."""
        return self.locked(key)

    def _owner_and_count(self, key):
        cdef Peek seen
        self._peek(key, &seen)
        if seen.owner == 0:
            return None, 0
        return seen.owner, seen.count

    def _release_save(self, key):
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        return self._release_fully(key, h)

    def _acquire_restore(self, key, state):
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        self._acquire_write(key, h, -1.0, restored_count(state))

    cdef KeyLock _view(self, key):
        cdef KeyLock view = KeyLock.__new__(KeyLock)
        cdef Py_hash_t h = hash(key)
        view.key = key
        view.lock_key = self._lock_key(key, &h)
        view.hash = h
        view.manager = self
        view.seconds = -1.0
        return view

    cdef tuple _release_fully(self, object key, Py_hash_t h):
        cdef Py_ssize_t levels = self._release_write(key, h, True)
        return levels, existing_token().ident


@cython.final
cdef class RWLockManager(_Engine):
    """Per-key reader/writer locks: many readers or one writer, reentrant, FIFO without
    writer starvation, upgrades and downgrades within a thread."""

    def __cinit__(self, *, stripes=None):
        self._use_stripes(stripes)

    def acquire_read(self, key, blocking=True, timeout=FOREVER):
        """Take ``key`` for reading; the same arguments and result as ``LockManager.acquire``."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        return self._acquire_read(key, h, seconds)

    def acquire_write(self, key, blocking=True, timeout=FOREVER):
        """Take ``key`` for writing (an upgrade if the caller reads it)."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        return self._acquire_write(key, h, seconds, 1)

    def release_read(self, key):
        """Undo one ``acquire_read``; NotOwnedError if the caller does not read ``key``."""
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        self._release_read(key, h)

    def release_write(self, key):
        """Undo one ``acquire_write``; NotOwnedError if the caller does not write ``key``."""
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        self._release_write(key, h, False)

    def read(self, key, timeout=None):
        """A context manager reading ``key`` for its block (LockTimeout if not acquired)."""
        return self._holding(key, timeout, READ)

    def write(self, key, timeout=None):
        """A context manager writing ``key`` for its block (LockTimeout if not acquired)."""
        return self._holding(key, timeout, WRITE)

    def acquire_many(self, reads=(), writes=(), blocking=True, timeout=FOREVER):
        """Read every key of ``reads`` and write every key of ``writes`` at once, or none
        (a key in both is written); see ``LockManager.acquire_many``."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(rw_items(reads, writes, self._table_key), seconds)

    def release_many(self, reads=(), writes=()):
        """Undo one ``acquire_many`` with the same arguments."""
        self._release_many(rw_items(reads, writes, self._table_key))

    def hold_many(self, reads=(), writes=(), timeout=None):
        """A context manager holding ``reads`` and ``writes`` for its block (LockTimeout)."""
        return _HoldingMany(self, rw_items(reads, writes, self._table_key), hold_seconds(timeout))

    def readers(self, key):
        """How many threads hold ``key`` for reading."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.readers

    def write_locked(self, key):
        """Whether a thread holds ``key`` for writing."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.owner != 0

    def __contains__(self, key):
        """Whether ``key`` has any holder."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.owner != 0 or seen.readers > 0

    def _read_count(self, key):
        """How many times the calling thread reads ``key``."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.my_reads

    cdef _Holding _holding(self, key, timeout, Mode mode):
        cdef _Holding holding = _Holding.__new__(_Holding)
        cdef Py_hash_t h = hash(key)
        holding.seconds = hold_seconds(timeout)
        holding.key = self._lock_key(key, &h)
        holding.hash = h
        holding.manager = self
        holding.mode = mode
        return holding


@cython.final
@cython.freelist(16)
cdef class _Holding:
    """What ``RWLockManager.read()`` and ``write()`` return: holds the key for a block."""
    cdef RWLockManager manager  # whose key
    cdef object key             # the key
    cdef Py_hash_t hash         # hash(key)
    cdef double seconds         # how long ``with`` waits: -1 forever
    cdef Mode mode              # READ or WRITE

    def __enter__(self):
        if self.mode == READ:
            acquired = self.manager._acquire_read(self.key, self.hash, self.seconds)
        else:
            acquired = self.manager._acquire_write(self.key, self.hash, self.seconds, 1)
        if not acquired:
            raise timed_out(self.key, self.seconds)
        return True

    def __exit__(self, exc_type, exc, traceback):
        if self.mode == READ:
            self.manager._release_read(self.key, self.hash)
        else:
            self.manager._release_write(self.key, self.hash, False)


@cython.final
cdef class _HoldingMany:
    """What ``hold_many()`` returns: holds a set of keys for a block."""
    cdef _Engine manager  # whose keys
    cdef list items       # the distinct (key, mode) pairs
    cdef double seconds   # how long ``with`` waits: -1 forever

    def __cinit__(self, _Engine manager, list items, double seconds):
        self.manager = manager
        self.items = items
        self.seconds = seconds

    def __enter__(self):
        if not self.manager._acquire_many(self.items, self.seconds):
            raise timed_out(tuple(key for key, _ in self.items), self.seconds)
        return True

    def __exit__(self, exc_type, exc, traceback):
        self.manager._release_many(self.items)


@cython.final
@cython.freelist(16)
cdef class KeyLock:
    """One key of a manager seen as a ``threading.RLock``.

    Views are cheap and not cached: two views of one key of one manager are the same lock
    (and compare equal). A view keeps its manager alive; the manager does not keep views.
    """
    cdef readonly LockManager manager  # the manager whose key this is
    cdef readonly object key           # the key
    cdef object lock_key               # the key the table uses: ``key``, or its stripe
    cdef Py_hash_t hash                # hash(lock_key), computed when the view was made
    cdef double seconds                # how long ``with`` waits: -1 forever (hold() sets it)
    cdef object __weakref__

    def __init__(self, LockManager manager not None, key):
        cdef Py_hash_t h = hash(key)
        self.key = key
        self.lock_key = manager._lock_key(key, &h)
        self.hash = h
        self.manager = manager
        self.seconds = -1.0

    __class_getitem__ = classmethod(GenericAlias)

    def acquire(self, blocking=True, timeout=FOREVER):
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self.manager._acquire_write(self.lock_key, self.hash, seconds, 1)

    def release(self):
        self.manager._release_write(self.lock_key, self.hash, False)

    def locked(self):
        return self.manager.locked(self.key)

    def __enter__(self):
        if not self.manager._acquire_write(self.lock_key, self.hash, self.seconds, 1):
            raise timed_out(self.key, self.seconds)
        return True

    def __exit__(self, exc_type, exc, traceback):
        self.manager._release_write(self.lock_key, self.hash, False)

    def _is_owned(self):
        return self.manager.owned(self.key)

    def _release_save(self):
        return self.manager._release_fully(self.lock_key, self.hash)

    def _acquire_restore(self, state):
        self.manager._acquire_write(self.lock_key, self.hash, -1.0, restored_count(state))

    def _recursion_count(self):
        return self.manager.recursion_count(self.key)

    def __eq__(self, other):
        if not isinstance(other, KeyLock):
            return NotImplemented
        return self.manager is (<KeyLock>other).manager and bool(self.key == (<KeyLock>other).key)

    def __hash__(self):
        return hash((id(self.manager), self.key))

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)

    def __repr__(self):
        owner, count = self.manager._owner_and_count(self.key)
        return key_lock_repr(self, self.key, owner, count)
