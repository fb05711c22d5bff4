# lockmgr._core outside sections: the mutex, finish, lookups, tokens, thread exit, fork, sleeping.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

cdef inline void lock() noexcept:
    lockmgr_mutex_lock(&engine_mutex)


cdef inline void unlock() noexcept:
    """End a section: give back the shards it touched, then the engine mutex."""
    global touched_shards
    cdef Shard *shard = touched_shards
    touched_shards = NULL
    while shard is not NULL:
        shard.touched = False
        lockmgr_spin_unlock(&shard.mutex)
        shard = shard.next_touched
    lockmgr_mutex_unlock(&engine_mutex)


# -- finish -------------------------------------------------------------------------------

cdef inline void after_init(After *after, CycleStep *cycle, Py_ssize_t room) noexcept:
    after.retired = NULL
    after.woken = NULL
    after.woken_last = NULL
    after.cycle = cycle
    after.cycle_length = 0
    after.cycle_room = room
    after.resize = NULL
    after.ndropped = 0


cdef int finish(After *after, Token *keeper) except -1:
    """Do what a section left: wake, then drop retired keys (which may run ``__del__``),
    keeping one retired entry's memory as ``keeper``'s spare, then resize a table."""
    cdef Request *request = after.woken
    cdef Request *following
    cdef Entry *entry
    cdef PyThread_type_lock wakeup
    cdef object failure = None
    after.woken = NULL
    after.woken_last = NULL
    while request is not NULL:
        following = request.wake_next  # read first: once posted, the request may be gone
        if request.waiter is not NULL:
            failure = post_task(request.waiter, failure)
        else:
            wakeup = request.token.wakeup
            PyThread_release_lock(wakeup)
        request = following
    if after.resize is not NULL:
        resize_shards(after.resize)
        after.resize = NULL
    while after.retired is not NULL:
        entry = after.retired
        after.retired = entry.bucket_next
        Py_XDECREF(entry.key)
        if keeper is not NULL and keeper.spare_entry is NULL:
            keeper.spare_entry = entry
        else:
            PyMem_RawFree(entry)
    while after.ndropped:
        after.ndropped -= 1
        Py_DECREF(<object>after.dropped[after.ndropped])
    if failure is not None:
        raise failure
    return 0


cdef object post_task(PyObject *waiter, object failure):
    """Post a task's wait, then drop the reference the waking section took (which may free
    the wait). Its Waker never raises, but a signal handler may run inside it and raise
    anywhere: the post is delivered again until a delivery returns (the Waker counts a
    number once), every other post is made all the same, and the first such exception is
    raised after. The retries are bounded, so a loop whose every call raises cannot hold
    the releasing thread for ever."""
    cdef int attempts = 0
    cdef long long number = 0
    waker = (<_TaskWait>waiter).waker
    try:
        while True:
            try:
                if number == 0:
                    number = waker.next_post()
                waker.deliver(number)
                return failure
            except BaseException as error:
                if failure is None:
                    failure = error
                attempts += 1
                if attempts == post_attempts:
                    return failure
    finally:
        Py_DECREF(<object>waiter)


cdef void resize_shards(Table *table) noexcept:
    cdef size_t i
    for i in range(table.shard_mask + 1):
        resize(shard_at(table, i))


cdef void resize(Shard *shard) noexcept:
    """Give ``shard`` the bucket count its size wants (memory is taken with no mutex held,
    and the size is checked again after); if memory is short, keep the current one. Like a
    fast path, it holds the shard's mutex alone."""
    cdef size_t buckets
    cdef Entry **fresh
    cdef Entry **unneeded
    lockmgr_spin_lock(&shard.mutex)
    buckets = wanted_buckets(shard)
    lockmgr_spin_unlock(&shard.mutex)
    if buckets == 0:
        return
    fresh = <Entry**>PyMem_RawCalloc(buckets, sizeof(Entry*))
    if fresh is NULL:
        return
    lockmgr_spin_lock(&shard.mutex)
    if wanted_buckets(shard) == buckets:
        unneeded = rehash(shard, fresh, buckets)
    else:
        unneeded = fresh
    lockmgr_spin_unlock(&shard.mutex)
    PyMem_RawFree(unneeded)


cdef list cycle_list(After *after):
    """The DEADLOCK cycle as ``[(owner, key), ...]``; drops the After's key refs."""
    cdef Py_ssize_t i
    cycle = []
    for i in range(after.cycle_length):
        owner = after.cycle[i].ident
        if after.cycle[i].is_task:
            owner = task_of(after.cycle[i].ident)
        cycle.append((owner, <object>after.cycle[i].key))
        Py_XDECREF(after.cycle[i].key)
    return cycle


# -- prepare: lookups ---------------------------------------------------------------------

cdef inline void lookup_init(Lookup *lookup, PyObject *key, Py_hash_t h) noexcept:
    lookup.key = key
    lookup.hash = h
    lookup.candidate = NULL
    lookup.compared = NULL
    lookup.ncompared = 0
    lookup.room = 0
    lookup.limit = 0


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
    thread_name = threading.current_thread().name  # first: it runs Python code
    cdef PyObject *state = PyThreadState_GetDict()
    if state is NULL:
        raise RuntimeError("lockmgr needs a Python thread state in the calling thread")
    cdef Token *token = <Token*>PyMem_RawCalloc(1, sizeof(Token))
    if token is NULL:
        raise MemoryError()
    token.ident = PyThread_get_thread_ident()
    cdef _ThreadExit guard = _ThreadExit.__new__(_ThreadExit)
    guard.token = token  # from here on the guard frees the token
    guard.thread_name = thread_name
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


cdef enum:
    EXIT_ROUNDS = 100  # bounds a finalizer that takes a key again each time it is released


cdef bint release_abandoned(Token *token, object owner, object thread_name=None) except -1:
    """Release every key an ending thread holds, then drop them and warn (naming
    ``thread_name``, see warn_abandoned); False if it held none."""
    cdef After after
    cdef PyObject **keys = NULL
    cdef Py_ssize_t room, released, i
    after_init(&after, NULL, 0)
    lock()
    room = count_holds(token)
    unlock()
    if room == 0:
        return False
    keys = <PyObject**>PyMem_RawMalloc(room * sizeof(PyObject*))
    if keys is NULL:
        room = 0  # release all the same; only the warning loses its keys
    lock()
    released = release_token(token, NULL, keys, room, &after)
    unlock()
    after.resize = NULL  # no manager is held alive here: tables resize on their next use
    finish(&after, NULL)
    abandoned = []
    for i in range(min(released, room)):
        abandoned.append(<object>keys[i])
        Py_XDECREF(keys[i])
    PyMem_RawFree(keys)
    if abandoned and not lockmgr_is_finalizing():
        warn_abandoned(owner, abandoned, thread_name)
    return True


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
    cdef object thread_name  # the thread's name when its token was made (by its first
                             # use of lockmgr): the thread is gone from threading when
                             # its abandoned keys are reported

    def __dealloc__(self):
        cdef Token *token = self.token
        cdef int rounds
        cdef Py_ssize_t pid
        if token is NULL:
            return
        # Only at interpreter shutdown or in a forked child are the states of threads still
        # blocked in a wait cleared: their stacks still use the token, so keep it. In a
        # forked child the after-fork hook frees a dead thread's keys.
        pid = lockmgr_load_ssize(&forking_pid)  # another thread may be forking
        if token.request is NULL and not (pid and pid != os.getpid()):
            # Dropping the released keys and warning run Python code (finalizers, warning
            # filters) in this thread, with its token still its own: what that code takes
            # is released in the next round.
            for rounds in range(EXIT_ROUNDS):
                if not release_abandoned(token, token.ident, self.thread_name):
                    break
            free_token(token)
        if PyThread_tss_get(&token_key) == token:
            PyThread_tss_set(&token_key, NULL)


# -- fork ---------------------------------------------------------------------------------

def _before_fork():
    # No mutex is taken: another library's before-fork hook (run after this one) may join
    # a thread whose exit needs the engine mutex. No section or fast path is half done in
    # the child all the same: with a GIL, the forking thread holds it across fork(), and no
    # section releases it; free-threaded, CPython stops the world after the hooks, which
    # waits for every thread attached to the interpreter, and sections and fast paths
    # never detach.
    lockmgr_store_ssize(&forking_pid, os.getpid())


def _after_fork_in_parent():
    lockmgr_store_ssize(&forking_pid, 0)


cdef void forget_waiting_threads(Token *survivor) noexcept nogil:
    """In a forked child: only the forking thread may still be waiting."""
    global waiting_threads
    waiting_threads = NULL
    if survivor is not NULL:
        survivor.waiting_prev = NULL
        survivor.waiting_next = NULL
        if survivor.request is not NULL:
            waiting_threads = survivor


def _after_fork_in_child():
    """The child holds only what the forking thread held; the rest is free, queues are empty."""
    global touched_shards, process_pid
    cdef Token *survivor = existing_token()
    cdef Table *table
    cdef After after
    cdef size_t i
    # A thread that no longer exists may have held a mutex it was about to use (handed
    # over while the world stopped) or been parked on one: start them all afresh.
    lockmgr_mutex_forget(&engine_mutex)
    touched_shards = NULL
    table = tables
    while table is not NULL:
        for i in range(table.shard_mask + 1):
            lockmgr_spin_forget(&shard_at(table, i).mutex)
            shard_at(table, i).touched = False
        table = table.next_table
    after_init(&after, NULL, 0)
    lock()
    table = tables
    while table is not NULL:
        keep_only(table, survivor, &after)
        table = table.next_table
    forget_waiting_threads(survivor)
    unlock()
    lockmgr_store_ssize(&forking_pid, 0)
    process_pid = os.getpid()  # a loop that ran in the parent does not run here (tasks.pxi)
    after.resize = NULL  # no manager is held alive here: tables resize on their next use
    finish(&after, survivor)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


cdef inline PY_TIMEOUT_T sleep_microseconds(double deadline) noexcept:
    """How long the next sleep may last: until ``deadline`` (-1: none), in slices. On the
    main thread a slice bounds how late a signal's handler runs; on every thread it bounds
    how late a waiter sees that code which ran in its own wait (a finalizer) made its
    request grantable by re-entry, which nobody posts."""
    cdef double seconds = wait_slice
    if deadline >= 0:
        seconds = min(max(deadline - lockmgr_monotonic(), 0.0), wait_slice)
    # Rounded up, as CPython rounds a lock's timeout: a sleep that ends before the deadline
    # would find the wait not yet timed out and run the wait check once more.
    return <PY_TIMEOUT_T>ceil(seconds * 1e6)
