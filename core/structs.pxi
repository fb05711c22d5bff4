# lockmgr._core: the C structures, each field with its writer and guard, and the module state.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

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
    bint post_owed               # mutex: set when a section schedules its wake-up post,
                                 # cleared by its waiter's section once it consumed it


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
cdef double wait_slice = MAIN_THREAD_SLICE
cdef object FOREVER = -1  # the default timeout object, so the fast path can test identity

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


cdef struct Peek:
    bint found           # the key has an entry
    unsigned long owner  # the write holder's ident (0: none)
    Py_ssize_t count     # the write holder's level
    bint mine            # the caller is the write holder
    Py_ssize_t readers   # read holds
    Py_ssize_t my_reads  # the caller's read level
