# lockmgr._core sections, part 2: the wait-for graph and every operation on a table.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

# -- the wait-for graph -------------------------------------------------------------------

cdef struct Search:
    unsigned long long number  # this search's number, marked on each token it reaches
    Token *me                  # the thread about to wait: reaching it again closes a cycle
    Request *request           # what ``me`` is about to queue (single, or a set's lead)
    Token *stack               # reached threads whose own waits are still to be followed


cdef bint reach(Search *search, Token *thread, Token *successor, Entry *waits_for,
               bint to_run) noexcept nogil:
    """``thread`` waits for ``successor`` in ``waits_for``: for a request of it to be granted
    and, ``to_run``, for it to run on (to release what it holds or will hold: a task runs
    only when its loop's thread does, so that thread is reached from it too, with a NULL
    ``waits_for``: the cycle shows LOOP_THREAD as its key; and the searching thread, if it
    runs in that task's context, as one the task may await: ``awaited_thread``). True if
    that closes the cycle."""
    if successor is NULL or successor == thread:
        return False
    if successor == search.me:
        successor.reached_from = thread
        successor.reached_via = waits_for
        return True
    if successor.visit != search.number:
        successor.visit = search.number
        successor.reached_from = thread
        successor.reached_via = waits_for
        successor.search_next = search.stack
        search.stack = successor
    if to_run and successor.is_task:
        if successor == search.me.awaited_by:
            return reach(search, successor, search.me, &awaited_thread, True)
        return reach(search, successor, loop_thread_of(search, successor), NULL, True)
    return False


cdef bint reach_waited_for(Search *search, Token *thread, Request *node, bint enqueued) noexcept nogil:
    """Reach every thread a request (node) of ``thread`` waits for: the holders it conflicts
    with (hard edges), then the requests queued ahead of it that ``pass_on`` must grant
    before it (soft edges).

    The edges are exactly what the grant rules (``grantable``, ``pass_on``,
    ``group_grantable`` in table.pxi) make a request wait for:

    - the key's writer, unless it is the request's own thread (a re-entry), and, for a
      write or a read of a key with one slot (a semaphore's limit of 1: its one reader is
      what the wait waits for), every other reader: to release the key (they must run on).
      A read of a key with more slots waits for *any* of its holders to leave: no edge
      (one edge per holder would make cycles of holders that another holder frees);
    - unless it is an upgrade (queued at the head, nothing is ahead of it), every request
      ahead of it when either of the two is a write (a write is granted alone), or the key
      has one slot: to be granted and release the key again (it must run on);
    - and, ahead of a read, a set's read node: a set is granted only once its node heads
      every queue it is in, so a read behind one waits until the whole set is granted, but
      not for its owner to run (``pass_on`` grants it whether its task runs or not);
    - an upgrade the searching thread is about to queue on the same key: it goes before
      every request queued there, this one included (not queued yet, it is no request
      ahead of anyone in the queue the search reads).

    A read ahead of a read, when not a set's, is no edge, even for a set's node: it is
    granted whenever the key lets a read in (by ``pass_on``, without its owner running), so
    it waits for nothing the read behind it does not wait for itself.

    The pure twin's ``_find_cycle`` (``_pure/_operations.py``) follows the same list."""
    cdef Entry *waits_for = touched(node.entry)
    cdef Hold *hold = waits_for.readers
    cdef Request *ahead = waits_for.head
    cdef Request *own_place = node if enqueued else NULL
    cdef bint conflicting
    cdef bint exclusive = node.mode == WRITE or waits_for.limit == 1  # one slot: as a write
    if reach(search, thread, waits_for.owner, waits_for, True):
        return True
    if exclusive:
        while hold is not NULL:
            if reach(search, thread, hold.token, waits_for, True):
                return True
            hold = hold.entry_next
    if thread != search.me and upgrades(search.request, waits_for):
        return reach(search, thread, search.me, waits_for, True)
    if node.at_head:
        return False
    while ahead is not NULL and ahead != own_place:
        conflicting = exclusive or ahead.mode == WRITE
        if (conflicting or ahead.lead is not NULL) and reach(
                search, thread, ahead.token, waits_for, conflicting):
            return True
        ahead = ahead.next
    return False


cdef bint upgrades(Request *request, Entry *entry) noexcept nogil:
    """Whether ``request`` (not queued yet) has an upgrade of ``entry``, queued at its head."""
    cdef Py_ssize_t i
    for i in range(request.nodes):
        if request[i].queued and request[i].at_head and request[i].entry == entry:
            return True
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
    if me.is_task and me.held is NULL and me.reads is NULL:
        # Nobody can wait for a task that holds nothing and waits nowhere else: it is not
        # a holder, only the newest of its queues, and no loop-thread edge leads to a task.
        return QUEUED
    searches += 1
    search.number = searches
    search.me = me
    search.request = request
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
        after.cycle[i].is_task = thread.reached_from.is_task
        after.cycle[i].key = loop_thread if thread.reached_via is NULL else thread.reached_via.key
        lockmgr_incref(after.cycle[i].key)
        thread = thread.reached_from
    return DEADLOCK


cdef void uncount_deadlock(Table *table) noexcept nogil:
    """Take back the refusal ``queue`` counted for a cycle that did not hold (see
    execute_for_thread): from the first shard, as the stats read the sum of the shards'."""
    cdef Shard *shard = shard_at(table, 0)
    touch(shard)
    shard.deadlocks -= 1


cdef Token* loop_thread_of(Search *search, Token *task) noexcept nogil:
    """The token of the thread running ``task``'s loop if it waits in a synchronous acquire
    (or is about to: the searching thread), else NULL."""
    cdef unsigned long ident = <unsigned long>task.loop_ident
    cdef Token *thread = waiting_threads
    if not search.me.is_task and search.me.ident == ident:
        return search.me
    while thread is not NULL and thread.ident != ident:
        thread = thread.waiting_next
    return thread


# -- fast paths ---------------------------------------------------------------------------
# With the key's shard mutex held alone (no engine mutex): what one shard decides by itself,
# for a thread that is not waiting (so only it writes its lists). Anything that involves a
# queue, another thread, an error or a Python comparison answers SECTION, having changed
# nothing, and the caller runs the operation's section instead.

cdef inline Outcome fast_acquire_write(Table *table, Shard *shard, Lookup *lookup, Token *token,
                                       Py_ssize_t count, After *after) noexcept nogil:
    cdef bint unsure = False
    cdef Entry *entry
    if token.request is not NULL or lockmgr_load_ssize(&token.orphans):
        return SECTION
    entry = find_in(shard, lookup, &unsure)
    if unsure:
        return SECTION
    if entry is NULL:
        entry = insert(table, lookup, token.spare_entry, after)
        token.spare_entry = NULL
        own(entry, token, count)
        return DONE
    if entry.owner == token and room_for(entry.count, count) and not table.counts_slots:
        entry.count += count
        shard.acquisitions += 1
        return DONE
    if entry.owner is NULL and entry.nreaders == 0 and entry.head is NULL:
        own(entry, token, count)
        return DONE
    return SECTION


cdef inline Outcome fast_release_write(Shard *shard, Lookup *lookup, Token *token, bint fully,
                                       Py_ssize_t *released, After *after) noexcept nogil:
    cdef bint unsure = False
    cdef Entry *entry
    if token is NULL or token.request is not NULL:
        return SECTION
    entry = find_in(shard, lookup, &unsure)
    if entry is NULL or entry.owner != token:  # unsure, or an error to raise
        return SECTION
    if not fully and entry.count > 1:
        entry.count -= 1
        released[0] = 1
        return DONE
    if entry.head is not NULL:  # someone to hand the key to
        return SECTION
    released[0] = entry.count
    disown(entry)
    if unused(entry):
        remove(entry, after)
    return DONE


cdef Outcome fast_acquire_read(Table *table, Shard *shard, Lookup *lookup, Token *token,
                               After *after) noexcept nogil:
    cdef bint unsure = False
    cdef Entry *entry
    cdef Hold *hold
    if token.request is not NULL or lockmgr_load_ssize(&token.orphans):
        return SECTION
    entry = find_in(shard, lookup, &unsure)
    if unsure:
        return SECTION
    if entry is not NULL:
        hold = read_hold(entry, token)
        if hold is not NULL and entry.limit == 0:  # an RWLockManager's read re-enters
            if not room_for(hold.count, 1):
                return SECTION
            hold.count += 1
            entry.slots += 1
            shard.acquisitions += 1
            return DONE
        if entry.head is not NULL or (entry.owner is not NULL and entry.owner != token) \
                or not has_slot(entry):
            return SECTION
        if hold is not NULL:  # a semaphore's holder takes one more slot
            hold.count += 1
            entry.slots += 1
            shard.acquisitions += 1
            return DONE
    else:
        entry = insert(table, lookup, token.spare_entry, after)
        token.spare_entry = NULL
    add_read(entry, token, token.spare_hold, 1)
    token.spare_hold = NULL
    return DONE


cdef Outcome fast_release_read(Shard *shard, Lookup *lookup, Token *token,
                               After *after) noexcept nogil:
    cdef bint unsure = False
    cdef Entry *entry
    cdef Hold *hold
    if token is NULL or token.request is not NULL:
        return SECTION
    entry = find_in(shard, lookup, &unsure)
    if entry is NULL:
        return SECTION
    hold = read_hold(entry, token)
    if hold is NULL:
        return SECTION
    if hold.count > 1 and (entry.limit == 0 or entry.head is NULL):
        hold.count -= 1  # (a semaphore's slot given back with a queue: passed on, below)
        entry.slots -= 1
        return DONE
    if entry.head is not NULL:
        return SECTION
    drop_read(entry, hold)
    if unused(entry):
        remove(entry, after)
    return DONE


# -- acquiring ----------------------------------------------------------------------------

cdef inline Outcome acquire_write(Table *table, Lookup *lookup, Token *token, Py_ssize_t count,
                           bint try_only, Request *request, After *after) noexcept nogil:
    cdef Entry *entry = find(table, lookup)
    cdef bint upgrade
    if lookup.candidate is not NULL:
        return COMPARE
    if entry is NULL:
        entry = insert(table, lookup, token.spare_entry, after)
        token.spare_entry = NULL
        own(entry, token, count)
        return DONE
    if entry.owner == token:
        if table.counts_slots:  # a semaphore's one slot, held by the caller itself
            return refuse_own_wait(entry, token, try_only, after)
        if not room_for(entry.count, count):
            return OVERFLOW
        entry.count += count
        entry.shard.acquisitions += 1
        return DONE
    upgrade = entry.nreaders and read_hold(entry, token) is not NULL
    if entry.owner is NULL and (
            (entry.nreaders == 0 and (entry.head is NULL or entry.head.state == WOKEN))
            or (upgrade and entry.nreaders == 1)):
        # Free and nobody queued (with fair=False, a woken head that has not run yet may be
        # overtaken), or the caller is the only reader: an upgrade goes at once.
        own(entry, token, count)
        return DONE
    return queue_single(table, entry, token, WRITE, count, upgrade, try_only, request, after)


cdef Outcome acquire_read(Table *table, Lookup *lookup, Token *token, bint try_only,
                          Request *request, After *after) noexcept nogil:
    cdef Entry *entry = find(table, lookup)
    cdef Hold *hold = NULL
    if lookup.candidate is not NULL:
        return COMPARE
    if entry is not NULL:
        hold = read_hold(entry, token)
        if hold is not NULL and entry.limit == 0:
            # an RWLockManager's read: reentrant, even past queued writers (else it
            # self-deadlocks)
            if not room_for(hold.count, 1):
                return OVERFLOW
            hold.count += 1
            entry.slots += 1
            entry.shard.acquisitions += 1
            return DONE
    if entry is NULL:
        entry = insert(table, lookup, token.spare_entry, after)
        token.spare_entry = NULL
    if entry.owner == token or (entry.owner is NULL and has_slot(entry) and (
            entry.head is NULL or not table.fair)):  # fair=False: a free slot past a queue
        if hold is not NULL:  # a semaphore's holder takes one more slot
            hold.count += 1
            entry.slots += 1
            entry.shard.acquisitions += 1
            return DONE
        add_read(entry, token, token.spare_hold, 1)
        token.spare_hold = NULL
        return DONE
    if hold is not NULL and hold.count == entry.slots and not has_slot(entry):
        return refuse_own_wait(entry, token, try_only, after)  # every slot is the caller's
    return queue_single(table, entry, token, READ, 1, False, try_only, request, after)


cdef Outcome refuse_own_wait(Entry *entry, Token *token, bint try_only,
                             After *after) noexcept nogil:
    """A semaphore's key whose every slot the caller holds: only its own release could
    give it one more, so a try gives up (BUSY) and a wait is refused as the cycle of one
    step it would be (DEADLOCK), nothing changed."""
    if try_only:
        entry.shard.timeouts += 1
        return BUSY
    after.cycle_length = 1
    if after.cycle_room < 1:
        return LONG_CYCLE
    after.cycle[0].ident = token.ident
    after.cycle[0].is_task = token.is_task
    after.cycle[0].key = entry.key
    lockmgr_incref(entry.key)
    entry.shard.deadlocks += 1
    return DEADLOCK


cdef Outcome queue_single(Table *table, Entry *entry, Token *token, Mode mode, Py_ssize_t count,
                          bint upgrade, bint try_only, Request *request,
                          After *after) noexcept nogil:
    """The key is taken: give up (try-lock), refuse, or queue ``request``."""
    cdef PyObject *waiter
    if try_only:
        entry.shard.timeouts += 1
        return BUSY
    if token.request is not NULL:
        return NESTED
    waiter = request.waiter  # set by prepare: a task's wait, or NULL
    memset(request, 0, sizeof(Request))
    request.waiter = waiter
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
    global waiting_threads
    cdef Outcome outcome = refuse_if_cycle(request.token, request, after)
    cdef Py_ssize_t i
    cdef Request *node
    if outcome != QUEUED:
        if outcome == DEADLOCK:
            request.entry.shard.deadlocks += 1
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
            time_holds(node.entry, request.since)
        else:
            pin(node)
    table.waiting += 1
    request.token.request = request
    if not request.token.is_task:
        request.token.waiting_prev = NULL
        request.token.waiting_next = waiting_threads
        if waiting_threads is not NULL:
            waiting_threads.waiting_prev = request.token
        waiting_threads = request.token
    return QUEUED


cdef void pin(Request *node) noexcept nogil:
    """A set re-enters a key its thread holds: take that level now, pinned while it waits."""
    cdef Hold *hold
    if node.mode == WRITE:
        node.entry.count += 1
        node.entry.pinned += 1
        return
    hold = read_hold(node.entry, node.token)
    if hold is NULL:  # reads a key it writes
        add_read(node.entry, node.token, node.hold, 0)
        node.entry.shard.acquisitions -= 1  # counted when the set is granted
        node.hold = NULL
        hold = node.entry.readers
    hold.count += 1
    node.entry.slots += 1
    hold.pinned += 1


cdef void unpin_and_give_back(Request *node) noexcept nogil:
    """A waiting set leaves: give back a level it pinned."""
    cdef Entry *entry = node.entry
    cdef Hold *hold
    if node.mode == WRITE:
        entry.pinned -= 1
        entry.count -= 1
        if entry.count == 0:
            disown(entry)
        return
    hold = read_hold(entry, node.token)
    hold.pinned -= 1
    hold.count -= 1
    entry.slots -= 1
    if hold.count == 0:
        drop_read(entry, hold)


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
    for i in range(n):  # a semaphore's key whose every slot the caller holds: as acquire's
        entry = nodes[i].entry
        if entry is not NULL and (
                (nodes[i].mode == WRITE and entry.owner == token and table.counts_slots)
                or (nodes[i].mode == READ and entry.limit and not has_slot(entry)
                    and read_hold(entry, token) is not NULL
                    and read_hold(entry, token).count == entry.slots)):
            return refuse_own_wait(entry, token, try_only, after)
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
        elif entry.owner == token or (entry.limit == 0 and read_hold(entry, token) is not NULL):
            node.queued = False  # re-entered (a semaphore's slot is one more: queued)
        else:
            ready = ready and entry.owner is NULL and entry.head is NULL and has_slot(entry)
    if ready:
        grant_nodes(nodes, False)
        return DONE
    if try_only:
        nodes.entry.shard.timeouts += 1
        outcome = BUSY
    elif token.request is not NULL:
        outcome = NESTED
    else:
        outcome = queue(table, nodes, after)
        if outcome == QUEUED:
            return QUEUED
    for i in range(n):  # nothing was queued: drop the entries it made
        if unused(nodes[i].entry):
            remove(nodes[i].entry, after)
    return outcome


# -- waiting ------------------------------------------------------------------------------

cdef void stop_waiting(Token *thread) noexcept nogil:
    """Unlink a thread's token from ``waiting_threads``."""
    global waiting_threads
    if thread.waiting_prev is not NULL:
        thread.waiting_prev.waiting_next = thread.waiting_next
    elif waiting_threads == thread:
        waiting_threads = thread.waiting_next
    if thread.waiting_next is not NULL:
        thread.waiting_next.waiting_prev = thread.waiting_prev
    thread.waiting_prev = NULL
    thread.waiting_next = NULL


cdef void end_request(Table *table, Request *request, After *after) noexcept nogil:
    """The waiter's call is about to return: the request stops pointing at its entries."""
    cdef Py_ssize_t i
    request.token.request = NULL
    if not request.token.is_task:
        stop_waiting(request.token)
    for i in range(request.nodes):
        touched(request[i].entry).inflight -= 1
    for i in range(request.nodes):
        pass_on(table, request[i].entry, after)  # only drops an entry nobody uses now


cdef void leave(Table *table, Request *request, After *after) noexcept nogil:
    """A waiting (or woken) request gives up: out of every queue, pinned levels given back."""
    cdef Py_ssize_t i
    for i in range(request.nodes):
        touch(request[i].entry.shard)
        if request[i].queued:
            dequeue(request[i].entry, request + i)
        else:
            unpin_and_give_back(request + i)
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
        entry = touched(node.entry)
        if node.mode == WRITE:
            if entry.owner != node.token:
                continue
            levels = min(node.count, entry.count - entry.pinned)
            entry.count -= levels
            if entry.count == 0:
                disown(entry)
        else:
            hold = read_hold(entry, node.token)
            if hold is NULL:
                continue
            levels = min(node.count, hold.count - hold.pinned)
            hold.count -= levels
            entry.slots -= levels
            if hold.count == 0:
                drop_read(entry, hold)
        if levels:
            entry.shard.acquisitions -= 1
    end_request(table, request, after)


cdef inline bint post_still_owed(Request *request, bint consumed) noexcept nogil:
    """Record a post the waiter consumed; True if one is still on its way (the waiter must
    take it before its request changes again or ends: one post per transition)."""
    if consumed:
        request.post_owed = False
    return request.post_owed


cdef Outcome settle(Table *table, Request *request, bint consumed, double deadline,
                    After *after) noexcept nogil:
    """The waiter woke (``consumed``: it took a wake-up post): decide what its wait became.
    A grant it makes itself (re-entry) owes no post."""
    cdef Entry *entry = touched(request.entry)
    if post_still_owed(request, consumed):
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
            grant_nodes(request, True)
            table.waiting -= 1
    if request.state == GRANTED:  # the waiter runs handlers, then completes or undoes it
        request.ended = lockmgr_monotonic()
        return DONE
    if deadline >= 0 and lockmgr_monotonic() >= deadline:
        request.ended = lockmgr_monotonic()
        record_wait(table, request, False, after)
        leave(table, request, after)
        entry.shard.timeouts += 1
        return TIMED_OUT
    return STILL


cdef void complete(Table *table, Request *request, After *after) noexcept nogil:
    """A granted wait returns."""
    touched(request.entry).shard.contended += 1
    record_wait(table, request, True, after)
    end_request(table, request, after)


cdef void record_wait(Table *table, Request *request, bint granted, After *after) noexcept nogil:
    """A wait ended (``request.ended``): measure it (if granted), and charge it to every key
    it queued on."""
    cdef double waited = max(request.ended - request.since, 0.0)
    cdef Py_ssize_t i
    if granted:
        count_in(&table.waits, waited)
    for i in range(request.nodes):
        if request[i].queued and request[i].entry.key is not NULL:
            charge(table, request[i].entry.key, waited, after)


cdef void charge(Table *table, PyObject *key, double waited, After *after) noexcept nogil:
    """Space-Saving: add ``waited`` to the key's slot, or take a free slot, or replace the
    least-charged key (whose charge becomes the slot's error; its reference is dropped by
    the finish). Slots match by identity, or by value where that needs no Python code."""
    cdef Py_ssize_t i
    cdef HotSlot *slot
    cdef HotSlot *least = table.hot
    for i in range(HOT_KEY_SLOTS):
        slot = table.hot + i
        if slot.key is NULL:
            lockmgr_incref(key)
            slot.key = key
            slot.waited = waited
            slot.error = 0.0
            return
        if slot.key == key or lockmgr_key_equal(slot.key, key) > 0:
            slot.waited += waited
            return
        if slot.waited < least.waited:
            least = slot
    if after.ndropped == DROP_ROOM:
        return
    after.dropped[after.ndropped] = least.key
    after.ndropped += 1
    lockmgr_incref(key)
    least.key = key
    least.error = least.waited
    least.waited += waited


cdef Outcome abandon(Table *table, Request *request, bint consumed, After *after) noexcept nogil:
    """An exception ends the wait: leave, or undo a grant that raced it."""
    if post_still_owed(request, consumed):
        return NEED_POST
    if request.state != GRANTED:  # (else it was measured when its waiter saw the grant)
        request.ended = lockmgr_monotonic()
    record_wait(table, request, False, after)  # waited for all the same
    if request.state == GRANTED:
        undo_grant(table, request, after)
    else:
        leave(table, request, after)
    return DONE


# -- releasing ----------------------------------------------------------------------------

cdef inline Outcome release_write(Table *table, Lookup *lookup, Token *token, bint fully,
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
        disown(entry)
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
    entry.slots -= 1
    if hold.count == 0:
        drop_read(entry, hold)
        pass_on(table, entry, after)
    elif entry.limit:  # a semaphore's slot is free for the queue
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
                disown(entry)
        else:
            hold = read_hold(entry, token)
            hold.count -= 1
            entry.slots -= 1
            if hold.count == 0:
                drop_read(entry, hold)
        pass_on(table, entry, after)
    return DONE


cdef Py_ssize_t release_token(Token *token, Table *only, PyObject **keys, Py_ssize_t room,
                              After *after) noexcept nogil:
    """Release every level ``token`` holds (in ``only``'s entries, unless it is NULL) except
    levels pinned by a waiting set; returns how many keys it stopped holding (a key read and
    written counts once). The first ``room`` of those keys go to ``keys`` (strong refs).
    Holds its thread kept in managers that are gone (orphans) are freed on the way."""
    cdef Py_ssize_t released = 0
    cdef Entry *entry
    cdef Entry *following
    cdef Hold *hold = token.reads
    cdef Hold *next_hold
    while hold is not NULL:  # reads first, so a write-held key is counted with its write
        next_hold = hold.token_next  # survives: it is another entry's hold
        entry = hold.entry
        if entry is NULL:
            unlink_read(hold)
            PyMem_RawFree(hold)
        elif only is NULL or entry.table == only:
            touch(entry.shard)
            if hold.pinned:
                entry.slots -= hold.count - hold.pinned
                hold.count = hold.pinned
            else:
                if entry.owner != token:
                    released += keep_key(entry, released, keys, room)
                drop_read(entry, hold)
                pass_on(entry.table, entry, after)
        hold = next_hold
    entry = token.held
    while entry is not NULL:
        following = entry.held_next  # survives: only ``entry`` is unlinked or removed below
        if entry.table is NULL:  # its key goes with it in finish
            unlink_held(entry)
            entry.bucket_next = after.retired
            after.retired = entry
        elif only is NULL or entry.table == only:
            touch(entry.shard)
            if entry.pinned:
                entry.count = entry.pinned
            else:
                if read_hold(entry, token) is NULL:  # else a pinned read keeps it held
                    released += keep_key(entry, released, keys, room)
                disown(entry)
                pass_on(entry.table, entry, after)
        entry = following
    return released


cdef void free_orphans(Token *token, After *after) noexcept nogil:
    """Free what freed managers left in ``token``'s lists (its own section: only it may)."""
    cdef Entry *entry = token.held
    cdef Entry *following
    cdef Hold *hold = token.reads
    cdef Hold *next_hold
    lockmgr_store_ssize(&token.orphans, 0)
    while hold is not NULL:
        next_hold = hold.token_next
        if hold.entry is NULL:
            unlink_read(hold)
            PyMem_RawFree(hold)
        hold = next_hold
    while entry is not NULL:
        following = entry.held_next
        if entry.table is NULL:  # its key (if tear_down had no room for it) goes in finish
            unlink_held(entry)
            entry.bucket_next = after.retired
            after.retired = entry
        entry = following


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


cdef void tear_down(Table *table, Token *current, PyObject **keys, Py_ssize_t room,
                    After *after) noexcept nogil:
    """A manager is being freed (nobody waits in it: a waiter's call keeps it alive): leave
    the live list, hand every entry to the After. What another thread holds stays linked in
    its lists, which only that thread may change while it runs fast paths: the entry becomes
    an orphan that thread retires, a read hold one it frees. An orphan's key goes to
    ``keys`` (the first ``room`` of them; the rest stay with their orphans), except a stripe,
    which every entry held borrowed: the table's reference is dropped after this."""
    cdef size_t i, b
    cdef Shard *shard
    cdef Entry *entry
    cdef Entry *following
    cdef Hold *hold
    cdef Hold *next_hold
    cdef bint orphan
    global tables
    if table.previous_table is not NULL:
        table.previous_table.next_table = table.next_table
    else:
        tables = table.next_table
    if table.next_table is not NULL:
        table.next_table.previous_table = table.previous_table
    for i in range(table.shard_mask + 1):
        shard = shard_at(table, i)
        touch(shard)
        for b in range(shard.mask + 1):
            entry = shard.buckets[b]
            while entry is not NULL:
                following = entry.bucket_next
                hold = entry.readers
                while hold is not NULL:
                    next_hold = hold.entry_next
                    if hold.token == current:
                        unlink_read(hold)
                        PyMem_RawFree(hold)
                    else:
                        hold.entry = NULL
                        lockmgr_store_ssize(&hold.token.orphans, 1)
                    hold = next_hold
                if is_stripe(table, entry.key, entry.hash):  # borrowed: nothing to drop
                    entry.key = NULL
                orphan = entry.owner is not NULL and entry.owner != current
                if entry.owner is not NULL and not orphan:
                    unlink_held(entry)
                if orphan:
                    entry.table = NULL
                    entry.shard = NULL
                    lockmgr_store_ssize(&entry.owner.orphans, 1)
                    if room and entry.key is not NULL:
                        room -= 1
                        keys[room] = entry.key
                        entry.key = NULL
                else:
                    entry.bucket_next = after.retired
                    after.retired = entry
                entry = following
            shard.buckets[b] = NULL
        shard.entries = 0


cdef void keep_only(Table *table, Token *survivor, After *after) noexcept nogil:
    """In a forked child: keep what ``survivor`` (the forking thread) holds and its waiting
    request, if it forked from inside a wait; every other thread is gone."""
    cdef size_t i, b
    cdef Shard *shard
    cdef Entry *entry
    cdef Entry *following
    cdef Request *request
    cdef Request *next_request
    cdef Hold *hold
    cdef Hold *next_hold
    cdef Request *kept = survivor.request if survivor is not NULL else NULL
    table.waiting = 0
    touch_all(table)
    for i in range(table.shard_mask + 1):
        shard = shard_at(table, i)
        for b in range(shard.mask + 1):
            entry = shard.buckets[b]
            while entry is not NULL:
                entry.inflight = 0
                request = entry.head
                while request is not NULL:
                    next_request = request.next
                    if request.token != survivor:
                        request.token.request = NULL  # its thread is gone
                        if request.lead is not NULL:
                            request.lead.state = LEFT  # a task's wait sees it ended
                        else:
                            request.state = LEFT
                        dequeue(entry, request)
                    request = next_request
                if entry.owner is not NULL and entry.owner != survivor:
                    disown(entry)
                hold = entry.readers
                while hold is not NULL:
                    next_hold = hold.entry_next
                    if hold.token != survivor:
                        drop_read(entry, hold)
                    hold = next_hold
                entry = entry.bucket_next
    if kept is not NULL:
        for i in range(kept.nodes):
            if kept[i].entry.table == table:
                kept[i].entry.inflight += 1
        if kept.entry.table == table and (kept.state == WAITING or kept.state == WOKEN):
            table.waiting = 1
    for i in range(table.shard_mask + 1):
        shard = shard_at(table, i)
        for b in range(shard.mask + 1):
            entry = shard.buckets[b]
            while entry is not NULL:
                following = entry.bucket_next
                if unused(entry):
                    remove(entry, after)
                entry = following


cdef void read_stats(Table *table, unsigned long long *counters) noexcept nogil:
    """held, waiting, acquisitions, contended, timeouts, deadlocks: at one instant."""
    cdef size_t i
    cdef Shard *shard
    memset(counters, 0, 6 * sizeof(unsigned long long))
    counters[1] = table.waiting
    touch_all(table)
    for i in range(table.shard_mask + 1):
        shard = shard_at(table, i)
        counters[0] += shard.held
        counters[2] += shard.acquisitions
        counters[3] += shard.contended
        counters[4] += shard.timeouts
        counters[5] += shard.deadlocks


cdef Outcome peek(Table *table, Lookup *lookup, Token *token, Peek *seen) noexcept nogil:
    """Copy out what ``lookup``'s key looks like now (one section: a consistent view)."""
    cdef Entry *entry = find(table, lookup)
    if lookup.candidate is not NULL:
        return COMPARE
    look_at(entry, token, seen)
    return DONE


cdef Outcome fast_peek(Shard *shard, Lookup *lookup, Token *token, Peek *seen) noexcept nogil:
    """``peek`` as a fast path (one shard's state is all it reads)."""
    cdef bint unsure = False
    cdef Entry *entry = find_in(shard, lookup, &unsure)
    if unsure:
        return SECTION
    look_at(entry, token, seen)
    return DONE


cdef void look_at(Entry *entry, Token *token, Peek *seen) noexcept nogil:
    cdef Hold *hold
    memset(seen, 0, sizeof(Peek))
    if entry is NULL:
        return
    seen.found = True
    if entry.owner is not NULL:
        seen.owner = entry.owner.ident
        seen.task = entry.owner.is_task
        seen.count = entry.count
        seen.mine = entry.owner == token
    seen.readers = entry.nreaders
    seen.slots = entry.slots
    seen.limit = entry.limit
    if token is not NULL:
        hold = read_hold(entry, token)
        if hold is not NULL:
            seen.my_reads = hold.count


cdef Py_ssize_t held_count(Table *table) noexcept nogil:
    cdef Py_ssize_t held = 0
    cdef size_t i
    touch_all(table)
    for i in range(table.shard_mask + 1):
        held += shard_at(table, i).held
    return held


cdef Py_ssize_t entry_count(Table *table) noexcept nogil:
    cdef Py_ssize_t entries = 0
    cdef size_t i
    touch_all(table)
    for i in range(table.shard_mask + 1):
        entries += shard_at(table, i).entries
    return entries


# -- seeing contention (lockmgr._observe) --------------------------------------------------

cdef struct Party:
    # A holder or a waiter as a section copies it out.
    unsigned long ident          # its token's ident (a task's: id(task))
    bint is_task
    Mode mode
    Py_ssize_t count             # a holder's level
    double since                 # a holder's held_since, or a waiter's queueing time


cdef struct KeyCopy:
    PyObject *key                # strong reference, taken by the section
    Py_ssize_t holders           # its first ``holders`` parties hold it, the next ``waiters``
    Py_ssize_t waiters           # wait for it, oldest first
    Py_ssize_t ahead             # a described request: how many wait before it


cdef struct Copy:
    # What a section copies out of a table; the memory is the caller's.
    KeyCopy *keys
    Py_ssize_t nkeys             # copied, or (``fits`` false) needed
    Py_ssize_t key_room
    Party *parties
    Py_ssize_t nparties          # copied, or (``fits`` false) needed
    Py_ssize_t party_room
    bint fits
    double now                   # the section's clock


cdef inline bint in_use(Entry *entry) noexcept nogil:
    return entry.owner is not NULL or entry.nreaders != 0 or entry.head is not NULL


cdef Py_ssize_t parties_of(Entry *entry) noexcept nogil:
    cdef Py_ssize_t count = entry.nreaders + (entry.owner is not NULL)
    cdef Request *request = entry.head
    while request is not NULL:
        count += 1
        request = request.next
    return count


cdef void add_party(Copy *copy, Token *token, Mode mode, Py_ssize_t count,
                    double since) noexcept nogil:
    cdef Party *party = copy.parties + copy.nparties
    party.ident = token.ident
    party.is_task = token.is_task
    party.mode = mode
    party.count = count
    party.since = since
    copy.nparties += 1


cdef void copy_entry(Copy *copy, Entry *entry, Request *described) noexcept nogil:
    """The writer, the readers oldest first, then the queue (room was checked)."""
    cdef KeyCopy *key = copy.keys + copy.nkeys
    cdef Hold *hold = entry.readers
    cdef Request *request = entry.head
    cdef Py_ssize_t first = copy.nparties
    lockmgr_incref(entry.key)
    key.key = entry.key
    key.ahead = -1
    if entry.owner is not NULL:
        add_party(copy, entry.owner, WRITE, entry.count, entry.held_since)
    while hold is not NULL and hold.entry_next is not NULL:
        hold = hold.entry_next
    while hold is not NULL:
        add_party(copy, hold.token, READ, hold.count, hold.held_since)
        hold = hold.entry_prev
    key.holders = copy.nparties - first
    while request is not NULL:
        if request == described:
            key.ahead = copy.nparties - first - key.holders
        add_party(copy, request.token, request.mode,
                  0, request.since if request.lead is NULL else request.lead.since)
        request = request.next
    key.waiters = copy.nparties - first - key.holders
    if key.ahead < 0:
        key.ahead = key.waiters
    copy.nkeys += 1


cdef bint has_room(Copy *copy, Py_ssize_t keys, Py_ssize_t parties) noexcept nogil:
    """Whether ``keys`` and ``parties`` fit; if not, the Copy says what is needed."""
    copy.fits = keys <= copy.key_room and parties <= copy.party_room
    if not copy.fits:
        copy.nkeys = keys
        copy.nparties = parties
    return copy.fits


cdef void copy_table(Table *table, Copy *copy) noexcept nogil:
    """Every entry held or waited on (``snapshot()``)."""
    cdef Py_ssize_t keys = 0, parties = 0
    cdef size_t i, b
    cdef Shard *shard
    cdef Entry *entry
    touch_all(table)
    copy.now = lockmgr_monotonic()
    for i in range(table.shard_mask + 1):
        shard = shard_at(table, i)
        for b in range(shard.mask + 1):
            entry = shard.buckets[b]
            while entry is not NULL:
                if in_use(entry):
                    keys += 1
                    parties += parties_of(entry)
                entry = entry.bucket_next
    if not has_room(copy, keys, parties):
        return
    for i in range(table.shard_mask + 1):
        shard = shard_at(table, i)
        for b in range(shard.mask + 1):
            entry = shard.buckets[b]
            while entry is not NULL:
                if in_use(entry):
                    copy_entry(copy, entry, NULL)
                entry = entry.bucket_next


cdef void copy_request(Copy *copy, Request *request) noexcept nogil:
    """The entries a waiting request queued on (the slow-wait log)."""
    cdef Py_ssize_t keys = 0, parties = 0, i
    copy.now = lockmgr_monotonic()
    for i in range(request.nodes):
        if request[i].queued:
            keys += 1
            parties += parties_of(touched(request[i].entry))
    if not has_room(copy, keys, parties):
        return
    for i in range(request.nodes):
        if request[i].queued:
            copy_entry(copy, request[i].entry, request + i)


cdef void copy_metrics(Table *table, unsigned long long *counters, Histogram *waits,
                       Histogram *holds, HotSlot *hot) noexcept nogil:
    """``metrics()``: the counters, both histograms and the hot-key slots (their keys with a
    strong reference each), at one instant."""
    cdef Py_ssize_t i
    read_stats(table, counters)
    waits[0] = table.waits
    holds[0] = table.holds
    for i in range(HOT_KEY_SLOTS):
        hot[i] = table.hot[i]
        if hot[i].key is not NULL:
            lockmgr_incref(hot[i].key)
