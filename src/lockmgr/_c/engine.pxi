# lockmgr._core: operations (prepare, section, finish) and the engine every manager shares.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

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
    if op.token is not NULL and lockmgr_load_ssize(&op.token.orphans):  # the caller's own
        free_orphans(op.token, &op.after)
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
    # No room for a cycle: a section that finds one answers LONG_CYCLE and prepare makes
    # room (deadlocks are rare; the fast path stays small).
    after_init(&op.after, NULL, 0)
    op.result = 0
    op_fill(op, kind, table, token, lookups, n)


cdef inline void op_fill(Op *op, Kind kind, Table *table, Token *token, Lookup *lookups,
                         Py_ssize_t n) noexcept:
    """What an Op is about (its After and result are the section's)."""
    op.kind = kind
    op.table = table
    op.token = token
    op.lookups = lookups
    op.n = n


cdef inline int execute(Op *op) except -1:
    """Run ``op``'s section until it decides (returns the Outcome): after comparing keys in
    Python when it asks, with room for a cycle when it found one."""
    if op.kind <= ACQUIRE_MANY and not op.try_only and not op.token.is_task:
        return execute_for_thread(op)  # it may wait
    return execute_plain(op)


cdef inline int execute_plain(Op *op) except -1:
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
                # A key's __eq__ may itself have used the manager and taken this thread's
                # spare memory: the section must find it there again.
                if op.kind == ACQUIRE_WRITE or op.kind == ACQUIRE_READ:
                    ensure_memory(<void**>&op.token.spare_entry, sizeof(Entry))
                if op.kind == ACQUIRE_READ:
                    ensure_memory(<void**>&op.token.spare_hold, sizeof(Hold))
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


cdef int execute_for_thread(Op *op) except -1:
    """``execute`` for a thread that may wait. One that runs in a task's context (see
    lockmgr._owners.CONTEXT_TASK) may run for that task (``asyncio.to_thread``): its deadlock
    search has the task wait for the thread too (``reach``). Only a certain edge may refuse
    the thread, so a cycle closed through it counts only if the task is indeed in the
    ``asyncio.to_thread`` call running this thread (``awaits_this_thread``); else the
    section runs again without it (and the refusal it counted is taken back)."""
    cdef Outcome outcome
    cdef Py_ssize_t i
    task = CONTEXT_TASK.get()
    owner = None if task is None else task_owners.get(task)  # keeps the task's token alive
    if owner is None:
        return execute_plain(op)
    op.token.awaited_by = (<_TaskOwner>owner).token
    try:
        outcome = <Outcome>execute_plain(op)
        if outcome != DEADLOCK:
            return outcome
        for i in range(op.after.cycle_length):
            if op.after.cycle[i].key == <PyObject*>AWAITED_THREAD:
                break
        else:
            return outcome
        if awaits_this_thread(task):
            return outcome
        cycle_list(&op.after)  # (drops its references)
        op.token.awaited_by = NULL
        lock()
        uncount_deadlock(op.table)
        unlock()
        remake_fresh(op)
        return execute_plain(op)
    finally:
        op.token.awaited_by = NULL


cdef int make_cycle_room(Op *op) except -1:
    PyMem_RawFree(op.after.cycle)
    op.after.cycle_room = 0
    op.after.cycle = <CycleStep*>PyMem_RawMalloc(op.after.cycle_length * 2 * sizeof(CycleStep))
    if op.after.cycle is NULL:
        raise MemoryError()
    op.after.cycle_room = op.after.cycle_length * 2
    return remake_fresh(op)


cdef int remake_fresh(Op *op) except -1:
    """After a refusal, before ``op`` runs again."""
    cdef Py_ssize_t i
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


# -- copies for lockmgr._observe (prepare and finish of snapshot, metrics, the slow-wait log) --

cdef object token_owner(Token *token):
    """What a record names as a token's owner: the thread's ident, or the task."""
    return task_of(token.ident) if token.is_task else token.ident


cdef int make_copy_room(Copy *copy) except -1:
    """Room for what the last section said it needs, and some more (it may grow)."""
    PyMem_RawFree(copy.keys)
    PyMem_RawFree(copy.parties)
    copy.key_room = copy.party_room = 0
    copy.keys = <KeyCopy*>PyMem_RawMalloc((copy.nkeys + 8) * sizeof(KeyCopy))
    copy.parties = <Party*>PyMem_RawMalloc((copy.nparties + 16) * sizeof(Party))
    if copy.keys is NULL or copy.parties is NULL:
        raise MemoryError()
    copy.key_room = copy.nkeys + 8
    copy.party_room = copy.nparties + 16
    copy.nkeys = copy.nparties = 0
    return 0


cdef list copied_keys(Copy *copy):
    """The copy as lockmgr._observe.build_snapshot takes it; the keys' references are the
    list's now."""
    cdef Py_ssize_t i, j, first = 0
    cdef KeyCopy *key
    cdef Party *party
    raw = []
    try:
        for i in range(copy.nkeys):
            key = copy.keys + i
            holders, waiters = [], []
            for j in range(first, first + key.holders + key.waiters):
                party = copy.parties + j
                owner = task_of(party.ident) if party.is_task else party.ident
                if j < first + key.holders:
                    holders.append((owner, party.is_task, party.mode, party.count, party.since))
                else:
                    waiters.append((owner, party.is_task, party.mode, party.since))
            first += key.holders + key.waiters
            raw.append((<object>key.key, holders, waiters))
    finally:
        for i in range(copy.nkeys):
            Py_XDECREF(copy.keys[i].key)
            copy.keys[i].key = NULL
    return raw


cdef void free_copy(Copy *copy) noexcept:
    cdef Py_ssize_t i
    if copy.fits:
        for i in range(copy.nkeys):  # not handed over (an error came first)
            Py_XDECREF(copy.keys[i].key)
    PyMem_RawFree(copy.keys)
    PyMem_RawFree(copy.parties)


cdef tuple histogram_tuple(Histogram *histogram):
    return ([histogram.counts[i] for i in range(HISTOGRAM_BUCKETS)], histogram.count,
            histogram.sum, histogram.max)


# -- the engine ---------------------------------------------------------------------------

cdef class _Engine:
    """The table, holds, queues, grants and waits that every manager shares."""
    # Keeps ``table`` off the cache line of the object's header, whose shared reference
    # count other threads write (a view of a key holds a reference) on free-threaded builds.
    cdef char header_gap[64]
    cdef Table table                      # this manager's lock table (see struct Table; a
                                          # striped one's stripes are ``table.stripes``)
    cdef tuple observers                  # callables told of each granted wait (lockmgr.otel);
                                          # read and replaced with engine_mutex held
    cdef object limit_of                  # a SemaphoreManager's limit(key), or None; set at
                                          # creation
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        global tables
        cdef size_t i
        cdef Shard *shard
        cdef void *memory = PyMem_RawCalloc(shard_count + 1, SHARD_BYTES)
        if memory is NULL:
            raise MemoryError()
        self.table.shard_memory = memory
        self.table.shards = <Shard*>((<size_t>memory + SHARD_BYTES - 1) & ~(<size_t>SHARD_BYTES - 1))
        self.table.shard_mask = shard_count - 1
        self.table.fair = True
        self.table.log_after = -1.0
        for i in range(shard_count):
            shard = shard_at(&self.table, i)
            shard.buckets = <Entry**>PyMem_RawCalloc(MIN_BUCKETS, sizeof(Entry*))
            if shard.buckets is NULL:
                self._free_shards()
                raise MemoryError()
            shard.mask = MIN_BUCKETS - 1
        lock()
        self.table.next_table = tables
        if tables is not NULL:
            tables.previous_table = &self.table
        tables = &self.table
        unlock()

    def __dealloc__(self):
        cdef After after
        cdef PyObject **keys
        cdef Py_ssize_t room, i
        if self.table.shard_memory is NULL:  # __cinit__ failed: nothing is left to free
            return
        lock()
        room = held_count(&self.table)  # nothing else changes a table being freed
        unlock()
        keys = <PyObject**>PyMem_RawCalloc(room, sizeof(PyObject*)) if room else NULL
        if keys is NULL:
            room = 0  # orphans keep their keys until their threads retire them
        after_init(&after, NULL, 0)
        lock()
        tear_down(&self.table, existing_token(), keys, room, &after)
        unlock()
        finish(&after, NULL)
        for i in range(room):
            Py_XDECREF(keys[i])
        PyMem_RawFree(keys)
        for i in range(HOT_KEY_SLOTS):  # nobody else uses a table being freed
            Py_XDECREF(self.table.hot[i].key)
        self._free_shards()
        self._free_stripes()  # after tear_down: no entry holds one any more

    cdef void _free_stripes(self) noexcept:
        cdef PyObject **stripes = self.table.stripes
        cdef size_t i
        if stripes is NULL:
            return
        self.table.stripes = NULL
        for i in range(self.table.stripe_mask + 1):
            Py_XDECREF(stripes[i])
        PyMem_RawFree(stripes)

    cdef void _free_shards(self) noexcept:
        cdef size_t i
        for i in range(self.table.shard_mask + 1):
            PyMem_RawFree(shard_at(&self.table, i).buckets)
        PyMem_RawFree(self.table.shard_memory)
        self.table.shard_memory = NULL

    __class_getitem__ = classmethod(GenericAlias)

    def __repr__(self):
        stats = self.stats()
        return manager_repr(self, self.table.fair, stats.held, stats.waiting)

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)

    def __sizeof__(self):
        cdef size_t buckets = 0, i
        cdef Py_ssize_t entries
        lock()
        entries = entry_count(&self.table)
        for i in range(self.table.shard_mask + 1):
            buckets += shard_at(&self.table, i).mask + 1
        unlock()
        stripes = 0 if self.table.stripes is NULL else self.table.stripe_mask + 1
        return (sizeof(LockManager) + (self.table.shard_mask + 2) * SHARD_BYTES
                + buckets * sizeof(Entry*) + entries * sizeof(Entry) + stripes * sizeof(PyObject*))

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
        return None if self.table.stripes is NULL else self.table.stripe_mask + 1

    def stripe_of(self, key):
        """The stripe ``key`` maps onto (None without stripes): keys that share one share a
        lock. Raises TypeError for an unhashable key (when striped: unstriped, it is not
        hashed)."""
        if self.table.stripes is NULL:
            return None
        return spread(lockmgr_hash(key)) & self.table.stripe_mask

    cdef int _use_stripes(self, stripes) except -1:
        """Make the table striped (at creation): one Stripe object per stripe, kept in C by
        the table until it is freed, so that no collector's clear can drop them under the
        entries that hold them borrowed."""
        cdef size_t index
        count = stripe_count(stripes)
        if count is None:
            return 0
        self.table.stripes = <PyObject**>PyMem_RawCalloc(count, sizeof(PyObject*))
        if self.table.stripes is NULL:
            raise MemoryError()
        self.table.stripe_mask = count - 1
        for index in range(count):
            stripe = Stripe(index)
            lockmgr_incref(<PyObject*>stripe)
            self.table.stripes[index] = <PyObject*>stripe
        return 0

    cdef inline PyObject* _lock_key(self, object key, Py_hash_t *h) noexcept:
        """The key the table uses for ``key`` (hashed to ``h[0]``), borrowed: the key itself
        (the caller's), or its stripe (the table's, alive as long as the manager); ``h[0]``
        becomes that key's hash. No reference is taken: without a GIL, threads using keys of
        different stripes would otherwise write the stripes' shared reference counts."""
        cdef size_t index
        if self.table.stripes is NULL:
            return <PyObject*>key
        index = spread(h[0]) & self.table.stripe_mask
        h[0] = <Py_hash_t>index
        return self.table.stripes[index]

    def _table_key(self, key):
        """``_lock_key`` for Python callers (the multi-key argument normalisers)."""
        cdef Py_hash_t h = lockmgr_hash(key)
        return <object>self._lock_key(key, &h)

    cdef int _limit_lookup(self, Lookup *lookup) except -1:
        """Prepare: the limit a semaphore's key gets if it enters the table, from the
        manager's ``limit(key)`` (checked: ValueError/TypeError, nothing changed)."""
        if self.limit_of is not None:
            lookup.limit = slot_limit(self.limit_of(<object>lookup.key), <object>lookup.key,
                                      True)
        return 0

    cdef int _peek(self, object key, Peek *seen) except -1:
        return self._peek_as(existing_token(), key, seen)

    cdef int _peek_as(self, Token *token, object key, Peek *seen) except -1:
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef Shard *shard
        cdef Lookup lookup
        cdef Op op
        cdef Outcome outcome
        cdef PyObject *lock_key = self._lock_key(key, &h)  # before ``h`` is read: it sets it
        lookup_init(&lookup, lock_key, h)
        shard = shard_for(&self.table, h)
        lockmgr_spin_lock(&shard.mutex)
        outcome = fast_peek(shard, &lookup, token, seen)
        lockmgr_spin_unlock(&shard.mutex)
        if outcome == SECTION:
            op_init(&op, PEEK, &self.table, token, &lookup, 1)
            op.seen = seen
            execute(&op)
        return 0

    def stats(self):
        """A snapshot of this manager's counters (read at one instant). Raises nothing."""
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

    # -- seeing contention (lockmgr._observe) ---------------------------------------------

    @property
    def log_waits_after(self):
        """Seconds after which a waiting request logs a WARNING (None: never)."""
        return None if self.table.log_after < 0 else self.table.log_after

    def snapshot(self):
        """Every key held or waited on, with its holders and its queue, at one instant.
        Raises nothing."""
        cdef Copy copy
        memset(&copy, 0, sizeof(Copy))
        try:
            while True:
                lock()
                copy_table(&self.table, &copy)
                unlock()
                if copy.fits:
                    return build_snapshot(copied_keys(&copy), copy.now)
                make_copy_room(&copy)
        finally:
            free_copy(&copy)

    def metrics(self):
        """The ``stats()`` counters, wait- and hold-time histograms and the hot keys, read
        at one instant. Raises nothing."""
        cdef unsigned long long counters[6]
        cdef Histogram waits, holds
        cdef HotSlot hot[HOT_KEY_SLOTS]
        cdef Py_ssize_t i
        lock()
        copy_metrics(&self.table, counters, &waits, &holds, hot)
        unlock()
        try:
            return build_metrics(
                [counters[i] for i in range(6)], histogram_tuple(&waits),
                histogram_tuple(&holds),
                [(<object>hot[i].key, hot[i].waited, hot[i].error)
                 for i in range(HOT_KEY_SLOTS) if hot[i].key is not NULL])
        finally:
            for i in range(HOT_KEY_SLOTS):
                Py_XDECREF(hot[i].key)

    def _add_wait_observer(self, observer):
        """Call ``observer(seconds)`` after every wait that was granted (lockmgr.otel), in
        the waiting thread or task, before its acquisition returns; what it raises ends the
        acquisition (the key is given back)."""
        self._replace_observers(lambda observers: observers + (observer,))

    def _remove_wait_observer(self, observer):
        self._replace_observers(
            lambda observers: tuple([other for other in observers if other is not observer]))

    cdef int _replace_observers(self, change) except -1:
        """Observers change while other threads may read them (free-threaded): swapped under
        the mutex, the old tuple dropped after it."""
        cdef tuple old, new
        while True:
            old = self._observers_now()
            new = change(old or ())
            lock()
            if self.observers is old:
                self.observers = new  # the field's reference to ``old`` moves to the local
                unlock()
                return 0
            unlock()  # another thread changed them meanwhile: again

    cdef tuple _observers_now(self):
        cdef tuple observers
        lock()
        observers = self.observers  # a reference taken, nothing else
        unlock()
        return observers

    cdef int _observe_wait(self, Request *request) except -1:
        observers = self._observers_now()
        if observers:
            waited = max(request.ended - request.since, 0.0)
            for observer in observers:
                observer(waited)
        return 0

    cdef object _log_slow_wait(self, Request *request):
        """The WARNING of a request still waiting after ``log_waits_after``; answers the keys
        it waits for (for the INFO line once it ends)."""
        cdef Copy copy
        memset(&copy, 0, sizeof(Copy))
        try:
            while True:
                lock()
                copy_request(&copy, request)
                unlock()
                if copy.fits:
                    break
                make_copy_room(&copy)
            raw = copied_keys(&copy)
            ahead = [copy.keys[i].ahead for i in range(copy.nkeys)]
        finally:
            free_copy(&copy)
        log_slow_wait(token_owner(request.token), max(copy.now - request.since, 0.0),
                      build_snapshot(raw, copy.now), ahead)
        return [key for key, _, _ in raw]

    def release_all(self):
        """Release every key of this manager the calling thread holds, all levels; returns how many.

        Levels that a waiting ``acquire_many`` of this thread took (only code running inside
        that wait can see them) stay until that call ends. Raises nothing.
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

    cdef bint _acquire_write(self, PyObject *key, Py_hash_t h, double seconds,
                             Py_ssize_t count) except -1:
        """Acquire ``count`` write levels of ``key``, waiting at most ``seconds`` (-1: forever)."""
        cdef Token *token = current_token()
        cdef Shard *shard
        cdef Lookup lookup
        cdef Request request
        cdef Op op
        cdef Outcome outcome
        if token.spare_entry is NULL:
            ensure_memory(<void**>&token.spare_entry, sizeof(Entry))
        if token.wakeup is NULL and seconds != 0:
            wakeup_lock(token)
        lookup_init(&lookup, key, h)
        # The Op is filled in only off the fast path.
        after_init(&op.after, NULL, 0)
        shard = shard_for(&self.table, h)
        lockmgr_spin_lock(&shard.mutex)
        outcome = fast_acquire_write(&self.table, shard, &lookup, token, count, &op.after)
        lockmgr_spin_unlock(&shard.mutex)
        if outcome == DONE and op.after.resize is NULL:
            return True
        op_fill(&op, ACQUIRE_WRITE, &self.table, token, &lookup, 1)
        op.count = count
        op.try_only = seconds == 0
        op.request = &request
        request.waiter = NULL
        if outcome == SECTION:
            outcome = <Outcome>execute(&op)
        return self._resolve(&op, outcome, key, seconds)

    cdef bint _acquire_read(self, PyObject *key, Py_hash_t h, double seconds) except -1:
        cdef Token *token = current_token()
        cdef Shard *shard
        cdef Lookup lookup
        cdef Request request
        cdef Op op
        cdef Outcome outcome
        ensure_memory(<void**>&token.spare_entry, sizeof(Entry))
        ensure_memory(<void**>&token.spare_hold, sizeof(Hold))
        if seconds != 0:
            wakeup_lock(token)
        lookup_init(&lookup, key, h)
        self._limit_lookup(&lookup)
        op_init(&op, ACQUIRE_READ, &self.table, token, &lookup, 1)
        op.try_only = seconds == 0
        op.request = &request
        request.hold = NULL
        request.waiter = NULL
        shard = shard_for(&self.table, h)
        lockmgr_spin_lock(&shard.mutex)
        outcome = fast_acquire_read(&self.table, shard, &lookup, token, &op.after)
        lockmgr_spin_unlock(&shard.mutex)
        if outcome == DONE and op.after.resize is NULL:  # nothing left for finish
            return True
        if outcome == SECTION:
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
                lookup_init(lookups + i, <PyObject*>key, lockmgr_hash(key))
                self._limit_lookup(lookups + i)
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
            return self._resolve(&op, outcome, <PyObject*>keys, seconds)
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

    cdef bint _resolve(self, Op *op, Outcome outcome, PyObject *key, double seconds) except -1:
        """Act on what an acquiring section decided (off the fast path); ``key`` (borrowed)
        is what errors name."""
        try:
            finish(&op.after, op.token)
            if outcome == DONE:
                return True
            if outcome == BUSY:
                return False
            if outcome == QUEUED:
                return self._wait(op.request, seconds)
            if outcome == NESTED:
                raise nested_wait(<object>key)
            if outcome == OVERFLOW:
                raise count_overflow(<object>key)
            raise deadlock(cycle_list(&op.after))
        finally:
            PyMem_RawFree(op.after.cycle)

    cdef bint _wait(self, Request *request, double seconds) except -1:
        """Sleep until the queued ``request`` is granted or its time runs out."""
        cdef Token *token = request.token
        cdef double deadline = -1.0
        cdef double log_at = -1.0  # when the slow-wait log is due (< 0: not, or done)
        cdef PY_TIMEOUT_T microseconds
        cdef PyLockStatus status
        cdef Outcome outcome
        logged_keys = None  # the keys a logged wait waits for
        if seconds > 0:
            deadline = request.since + seconds
        if self.table.log_after >= 0:
            log_at = request.since + self.table.log_after
        try:
            while True:
                microseconds = sleep_microseconds(
                    log_at if log_at >= 0 and (deadline < 0 or log_at < deadline) else deadline)
                with nogil:
                    status = PyThread_acquire_lock_timed(token.wakeup, microseconds, 1)
                outcome = self._settle(request, status == PY_LOCK_ACQUIRED, deadline, False)
                if outcome == TIMED_OUT:
                    break  # it left the queues: nothing may abandon it again
                # Handlers (and on 3.12+ the GC) run here; one that raises ends the wait,
                # and a grant that raced it is passed on.
                PyErr_CheckSignals()
                if outcome != DONE:
                    check = WAIT_CHECK.call  # lockmgr._owners: raising ends the wait
                    if check is not None:
                        check()
                if outcome == DONE:
                    self._observe_wait(request)
                    if logged_keys is not None:
                        log_wait_end(token_owner(token), logged_keys,
                                     max(request.ended - request.since, 0.0), True)
                    self._complete(request)
                    return True
                if log_at >= 0 and lockmgr_monotonic() >= log_at:
                    log_at = -1.0
                    logged_keys = self._log_slow_wait(request)
        except BaseException:
            self._settle(request, False, deadline, True)
            raise
        if logged_keys is not None:
            log_wait_end(token_owner(token), logged_keys,
                         max(request.ended - request.since, 0.0), False)
        return False

    cdef Outcome _settle(self, Request *request, bint consumed, double deadline,
                         bint abandoning) except *:
        """One section after a wake-up (or, ``abandoning``, after an exception), after
        consuming a post that is due but was not taken yet."""
        cdef After after
        cdef Outcome outcome
        after_init(&after, NULL, 0)
        while True:
            lock()
            if abandoning:
                outcome = abandon(&self.table, request, consumed, &after)
            else:
                outcome = settle(&self.table, request, consumed, deadline, &after)
            unlock()
            if outcome != NEED_POST:
                break
            with nogil:  # the post is at most one finish away
                PyThread_acquire_lock(request.token.wakeup, WAIT_LOCK)
            consumed = True
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

    cdef Py_ssize_t _release_write(self, PyObject *key, Py_hash_t h, bint fully) except -1:
        """Undo one write level of ``key`` (``fully``: all of them; returns how many)."""
        return self._release_write_as(existing_token(), key, h, fully)

    cdef Py_ssize_t _release_write_as(self, Token *token, PyObject *key, Py_hash_t h,
                                      bint fully) except -1:
        cdef Shard *shard
        cdef Lookup lookup
        cdef Op op
        cdef Outcome outcome
        lookup_init(&lookup, key, h)
        # The Op is filled in only off the fast path.
        after_init(&op.after, NULL, 0)
        shard = shard_for(&self.table, h)
        lockmgr_spin_lock(&shard.mutex)
        outcome = fast_release_write(shard, &lookup, token, fully, &op.result, &op.after)
        lockmgr_spin_unlock(&shard.mutex)
        if outcome == SECTION:
            op_fill(&op, RELEASE_WRITE, &self.table, token, &lookup, 1)
            op.fully = fully
            outcome = <Outcome>execute(&op)
        finish_if_needed(&op.after, token)
        if outcome == DONE:
            return op.result
        raise self._refusal(token, <object>key, WRITE, outcome)

    cdef int _release_read(self, PyObject *key, Py_hash_t h) except -1:
        return self._release_read_as(existing_token(), key, h)

    cdef int _release_read_as(self, Token *token, PyObject *key, Py_hash_t h) except -1:
        cdef Shard *shard
        cdef Lookup lookup
        cdef Op op
        cdef Outcome outcome
        lookup_init(&lookup, key, h)
        op_init(&op, RELEASE_READ, &self.table, token, &lookup, 1)
        shard = shard_for(&self.table, h)
        lockmgr_spin_lock(&shard.mutex)
        outcome = fast_release_read(shard, &lookup, token, &op.after)
        lockmgr_spin_unlock(&shard.mutex)
        if outcome == SECTION:
            outcome = <Outcome>execute(&op)
        finish_if_needed(&op.after, token)
        if outcome == DONE:
            return 0
        raise self._refusal(token, <object>key, READ, outcome)

    cdef int _release_many(self, list items) except -1:
        """Undo one ``_acquire_many`` of ``items``: all of them, or (if one is not held as
        asked) none, with NotOwnedError."""
        return self._release_many_as(existing_token(), items)

    cdef int _release_many_as(self, Token *token, list items) except -1:
        cdef Py_ssize_t n = len(items), i
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
                lookup_init(lookups + i, <PyObject*>key, lockmgr_hash(key))
                modes[i] = READ if mode == READ else WRITE
            if n:
                outcome = <Outcome>execute(&op)
                finish_if_needed(&op.after, token)
        finally:
            PyMem_RawFree(lookups)
            PyMem_RawFree(modes)
            PyMem_RawFree(entries)
        if outcome == NOT_OWNED or outcome == PINNED:
            key, mode = items[op.result]
            raise self._refusal(token, key, mode, outcome)
        return 0

    cdef object _refusal(self, Token *token, object key, int mode, Outcome outcome):
        """The error of a release ``token`` may not make (NULL: a thread that has none)."""
        owner = PyThread_get_thread_ident() if token is NULL else token_owner(token)
        if outcome == PINNED:
            return pinned(key, owner)
        return not_owned(key, owner, mode if isinstance(self, RWLockManager) else None)

    cdef object _tokenless_task_refusal(self, object key, int mode):
        """The error of a release by a task that has acquired nothing (it has no token)."""
        return not_owned(key, current_task_or_raise(),
                         mode if isinstance(self, RWLockManager) else None)

    # -- asyncio tasks as owners (lockmgr._aio states the protocol) -----------------------

    def _task_enter(self, key, int mode, double seconds, bint raises_timeout,
                    _BlockRecord record=None):
        """Take ``key`` for the current task now; answer an awaitable of the outcome (see
        lockmgr._aio). With ``record``, an ``async with`` block enters it once held."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        cdef _TaskOwner owner = task_owner(True)
        got = self._task_take(owner, lock_key, h, mode, seconds == 0, 1)
        if record is not None:
            self._enter_record(record, got, owner, lock_key, h, mode)
        return self._task_awaitable(got, key, seconds, raises_timeout)

    def _task_acquire(self, key, blocking=True, timeout=-1):
        """``aio.acquire`` (and ``rw.aio.acquire_write``), bound by the view as its own: lock
        ``key`` for the current task (see ``AsyncLockManager``).

        Raises, with nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``
        (as ``threading.Lock.acquire``; OverflowError past ``threading.TIMEOUT_MAX``),
        TypeError for an unhashable key, DeadlockError if waiting would close a cycle of
        tasks and threads, RuntimeError outside a running asyncio task."""
        # It answers a coroutine (an _Acquiring) that acquires for the task driving it, as an
        # ``async def`` would, but runs no Python frame (see lockmgr._aio).
        return acquiring(self, key, WRITE, blocking, timeout)

    def _task_acquire_read(self, key, blocking=True, timeout=-1):
        """``rw.aio.acquire_read``, bound by the view as its own: ``key`` shared for the
        current task; raises what ``aio.acquire`` raises."""
        return acquiring(self, key, READ, blocking, timeout)

    def _task_acquire_many(self, make_items, blocking=True, timeout=-1):
        """``aio.acquire_many``: a coroutine (an _Acquiring) as ``_task_acquire``'s, which
        makes the set's items with ``make_items()`` when it runs."""
        return acquiring(self, make_items, WRITE, blocking, timeout, True)

    cdef object _task_acquire_many_as(self, object make_items, object blocking,
                                      object timeout):
        items = make_items()
        return self._task_enter_many(items, wait_seconds(blocking, timeout), False)

    cdef object _task_acquire_as(self, object key, int mode, object blocking, object timeout):
        cdef double seconds = -1.0
        if not (blocking is True and timeout is DEFAULT_TIMEOUT):
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        cdef _TaskOwner owner = task_owner(True)
        got = self._task_take(owner, lock_key, h, mode, seconds == 0, 1)
        return self._task_awaitable(got, key, seconds, False)

    def _task_release_write(self, key):
        """``aio.release`` (and ``rw.aio.release_write``), bound by the view as its own: undo
        one acquire of ``key`` by the current task, at the call; answers a ready awaitable of
        None (awaiting it is optional, as for the PostgreSQL views'). Raises NotOwnedError if
        the task does not hold it, TypeError for an unhashable key, RuntimeError outside a
        running asyncio task."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._task_release_at(task_token(False), lock_key, h, WRITE)
        return READY_NONE

    def _task_release_read(self, key):
        """``rw.aio.release_read``, bound by the view as its own; answers and raises what
        ``aio.release`` does (NotOwnedError if the current task does not read ``key``)."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._task_release_at(task_token(False), lock_key, h, READ)
        return READY_NONE

    cdef int _enter_record(self, _BlockRecord record, object got, _TaskOwner owner,
                           PyObject *key, Py_hash_t h, int mode) except -1:
        """The block of ``record`` enters once its task holds what it asked for: now, or
        when its wait is granted. If another task entered the object meanwhile, what was
        taken goes back (RuntimeError)."""
        if got is True:
            try:
                record.enter(owner)
            except BaseException:
                self._task_release_at(owner.token, key, h, mode)
                raise
        elif type(got) is _TaskWait:
            (<_TaskWait>got).entering = record
        return 0

    def _task_key_lock(self, key):
        """``aio[key]``: the key's view for tasks."""
        return AsyncKeyLock(self, key)

    def _task_hold(self, key, double seconds, int mode):
        """``aio.hold(key)`` (``read``, ``write``): an ``async with`` object."""
        return async_holding(self, key, seconds, mode)

    def _task_hold_many(self, list items, double seconds):
        """``aio.hold_many(...)``: an ``async with`` object."""
        cdef AsyncHoldingMany made = AsyncHoldingMany.__new__(AsyncHoldingMany)
        made.manager = self
        made.items = items
        made.seconds = seconds
        return made

    def _task_record(self):
        """The record of an ``async with`` object: which task is inside it (lockmgr._aio)."""
        return _BlockRecord.__new__(_BlockRecord)

    def _task_enter_many(self, list items, double seconds, bint raises_timeout,
                         _BlockRecord record=None):
        cdef _TaskOwner owner = None
        if record is not None and items:
            owner = task_owner(True)
        got = self._task_take_many(items, seconds == 0)
        if owner is not None:
            if got is True:
                try:
                    record.enter(owner)
                except BaseException:
                    self._release_many_as(owner.token, items)
                    raise
            elif type(got) is _TaskWait:
                (<_TaskWait>got).entering = record
        if got is True or not raises_timeout:
            return self._task_awaitable(got, None, seconds, False)
        return self._task_awaitable(got, tuple([key for key, _ in items]), seconds, True)

    cdef object _task_awaitable(self, object got, object keys, double seconds,
                                bint raises_timeout):
        cdef _TaskWait wait
        if got is True:
            return READY_TRUE
        if got is False:
            if raises_timeout:
                raise timed_out(keys, seconds)
            return READY_FALSE
        wait = <_TaskWait>got
        wait.deadline = lockmgr_monotonic() + seconds if seconds > 0 else -1.0
        wait.log_at = -1.0
        if self.table.log_after >= 0:
            wait.log_at = wait.request.since + self.table.log_after
        wait.raises_timeout = raises_timeout
        wait.keys = keys
        wait.seconds = seconds
        return wait

    def _task_exit(self, _BlockRecord record not None, key, int mode):
        """The exit of a block: gives back the hold ``record`` names (see lockmgr._aio)."""
        cdef Py_hash_t h
        cdef PyObject *lock_key
        cdef _TaskOwner owner = record.leave()
        if owner is not None and releases_here(owner, self, key, mode):
            h = lockmgr_hash(key)
            lock_key = self._lock_key(key, &h)
            self._task_release_at(owner.token, lock_key, h, mode)
        return READY_NONE

    def _task_exit_many(self, _BlockRecord record not None, list items):
        cdef _TaskOwner owner
        if not items:  # an empty hold_many entered nothing
            return READY_NONE
        owner = record.leave()
        if owner is not None and releases_here(owner, self, items, -1):
            self._release_many_as(owner.token, items)
        return READY_NONE

    def _task_release_for(self, _TaskOwner owner, key, int mode):
        """A block's exit run on another thread than its task's loop, sent there."""
        if owner.ended:
            return
        if mode < 0:
            self._release_many_as(owner.token, key)
        else:
            self._task_release(key, mode, owner)

    cdef object _task_take(self, _TaskOwner owner, PyObject *key, Py_hash_t h, int mode,
                           bint try_only, Py_ssize_t count):
        """Acquire the table's ``key`` (hashing to ``h``) for the current task, whose owner
        is ``owner``: True, False (try-lock), or a queued _TaskWait."""
        cdef Token *token = owner.token
        cdef Shard *shard
        cdef Lookup lookup
        cdef Op op
        cdef Outcome outcome
        cdef _TaskWait wait = None
        if owner.wait is not None:
            owner.abandon_stranded()
        ensure_memory(<void**>&token.spare_entry, sizeof(Entry))
        if mode == READ:
            ensure_memory(<void**>&token.spare_hold, sizeof(Hold))
        lookup_init(&lookup, key, h)
        if mode == READ:
            self._limit_lookup(&lookup)
        after_init(&op.after, NULL, 0)
        shard = shard_for(&self.table, h)
        lockmgr_spin_lock(&shard.mutex)
        if mode == READ:
            outcome = fast_acquire_read(&self.table, shard, &lookup, token, &op.after)
        else:
            outcome = fast_acquire_write(&self.table, shard, &lookup, token, count, &op.after)
        lockmgr_spin_unlock(&shard.mutex)
        if outcome == SECTION:
            wait = self._task_wait(owner, 1)
            wait.taken_key = <object>key
            wait.taken_hash = h
            wait.taken_mode = mode
            op_fill(&op, ACQUIRE_READ if mode == READ else ACQUIRE_WRITE, &self.table, token,
                    &lookup, 1)
            op.count = count
            op.try_only = try_only
            op.request = wait.request
            outcome = <Outcome>execute(&op)
        return self._task_outcome(&op, outcome, wait, key)

    cdef object _task_take_many(self, list items, bint try_only):
        """``_acquire_many`` for the current task: True, False, or a queued _TaskWait."""
        cdef Py_ssize_t n = len(items), i
        cdef _TaskOwner owner = task_owner(n != 0)
        cdef Token *token
        cdef Lookup *lookups = NULL
        cdef Entry **fresh = NULL
        cdef _TaskWait wait
        cdef Op op
        cdef Outcome outcome
        if n == 0:
            return True
        token = owner.token
        if owner.wait is not None:
            owner.abandon_stranded()
        wait = self._task_wait(owner, n)
        wait.taken_items = items
        try:
            lookups = <Lookup*>PyMem_RawCalloc(n, sizeof(Lookup))
            fresh = <Entry**>PyMem_RawCalloc(n, sizeof(Entry*))
            if lookups is NULL or fresh is NULL:
                raise MemoryError()
            op_init(&op, ACQUIRE_MANY, &self.table, token, lookups, n)
            op.try_only = try_only
            op.request = wait.request
            op.fresh = fresh
            for i in range(n):
                key, mode = items[i]  # ``items`` keeps the keys alive
                lookup_init(lookups + i, <PyObject*>key, lockmgr_hash(key))
                self._limit_lookup(lookups + i)
                wait.request[i].token = token
                wait.request[i].lead = wait.request
                wait.request[i].count = 1
                wait.request[i].mode = READ if mode == READ else WRITE
                fresh[i] = <Entry*>PyMem_RawMalloc(sizeof(Entry))
                if fresh[i] is NULL:
                    raise MemoryError()
                if wait.request[i].mode == READ:
                    wait.request[i].hold = <Hold*>PyMem_RawMalloc(sizeof(Hold))
                    if wait.request[i].hold is NULL:
                        raise MemoryError()
            wait.request.nodes = n
            outcome = <Outcome>execute(&op)
            keys = tuple([key for key, _ in items]) if outcome in (NESTED, OVERFLOW) else None
            return self._task_outcome(&op, outcome, wait, <PyObject*>keys)
        finally:
            if fresh is not NULL:
                for i in range(n):
                    PyMem_RawFree(fresh[i])
            PyMem_RawFree(lookups)
            PyMem_RawFree(fresh)

    cdef _TaskWait _task_wait(self, _TaskOwner owner, Py_ssize_t n):
        """The memory and Waker of a task's request of ``n`` nodes, before its section
        (which may queue it, and another thread grant it and post the Waker, at once).
        Nothing knows of it until ``_task_outcome`` finds it queued: an exception before
        (a key's ``__eq__``, a signal handler's) leaves the task's owner as it was."""
        cdef _TaskWait wait = _TaskWait.__new__(_TaskWait)
        cdef Py_ssize_t i
        wait.manager = self
        wait.owner = owner
        wait.waker = Waker(running_loop())
        if n == 1:
            wait.request = &wait.single
        else:
            wait.nodes = <Request*>PyMem_RawCalloc(n, sizeof(Request))
            if wait.nodes is NULL:
                raise MemoryError()
            wait.request = wait.nodes
        wait.n = n
        for i in range(n):
            wait.request[i].waiter = <PyObject*>wait  # no reference: see Request.waiter
        return wait

    cdef object _task_outcome(self, Op *op, Outcome outcome, _TaskWait wait, PyObject *key):
        if outcome == QUEUED:
            # Published here, with no Python code since the section: a grant's post may
            # come from another thread already, but it needs nothing of this (the Waker
            # was made first), and the loop running this task cannot be closed meanwhile.
            wait.queued = True  # until it ends (settle or abandon)
            wait.waker.lost = wait._loop_closed
            wait.owner.wait = wait  # (the table refuses a second wait: NestedWaitError)
        try:
            finish(&op.after, op.token)
            if outcome == DONE:
                return True
            if outcome == BUSY:
                return False
            if outcome == QUEUED:
                return wait
            if outcome == NESTED:
                raise nested_wait(<object>key)
            if outcome == OVERFLOW:
                raise count_overflow(<object>key)
            raise deadlock(cycle_list(&op.after))
        finally:
            PyMem_RawFree(op.after.cycle)

    def _task_abandon(self):
        """An exception ended an acquisition of the current task: abandon the wait it may
        have queued, if nothing awaits it (idempotent)."""
        try:
            owner = task_owners.get(current_task_or_raise())
        except RuntimeError:  # not in a task: it queued nothing
            return
        if owner is not None:
            (<_TaskOwner>owner).abandon_stranded()

    def _task_release(self, key, int mode, _TaskOwner owner=None):
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._task_release_at(task_token(False) if owner is None else owner.token,
                              lock_key, h, mode)

    cdef int _task_release_at(self, Token *token, PyObject *key, Py_hash_t h,
                              int mode) except -1:
        if token is NULL:  # the task has acquired nothing
            raise self._tokenless_task_refusal(<object>key, mode)
        if mode == READ:
            self._release_read_as(token, key, h)
        else:
            self._release_write_as(token, key, h, False)
        return 0

    def _task_release_many(self, list items):
        cdef Token *token = task_token(False)
        if token is NULL and items:  # the task has acquired nothing
            key, mode = items[0]
            raise self._tokenless_task_refusal(key, mode)
        self._release_many_as(token, items)
        return READY_NONE  # (as _task_release_write's)

    def _task_release_all(self):
        cdef Token *token = task_token(False)
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

    def _task_levels(self, key):
        """The current task's write and read levels of ``key``."""
        cdef Token *token = task_token(False)
        cdef Peek seen
        self._peek_as(token, key, &seen)
        return (seen.count if seen.mine else 0), seen.my_reads
