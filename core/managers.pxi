# lockmgr._core: the public managers and their per-key views.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

# -- the managers -------------------------------------------------------------------------

@cython.final
cdef class LockManager(_Engine):
    """Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

    Memory grows only with the keys currently held or waited on.
    """

    def __cinit__(self, *, fair=True, stripes=None, log_waits_after=None):
        self.table.fair = bool(fair)
        self.table.log_after = log_waits_after_seconds(log_waits_after)
        self._use_stripes(stripes)

    @property
    def fair(self):
        """True for strict FIFO hand-off, False for eventual fairness."""
        return self.table.fair

    @property
    def aio(self):
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncLockManager(self)

    def acquire(self, key, blocking=True, timeout=FOREVER):
        """Lock ``key`` for the calling thread, like ``threading.RLock.acquire``.

        Returns True once held (reentrant: a holder always succeeds at once), False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first.
        """
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._acquire_write(lock_key, h, seconds, 1)

    def release(self, key):
        """Undo one ``acquire`` of ``key``; raises NotOwnedError if the caller does not hold it."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._release_write(lock_key, h, False)

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
        return (task_of(seen.owner) if seen.task else seen.owner), seen.count

    def _release_save(self, key):
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._release_fully(lock_key, h)

    def _acquire_restore(self, key, state):
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._acquire_write(lock_key, h, -1.0, restored_count(state))

    cdef KeyLock _view(self, key):
        cdef KeyLock view = KeyLock.__new__(KeyLock)
        cdef Py_hash_t h = lockmgr_hash(key)
        view.key = key
        view.lock_key = self._lock_key(key, &h)  # borrowed: see KeyLock.lock_key
        view.hash = h
        view.manager = self
        view.seconds = -1.0
        return view

    cdef tuple _release_fully(self, PyObject *key, Py_hash_t h):
        cdef Py_ssize_t levels = self._release_write(key, h, True)
        return levels, existing_token().ident


@cython.final
cdef class RWLockManager(_Engine):
    """Per-key reader/writer locks: many readers or one writer, reentrant, FIFO without
    writer starvation, upgrades and downgrades within a thread."""

    @property
    def aio(self):
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncRWLockManager(self)

    def __cinit__(self, *, stripes=None, log_waits_after=None):
        self.table.log_after = log_waits_after_seconds(log_waits_after)
        self._use_stripes(stripes)

    def acquire_read(self, key, blocking=True, timeout=FOREVER):
        """Take ``key`` for reading; the same arguments and result as ``LockManager.acquire``."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._acquire_read(lock_key, h, seconds)

    def acquire_write(self, key, blocking=True, timeout=FOREVER):
        """Take ``key`` for writing (an upgrade if the caller reads it)."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._acquire_write(lock_key, h, seconds, 1)

    def release_read(self, key):
        """Undo one ``acquire_read``; NotOwnedError if the caller does not read ``key``."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._release_read(lock_key, h)

    def release_write(self, key):
        """Undo one ``acquire_write``; NotOwnedError if the caller does not write ``key``."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._release_write(lock_key, h, False)

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
        cdef Py_hash_t h = lockmgr_hash(key)
        holding.seconds = hold_seconds(timeout)
        holding.key = key
        holding.lock_key = self._lock_key(key, &h)  # borrowed: see _Holding.lock_key
        holding.hash = h
        holding.manager = self
        holding.mode = mode
        return holding


@cython.final
@cython.freelist(16)
cdef class _Holding:
    """What ``RWLockManager.read()`` and ``write()`` return: holds the key for a block."""
    cdef RWLockManager manager  # whose key
    cdef object key             # the key as given
    cdef PyObject *lock_key     # the key the table uses, borrowed: ``key`` itself, or its
                                # stripe, which ``manager`` keeps (no shared reference count
                                # is written for it); what errors name
    cdef Py_hash_t hash         # hash(lock_key)
    cdef double seconds         # how long ``with`` waits: -1 forever
    cdef Mode mode              # READ or WRITE

    def __enter__(self):
        if self.mode == READ:
            acquired = self.manager._acquire_read(self.lock_key, self.hash, self.seconds)
        else:
            acquired = self.manager._acquire_write(self.lock_key, self.hash, self.seconds, 1)
        if not acquired:
            raise timed_out(<object>self.lock_key, self.seconds)
        return True

    def __exit__(self, exc_type, exc, traceback):
        if self.mode == READ:
            self.manager._release_read(self.lock_key, self.hash)
        else:
            self.manager._release_write(self.lock_key, self.hash, False)


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
    cdef PyObject *lock_key            # the key the table uses, borrowed: ``key`` itself, or
                                       # its stripe, which ``manager`` keeps (no shared
                                       # reference count is written for it)
    cdef Py_hash_t hash                # hash(lock_key), computed when the view was made
    cdef double seconds                # how long ``with`` waits: -1 forever (hold() sets it)
    cdef object __weakref__

    def __init__(self, LockManager manager not None, key):
        cdef Py_hash_t h = lockmgr_hash(key)
        # ``lock_key`` first: replacing ``key`` or ``manager`` may free the old ones (and run
        # a ``__del__``), while the new ones are kept alive by this call's arguments.
        self.lock_key = manager._lock_key(key, &h)
        self.hash = h
        self.key = key
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


cdef class _Blocks:
    """lockmgr._common.BlocksInside in C, for the compiled core's ``async with`` objects:
    which task runs each block of one object, by the frame running it. Most objects have
    one block at a time, which needs no dict. As there, each _TaskOwner lists the objects
    holding its frames (``blocks``, a slot per frame, which goes with the frame's last
    entry, whoever's exit that is), and the ending of a task (done, or stranded on a closed
    loop) moves its entries to ``ended``, which keeps no frame.

    A frame's entry is changed by the code running that frame, but a stranded task's frame
    is closed by whoever collects it, in any thread, and a task's ending may run in another
    thread than its loop's: free-threaded, the record is changed in a critical section of
    this object (nothing on a GIL build). A _TaskOwner's list is changed in a critical
    section of that owner; the two are never nested. Frames the record lets go are dropped
    after the section (their finalizers run Python code)."""
    cdef object frame              # the frame running a block (None: none is)
    cdef _TaskOwner owner          # the owner of the task that block runs for
    cdef Py_ssize_t depth          # how many blocks of the object that frame is inside
    cdef dict others               # the other frames inside at once: frame -> [the
                                   # task's _TaskOwner, depth] (None until needed)
    cdef dict ended                # blocks of tasks lockmgr has ended, by their frame's
                                   # id, for frames a generator or coroutine still owns:
                                   # id(frame) -> [weak reference to the task, depth, weak
                                   # reference to that owner, its id] (None until needed);
                                   # an entry goes when its block exits, or once its id
                                   # names another frame (counted in, or exiting)

    cdef int count_in(self, frame, _TaskOwner owner) except -1:
        """A block running in ``frame`` for ``owner``'s task holds what it asked for."""
        cdef bint new_entry = False
        with cython.critical_section(self):
            if self.frame is frame:
                self.depth += 1
            elif self.frame is None and not (self.others and frame in self.others):
                self.frame = frame
                self.owner = owner
                self.depth = 1
                new_entry = True
            else:
                if self.others is None:
                    self.others = {}
                entry = self.others.get(frame)
                if entry is None:
                    self.others[frame] = [owner, 1]
                    new_entry = True
                else:
                    entry[1] += 1
            if new_entry and self.ended:
                self.ended.pop(id(frame), None)  # that frame is gone: its id is reused
        if new_entry:
            owner.remember_block(self)
        return 0

    cdef object leave_block(self, frame, _TaskOwner current):
        """A weak reference to the task whose block in ``frame`` exits (its _TaskOwner's
        ``task_ref``); NOT_ENTERED if none was counted in there: entered in another frame,
        whose entry, one of the running task's (``current``: its owner, None if it has
        none), goes instead (see BlocksInside)."""
        entered = NOT_ENTERED
        let_go = None  # a frame whose last entry went, dropped after the section
        cdef _TaskOwner emptied = None  # whose frame's last entry went: its slot goes
        with cython.critical_section(self):
            if frame is not None and self.frame is frame:
                entered = self.owner.task_ref
                emptied = self.count_down_first()
            elif self.others and frame in self.others:
                entered = (<_TaskOwner>self.others[frame][0]).task_ref
                emptied = self.count_down_other(frame)
            elif self.ended and self.is_ended_frame(frame):
                entered = self.count_down_ended(id(frame))
            elif current is not None and self.owner is current:
                let_go = self.frame
                emptied = self.count_down_first()
            elif current is not None and self.others:
                for other, entry in list(self.others.items()):
                    if entry[0] is current:
                        let_go = other
                        emptied = self.count_down_other(other)
                        break
        if emptied is not None:
            emptied.forget_block(self)
        return entered

    cdef _TaskOwner count_down_first(self):
        """One block of the first frame exits: its owner if it was its last, else None."""
        owner = self.owner
        self.depth -= 1
        if self.depth == 0:
            self.frame = self.owner = None
            return owner
        return None

    cdef _TaskOwner count_down_other(self, frame):
        entry = self.others[frame]
        entry[1] -= 1
        if entry[1] == 0:
            del self.others[frame]
            return <_TaskOwner>entry[0]
        return None

    cdef bint is_ended_frame(self, frame) except -1:
        """Whether ``frame`` is the frame of an entry in ``ended``. Only its id was kept, and
        a frame that died may leave it to another (an ``AsyncExitStack``'s exit, a wrapper's
        ``__aexit__``, the same helper called again): its owner tells, for a generator
        owns one frame. An owner being finalized (which closes it, running the block's
        exit) has had its weak references cleared: its id tells then. Another frame's
        entry goes. (The running frame's owner is running it: no reference dropped here is
        its last.)"""
        if frame is None:
            return False
        entry = self.ended.get(id(frame))
        if entry is None:
            return False
        owner = frame_owner(frame)
        kept = entry[2]()
        if owner is None or not (kept is owner or (kept is None and id(owner) == entry[3])):
            del self.ended[id(frame)]
            return False
        return True

    cdef object count_down_ended(self, Py_ssize_t frame_id):
        entry = self.ended[frame_id]
        entry[1] -= 1
        if entry[1] == 0:
            del self.ended[frame_id]
        return entry[0]

    cdef list forget_task(self, _TaskOwner owner):
        """Move the entries of ``owner``'s task, which lockmgr has ended, to ``ended``, but
        for frames no generator owns any more (returned or raised: a helper's that entered
        for its caller), which can run no exit; answers their frames and owners, to drop
        after the section."""
        frames = []  # and the frames' owners: their last reference may go with these
        with cython.critical_section(self):
            if self.frame is not None and self.owner is owner:
                frames.append(self.frame)
                self.set_ended(self.frame, owner.task_ref, self.depth, frames)
                self.frame = self.owner = None
                self.depth = 0
            if self.others:
                for other, entry in list(self.others.items()):
                    if entry[0] is owner and self.others.get(other) is entry:
                        del self.others[other]
                        frames.append(other)
                        self.set_ended(other, owner.task_ref, entry[1], frames)
        return frames

    cdef int set_ended(self, frame, task_ref, Py_ssize_t depth, list keep) except -1:
        """``keep``: where the frame's owner goes, to be dropped after the section (a frame
        does not keep its owner alive: another thread may drop it meanwhile)."""
        owner = frame_owner(frame)
        if owner is None:
            return 0
        keep.append(owner)
        if self.ended is None:
            self.ended = {}
        self.ended[id(frame)] = [task_ref, depth, PyWeakref_NewRef(owner, None), id(owner)]
        return 0


@cython.final
@cython.freelist(16)
cdef class AsyncKeyLock(_Blocks):
    """``locks.aio[key]``: one key of the table as an asyncio lock owned by the current task
    (reentrant; ``async with`` acquires and releases it). The pure twin's is
    ``lockmgr._aio.AsyncKeyLock``; this one takes the key in ``__aenter__`` without a
    Python frame.

    One view may serve many tasks: its exit releases for the task whose block it is, told
    by the frame running the block (its ``_Blocks`` record: the base class, so that a view
    needs no second object)."""
    cdef readonly object key       # the key
    cdef readonly _Engine _manager # the manager whose table it is
    cdef PyObject *lock_key        # the key the table uses, borrowed: ``key`` itself, or its
                                   # stripe, which ``_manager`` keeps
    cdef Py_hash_t hash            # hash(lock_key), computed when the view was made

    def __cinit__(self, _Engine manager not None, key):
        cdef Py_hash_t h = lockmgr_hash(key)
        self.lock_key = manager._lock_key(key, &h)
        self.hash = h
        self.key = key
        self._manager = manager

    __class_getitem__ = classmethod(GenericAlias)

    async def acquire(self, blocking=True, timeout=-1):
        """As ``AsyncLockManager.acquire`` for this view's key."""
        return await aio_take(self._manager, self._manager._task_enter, self.key, WRITE,
                              wait_seconds(blocking, timeout), False)

    def release(self):
        self._manager._task_release_at(task_token(False), self.lock_key, self.hash, WRITE)

    def locked(self):
        """Whether any thread or task holds the key."""
        return bool(self._manager.locked(self.key))

    def __aenter__(self):
        cdef _TaskOwner owner
        try:
            owner = task_owner(True)
            got = self._manager._task_take(owner, self.lock_key, self.hash, WRITE, False, 1)
            count_block_in(got, owner, self, running_frame())
            return self._manager._task_awaitable(got, self.key, -1.0, False)
        except BaseException:
            self._manager._task_abandon()  # it may have queued before what raised
            raise

    def __aexit__(self, exc_type, exc, traceback):
        cdef Token *token
        if exit_releases(self, running_frame(), exc_type, self.key, &token):
            self._manager._task_release_at(token, self.lock_key, self.hash, WRITE)
        return READY_NONE

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)

    def __repr__(self):
        return f"<lockmgr.AsyncKeyLock key={self.key!r} locked={self.locked()}>"


# -- the references a table holds in C, shown to the garbage collector ---------------------
# A hot-key slot keeps its key alive for the manager's life; a key that refers back to its
# manager would make a cycle the collector cannot see through Cython's own tp_traverse (it
# knows the object fields only). So every manager type's traverse also visits the slots,
# and its clear empties them first. Nothing runs a section meanwhile: the collector holds
# the GIL (or, free-threaded, has stopped the world), and sections never allocate.

cdef traverseproc cython_traverse = (<GCSlots*>_Engine).tp_traverse
cdef inquiry cython_clear = (<GCSlots*>_Engine).tp_clear
cdef Py_ssize_t table_offset = 0  # where a manager object keeps its Table


cdef inline Table* table_of(PyObject *manager) noexcept:
    return <Table*>(<char*>manager + table_offset)


cdef int traverse_manager(PyObject *manager, visitproc visit, void *arg) noexcept:
    cdef Table *table = table_of(manager)
    cdef Py_ssize_t i
    cdef int failed = cython_traverse(manager, visit, arg)
    for i in range(HOT_KEY_SLOTS):
        if failed:
            return failed
        if table.hot[i].key is not NULL:
            failed = visit(table.hot[i].key, arg)
    return failed


cdef int clear_manager(PyObject *manager) noexcept:
    cdef Table *table = table_of(manager)
    cdef PyObject *keys[HOT_KEY_SLOTS]
    cdef Py_ssize_t i
    lock()
    for i in range(HOT_KEY_SLOTS):
        keys[i] = table.hot[i].key
        table.hot[i].key = NULL
        table.hot[i].waited = table.hot[i].error = 0.0
    unlock()
    for i in range(HOT_KEY_SLOTS):  # after the mutex: a key's __del__ may use a manager
        Py_XDECREF(keys[i])
    return cython_clear(manager)


cdef int show_tables_to_the_collector() except -1:
    global table_offset
    cdef LockManager probe = LockManager()
    table_offset = <char*>&probe.table - <char*><PyObject*>probe
    for kind in (_Engine, LockManager, RWLockManager):
        if (<GCSlots*>kind).tp_traverse != cython_traverse or (<GCSlots*>kind).tp_clear != cython_clear:
            raise ImportError(f"lockmgr._core: {kind.__name__} does not use the engine's "
                              "garbage-collector slots")
        (<GCSlots*>kind).tp_traverse = traverse_manager
        (<GCSlots*>kind).tp_clear = clear_manager
    return 0


show_tables_to_the_collector()
