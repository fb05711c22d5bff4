# lockmgr._core's declarations: the C shim it calls (the .h files in _c/) and the C
# structures, each field with its writer and guard. The rules these follow are in the docstring
# of lockmgr_core.pyx (the repository's root); the module state and the code are in _c/*.pxi,
# included by it.

from cpython.object cimport PyObject
from cpython.pythread cimport PyThread_type_lock


cdef extern from "_c/lockmgr_platform.h":
    int lockmgr_is_finalizing()
    const bint LOCKMGR_FREE_THREADED
    double lockmgr_monotonic() nogil
    Py_ssize_t lockmgr_load_ssize(Py_ssize_t *p) nogil
    void lockmgr_store_ssize(Py_ssize_t *p, Py_ssize_t value) nogil


cdef extern from "_c/lockmgr_locks.h":
    ctypedef struct lockmgr_spinlock:
        pass
    void lockmgr_spin_lock(lockmgr_spinlock *m) nogil
    void lockmgr_spin_unlock(lockmgr_spinlock *m) nogil
    void lockmgr_spin_forget(lockmgr_spinlock *m) nogil
    ctypedef struct lockmgr_mutex:
        pass
    # nogil: sections take shard mutexes (``touch``); see rule 1 for why they may
    void lockmgr_mutex_lock(lockmgr_mutex *m) nogil
    void lockmgr_mutex_unlock(lockmgr_mutex *m) nogil
    void lockmgr_mutex_forget(lockmgr_mutex *m) nogil


cdef extern from "_c/lockmgr_keys.h":
    Py_hash_t lockmgr_hash(object key) except? -1
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
    SECTION     # a fast path left the operation to a section (nothing changed)


# Every field below says who writes it and under which guard:
#   "engine": only with engine_mutex held;
#   "shard": only with the mutex of the shard the entry (or the field's struct) belongs to
#            held (a fast path holds it alone; a section takes it with ``touch``);
#   "lists": the token's own lists: written by its thread, or, while it waits (its
#            ``request`` is set, which turns its fast paths off), under engine_mutex.

cdef struct Token:
    # One per thread that used lockmgr, and one per asyncio task that used an ``aio`` view
    # (a task's "thread" below is the thread running its event loop, where it always runs);
    # ownership means this object, never the ident.
    unsigned long ident          # threading.get_ident() of its thread, or id() of its task;
                                 # set at creation
    bint is_task                 # set at creation: a task's token (owned by its _TaskOwner)
    Py_ssize_t loop_ident        # a task's: the ident of the thread running its loop; set at
                                 # creation (a deadlock search follows a task to that thread)
    Token *awaited_by            # its thread only, during its acquiring sections: the token
                                 # of the task whose context the thread runs in (which may be
                                 # awaiting it: asyncio.to_thread), or NULL
    Token *waiting_prev          # engine: neighbour in ``waiting_threads`` while its thread
    Token *waiting_next          # waits in a synchronous acquire (thread tokens only)
    Entry *held                  # lists: entries it write-holds in any manager (held_next)
    Hold *reads                  # lists: its read holds in any manager (token_next)
    Request *request             # engine, by its thread only: the request it waits in, or
                                 # NULL (its fast paths read it without the mutex)
    PyThread_type_lock wakeup    # threads: created by its thread before its first wait;
                                 # posted by finishes, consumed by its thread: a binary
                                 # semaphore (tasks are posted through Request.waiter)
    Entry *spare_entry           # its thread only: memory for the next entry it inserts
    Hold *spare_hold             # its thread only: memory for the next read hold it takes
    unsigned long long visit     # engine: number of the last deadlock search that reached it
    Token *reached_from          # engine: in that search, the thread whose wait led here
    Entry *reached_via           # engine: in that search, the entry that thread waits for
    Token *search_next           # engine: in that search, the next thread still to follow
    Py_ssize_t orphans           # engine, read by its fast paths atomically: set when a freed
                                 # manager left orphans in its lists; its next section frees them


cdef struct Hold:
    # One thread's read hold of one entry; linked in the entry's and the token's lists.
    Token *token                 # the reading thread; set when linked
    Entry *entry                 # the entry it reads; set when linked; engine: set to NULL
                                 # when its manager is freed (an orphan its thread frees)
    Py_ssize_t count             # shard: its read recursion level (> 0 while linked)
    Py_ssize_t pinned            # shard: levels taken by a waiting set of the thread (<= count)
    Hold *entry_prev             # shard: neighbour among the entry's read holds (newest first)
    Hold *entry_next             # shard
    Hold *token_prev             # lists: neighbour among the token's read holds (newest first)
    Hold *token_next             # lists
    double held_since            # shard: monotonic time the hold is timed from (0.0: not
                                 # timed): its grant to a request that waited, or the first
                                 # request queued behind it (see lockmgr._observe)


cdef struct Request:
    # A waiting acquisition; lives in its thread's C stack (or the nodes array of a set) and
    # is out of every queue before that frame ends. Only sections touch a request (engine),
    # and with its entry's shard touched for the queue links.
    Request *prev                # engine + shard: neighbour towards the head of the entry's queue
    Request *next                # engine + shard: neighbour towards the tail
    Token *token                 # the waiting thread; set before queueing
    Entry *entry                 # the entry whose queue it is (or would be) in
    Mode mode                    # what it asks for
    Hold *hold                   # READ: memory for the hold a grant links in (from prepare;
                                 # a grant takes it, the waiter frees what is left)
    Py_ssize_t count             # recursion level a grant installs
    RequestState state           # engine: set by granting/waking sections and by the waiter
    double since                 # monotonic time it queued (fair=False's hand-off rule)
    bint at_head                 # an upgrade: queued before every other request
    Request *lead                # multi-key: the first node, whose state speaks for all
    Py_ssize_t nodes             # how many nodes the request has (1 for a single request)
    bint queued                  # multi-key: it waits in its entry's queue; else it
                                 # re-enters a key its thread holds (a pinned level)
    PyObject *waiter             # a task's request: its _TaskWait (which holds this memory),
                                 # set before queueing; a waking section takes a reference
                                 # for its finish (which posts the task and drops it); NULL
                                 # for a thread's
    Request *wake_next           # engine: next request in the After that is to wake it
    bint post_owed               # engine: set when a section schedules its wake-up post,
                                 # cleared by its waiter's section once it consumed it
    double ended                 # engine: when its waiter's section saw its wait end (granted,
                                 # or given up); what every measure of the wait uses


cdef struct Entry:
    # One key held or waited on; in its shard's buckets from its first use to its last.
    PyObject *key                # strong reference to the key as first given, or, when it is
                                 # one of its table's stripes (``is_stripe``), a borrowed one
                                 # (the table keeps its stripes; no thread writes a stripe's
                                 # reference count on the way); engine: NULL once its manager
                                 # is freed while another thread holds it; shard: a stripe's
                                 # is NULL once the entry leaves its table
    Py_hash_t hash               # hash(key)
    Entry *bucket_next           # shard: next entry in its bucket; once retired, in the After
    Table *table                 # the table it belongs to; engine: NULL once that table is
                                 # freed while another thread holds it (an orphan, which only
                                 # the owner's thread frees: it is linked in its lists)
    Shard *shard                 # the shard of ``table`` it is in; set when inserted
    Token *owner                 # shard: the write holder, or NULL
    Py_ssize_t count             # shard: the owner's write level; 0 iff owner is NULL
    Py_ssize_t pinned            # shard: write levels a waiting set of the owner took (<= count)
    Entry *held_prev             # lists (the owner's): neighbour among its write-held entries
    Entry *held_next             # lists
    Hold *readers                # shard: read holds, one per reading thread (newest first)
    Py_ssize_t nreaders          # shard: how many read holds
    Py_ssize_t slots             # shard: the read levels held, all holds together (a
                                 # semaphore's taken slots: each acquire takes one)
    Py_ssize_t limit             # set when inserted (the lookup's, else the table's
                                 # slot_limit): a SemaphoreManager's key admits at most this
                                 # many read holds (its slots); 0: any number
    Request *head                # engine + shard: oldest waiting request (an upgrade goes
                                 # first); fast paths read it to leave queued keys to sections
    Request *tail                # engine + shard: newest waiting request
    Py_ssize_t inflight          # engine + shard: requests of calls still running that point
                                 # here (queued, or granted and not returned yet)
    double held_since            # shard: as Hold.held_since, for the write hold (0.0 while
                                 # there is none)


cdef struct Shard:
    # A slice of a table (keys by hash), with its own mutex so that threads using keys of
    # different shards never touch the same memory. On its own cache lines (see Table).
    lockmgr_spinlock mutex       # guards every "shard" field of the shard and its entries
    bint touched                 # engine: the engine holder has taken ``mutex`` (touch)
    Shard *next_touched          # engine: the next shard it has taken
    Entry **buckets              # shard: chained hash table; mask + 1 buckets
    size_t mask                  # shard: bucket count - 1 (a power of two)
    Py_ssize_t entries           # shard: entries in the shard
    Py_ssize_t held              # shard: entries with a write or read holder
    unsigned long long acquisitions  # shard: successful acquisitions, reentrant ones included
    unsigned long long contended     # shard: acquisitions that had to wait
    unsigned long long timeouts      # shard: acquisitions that gave up (try-locks included)
    unsigned long long deadlocks     # shard: acquisitions refused to avoid a deadlock


cdef enum:
    HISTOGRAM_BUCKETS = 23  # len(lockmgr._observe.HISTOGRAM_BOUNDS) + 1 (checked at import)
    HOT_KEY_SLOTS = 32      # lockmgr._observe.HOT_KEY_SLOTS (checked at import)
    DROP_ROOM = HOT_KEY_SLOTS  # keys one section may evict from a hot-key summary


cdef struct Histogram:
    # Durations measured on the contended path, in lockmgr._observe.HISTOGRAM_BOUNDS' buckets.
    unsigned long long counts[HISTOGRAM_BUCKETS]  # engine
    unsigned long long count     # engine
    double sum                   # engine: seconds
    double max                   # engine: seconds


cdef struct HotSlot:
    # One slot of a table's Space-Saving summary of wait time by key.
    PyObject *key                # engine: strong reference, or NULL (a free slot); an
                                 # evicted key is dropped by the evicting section's finish
    double waited                # engine: seconds charged to the slot
    double error                 # engine: what the slot had when ``key`` took it over


cdef struct Table:
    # One per manager, inside the manager object. Invariant: an entry is in the table iff
    # it has a holder or inflight requests.
    Shard *shards                # shard_mask + 1 shards (aligned within ``shard_memory``);
                                 # set at creation, like the two fields below
    void *shard_memory           # the allocation ``shards`` lies in
    size_t shard_mask            # shard count - 1 (a power of two: module ``shard_count``)
    bint fair                    # set at creation: strict FIFO hand-off, or eventual fairness
    Py_ssize_t slot_limit        # set at creation: a SemaphoreManager's limit per key (the
                                 # ``limit`` of the entries it inserts); 0: none
    bint counts_slots            # set at creation: a SemaphoreManager's (each acquire takes
                                 # one more slot: a holder's write never re-enters)
    Py_ssize_t waiting           # engine: requests (a set counts once) queued in its entries
    Table *previous_table        # engine: neighbour in the list of live tables (for fork)
    Table *next_table            # engine
    PyObject **stripes           # set at creation: a striped manager's stripe objects (strong
                                 # references, dropped when the table is freed), the keys its
                                 # entries hold borrowed; NULL: exact keys
    size_t stripe_mask           # set at creation: stripe count - 1 (a power of two)
    double log_after             # set at creation: seconds after which a waiter logs (< 0: off)
    Histogram waits              # engine: waits that were granted (``complete``)
    Histogram holds              # engine: timed holds that ended with someone queued
    HotSlot hot[HOT_KEY_SLOTS]   # engine: wait time by key, filled from the first slot on


cdef struct CycleStep:
    unsigned long ident          # a thread of the cycle, or id() of a task (``is_task``)
    bint is_task
    PyObject *key                # strong reference: the key it waits for (LOOP_THREAD: a
                                 # task waiting for its loop's thread; AWAITED_THREAD: a task
                                 # waiting for a thread it awaits)


cdef struct After:
    # What a section left for its finish; on the caller's C stack.
    Entry *retired               # entries unlinked from their table (bucket_next list)
    Request *woken               # requests to post (wake_next list), in the order woken:
                                 # tasks granted one read together resume in arrival order
    Request *woken_last          # the last of them (NULL when none), where wake appends
    CycleStep *cycle             # DEADLOCK: the cycle, refused request first
    Py_ssize_t cycle_length      # DEADLOCK/LONG_CYCLE: how many steps the cycle has
    Py_ssize_t cycle_room        # how many steps ``cycle`` has room for
    Table *resize                # a table some of whose shards should change their bucket
                                 # count, or NULL
    PyObject *dropped[DROP_ROOM] # strong references evicted from a hot-key summary
    Py_ssize_t ndropped          # how many (one section never evicts more than the summary
                                 # holds)


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
    Py_ssize_t limit             # a semaphore's limit for the key, should it be inserted
                                 # (from its manager's limit(key)); 0: the table's slot_limit


cdef enum:
    MIN_BUCKETS = 8   # a shard never shrinks below this
    SHARD_BYTES = 128 # a shard's stride: two cache lines (adjacent-line prefetch)

