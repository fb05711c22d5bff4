# lockmgr._core: the public managers and their per-key views.
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

# -- the managers -------------------------------------------------------------------------

@cython.final
cdef class LockManager(_Engine):
    """LockManager(*, fair=True, stripes=None, log_waits_after=None)
--

    Exclusive, reentrant, FIFO-fair locks on any hashable key, in one table.

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

    def acquire(self, key, blocking=True, timeout=-1):
        """Lock ``key`` for the calling thread, like ``threading.RLock.acquire``.

        Returns True once held (reentrant: a holder always succeeds at once), False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first.

        Raises, with nothing taken: TypeError/ValueError for bad ``blocking``/``timeout``
        (as ``threading.Lock.acquire``; OverflowError past ``threading.TIMEOUT_MAX``),
        TypeError for an unhashable key, DeadlockError if waiting would close a cycle of
        threads and tasks, NestedWaitError if the thread would wait while already waiting
        for a key (a signal handler or finalizer running inside that wait), OverflowError
        past ``sys.maxsize`` levels.
        """
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._acquire_write(lock_key, h, seconds, 1)

    def release(self, key):
        """Undo one ``acquire`` of ``key``. Raises NotOwnedError if the calling thread does
        not hold it, TypeError for an unhashable key."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._release_write(lock_key, h, False)

    def hold(self, key, timeout=None):
        """A context manager holding ``key`` for its block.

        ``timeout``: None or -1 waits forever, 0 tries once. Raises TypeError/ValueError for a
        bad ``timeout``, TypeError for an unhashable key; entering raises LockTimeout if not
        acquired in time and what ``acquire`` raises; leaving, what ``release`` raises.
        """
        cdef double seconds = hold_seconds(timeout)
        cdef KeyLock view = self._view(key)
        view.seconds = seconds
        return view

    def __getitem__(self, key):
        """The per-key lock view: behaves like a ``threading.RLock`` for this one key."""
        return self._view(key)

    def synchronized(self, key_func):
        """Decorator: the call holds the key ``key_func(*args, **kwargs)`` while it runs.

        Write it with its key function: ``@locks.synchronized(lambda user_id: user_id)``.
        Written bare (``@locks.synchronized``), it raises TypeError saying so: at once over
        a coroutine function, else when the function is called. A ``key_func`` that is not
        callable, and decorating a coroutine function, raise TypeError; each call raises
        what ``hold`` raises around the function's own errors.

        The decorated function keeps its signature for type checkers.
        """
        return synchronized(self, key_func)

    def acquire_many(self, keys, blocking=True, timeout=-1):
        """Lock every key of ``keys`` at once, or none: True, or False on timeout.

        Duplicates count once; keys the caller holds are re-entered. The request queues
        FIFO on every key it needs and keeps its place there, so it cannot starve, and it
        never deadlocks against other multi-key calls, whatever the order of the keys.
        Raises what ``acquire`` raises, nothing taken, and TypeError if ``keys`` is a str
        or bytes.
        """
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(many_items(keys, self._table_key), seconds)

    def release_many(self, keys):
        """Undo one ``acquire_many(keys)``. Raises, nothing released: NotOwnedError if one is
        not held, TypeError if ``keys`` is a str or bytes, an iterator already consumed, or
        holds an unhashable key."""
        self._release_many(many_items(keys, self._table_key, True))

    def hold_many(self, keys, timeout=None):
        """A context manager holding every key of ``keys`` for its block. Raises TypeError for
        bad ``keys`` (as ``acquire_many``) and TypeError/ValueError for a bad ``timeout``;
        entering raises LockTimeout if not acquired in time and what ``acquire_many``
        raises; leaving, what ``release_many`` raises."""
        return _HoldingMany(self, many_items(keys, self._table_key), hold_seconds(timeout))

    def locked(self, key):
        """Whether any thread or task holds ``key``. Raises TypeError for an unhashable key."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.owner != 0

    def owned(self, key):
        """Whether the calling thread holds ``key``. Raises TypeError for an unhashable key."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.mine

    def owner(self, key):
        """The ``threading.get_ident()`` of the thread holding ``key`` (the task, for a task),
        or None. Raises TypeError for an unhashable key."""
        return self._owner_and_count(key)[0]

    def recursion_count(self, key):
        """How many times the calling thread holds ``key`` (0 if it does not). Raises
        TypeError for an unhashable key."""
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
    """RWLockManager(*, stripes=None, log_waits_after=None)
--

    Per-key reader/writer locks: many readers or one writer, reentrant, FIFO without
    writer starvation, upgrades and downgrades within a thread."""

    @property
    def aio(self):
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncRWLockManager(self)

    def __cinit__(self, *, stripes=None, log_waits_after=None):
        self.table.log_after = log_waits_after_seconds(log_waits_after)
        self._use_stripes(stripes)

    def acquire_read(self, key, blocking=True, timeout=-1):
        """Take ``key`` for reading; the same arguments, result and errors as
        ``LockManager.acquire``: raises what it raises."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._acquire_read(lock_key, h, seconds)

    def acquire_write(self, key, blocking=True, timeout=-1):
        """Take ``key`` for writing (an upgrade if the caller reads it); as
        ``LockManager.acquire``: raises what it raises (DeadlockError for the second of two
        readers upgrading at once)."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        return self._acquire_write(lock_key, h, seconds, 1)

    def release_read(self, key):
        """Undo one ``acquire_read``. Raises NotOwnedError if the calling thread does not read
        ``key``, TypeError for an unhashable key."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._release_read(lock_key, h)

    def release_write(self, key):
        """Undo one ``acquire_write``. Raises NotOwnedError if the calling thread does not
        write ``key``, TypeError for an unhashable key."""
        cdef Py_hash_t h = lockmgr_hash(key)
        cdef PyObject *lock_key = self._lock_key(key, &h)
        self._release_write(lock_key, h, False)

    def read(self, key, timeout=None):
        """A context manager reading ``key`` for its block; raises what ``LockManager.hold``
        raises."""
        return self._holding(key, timeout, READ)

    def write(self, key, timeout=None):
        """A context manager writing ``key`` for its block; raises what ``LockManager.hold``
        raises."""
        return self._holding(key, timeout, WRITE)

    def acquire_many(self, reads=(), writes=(), blocking=True, timeout=-1):
        """Read every key of ``reads`` and write every key of ``writes`` at once, or none
        (a key in both is written); see ``LockManager.acquire_many``, whose errors it raises
        (TypeError if ``reads`` or ``writes`` is a str or bytes)."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(rw_items(reads, writes, self._table_key), seconds)

    def release_many(self, reads=(), writes=()):
        """Undo one ``acquire_many`` with the same arguments; raises what
        ``LockManager.release_many`` raises."""
        self._release_many(rw_items(reads, writes, self._table_key, True))

    def hold_many(self, reads=(), writes=(), timeout=None):
        """A context manager holding ``reads`` and ``writes`` for its block; raises what
        ``LockManager.hold_many`` raises."""
        return _HoldingMany(self, rw_items(reads, writes, self._table_key), hold_seconds(timeout))

    def readers(self, key):
        """How many threads and tasks hold ``key`` for reading. Raises TypeError for an
        unhashable key."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.readers

    def write_locked(self, key):
        """Whether a thread or task holds ``key`` for writing. Raises TypeError for an
        unhashable key."""
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
        return make_holding(self, key, timeout, mode)


@cython.final
cdef class SemaphoreManager(_Engine):
    """SemaphoreManager(limit, *, fair=True, log_waits_after=None)
--

    At most ``limit`` slots per key held at once (by threads or tasks), FIFO, in one table.

    Each ``acquire`` takes one more slot, also by an owner holding slots of the key (no
    re-entry); each ``release`` gives back one of the caller's. A wait only the caller's
    own release could end (every slot of the key is its own) is a DeadlockError. A limit
    of 1 is ``LockManager``'s exclusive lock; above it, each owner has a read hold of the
    key counting its slots, admitted while fewer than ``limit`` slots are taken and nobody
    is queued ahead (``fair=False``: past a queue too).
    Memory grows only with the keys currently held or waited on.
    """
    cdef Mode mode  # how a holder holds a key: WRITE (a limit of 1) or READ

    def __cinit__(self, limit, *, fair=True, log_waits_after=None):
        cdef Py_ssize_t checked = 0 if callable(limit) else slot_limit(limit)
        self.table.fair = bool(fair)
        self.table.log_after = log_waits_after_seconds(log_waits_after)
        self.mode = WRITE if checked == 1 else READ
        self.table.slot_limit = 0 if checked == 1 else checked
        self.table.counts_slots = True
        self.limit_of = None if checked else limit

    @property
    def _slot_mode(self):
        """How a slot is held: WRITE (a limit of 1: the exclusive lock) or READ."""
        return <int>self.mode

    @property
    def limit(self):
        """Holders admitted per key at once, or the ``limit(key)`` that says so for each key
        (called at each acquisition: its answer for a key that enters the table is that
        key's limit while it is in use)."""
        return self.limit_of or self.table.slot_limit or 1

    @property
    def fair(self):
        """True: no waiter is overtaken; False: a free slot goes to whoever asks first."""
        return self.table.fair

    @property
    def aio(self):
        """This manager's table for asyncio tasks: the current task owns what it acquires."""
        return AsyncSemaphoreManager(self)

    def acquire(self, key, blocking=True, timeout=-1):
        """Take one more slot of ``key`` for the calling thread: True once held, False if
        ``blocking`` is false or ``timeout`` (seconds, -1 = forever) ran out first. Raises
        what ``LockManager.acquire`` raises, and DeadlockError (without waiting) if every
        slot of ``key`` is the caller's own, nothing taken."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        cdef Py_hash_t h = lockmgr_hash(key)
        if self.mode == WRITE:
            return self._acquire_write(<PyObject*>key, h, seconds, 1)
        return self._acquire_read(<PyObject*>key, h, seconds)

    def release(self, key):
        """Undo one ``acquire`` of ``key``. Raises NotOwnedError if the calling thread holds
        no slot of it, TypeError for an unhashable key."""
        cdef Py_hash_t h = lockmgr_hash(key)
        if self.mode == WRITE:
            self._release_write(<PyObject*>key, h, False)
        else:
            self._release_read(<PyObject*>key, h)

    def hold(self, key, timeout=None):
        """A context manager holding a slot of ``key`` for its block; raises what
        ``LockManager.hold`` raises."""
        return make_holding(self, key, timeout, self.mode)

    def __getitem__(self, key):
        """The per-key view: ``acquire``/``release`` and ``with`` for this one key."""
        lockmgr_hash(key)
        return KeySemaphore(self, key)

    def synchronized(self, key_func):
        """Decorator: the call holds a slot of ``key_func(*args, **kwargs)`` while it runs;
        raises what ``LockManager.synchronized`` raises."""
        return synchronized(self, key_func)

    def _items(self, keys, releasing=False):
        if self.mode == WRITE:
            return many_items(keys, self._table_key, releasing)
        return rw_items(keys, (), self._table_key, releasing)

    def acquire_many(self, keys, blocking=True, timeout=-1):
        """A slot of every key of ``keys`` at once, or none: True, or False on timeout; raises
        what ``LockManager.acquire_many`` raises, nothing taken."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self._acquire_many(self._items(keys), seconds)

    def release_many(self, keys):
        """Undo one ``acquire_many(keys)``; raises what ``LockManager.release_many`` raises,
        nothing released."""
        self._release_many(self._items(keys, True))

    def hold_many(self, keys, timeout=None):
        """A context manager holding a slot of every key of ``keys`` for its block; raises
        what ``LockManager.hold_many`` raises."""
        return _HoldingMany(self, self._items(keys), hold_seconds(timeout))

    def holders(self, key):
        """How many slots of ``key`` are held (an owner holding two counts twice). Raises
        TypeError for an unhashable key."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.slots + (seen.owner != 0)  # a limit of 1's holder has its one slot

    def available(self, key):
        """How many slots of ``key`` are free now (``limit - holders(key)``; waiters queued
        ahead aside). Raises
        TypeError for an unhashable key, and what ``limit(key)`` raises for a key not in
        the table."""
        cdef Peek seen
        cdef Lookup lookup
        if self.mode == WRITE:
            return 1 - self.holders(key)
        self._peek(key, &seen)
        if not seen.limit:
            lookup_init(&lookup, <PyObject*>key, 0)
            self._limit_lookup(&lookup)
            seen.limit = lookup.limit or self.table.slot_limit
        return seen.limit - seen.slots

    def owned(self, key):
        """Whether the calling thread holds a slot of ``key``. Raises TypeError for an
        unhashable key."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.mine or seen.my_reads > 0

    def __contains__(self, key):
        """Whether ``key`` has any holder."""
        cdef Peek seen
        self._peek(key, &seen)
        return seen.owner != 0 or seen.readers > 0

    def __repr__(self):
        stats = self.stats()
        return semaphore_repr(self, self.limit, self.table.fair, stats.held, stats.waiting)


cdef _Holding make_holding(_Engine manager, key, timeout, Mode mode):
    cdef _Holding holding = _Holding.__new__(_Holding)
    cdef Py_hash_t h = lockmgr_hash(key)
    holding.seconds = hold_seconds(timeout)
    holding.key = key
    holding.lock_key = manager._lock_key(key, &h)  # borrowed: see _Holding.lock_key
    holding.hash = h
    holding.manager = manager
    holding.mode = mode
    return holding


@cython.final
@cython.freelist(16)
cdef class _Holding:
    """What ``RWLockManager.read()`` and ``write()`` and ``SemaphoreManager.hold()`` return:
    holds the key for a block."""
    cdef _Engine manager        # whose key
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
    """KeyLock(manager, key)
--

    One key of a manager seen as a ``threading.RLock``.

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

    def acquire(self, blocking=True, timeout=-1):
        """``manager.acquire(key, ...)``: raises what it raises."""
        cdef double seconds = -1.0
        if blocking is not True or timeout is not FOREVER:
            seconds = wait_seconds(blocking, timeout)
        return self.manager._acquire_write(self.lock_key, self.hash, seconds, 1)

    def release(self):
        """``manager.release(key)``: raises what it raises."""
        self.manager._release_write(self.lock_key, self.hash, False)

    def locked(self):
        """``manager.locked(key)``: whether any thread or task holds the key. Raises nothing."""
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


cdef class _BlockRecord:
    """Which task is inside an ``async with`` object's block, and how many times: written
    when ``__aenter__`` has acquired (at once, or when its wait is granted) and read back
    by ``__aexit__``, which gives back exactly that task's hold, whatever task runs it.
    One task at a time (it may nest the object): another task's entry waits for the key
    as usual and enters once the first task's blocks have exited; if it would enter
    while the object is still another task's (two readers, a task that released inside
    its block or ended inside it), it gives back what it took and raises RuntimeError.

    An exit may run in another thread than the block's (the garbage collector closing a
    coroutine): free-threaded, the record is changed in a critical section of this object
    (nothing on a GIL build). Nothing in those sections runs Python code or drops the last
    reference of anything but an owner that ``leave`` hands back."""
    cdef _TaskOwner owner     # the task inside (None: none is); written in a section
    cdef Py_ssize_t depth     # how many blocks of that task are inside; likewise

    cdef int enter(self, _TaskOwner owner) except -1:
        """``owner``'s task holds what it asked for: it is inside (RuntimeError, and
        nothing changed, if another task is)."""
        cdef _TaskOwner inside
        with cython.critical_section(self):
            inside = self.owner
            if inside is None or inside is owner:
                self.owner = owner
                self.depth += 1
        if inside is not None and inside is not owner:
            raise block_in_use(inside.task_and_loop()[0], inside.ended)
        return 0

    cdef _TaskOwner leave(self):
        """One block exits: the owner whose hold it gives back, or None if that task has
        ended (its ending released it). RuntimeError if no block is inside."""
        cdef _TaskOwner inside
        with cython.critical_section(self):
            inside = self.owner
            if inside is not None:
                self.depth -= 1
                if self.depth == 0:
                    self.owner = None
        if inside is None:
            raise not_entered()
        return None if inside.ended else inside

    @property
    def _inside(self):
        """The task inside and its depth (None, 0 if none), for tests."""
        with cython.critical_section(self):
            owner, depth = self.owner, self.depth
        return (None if owner is None else owner.task_and_loop()[0]), depth


cdef bint releases_here(_TaskOwner owner, _Engine engine, object key, int mode) except -1:
    """Whether a block's exit releases ``owner``'s hold now, in this thread: only its loop's
    thread may change a task's holds. An exit run elsewhere (a coroutine the collector
    closes in another thread) sends the release to that loop. If that loop is closed, the
    task can never run again: it is ended here instead (what it held goes, with
    AbandonedLockWarning), as a grant that finds its loop closed does."""
    cdef bint here = <Py_ssize_t>PyThread_get_thread_ident() == owner.loop_ident
    with cython.critical_section(owner):
        loop = owner.loop
    if here and loop is not None and running_loop_or_none() is loop:
        return True  # the usual exit: in a task of that loop, running (so not closed)
    try:
        if loop is None or loop.is_closed():
            raise RuntimeError("its event loop is closed")
        if here:
            return True
        loop.call_soon_threadsafe(engine._task_release_for, owner, key, mode)
    except RuntimeError:  # closed (maybe just now)
        owner._task_done(owner.task_and_loop()[0])
    return False


@cython.final
@cython.freelist(16)
cdef class AsyncKeyLock(_BlockRecord):
    """AsyncKeyLock(manager, key)
--

    ``locks.aio[key]``: one key of the table as an asyncio lock owned by the current task
    (reentrant; ``async with`` acquires and releases it). The pure twin's is
    ``lockmgr._aio.AsyncKeyLock``; this one takes the key in ``__aenter__`` without a
    Python frame. It is its own block record (the base class): see lockmgr._aio for the
    rule of an object entered by several tasks."""
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

    def acquire(self, blocking=True, timeout=-1):
        """As ``AsyncLockManager.acquire`` for this view's key: raises what it raises."""
        # A coroutine that runs no Python frame (an _Acquiring): no signal handler's
        # exception can come between the grant and the caller.
        return acquiring(self._manager, self.key, WRITE, blocking, timeout)

    def release(self):
        """As ``AsyncLockManager.release`` for this view's key: answers and raises what it
        does."""
        self._manager._task_release_at(task_token(False), self.lock_key, self.hash, WRITE)
        return READY_NONE

    def locked(self):
        """Whether any thread or task holds the key. Raises nothing."""
        return bool(self._manager.locked(self.key))

    def __aenter__(self):
        cdef _TaskOwner owner = task_owner(True)
        got = self._manager._task_take(owner, self.lock_key, self.hash, WRITE, False, 1)
        self._manager._enter_record(self, got, owner, self.lock_key, self.hash, WRITE)
        return self._manager._task_awaitable(got, self.key, -1.0, False)

    def __aexit__(self, exc_type, exc, traceback):
        cdef _TaskOwner owner = self.leave()
        if owner is not None and releases_here(owner, self._manager, self.key, WRITE):
            self._manager._task_release_at(owner.token, self.lock_key, self.hash, WRITE)
        return READY_NONE

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)

    def __repr__(self):
        return f"<lockmgr.AsyncKeyLock key={self.key!r} locked={self.locked()}>"


@cython.final
cdef class AsyncHolding(_BlockRecord):
    """``async with aio.hold(key)`` (and ``rw.aio.read``/``write``): LockTimeout if not
    acquired in time. The pure twin's is ``lockmgr._aio._AsyncHolding``; this one enters and
    exits with no Python frame, so no signal handler can interrupt it between taking the
    key and recording the block. Its own block record (the base class)."""
    cdef readonly object key       # the key
    cdef _Engine manager           # the manager whose table it is
    cdef PyObject *lock_key        # the key the table uses, borrowed (see AsyncKeyLock)
    cdef Py_hash_t hash            # hash(lock_key)
    cdef int mode                  # READ or WRITE
    cdef double seconds            # how long to wait (< 0: for ever)

    def __aenter__(self):
        cdef _TaskOwner owner = task_owner(True)
        got = self.manager._task_take(owner, self.lock_key, self.hash, self.mode,
                                      self.seconds == 0, 1)
        self.manager._enter_record(self, got, owner, self.lock_key, self.hash, self.mode)
        return self.manager._task_awaitable(got, self.key, self.seconds, True)

    def __aexit__(self, exc_type, exc, traceback):
        cdef _TaskOwner owner = self.leave()
        if owner is not None and releases_here(owner, self.manager, self.key, self.mode):
            self.manager._task_release_at(owner.token, self.lock_key, self.hash, self.mode)
        return READY_NONE

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)


cdef AsyncHolding async_holding(_Engine manager, object key, double seconds, int mode):
    cdef AsyncHolding made = AsyncHolding.__new__(AsyncHolding)
    cdef Py_hash_t h = lockmgr_hash(key)
    made.lock_key = manager._lock_key(key, &h)
    made.hash = h
    made.key = key
    made.manager = manager
    made.mode = mode
    made.seconds = seconds
    return made


@cython.final
cdef class AsyncHoldingMany(_BlockRecord):
    """``async with aio.hold_many(...)``: every key for the block, or LockTimeout; in C for
    the same reason as AsyncHolding."""
    cdef _Engine manager
    cdef list items                # [(key, READ or WRITE)], each lock once
    cdef double seconds

    def __aenter__(self):
        return self.manager._task_enter_many(self.items, self.seconds, True, self)

    def __aexit__(self, exc_type, exc, traceback):
        return self.manager._task_exit_many(self, self.items)

    def __reduce__(self):
        raise TypeError(PICKLE_ERROR)


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
