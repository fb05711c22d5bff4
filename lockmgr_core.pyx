# cython: language_level=3, binding=False
"""The compiled engine of lockmgr, built as ``lockmgr._core``.

It is ``src/lockmgr/_pure.py`` in C: the same entries, requests, tokens and hand-off rules
(that file's docstring states the invariants; each is kept here where the same name
appears). What differs is how state is guarded and how threads sleep.

Guarding state: the table section
---------------------------------
Every field of a manager, of its entries and requests, and every token's list of held
entries is read and written only with the GIL held and with no Python code running in
between ("the table section"). Keys are hashed before a section starts; a lookup that must
call a key's ``__eq__`` (Python code, which may let other threads in) re-validates against
``LockManager.version`` afterwards and restarts if the table changed; a key reference the
table gives up is dropped (which may run ``__del__``) only after the section ends. This is
the module's one GIL-dependent rule: a free-threaded build needs one per-manager mutex
(``PyMutex``) around exactly the code between ``# table section`` and ``# end of table
section``, and around the token hand-over in ``_ThreadExit``.

Sleeping
--------
A waiting thread sleeps on its token's ``wakeup`` lock (CPython's ``PyThread_type_lock``:
monotonic, interruptible by signals, native on every platform CPython supports) with the GIL
released; a granting thread posts it with the GIL held. Lock-ordering rule: the only C lock
any thread blocks on is a wakeup lock, and only its own, without the GIL; posting one takes
at most CPython's short internal mutex of that lock, whose holder never needs the GIL.
"""

cimport cython
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport Py_EQ, PyObject, PyObject_RichCompareBool
from cpython.pythread cimport (
    NOWAIT_LOCK,
    PY_LOCK_ACQUIRED,
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
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport uint64_t

import threading
from types import GenericAlias

from lockmgr._common import (
    HANDOFF_AFTER,
    MAIN_THREAD_SLICE,
    PICKLE_ERROR,
    LockStats,
    deadlock,
    hold_seconds,
    key_lock_repr,
    manager_repr,
    many_items,
    not_owned,
    restored_count,
    rw_items,
    Stripe,
    stripe_count,
    synchronized,
    timed_out,
    wait_seconds,
    warn_abandoned,
)
import os

cdef extern from "Python.h":
    ctypedef long long PY_TIMEOUT_T
    const PY_TIMEOUT_T PY_TIMEOUT_MAX
    PyLockStatus PyThread_acquire_lock_timed(
        PyThread_type_lock lock, PY_TIMEOUT_T microseconds, int intr_flag) nogil
    int PyErr_CheckSignals() except -1
    PyObject *PyThreadState_GetDict()
    int lockmgr_is_finalizing()

cdef extern from *:
    """
    #if PY_VERSION_HEX >= 0x030D0000
    #  define lockmgr_is_finalizing() Py_IsFinalizing()
    #else
    #  define lockmgr_is_finalizing() _Py_IsFinalizing()
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
    """
    double lockmgr_monotonic() nogil


cdef enum RequestState:
    WAITING = 0  # queued, asleep or about to sleep
    WOKEN = 1    # fair=False: the key was freed and this request was told to race for it
    GRANTED = 2  # the key was handed to this request; its thread holds it now
    LEFT = 3     # timed out or cancelled: out of the queue, its thread about to return


cdef enum Mode:
    READ = 1   # shared: any number of threads at once (RWLockManager)
    WRITE = 2  # exclusive (every LockManager request)


cdef struct Token:
    unsigned long ident         # threading.get_ident() of its thread, for owner() and reprs
    bint is_main                # its thread is the main thread, where signal handlers run
    Entry *held                 # entries it write-holds in any manager, linked through held_next
    Hold *reads                 # its read holds in any manager, linked through token_next
    PyThread_type_lock wakeup   # locked unless a grant or wake is posted; NULL until first wait
    Request *request            # the request its thread is waiting in, or NULL
    unsigned long long visit    # deadlock search: number of the last search that reached it
    Token *reached_from         # deadlock search: the thread whose wait led here
    Entry *reached_via          # deadlock search: the entry that thread waits for


cdef struct Hold:
    Token *token        # the reading thread
    Entry *entry        # the entry it reads
    Py_ssize_t count    # its read recursion level (> 0 while linked)
    Hold *entry_prev    # neighbour among the entry's read holds (newest first)
    Hold *entry_next    # neighbour among the entry's read holds
    Hold *token_prev    # neighbour among the token's read holds (newest first)
    Hold *token_next    # neighbour among the token's read holds


cdef struct Request:
    Request *prev        # neighbour towards the head of the entry's queue
    Request *next        # neighbour towards the tail
    Token *token         # the waiting thread's token
    Entry *entry         # the entry whose queue it is (or would be) in
    Mode mode            # what it asks for
    Hold *hold           # READ: the hold to link in when granted (allocated by the waiter)
    Py_ssize_t count     # recursion level to install when granted
    RequestState state   # set by the granting/waking thread and by the waiter, table section only
    double since         # monotonic time it queued (fair=False's hand-off rule)
    bint at_head         # an upgrade: queued before every other request
    Request *lead        # multi-key: the first node of its array, whose state speaks for all
    Py_ssize_t nodes     # multi-key, on the lead: how many nodes its array holds
    bint queued          # multi-key: it waits in its entry's queue (else it re-enters a held key)


cdef struct Entry:
    PyObject *key        # strong reference to the key as first given
    Py_hash_t hash       # hash(key), computed before the table section
    Entry *bucket_next   # next entry in the same bucket, or in the manager's spare list
    PyObject *manager    # the _Engine holding this entry (borrowed: it frees its entries)
    Token *owner         # the write (exclusive) holder; NULL if none
    Py_ssize_t count     # the owner's write recursion level; 0 iff owner is NULL
    Entry *held_prev     # neighbour in the owner's list of write-held entries
    Entry *held_next     # neighbour in the owner's list of write-held entries
    Hold *readers        # read holds, one per reading thread (newest first)
    Py_ssize_t nreaders  # how many read holds
    Request *head        # oldest waiting request (an upgrade goes before all others)
    Request *tail        # newest waiting request


cdef enum:
    MIN_BUCKETS = 8  # the table never shrinks below this
    MAX_SPARE = 16   # freed entries kept for reuse by each manager

cdef double handoff_after = HANDOFF_AFTER
cdef double main_thread_slice = MAIN_THREAD_SLICE
cdef object FOREVER = -1  # the default timeout object, so the fast path can test identity
cdef unsigned long main_ident = threading.main_thread().ident

cdef Py_tss_t token_key  # per thread: that thread's Token*, or NULL before its first use
cdef unsigned long long searches = 0  # numbers deadlock searches (Token.visit)
cdef PyObject *managers = NULL  # every live _Engine, linked through next_manager (for fork)
cdef bint forking = False  # between os.fork()'s before hook and its after hook
if PyThread_tss_create(&token_key) != 0:
    raise MemoryError("cannot create the thread-specific key for lockmgr tokens")


cdef inline size_t spread(Py_hash_t h) noexcept:
    """Mix a hash so its low bits depend on all of it (lockmgr._common.stripe_index)."""
    cdef uint64_t mixed = <uint64_t>h * 0x9E3779B97F4A7C15ULL
    return <size_t>(mixed ^ (mixed >> 32))


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
    cdef Token *token = <Token*>PyMem_Calloc(1, sizeof(Token))
    if token is NULL:
        raise MemoryError()
    token.ident = PyThread_get_thread_ident()
    token.is_main = token.ident == main_ident
    cdef _ThreadExit guard = _ThreadExit.__new__(_ThreadExit)
    guard.token = token  # from here on the guard frees the token
    (<object>state)[_ThreadExit] = guard
    PyThread_tss_set(&token_key, token)
    return token


@cython.final
cdef class _ThreadExit:
    """Sits in its thread's state dict, so CPython destroys it when the thread ends.

    It then releases whatever the thread still holds (waiters are handed those keys as
    usual) and frees the thread's token. Ownership is the token, so a new thread that is
    given a recycled ident starts with a new token and never inherits anything.
    """
    cdef Token *token  # the token of the thread whose state dict holds this guard

    def __dealloc__(self):
        cdef Token *token = self.token
        if token is NULL:
            return
        if PyThread_tss_get(&token_key) == token:
            PyThread_tss_set(&token_key, NULL)
        if token.request is not NULL:
            # Only at interpreter shutdown or in a forked child, which clear the states of
            # threads still blocked in a wait: their stacks still use the token, so keep it.
            return
        if forking:
            return  # a forked child's dead thread: the after-fork hook frees its keys
        abandoned = held_keys(token)
        retired = []
        release_held(token, NULL, retired)
        if token.wakeup is not NULL:
            PyThread_free_lock(token.wakeup)
        ident = token.ident
        PyMem_Free(token)
        del retired  # the dropped keys' last references, after the table section
        if abandoned and not lockmgr_is_finalizing():
            warn_abandoned(ident, abandoned)


cdef list held_keys(Token *token):
    """Every key ``token`` holds, read or write, once each."""
    cdef list keys = []
    cdef Entry *entry = token.held
    cdef Hold *hold = token.reads
    while entry is not NULL:
        keys.append(<object>entry.key)
        entry = entry.held_next
    while hold is not NULL:
        if hold.entry.owner != token:
            keys.append(<object>hold.entry.key)
        hold = hold.token_next
    return keys


cdef Py_ssize_t release_held(Token *token, PyObject *manager, list retired) except -1:
    """Fully release every key ``token`` holds (in ``manager`` only, unless it is NULL).

    Returns how many keys (one held for read and write counts once); the keys the tables
    gave up go to ``retired``, for the caller to drop after the section.
    """
    cdef Py_ssize_t released = 0
    cdef Entry *entry = token.held
    cdef Entry *following
    cdef Hold *hold = token.reads
    cdef Hold *next_hold
    cdef PyObject *key
    cdef _Engine engine
    # table section
    while hold is not NULL:  # reads first, so a write-held key is counted with its write
        next_hold = hold.token_next  # survives: it is on another entry
        entry = hold.entry
        if manager is NULL or entry.manager == manager:
            engine = <_Engine>entry.manager
            if entry.owner != token:
                released += 1
            engine._drop_read(entry, hold)
            key = engine._pass_on(entry)
            if key is not NULL:
                retired.append(<object>key)
                Py_XDECREF(key)
        hold = next_hold
    entry = token.held
    while entry is not NULL:
        following = entry.held_next  # survives: only ``entry`` is unlinked or freed below
        if manager is NULL or entry.manager == manager:
            engine = <_Engine>entry.manager
            engine._disown(entry)
            key = engine._pass_on(entry)
            if key is not NULL:
                retired.append(<object>key)
                Py_XDECREF(key)
            released += 1
        entry = following
    # end of table section
    return released


cdef struct Search:
    unsigned long long number  # this search's number, marked on each token it reaches (visit)
    Token *me                  # the thread about to wait: reaching it again closes a cycle
    Token **stack              # reached threads whose own waits are still to be followed
    Py_ssize_t depth           # how many threads are on the stack
    Py_ssize_t room            # how many the stack has room for


cdef int reach(Search *search, Token *thread, Token *successor, Entry *waits_for) except -1:
    """``thread`` waits for ``successor`` in ``waits_for``; returns 1 if that closes the cycle."""
    if successor is NULL or successor == thread:
        return 0
    if successor == search.me:
        successor.reached_from = thread
        successor.reached_via = waits_for
        return 1
    if successor.visit == search.number:
        return 0
    successor.visit = search.number
    successor.reached_from = thread
    successor.reached_via = waits_for
    if search.depth == search.room:
        search.room = search.room * 2 + 8
        search.stack = <Token**>PyMem_Realloc(search.stack, search.room * sizeof(Token*))
        if search.stack is NULL:
            raise MemoryError()
    search.stack[search.depth] = successor
    search.depth += 1
    return 0


cdef int reach_waited_for(Search *search, Token *thread, Entry *waits_for, Mode mode,
                          Request *own, bint at_head) except -1:
    """Reach every thread a ``mode`` request of ``thread`` in ``waits_for`` waits for: the
    holders it conflicts with (hard edges), then the conflicting requests queued ahead of
    ``own`` (soft edges; ``own`` NULL: all, unless ``at_head``). Returns 1 on a cycle."""
    cdef Hold *hold = waits_for.readers
    cdef Request *ahead = waits_for.head
    if reach(search, thread, waits_for.owner, waits_for):
        return 1
    if mode == WRITE:
        while hold is not NULL:
            if reach(search, thread, hold.token, waits_for):
                return 1
            hold = hold.entry_next
    if at_head:
        return 0
    while ahead is not NULL and ahead != own:
        if (mode == WRITE or ahead.mode == WRITE) and reach(search, thread, ahead.token, waits_for):
            return 1
        ahead = ahead.next
    return 0


cdef int reach_request(Search *search, Token *thread, Request *request, bint enqueued) except -1:
    """Reach every thread ``request`` (single, or a multi-key lead) waits for."""
    cdef Py_ssize_t i
    cdef Request *node
    if request.lead is NULL:
        return reach_waited_for(search, thread, request.entry, request.mode,
                                request if enqueued else NULL, request.at_head)
    for i in range(request.nodes):
        node = request + i
        if node.queued and reach_waited_for(search, thread, node.entry, node.mode,
                                            node if enqueued else NULL, node.at_head):
            return 1
    return 0


cdef list find_cycle(Token *me, Request *request):
    """The cycle ``me`` would close by queueing ``request`` (not queued yet), or None.

    A waiting request waits for the holders it conflicts with and for the conflicting
    requests queued ahead of it (PostgreSQL's hard and soft edges). With soft edges a
    hand-off never adds an edge, so checking each new wait catches every cycle. The search
    follows waits within ``entry``'s manager. Returns ``[(thread ident, key it waits for),
    ...]`` starting with ``me``; nothing is changed and no Python code runs until the cycle
    is found.
    """
    global searches
    cdef Search search
    cdef Token *thread = me
    cdef Request *own
    cdef int closed
    cdef PyObject *manager = request.entry.manager
    searches += 1
    search.number = searches
    search.me = me
    search.stack = NULL
    search.depth = 0
    search.room = 0
    me.visit = searches
    try:
        closed = reach_request(&search, me, request, False)
        while not closed and search.depth:
            search.depth -= 1
            thread = search.stack[search.depth]
            own = thread.request
            if own is not NULL and (own.state == WAITING or own.state == WOKEN) \
                    and own.entry.manager == manager:
                closed = reach_request(&search, thread, own, True)
    finally:
        PyMem_Free(search.stack)
    if not closed:
        return None
    cycle = []
    thread = me
    while True:  # walk back: whoever reached ``thread`` waits for it in ``reached_via``
        cycle.append((thread.reached_from.ident, <object>thread.reached_via.key))
        thread = thread.reached_from
        if thread == me:
            break
    cycle.reverse()
    return cycle


cdef PyThread_type_lock new_wakeup() except NULL:
    cdef PyThread_type_lock wakeup = PyThread_allocate_lock()
    if wakeup is NULL:
        raise MemoryError("cannot allocate a wakeup lock")
    PyThread_acquire_lock(wakeup, NOWAIT_LOCK)  # locked = nothing posted
    return wakeup


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


cdef inline int retire(PyObject *key, list retired) except -1:
    """Keep a key reference the table gave up in ``retired`` (dropped after the section)."""
    if key is not NULL:
        retired.append(<object>key)
        Py_XDECREF(key)
    return 0


# -- fork ---------------------------------------------------------------------------------

def _before_fork():
    global forking
    forking = True


def _after_fork_in_parent():
    global forking
    forking = False


def _after_fork_in_child():
    """The child holds only what the forking thread held; the rest is free, queues are empty."""
    global forking, main_ident
    cdef Token *survivor = existing_token()
    cdef PyObject *manager = managers
    retired = []
    main_ident = PyThread_get_thread_ident()
    if survivor is not NULL:
        survivor.is_main = True  # the forking thread is the child's main thread
    while manager is not NULL:
        (<_Engine>manager)._keep_only(survivor, retired)
        manager = (<_Engine>manager).next_manager
    forking = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


# -- the engine ---------------------------------------------------------------------------

cdef class _Engine:
    """The table, holds, queues, grants and waits that every manager shares."""
    cdef Entry **buckets        # chained hash table of entries; mask + 1 buckets
    cdef size_t mask            # bucket count - 1 (the count is a power of two)
    cdef Py_ssize_t entries     # entries in the table: keys held or waited on
    cdef size_t version         # bumped by every insert and removal (see _find)
    cdef Entry *spare           # freed entries kept for reuse, linked through bucket_next
    cdef Py_ssize_t spares      # how many entries ``spare`` holds (at most MAX_SPARE)
    cdef bint _fair             # strict FIFO hand-off, or eventual fairness (exclusive only)
    cdef Py_ssize_t held        # entries with a write or read holder
    cdef Py_ssize_t waiting     # requests queued in any entry
    cdef unsigned long long acquisitions  # successful acquisitions, reentrant ones included
    cdef unsigned long long contended     # acquisitions that had to wait
    cdef unsigned long long timeouts      # acquisitions that gave up (try-locks included)
    cdef unsigned long long deadlocks     # acquisitions refused to avoid a deadlock
    cdef PyObject *previous_manager       # neighbour in the list of live managers (for fork)
    cdef PyObject *next_manager           # neighbour in the list of live managers (for fork)
    cdef tuple stripe_keys                # striped: one Stripe key per stripe; None: exact keys
    cdef size_t stripe_mask               # striped: stripe count - 1 (the count is a power of two)
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        global managers
        self.buckets = <Entry**>PyMem_Calloc(MIN_BUCKETS, sizeof(Entry*))
        if self.buckets is NULL:
            raise MemoryError()
        self.mask = MIN_BUCKETS - 1
        self._fair = True
        self.next_manager = managers
        if managers is not NULL:
            (<_Engine>managers).previous_manager = <PyObject*>self
        managers = <PyObject*>self

    def __dealloc__(self):
        # Nobody can wait here (a waiter's call keeps the manager alive), but keys may be
        # held: unlink every entry and hold from its thread's lists first, then drop keys.
        global managers
        cdef Entry *entry
        cdef Entry *following
        cdef size_t i
        if self.buckets is NULL:  # __cinit__ failed before allocating anything
            return
        if self.previous_manager is not NULL:
            (<_Engine>self.previous_manager).next_manager = self.next_manager
        else:
            managers = self.next_manager
        if self.next_manager is not NULL:
            (<_Engine>self.next_manager).previous_manager = self.previous_manager
        for i in range(self.mask + 1):
            entry = self.buckets[i]
            while entry is not NULL:
                if entry.owner is not NULL:
                    self._disown(entry)
                while entry.readers is not NULL:
                    self._drop_read(entry, entry.readers)
                entry = entry.bucket_next
        for i in range(self.mask + 1):
            entry = self.buckets[i]
            while entry is not NULL:
                following = entry.bucket_next
                Py_XDECREF(entry.key)
                PyMem_Free(entry)
                entry = following
        PyMem_Free(self.buckets)
        while self.spare is not NULL:
            entry = self.spare
            self.spare = entry.bucket_next
            PyMem_Free(entry)

    __class_getitem__ = classmethod(GenericAlias)

    def __repr__(self):
        return manager_repr(self, self._fair, self.held, self.waiting)

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)

    def __sizeof__(self):
        return (sizeof(LockManager) + (self.mask + 1) * sizeof(Entry*)
                + (self.entries + self.spares) * sizeof(Entry))

    def __len__(self):
        """Keys currently held (with stripes: stripes)."""
        return self.held

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

    cdef int _lookup(self, object key, Entry **found) except -1:
        cdef Py_hash_t h = hash(key)
        key = self._lock_key(key, &h)
        return self._find(key, h, found)

    def stats(self):
        """A snapshot of this manager's counters."""
        return LockStats(
            held=self.held,
            waiting=self.waiting,
            acquisitions=self.acquisitions,
            contended=self.contended,
            timeouts=self.timeouts,
            deadlocks=self.deadlocks,
        )

    def release_all(self):
        """Release every key of this manager the calling thread holds, all levels; returns how many."""
        cdef Token *token = existing_token()
        if token is NULL:
            return 0
        retired = []
        return release_held(token, <PyObject*>self, retired)

    # -- acquiring ------------------------------------------------------------------------

    cdef bint _acquire_write(self, object key, Py_hash_t h, double seconds,
                             Py_ssize_t count) except -1:
        """Acquire ``count`` write levels of ``key``, waiting at most ``seconds`` (-1: forever)."""
        cdef Token *token = current_token()
        cdef Entry *entry
        cdef bint upgrade = False
        self._find(key, h, &entry)
        # table section
        if entry is NULL:
            entry = self._insert(key, h)
            self._own(entry, token, count)
            return True
        if entry.owner == token:
            entry.count += count
            self.acquisitions += 1
            return True
        if entry.nreaders:
            upgrade = self._read_hold(entry, token) is not NULL
        if entry.owner is NULL and (
                (entry.nreaders == 0 and (entry.head is NULL or entry.head.state == WOKEN))
                or (upgrade and entry.nreaders == 1)):
            # Free and nobody queued (with fair=False, a woken head that has not run yet may
            # be overtaken), or the caller is the only reader: an upgrade goes at once.
            self._own(entry, token, count)
            return True
        return self._wait_unless(entry, token, seconds, count, WRITE, NULL, upgrade)

    cdef bint _acquire_read(self, object key, Py_hash_t h, double seconds) except -1:
        cdef Token *token = current_token()
        cdef Entry *entry
        cdef Hold *hold
        self._find(key, h, &entry)
        # table section
        if entry is not NULL:
            hold = self._read_hold(entry, token)
            if hold is not NULL:  # reentrant, even past queued writers (else it self-deadlocks)
                hold.count += 1
                self.acquisitions += 1
                return True
        hold = <Hold*>PyMem_Malloc(sizeof(Hold))
        if hold is NULL:
            raise MemoryError()
        if entry is NULL:
            try:
                entry = self._insert(key, h)
            except MemoryError:
                PyMem_Free(hold)
                raise
        if entry.owner == token or (entry.owner is NULL and entry.head is NULL):
            self._add_read(entry, token, hold, 1)
            return True
        return self._wait_unless(entry, token, seconds, 1, READ, hold, False)

    cdef bint _acquire_many(self, list items, double seconds) except -1:
        """Take every distinct ``(key, mode)`` of ``items`` at once, or none of them."""
        cdef Py_ssize_t n = len(items), i
        cdef Token *token = current_token()
        cdef Request *nodes = <Request*>PyMem_Calloc(n + 1, sizeof(Request))
        cdef Py_hash_t *hashes = <Py_hash_t*>PyMem_Malloc((n + 1) * sizeof(Py_hash_t))
        cdef Request *node
        cdef Entry *entry
        cdef size_t version
        cdef bint ready = True
        retired = []
        try:
            if nodes is NULL or hashes is NULL:
                raise MemoryError()
            if n == 0:
                return True
            for i in range(n):
                hashes[i] = hash(items[i][0])
            while True:  # a lookup that ran Python code may have let the table change
                version = self.version
                for i in range(n):
                    self._find(items[i][0], hashes[i], &(nodes + i).entry)
                if self.version == version:
                    break
            # table section
            for i in range(n):
                if nodes[i].entry is NULL:
                    try:
                        nodes[i].entry = self._insert(items[i][0], hashes[i])
                    except MemoryError:
                        nodes.nodes = i
                        self._discard(nodes, retired)
                        raise
            nodes.nodes = n
            for i in range(n):
                node = nodes + i
                entry = node.entry
                node.token = token
                node.lead = nodes
                node.count = 1
                node.mode = items[i][1]
                node.queued = True
                if node.mode == WRITE:
                    if entry.owner == token:
                        node.queued = False
                    else:
                        node.at_head = entry.nreaders and self._read_hold(entry, token) is not NULL
                        ready = ready and entry.owner is NULL and (
                            (entry.nreaders == 0 and entry.head is NULL)
                            or (node.at_head and entry.nreaders == 1))
                elif self._read_hold(entry, token) is not NULL:
                    node.queued = False
                else:
                    node.hold = <Hold*>PyMem_Malloc(sizeof(Hold))
                    if node.hold is NULL:
                        self._discard(nodes, retired)
                        raise MemoryError()
                    if entry.owner == token:
                        node.queued = False  # reads a key it writes
                    else:
                        ready = ready and entry.owner is NULL and entry.head is NULL
            if ready:
                self._grant_nodes(nodes, False)
                return True
            if seconds == 0:
                self._discard(nodes, retired)
                self.timeouts += 1
                return False
            return self._wait(nodes, seconds)
        finally:
            PyMem_Free(nodes)
            PyMem_Free(hashes)

    cdef int _release_many(self, list items) except -1:
        """Undo one ``_acquire_many`` of ``items``: all of them, or (if one is not held as
        asked) none, with NotOwnedError."""
        cdef Py_ssize_t n = len(items), i
        cdef Token *token = existing_token()
        cdef Entry **entries = <Entry**>PyMem_Malloc((n + 1) * sizeof(Entry*))
        cdef Py_hash_t *hashes = <Py_hash_t*>PyMem_Malloc((n + 1) * sizeof(Py_hash_t))
        cdef Entry *entry
        cdef Hold *hold
        cdef size_t version
        retired = []
        try:
            if entries is NULL or hashes is NULL:
                raise MemoryError()
            for i in range(n):
                hashes[i] = hash(items[i][0])
            while True:
                version = self.version
                for i in range(n):
                    self._find(items[i][0], hashes[i], entries + i)
                if self.version == version:
                    break
            # table section
            for i in range(n):
                entry = entries[i]
                if entry is NULL or token is NULL or (
                        entry.owner != token if items[i][1] == WRITE
                        else self._read_hold(entry, token) is NULL):
                    raise not_owned(items[i][0])
            for i in range(n):
                entry = entries[i]
                if items[i][1] == WRITE:
                    entry.count -= 1
                    if entry.count == 0:
                        self._disown(entry)
                else:
                    hold = self._read_hold(entry, token)
                    hold.count -= 1
                    if hold.count == 0:
                        self._drop_read(entry, hold)
                retire(self._pass_on(entry), retired)
            # end of table section
            return 0
        finally:
            PyMem_Free(entries)
            PyMem_Free(hashes)

    cdef bint _wait_unless(self, Entry *entry, Token *token, double seconds, Py_ssize_t count,
                           Mode mode, Hold *hold, bint upgrade) except -1:
        """The key is taken: give up (try-lock) or wait. Owns ``hold`` (READ): a grant links
        it in, anything else frees it."""
        cdef Request request
        if seconds == 0:
            PyMem_Free(hold)
            self.timeouts += 1
            return False
        request.token = token
        request.entry = entry
        request.mode = mode
        request.hold = hold
        request.count = count
        request.at_head = upgrade
        request.lead = NULL
        request.nodes = 1
        request.queued = True
        return self._wait(&request, seconds)

    cdef bint _wait(self, Request *request, double seconds) except -1:
        """Refuse ``request`` (single, or a multi-key lead) if waiting would deadlock, else
        queue it and sleep until it is granted or time runs out."""
        cdef Token *token = request.token
        cdef double deadline = -1.0
        cdef PY_TIMEOUT_T microseconds
        cdef PyLockStatus status
        retired = []  # keys the table gave up, dropped when this returns (after the section)
        cycle = find_cycle(token, request)
        if cycle is not None:
            self._discard(request, retired)
            self.deadlocks += 1
            # end of table section
            raise deadlock(cycle)
        if token.wakeup is NULL:
            try:
                token.wakeup = new_wakeup()
            except MemoryError:
                self._discard(request, retired)
                raise
        request.state = WAITING
        request.since = lockmgr_monotonic()
        if seconds > 0:
            deadline = request.since + seconds
        self._enqueue_request(request)
        # end of table section
        try:
            while True:
                microseconds = sleep_microseconds(deadline, token.is_main)
                with nogil:
                    status = PyThread_acquire_lock_timed(token.wakeup, microseconds, 1)
                # table section
                if request.state != WAITING:
                    if status != PY_LOCK_ACQUIRED:
                        PyThread_acquire_lock(token.wakeup, NOWAIT_LOCK)  # consume the post
                    if request.state == WOKEN:  # single requests only
                        if self._grantable(request.entry, request):
                            self._grant(request.entry, request)
                        else:
                            request.state = WAITING  # overtaken: sleep again at the head
                # end of table section
                PyErr_CheckSignals()  # handlers run here; one that raises ends the wait
                if request.state == GRANTED:
                    self.contended += 1
                    return True
                if deadline >= 0 and lockmgr_monotonic() >= deadline:
                    self._leave(request, retired)
                    self.timeouts += 1
                    return False
        except BaseException:
            # table section (to the raise)
            if request.state == GRANTED:  # only this thread can release what it was granted
                self._undo_grant(request, retired)
            else:
                PyThread_acquire_lock(token.wakeup, NOWAIT_LOCK)  # consume a post that raced us
                self._leave(request, retired)
            raise
        finally:
            token.request = NULL

    cdef void _enqueue_request(self, Request *request) noexcept:
        cdef Py_ssize_t i
        if request.lead is NULL:
            self._enqueue(request.entry, request, request.at_head)
        else:
            for i in range(request.nodes):
                (request + i).state = WAITING
                if (request + i).queued:
                    self._enqueue((request + i).entry, request + i, (request + i).at_head)
        self.waiting += 1
        request.token.request = request

    cdef int _leave(self, Request *request, list retired) except -1:
        """Take a waiting ``request`` (single, or a multi-key lead) out of every queue."""
        cdef Py_ssize_t i
        for i in range(request.nodes):
            if (request + i).queued:
                self._dequeue((request + i).entry, request + i)
        self.waiting -= 1
        request.state = LEFT
        self._discard(request, retired)

    cdef int _discard(self, Request *request, list retired) except -1:
        """Free what a request that was never granted allocated, and let its entries move on
        (entries it created and nobody uses go)."""
        cdef Py_ssize_t i
        for i in range(request.nodes):
            PyMem_Free((request + i).hold)
            (request + i).hold = NULL
        for i in range(request.nodes):
            retire(self._pass_on((request + i).entry), retired)

    cdef int _undo_grant(self, Request *request, list retired) except -1:
        """Give back everything a granted request (single, or multi-key lead) took."""
        cdef Py_ssize_t i
        cdef Request *node
        for i in range(request.nodes):
            node = request + i
            self.acquisitions -= 1
            if node.mode == WRITE:
                if node.queued:
                    self._disown(node.entry)
                else:
                    node.entry.count -= 1
            elif node.hold is not NULL:
                self._drop_read(node.entry, node.hold)
            else:
                self._read_hold(node.entry, node.token).count -= 1
        for i in range(request.nodes):
            retire(self._pass_on((request + i).entry), retired)

    # -- releasing ------------------------------------------------------------------------

    cdef int _release_write(self, object key, Py_hash_t h) except -1:
        cdef Token *token = existing_token()
        cdef Entry *entry
        cdef PyObject *retired
        self._find(key, h, &entry)
        # table section
        if entry is NULL or token is NULL or entry.owner != token:
            raise not_owned(key)
        entry.count -= 1
        if entry.count:
            return 0
        self._disown(entry)
        retired = self._pass_on(entry)
        # end of table section
        Py_XDECREF(retired)
        return 0

    cdef int _release_read(self, object key, Py_hash_t h) except -1:
        cdef Token *token = existing_token()
        cdef Entry *entry
        cdef Hold *hold = NULL
        cdef PyObject *retired
        self._find(key, h, &entry)
        # table section
        if entry is not NULL and token is not NULL:
            hold = self._read_hold(entry, token)
        if hold is NULL:
            raise not_owned(key)
        hold.count -= 1
        if hold.count:
            return 0
        self._drop_read(entry, hold)
        retired = self._pass_on(entry)
        # end of table section
        Py_XDECREF(retired)
        return 0

    cdef PyObject* _pass_on(self, Entry *entry) noexcept:
        """A holder or a request left ``entry``: grant what the queue's head allows (a run
        of readers together, or one writer), or drop the entry if nothing is left.

        Returns the key reference the table gave up (the caller drops it after the
        section), or NULL.
        """
        cdef Request *head
        cdef RequestState was
        while True:
            head = entry.head
            if head is NULL:
                if entry.owner is NULL and entry.nreaders == 0:
                    return self._remove(entry)
                return NULL
            if head.lead is not NULL:  # a multi-key request: all of its keys or none
                if head.lead.state != WAITING or not self._group_grantable(head.lead):
                    return NULL
                self._grant_group(head.lead, entry)
                if head.mode == WRITE:
                    return NULL
                continue
            if not self._grantable(entry, head):
                return NULL
            was = head.state
            if head.mode == READ or self._fair \
                    or lockmgr_monotonic() - head.since >= handoff_after:
                # Also when already WOKEN: a woken thread may wait long for the GIL while
                # others keep taking the key; granting it is what bounds its wait.
                self._grant(entry, head)
            elif was == WAITING:
                head.state = WOKEN
            if was == WAITING:  # a WOKEN head has its post already
                PyThread_release_lock(head.token.wakeup)
            if head.mode == WRITE:
                return NULL

    cdef inline bint _grantable(self, Entry *entry, Request *request) noexcept:
        if entry.owner is not NULL:
            return False
        return request.mode == READ or entry.nreaders == 0 or (
            entry.nreaders == 1 and entry.readers.token == request.token)

    cdef inline void _grant(self, Entry *entry, Request *request) noexcept:
        self._dequeue(entry, request)
        self._take(entry, request)
        self.waiting -= 1
        request.state = GRANTED

    cdef inline void _take(self, Entry *entry, Request *request) noexcept:
        if request.mode == READ:
            self._add_read(entry, request.token, request.hold, request.count)
        else:
            self._own(entry, request.token, request.count)

    cdef bint _group_grantable(self, Request *lead) noexcept:
        """Every node of a multi-key request is at the head of its queue and compatible."""
        cdef Py_ssize_t i
        cdef Request *node
        for i in range(lead.nodes):
            node = lead + i
            if node.queued and (node.entry.head != node or not self._grantable(node.entry, node)):
                return False
        return True

    cdef void _grant_nodes(self, Request *lead, bint enqueued) noexcept:
        """Give a multi-key request every key at once: queued nodes take their entries,
        the others re-enter keys the caller already holds."""
        cdef Py_ssize_t i
        cdef Request *node
        cdef Hold *hold
        for i in range(lead.nodes):
            node = lead + i
            if node.queued:
                if enqueued:
                    self._dequeue(node.entry, node)
                self._take(node.entry, node)
            elif node.mode == WRITE:
                node.entry.count += 1
                self.acquisitions += 1
            elif node.hold is not NULL:  # reading a key it writes
                self._add_read(node.entry, node.token, node.hold, 1)
            else:
                self._read_hold(node.entry, node.token).count += 1
                self.acquisitions += 1
        lead.state = GRANTED

    cdef void _grant_group(self, Request *lead, Entry *passing) noexcept:
        """_pass_on found ``lead`` grantable at the head of ``passing``."""
        cdef Py_ssize_t i
        self._grant_nodes(lead, True)
        self.waiting -= 1
        PyThread_release_lock(lead.token.wakeup)
        for i in range(lead.nodes):  # readers queued behind its read nodes may follow it in
            if (lead + i).queued and (lead + i).entry != passing and (lead + i).mode == READ:
                self._pass_on((lead + i).entry)  # never drops the entry: it has a holder now

    # -- holders --------------------------------------------------------------------------

    cdef inline void _own(self, Entry *entry, Token *token, Py_ssize_t count) noexcept:
        if entry.nreaders == 0:
            self.held += 1
        entry.owner = token
        entry.count = count
        entry.held_prev = NULL
        entry.held_next = token.held
        if token.held is not NULL:
            token.held.held_prev = entry
        token.held = entry
        self.acquisitions += 1

    cdef inline void _disown(self, Entry *entry) noexcept:
        if entry.held_prev is not NULL:
            entry.held_prev.held_next = entry.held_next
        else:
            entry.owner.held = entry.held_next
        if entry.held_next is not NULL:
            entry.held_next.held_prev = entry.held_prev
        entry.owner = NULL
        entry.count = 0
        if entry.nreaders == 0:
            self.held -= 1

    cdef inline Hold* _read_hold(self, Entry *entry, Token *token) noexcept:
        cdef Hold *hold = entry.readers
        while hold is not NULL and hold.token != token:
            hold = hold.entry_next
        return hold

    cdef void _add_read(self, Entry *entry, Token *token, Hold *hold, Py_ssize_t count) noexcept:
        if entry.owner is NULL and entry.nreaders == 0:
            self.held += 1
        hold.token = token
        hold.entry = entry
        hold.count = count
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
        self.acquisitions += 1

    cdef void _drop_read(self, Entry *entry, Hold *hold) noexcept:
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
            self.held -= 1
        PyMem_Free(hold)

    # -- queues ---------------------------------------------------------------------------

    cdef inline void _enqueue(self, Entry *entry, Request *request, bint at_head) noexcept:
        if at_head:  # an upgrade: no writer behind could get in before it anyway
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

    cdef inline void _dequeue(self, Entry *entry, Request *request) noexcept:
        if request.prev is not NULL:
            request.prev.next = request.next
        else:
            entry.head = request.next
        if request.next is not NULL:
            request.next.prev = request.prev
        else:
            entry.tail = request.prev

    cdef int _keep_only(self, Token *survivor, list retired) except -1:
        """In a forked child: keep what ``survivor`` (the forking thread) holds, drop the rest.

        Every other thread and every waiting request belongs to a thread that does not exist
        here. Keys the table gives up go to ``retired``.
        """
        cdef Entry **doomed = <Entry**>PyMem_Malloc((self.entries + 1) * sizeof(Entry*))
        cdef Py_ssize_t count = 0, i
        cdef size_t bucket
        cdef Entry *entry
        cdef Request *request
        cdef Hold *hold
        cdef Hold *next_hold
        cdef PyObject *key
        if doomed is NULL:
            raise MemoryError()
        # table section
        for bucket in range(self.mask + 1):
            entry = self.buckets[bucket]
            while entry is not NULL:
                request = entry.head
                while request is not NULL:
                    request.token.request = NULL  # lets its thread's token be freed
                    request = request.next
                entry.head = NULL
                entry.tail = NULL
                if entry.owner is not NULL and entry.owner != survivor:
                    self._disown(entry)
                hold = entry.readers
                while hold is not NULL:
                    next_hold = hold.entry_next
                    if hold.token != survivor:
                        self._drop_read(entry, hold)
                    hold = next_hold
                if entry.owner is NULL and entry.nreaders == 0:
                    doomed[count] = entry
                    count += 1
                entry = entry.bucket_next
        self.waiting = 0
        for i in range(count):
            key = self._remove(doomed[i])
            retired.append(<object>key)
            Py_XDECREF(key)
        # end of table section
        PyMem_Free(doomed)
        return 0

    # -- the table ------------------------------------------------------------------------

    cdef inline size_t _bucket(self, Py_hash_t h) noexcept:
        return spread(h) & self.mask  # spread: consecutive ints must not share low bits

    cdef int _find(self, object key, Py_hash_t h, Entry **found) except -1:
        """Point ``found`` at the entry for ``key`` (hashed to ``h``), or at NULL.

        Comparing keys may run Python code that lets other threads change the table; the
        lookup then starts again, so what it returns was in the table when it returned.
        """
        cdef Entry *entry
        cdef size_t version
        cdef int equal
        cdef object stored
        while True:
            entry = self.buckets[self._bucket(h)]
            while entry is not NULL:
                if entry.hash == h:
                    if entry.key == <PyObject*>key:
                        found[0] = entry
                        return 0
                    version = self.version
                    stored = <object>entry.key  # keeps the key alive while __eq__ runs
                    equal = PyObject_RichCompareBool(stored, key, Py_EQ)
                    stored = None  # may run __del__: before the version check, not after
                    if self.version != version:
                        break
                    if equal:
                        found[0] = entry
                        return 0
                entry = entry.bucket_next
            else:
                found[0] = NULL
                return 0

    cdef Entry* _insert(self, object key, Py_hash_t h) except NULL:
        cdef Entry *entry = self.spare
        cdef Entry **bucket
        if entry is not NULL:
            self.spare = entry.bucket_next
            self.spares -= 1
        else:
            entry = <Entry*>PyMem_Malloc(sizeof(Entry))
            if entry is NULL:
                raise MemoryError()
        Py_INCREF(key)
        entry.key = <PyObject*>key
        entry.hash = h
        entry.manager = <PyObject*>self
        entry.owner = NULL
        entry.count = 0
        entry.held_prev = NULL
        entry.held_next = NULL
        entry.readers = NULL
        entry.nreaders = 0
        entry.head = NULL
        entry.tail = NULL
        bucket = &self.buckets[self._bucket(h)]
        entry.bucket_next = bucket[0]
        bucket[0] = entry
        self.entries += 1
        self.version += 1
        if <size_t>self.entries > self.mask + 1:
            self._resize((self.mask + 1) * 2)
        return entry

    cdef PyObject* _remove(self, Entry *entry) noexcept:
        """Unlink and free ``entry``; returns its key reference for the caller to drop."""
        cdef Entry **link = &self.buckets[self._bucket(entry.hash)]
        cdef PyObject *key = entry.key
        while link[0] != entry:
            link = &link[0].bucket_next
        link[0] = entry.bucket_next
        self.entries -= 1
        self.version += 1
        if self.spares < MAX_SPARE:
            entry.bucket_next = self.spare
            self.spare = entry
            self.spares += 1
        else:
            PyMem_Free(entry)
        if self.mask + 1 > MIN_BUCKETS and <size_t>self.entries * 4 < self.mask + 1:
            self._resize((self.mask + 1) // 2)
        return key

    cdef void _resize(self, size_t buckets) noexcept:
        """Rehash into ``buckets`` buckets; if memory is short, keep the current ones."""
        cdef Entry **fresh = <Entry**>PyMem_Calloc(buckets, sizeof(Entry*))
        cdef Entry *entry
        cdef Entry *following
        cdef size_t i
        if fresh is NULL:
            return
        cdef Entry **old = self.buckets
        cdef size_t old_count = self.mask + 1
        self.buckets = fresh
        self.mask = buckets - 1
        for i in range(old_count):
            entry = old[i]
            while entry is not NULL:
                following = entry.bucket_next
                entry.bucket_next = fresh[self._bucket(entry.hash)]
                fresh[self._bucket(entry.hash)] = entry
                entry = following
        PyMem_Free(old)


# -- the managers -------------------------------------------------------------------------

@cython.final
cdef class LockManager(_Engine):
    """Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

    Memory grows only with the keys currently held or waited on.
    """

    def __cinit__(self, *, fair=True, stripes=None):
        self._fair = bool(fair)
        self._use_stripes(stripes)

    @property
    def fair(self):
        """True for strict FIFO hand-off, False for eventual fairness."""
        return self._fair

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
        self._release_write(key, h)

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
        cdef Entry *entry
        self._lookup(key, &entry)
        return entry is not NULL and entry.owner is not NULL

    def owned(self, key):
        """Whether the calling thread holds ``key``."""
        cdef Entry *entry
        self._lookup(key, &entry)
        return entry is not NULL and entry.owner is not NULL and entry.owner == existing_token()

    def owner(self, key):
        """The ``threading.get_ident()`` of the thread holding ``key``, or None."""
        return self._owner_and_count(key)[0]

    def recursion_count(self, key):
        """How many times the calling thread holds ``key`` (0 if it does not)."""
        cdef Entry *entry
        self._lookup(key, &entry)
        if entry is NULL or entry.owner is NULL or entry.owner != existing_token():
            return 0
        return entry.count

    def __contains__(self, key):
        """Whether ``key`` is currently held (by any thread)."""
        return self.locked(key)

    def _owner_and_count(self, key):
        cdef Entry *entry
        self._lookup(key, &entry)
        if entry is NULL or entry.owner is NULL:
            return None, 0
        return entry.owner.ident, entry.count

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
        cdef Token *token = existing_token()
        cdef Entry *entry
        cdef PyObject *retired
        self._find(key, h, &entry)
        # table section
        if entry is NULL or token is NULL or entry.owner != token:
            raise not_owned(key)
        saved = (entry.count, token.ident)
        self._disown(entry)
        retired = self._pass_on(entry)
        # end of table section
        Py_XDECREF(retired)
        return saved


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
        self._release_write(key, h)

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
        cdef Entry *entry
        self._lookup(key, &entry)
        return 0 if entry is NULL else entry.nreaders

    def write_locked(self, key):
        """Whether a thread holds ``key`` for writing."""
        cdef Entry *entry
        self._lookup(key, &entry)
        return entry is not NULL and entry.owner is not NULL

    def __contains__(self, key):
        """Whether ``key`` has any holder."""
        cdef Entry *entry
        self._lookup(key, &entry)
        return entry is not NULL and (entry.owner is not NULL or entry.nreaders > 0)

    def _read_count(self, key):
        """How many times the calling thread reads ``key``."""
        cdef Entry *entry
        cdef Hold *hold = NULL
        self._lookup(key, &entry)
        if entry is not NULL and existing_token() is not NULL:
            hold = self._read_hold(entry, existing_token())
        return 0 if hold is NULL else hold.count

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
            self.manager._release_write(self.key, self.hash)


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
        self.manager._release_write(self.lock_key, self.hash)

    def locked(self):
        return self.manager.locked(self.key)

    def __enter__(self):
        if not self.manager._acquire_write(self.lock_key, self.hash, self.seconds, 1):
            raise timed_out(self.key, self.seconds)
        return True

    def __exit__(self, exc_type, exc, traceback):
        self.manager._release_write(self.lock_key, self.hash)

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
