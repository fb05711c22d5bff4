# lockmgr._core sections, part 1: the table, holders, queues and grants.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

# == sections: every function in this file and in operations.pxi is noexcept nogil and
# runs under the mutex (the compiler rejects Python object operations in them) ===========

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


cdef inline Entry* find(Table *table, Lookup *lookup) noexcept nogil:
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
    request.post_owed = True
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
