# lockmgr._core sections, part 1: the table, holders, queues and grants.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

# == every function in this file and in operations.pxi is noexcept nogil: the compiler
# rejects Python object operations in them. They run in a section (engine_mutex held,
# each shard touched before its entries are read), or, the few the fast paths use, with
# one shard's mutex held alone. =============================================================

# -- shards -------------------------------------------------------------------------------

cdef inline void touch(Shard *shard) noexcept nogil:
    """Take ``shard``'s mutex for the rest of the section (once; ``unlock`` gives it back).

    Only the engine holder holds more than one shard, and a fast path holds one and takes
    nothing else, so shards may be taken in any order without a deadlock."""
    global touched_shards
    if not shard.touched:
        lockmgr_spin_lock(&shard.mutex)
        shard.touched = True
        shard.next_touched = touched_shards
        touched_shards = shard


cdef inline Entry* touched(Entry *entry) noexcept nogil:
    """``entry``, its shard touched (a section reached it through a request or a list)."""
    touch(entry.shard)
    return entry


cdef void touch_all(Table *table) noexcept nogil:
    cdef size_t i
    for i in range(table.shard_mask + 1):
        touch(shard_at(table, i))


cdef inline Shard* shard_at(Table *table, size_t index) noexcept nogil:
    return <Shard*>(<char*>table.shards + index * SHARD_BYTES)


# -- the table ----------------------------------------------------------------------------

cdef inline size_t bucket_of(Shard *shard, Py_hash_t h) noexcept nogil:
    return spread(h) & shard.mask  # spread: consecutive ints must not share low bits


cdef int known_answer(Lookup *lookup, PyObject *stored) noexcept nogil:
    """What prepare's comparison said of ``stored``: 1, 0, or -1 (not asked yet)."""
    cdef Py_ssize_t i
    for i in range(lookup.ncompared):
        if lookup.compared[i].key == stored:
            return lookup.compared[i].equal
    return -1


cdef inline Entry* find_in(Shard *shard, Lookup *lookup, bint *unsure) noexcept nogil:
    """The entry for ``lookup``'s key in ``shard`` (held), or NULL: absent, or (``unsure[0]``
    set) a stored key must be compared in Python first; a section then gets it as
    ``lookup.candidate`` (a strong reference), a fast path (``unsure`` not NULL) just learns
    it must leave the key to a section."""
    cdef Entry *entry = shard.buckets[bucket_of(shard, lookup.hash)]
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
                if unsure is not NULL:
                    unsure[0] = True
                    return NULL
                lockmgr_incref(entry.key)
                lookup.candidate = entry.key
                return NULL
        entry = entry.bucket_next
    return NULL


cdef inline Entry* find(Table *table, Lookup *lookup) noexcept nogil:
    """``find_in`` for a section: the key's shard is touched first."""
    cdef Shard *shard = shard_for(table, lookup.hash)
    touch(shard)
    return find_in(shard, lookup, NULL)


cdef inline bint is_stripe(Table *table, PyObject *key, Py_hash_t h) noexcept nogil:
    """Whether ``key`` (hashing to ``h``) is one of ``table``'s stripes: the table keeps it
    alive, so its entry holds it without a reference (a stripe's hash is its index)."""
    return table.stripes is not NULL and <size_t>h <= table.stripe_mask and table.stripes[h] == key


cdef Entry* insert(Table *table, Lookup *lookup, Entry *entry, After *after) noexcept nogil:
    """Put ``entry`` (memory from prepare) in the table for ``lookup``'s key (its shard held)."""
    cdef Shard *shard = shard_for(table, lookup.hash)
    cdef size_t bucket = bucket_of(shard, lookup.hash)
    if not is_stripe(table, lookup.key, lookup.hash):
        lockmgr_incref(lookup.key)
    entry.key = lookup.key
    entry.hash = lookup.hash
    entry.table = table
    entry.shard = shard
    entry.owner = NULL
    entry.count = 0
    entry.pinned = 0
    entry.readers = NULL
    entry.nreaders = 0
    entry.slots = 0
    entry.limit = lookup.limit if lookup.limit else table.slot_limit
    entry.head = NULL
    entry.tail = NULL
    entry.inflight = 0
    entry.held_since = 0.0
    entry.bucket_next = shard.buckets[bucket]
    shard.buckets[bucket] = entry
    shard.entries += 1
    if <size_t>shard.entries > shard.mask + 1:
        after.resize = table
    return entry


cdef void remove(Entry *entry, After *after) noexcept nogil:
    """Unlink an unused ``entry``; its key (unless a stripe: borrowed) and memory go to the
    After."""
    cdef Shard *shard = entry.shard
    cdef Entry **link = &shard.buckets[bucket_of(shard, entry.hash)]
    if is_stripe(entry.table, entry.key, entry.hash):
        entry.key = NULL
    while link[0] != entry:
        link = &link[0].bucket_next
    link[0] = entry.bucket_next
    entry.bucket_next = after.retired
    after.retired = entry
    shard.entries -= 1
    if shard.mask + 1 > MIN_BUCKETS and <size_t>shard.entries * 4 < shard.mask + 1:
        after.resize = entry.table


cdef inline bint unused(Entry *entry) noexcept nogil:
    return entry.owner is NULL and entry.nreaders == 0 and entry.inflight == 0


cdef size_t wanted_buckets(Shard *shard) noexcept nogil:
    """The bucket count ``shard`` should have, or 0 if its current one is fine."""
    cdef size_t buckets = shard.mask + 1
    if <size_t>shard.entries > buckets:
        while <size_t>shard.entries > buckets:
            buckets *= 2
        return buckets
    if buckets > MIN_BUCKETS and <size_t>shard.entries * 4 < buckets:
        while buckets > MIN_BUCKETS and <size_t>shard.entries * 2 < buckets:
            buckets //= 2
        return buckets
    return 0


cdef Entry** rehash(Shard *shard, Entry **fresh, size_t buckets) noexcept nogil:
    """Move every entry into ``fresh`` (``buckets`` zeroed slots); returns the old array."""
    cdef Entry **old = shard.buckets
    cdef size_t old_count = shard.mask + 1, i
    cdef Entry *entry
    cdef Entry *following
    shard.buckets = fresh
    shard.mask = buckets - 1
    for i in range(old_count):
        entry = old[i]
        while entry is not NULL:
            following = entry.bucket_next
            entry.bucket_next = fresh[bucket_of(shard, entry.hash)]
            fresh[bucket_of(shard, entry.hash)] = entry
            entry = following
    return old


# -- holders ------------------------------------------------------------------------------

cdef inline void own(Entry *entry, Token *token, Py_ssize_t count) noexcept nogil:
    if entry.head is not NULL:  # a section, past a queue (an upgrade, a barge, fair=False)
        entry.held_since = lockmgr_monotonic()
    if entry.nreaders == 0:
        entry.shard.held += 1
    entry.owner = token
    entry.count = count
    entry.pinned = 0
    entry.held_prev = NULL
    entry.held_next = token.held
    if token.held is not NULL:
        token.held.held_prev = entry
    token.held = entry
    entry.shard.acquisitions += 1


cdef inline void unlink_held(Entry *entry) noexcept nogil:
    """Take ``entry`` out of its owner's list of write-held entries."""
    if entry.held_prev is not NULL:
        entry.held_prev.held_next = entry.held_next
    else:
        entry.owner.held = entry.held_next
    if entry.held_next is not NULL:
        entry.held_next.held_prev = entry.held_prev


cdef inline void disown(Entry *entry) noexcept nogil:
    if entry.head is not NULL:  # never on a fast path: they leave queued keys to sections
        count_hold(entry.table, entry.held_since)
    entry.held_since = 0.0
    unlink_held(entry)
    entry.owner = NULL
    entry.count = 0
    entry.pinned = 0
    if entry.nreaders == 0:
        entry.shard.held -= 1


cdef inline Hold* read_hold(Entry *entry, Token *token) noexcept nogil:
    cdef Hold *hold = entry.readers
    while hold is not NULL and hold.token != token:
        hold = hold.entry_next
    return hold


cdef void add_read(Entry *entry, Token *token, Hold *hold, Py_ssize_t count) noexcept nogil:
    if entry.owner is NULL and entry.nreaders == 0:
        entry.shard.held += 1
    hold.token = token
    hold.entry = entry
    hold.count = count
    entry.slots += count
    hold.pinned = 0
    # A section may add a read past a queue (re-entry by a writer, a downgrade): timed.
    hold.held_since = 0.0 if entry.head is NULL else lockmgr_monotonic()
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
    entry.shard.acquisitions += 1


cdef inline void unlink_read(Hold *hold) noexcept nogil:
    """Take ``hold`` out of its thread's list of read holds."""
    if hold.token_prev is not NULL:
        hold.token_prev.token_next = hold.token_next
    else:
        hold.token.reads = hold.token_next
    if hold.token_next is not NULL:
        hold.token_next.token_prev = hold.token_prev


cdef void drop_read(Entry *entry, Hold *hold) noexcept nogil:
    if entry.head is not NULL:  # never on a fast path: they leave queued keys to sections
        count_hold(entry.table, hold.held_since)
    if hold.entry_prev is not NULL:
        hold.entry_prev.entry_next = hold.entry_next
    else:
        entry.readers = hold.entry_next
    if hold.entry_next is not NULL:
        hold.entry_next.entry_prev = hold.entry_prev
    unlink_read(hold)
    entry.nreaders -= 1
    entry.slots -= hold.count
    if entry.owner is NULL and entry.nreaders == 0:
        entry.shard.held -= 1
    PyMem_RawFree(hold)


cdef inline bint room_for(Py_ssize_t level, Py_ssize_t more) noexcept nogil:
    return level <= PY_SSIZE_T_MAX - more


# -- timing holds (only where a request waits: lockmgr._observe) ---------------------------

cdef void count_in(Histogram *histogram, double seconds) noexcept nogil:
    cdef Py_ssize_t bucket = 0
    while bucket < HISTOGRAM_BUCKETS - 1 and seconds > histogram_bounds[bucket]:
        bucket += 1
    histogram.counts[bucket] += 1
    histogram.count += 1
    histogram.sum += seconds
    if seconds > histogram.max:
        histogram.max = seconds


cdef void count_hold(Table *table, double since) noexcept nogil:
    """A hold ends while a request is queued for its key (engine): count it if it was timed
    (not for an orphan, whose table is gone)."""
    if since > 0 and table is not NULL:
        count_in(&table.holds, max(lockmgr_monotonic() - since, 0.0))


cdef void time_grant(Entry *entry, Request *request) noexcept nogil:
    """A request that waited was granted: its hold is timed from now, unless it re-entered
    a hold timed already."""
    cdef Hold *hold
    if request.mode == WRITE:
        if entry.held_since == 0:
            entry.held_since = lockmgr_monotonic()
        return
    hold = read_hold(entry, request.token)
    if hold.held_since == 0:
        hold.held_since = lockmgr_monotonic()


cdef void time_holds(Entry *entry, double since) noexcept nogil:
    """A request queued on ``entry`` at ``since``: holds not timed yet are timed from then."""
    cdef Hold *hold = entry.readers
    if entry.owner is not NULL and entry.held_since == 0:
        entry.held_since = since
    while hold is not NULL:
        if hold.held_since == 0:
            hold.held_since = since
        hold = hold.entry_next


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

cdef inline bint has_slot(Entry *entry) noexcept nogil:
    """Whether ``entry`` admits one more read level: a semaphore's key with a free slot."""
    return entry.limit == 0 or entry.slots < entry.limit


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
    if request.mode == READ:
        # an RWLockManager's entry always has one; a semaphore's slot is one more, also
        # for a holder of slots
        return has_slot(entry)
    return entry.nreaders == 0 or (
        entry.nreaders == 1 and entry.readers.token == request.token)


cdef void take(Entry *entry, Request *request) noexcept nogil:
    """Give ``request`` its key (``grantable`` said it may)."""
    cdef Hold *hold
    if request.mode == WRITE:
        if entry.owner == request.token:
            entry.count += request.count
            entry.shard.acquisitions += 1
        else:
            own(entry, request.token, request.count)
        return
    hold = read_hold(entry, request.token)
    if hold is not NULL:
        hold.count += request.count
        entry.slots += request.count
        entry.shard.acquisitions += 1
    else:
        add_read(entry, request.token, request.hold, request.count)
        request.hold = NULL


cdef inline void wake(Request *request, After *after) noexcept nogil:
    if request.waiter is not NULL:  # a task's: its memory lives until the finish posted it
        lockmgr_incref(request.waiter)
    request.post_owed = True
    request.wake_next = NULL
    if after.woken_last is NULL:
        after.woken = request
    else:
        after.woken_last.wake_next = request
    after.woken_last = request


cdef void grant(Table *table, Entry *entry, Request *request) noexcept nogil:
    """A single request takes its key and leaves the queue (its wake-up is the caller's)."""
    dequeue(entry, request)
    take(entry, request)
    time_grant(entry, request)
    table.waiting -= 1
    request.state = GRANTED


cdef bint node_ready(Request *node) noexcept nogil:
    touch(node.entry.shard)
    return node.entry.owner == node.token and grantable(node.entry, node) or (
        node.entry.head == node and grantable(node.entry, node))


cdef bint group_grantable(Request *lead) noexcept nogil:
    """Every queued node of a set is at the head of its queue (or re-enters) and compatible."""
    cdef Py_ssize_t i
    for i in range(lead.nodes):
        if lead[i].queued and not node_ready(lead + i):
            return False
    return True


cdef void grant_nodes(Request *lead, bint was_queued) noexcept nogil:
    """Give a set every key at once: queued nodes take their entries; the others re-enter
    keys its thread holds (their levels were pinned when it queued, or are taken now)."""
    cdef Py_ssize_t i
    cdef Request *node
    cdef Hold *hold
    for i in range(lead.nodes):
        node = lead + i
        touch(node.entry.shard)
        if node.queued:
            if was_queued:
                dequeue(node.entry, node)
            take(node.entry, node)
            if was_queued:
                time_grant(node.entry, node)
        elif was_queued:
            if node.mode == WRITE:
                node.entry.pinned -= 1
            else:
                read_hold(node.entry, node.token).pinned -= 1
            node.entry.shard.acquisitions += 1
        else:
            take(node.entry, node)
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
                remove(entry, after)
            return
        if head.lead is not NULL:  # a set: all of its keys or none
            lead = head.lead
            if lead.state != WAITING or not group_grantable(lead):
                return
            grant_nodes(lead, True)
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
