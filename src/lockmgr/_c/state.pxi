# lockmgr._core: the module state, set at import (the structures are in _core.pxd).
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

cdef double handoff_after = HANDOFF_AFTER
cdef double wait_slice = MAIN_THREAD_SLICE
cdef int post_attempts = POST_ATTEMPTS
# The acquiring methods' default timeout, told by identity on the fast path: their signatures
# write it as the literal -1 (a cached small int, this very object), which inspect.signature
# can read where a name of the module's C globals would make the whole signature invalid.
cdef object FOREVER = -1

cdef lockmgr_mutex engine_mutex           # see the module docstring
cdef Py_tss_t token_key                   # per thread: its Token*, or NULL before first use
cdef unsigned long long searches = 0      # engine: numbers deadlock searches (Token.visit)
cdef Table *tables = NULL                 # engine: every live table (previous/next_table)
cdef Shard *touched_shards = NULL         # engine: the shards the engine holder has taken
cdef PyObject *loop_thread = <PyObject*>LOOP_THREAD  # lockmgr._owners keeps it alive
cdef Entry awaited_thread                 # what a task waits for in a thread it awaits (only
awaited_thread.key = <PyObject*>AWAITED_THREAD  # its key is read; lockmgr._owners keeps it)
cdef Token *waiting_threads = NULL        # engine: thread tokens waiting in a synchronous
                                          # acquire (Token.waiting_next); tasks follow their
                                          # loop's thread through it in a deadlock search
cdef size_t shard_count = 1               # shards per new table; set once at import
cdef Py_ssize_t forking_pid = 0           # atomic: between os.fork()'s hooks, the parent's pid
cdef long process_pid = os.getpid()       # this process's; a forked child's after-fork hook
                                          # sets it (GIL or stopped world); tasks.pxi reads it
cdef double histogram_bounds[HISTOGRAM_BUCKETS - 1]  # lockmgr._observe.HISTOGRAM_BOUNDS
if len(HISTOGRAM_BOUNDS) != HISTOGRAM_BUCKETS - 1 or HOT_KEY_SLOTS_SHARED != HOT_KEY_SLOTS:
    raise ImportError("lockmgr._core was built for other histogram bounds or hot-key slots")
for _bucket, _bound in enumerate(HISTOGRAM_BOUNDS):
    histogram_bounds[_bucket] = _bound
memset(&engine_mutex, 0, sizeof(engine_mutex))
if sizeof(Shard) > SHARD_BYTES:
    raise ImportError("lockmgr._core: a Shard does not fit SHARD_BYTES on this platform")
shard_count = shards_per_table(os.environ.get("LOCKMGR_SHARDS"), LOCKMGR_FREE_THREADED)
if PyThread_tss_create(&token_key) != 0:
    raise MemoryError("cannot create the thread-specific key for lockmgr tokens")


cdef inline size_t spread(Py_hash_t h) noexcept nogil:
    """Mix a hash so its low bits depend on all of it (lockmgr._args.stripe_index)."""
    cdef uint64_t mixed = <uint64_t>h * 0x9E3779B97F4A7C15ULL
    return <size_t>(mixed ^ (mixed >> 32))


cdef inline Shard* shard_for(Table *table, Py_hash_t h) noexcept nogil:
    """The shard a hash belongs to: the top bits of the mixed hash (buckets use the low)."""
    cdef uint64_t mixed = <uint64_t>h * 0x9E3779B97F4A7C15ULL
    return <Shard*>(<char*>table.shards + ((mixed >> 48) & table.shard_mask) * SHARD_BYTES)


cdef struct Peek:
    bint found           # the key has an entry
    unsigned long owner  # the write holder's ident (0: none)
    Py_ssize_t count     # the write holder's level
    bint mine            # the caller is the write holder
    bint task            # the write holder is a task (``owner`` is its id())
    Py_ssize_t readers   # read holds
    Py_ssize_t slots     # read levels, all holds together (a semaphore's taken slots)
    Py_ssize_t my_reads  # the caller's read level
    Py_ssize_t limit     # the entry's limit of read holders (a semaphore's; 0: none)
