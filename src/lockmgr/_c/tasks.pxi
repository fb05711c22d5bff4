# lockmgr._core: asyncio tasks as owners and waiters (lockmgr._aio states the protocol).
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

cdef dict task_owners = {}  # running task -> its _TaskOwner, until the task is done
cdef dict owners_by_ident = {}  # id(task) -> its _TaskOwner (owner() and cycles name tasks)


# -- the current task and its loop, cheaply ---------------------------------------------------
# Every aio call needs its task. From 3.12 asyncio.current_task() is C. Before, it is Python
# code around get_running_loop(), which makes a getpid() system call each time (its fork
# check): ~0.5 us on 3.11, more than an acquisition. There asyncio keeps the running loop
# in a holder object in the thread state dict, replaced whenever a loop starts or stops in
# that thread; its C layout (the loop, and the pid that set it) is read here directly,
# with the fork check against a pid the after-fork hook keeps, so nothing is cached and no
# loop is kept alive. The layout is trusted only once one reading agreed with
# get_running_loop(); any other holder type, or a disagreement, means asyncio's own call.

cdef extern from *:
    """
    typedef struct {  /* _asynciomodule.c's PyRunningLoopHolder, 3.7 to 3.11 */
        PyObject_HEAD
        PyObject *rl_loop;
    #if defined(HAVE_GETPID) && !defined(MS_WINDOWS)
        pid_t rl_pid;
    #endif
    } lockmgr_loop_holder;
    #define lockmgr_holder_loop(h) (((lockmgr_loop_holder *)(h))->rl_loop)
    #if defined(HAVE_GETPID) && !defined(MS_WINDOWS)
    #  define lockmgr_holder_pid(h) ((long)((lockmgr_loop_holder *)(h))->rl_pid)
    #else
    #  define lockmgr_holder_pid(h) (-1L)
    #endif
    """
    PyObject *lockmgr_holder_loop(PyObject *holder)
    long lockmgr_holder_pid(PyObject *holder)

cdef object asyncio_current_task = None  # asyncio.current_task (3.12+), once bound
cdef object asyncio_running_loop = None  # asyncio.get_running_loop, once bound
cdef dict asyncio_current_tasks = None   # before 3.12: loop -> its running task (asyncio's)
cdef object holder_type = None           # before 3.12, asyncio's C running-loop holder type
cdef int holder_trust = 0                # 1: its layout agreed with asyncio; -1: it did not
cdef str RUNNING_LOOP_HOLDER = "__asyncio_running_event_loop__"


cdef bint bind_asyncio() except -1:
    """Find asyncio's functions (imported by whoever runs a loop); False if not imported."""
    global asyncio_current_task, asyncio_running_loop, asyncio_current_tasks, holder_trust
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return False
    events, tasks = sys.modules["asyncio.events"], sys.modules["asyncio.tasks"]
    c_asyncio = sys.modules.get("_asyncio")
    if sys.version_info < (3, 12):
        asyncio_current_tasks = tasks._current_tasks
        if c_asyncio is None or events.get_running_loop is not c_asyncio.get_running_loop:
            holder_trust = -1  # the Python implementation keeps no holder
    asyncio_running_loop = events.get_running_loop
    asyncio_current_task = tasks.current_task
    return True


cdef object asyncio_says_running_loop():
    try:
        return asyncio_running_loop()
    except RuntimeError:
        return None


cdef object running_loop_or_none():
    """The loop running in this thread, or None."""
    global holder_type, holder_trust
    cdef PyObject *state
    cdef PyObject *holder
    cdef PyObject *loop
    if asyncio_running_loop is None and not bind_asyncio():
        return None
    if asyncio_current_tasks is None or holder_trust < 0:
        return asyncio_says_running_loop()
    state = PyThreadState_GetDict()
    if state is NULL:
        return None
    # An exact str key: the lookup runs no Python code and cannot fail.
    holder = PyDict_GetItemWithError(<object>state, RUNNING_LOOP_HOLDER)
    if holder is NULL:
        return None
    if holder_trust == 0:
        if type(<object>holder).__name__ != "_RunningLoopHolder":
            holder_trust = -1
            return asyncio_says_running_loop()
        expected = asyncio_says_running_loop()
        if expected is None:
            return None  # nothing to compare with yet
        loop = lockmgr_holder_loop(holder)
        if loop is not <PyObject*>expected or lockmgr_holder_pid(holder) not in (-1, process_pid):
            holder_trust = -1
            return expected
        holder_type = type(<object>holder)
        holder_trust = 1
        return expected
    if type(<object>holder) is not holder_type:
        return asyncio_says_running_loop()
    loop = lockmgr_holder_loop(holder)
    if loop is NULL or loop is <PyObject*>None:
        return None
    if lockmgr_holder_pid(holder) != process_pid and lockmgr_holder_pid(holder) != -1:
        return None  # set in the parent of this forked child: it runs no loop here
    return <object>loop


cdef object current_task():
    """The running asyncio task, or None."""
    if asyncio_running_loop is None and not bind_asyncio():
        return None
    if asyncio_current_tasks is None:
        try:
            return asyncio_current_task()
        except RuntimeError:  # no running loop
            return None
    loop = running_loop_or_none()
    return None if loop is None else asyncio_current_tasks.get(loop)


cdef object current_task_or_raise():
    task = current_task()
    if task is None:
        not_in_task()
    return task


cdef object running_loop():
    """The loop of the current task (the caller runs in one)."""
    loop = running_loop_or_none()
    if loop is None:
        not_in_task()
    return loop


# -- outcomes known at once ---------------------------------------------------------------
# ``async with aio[key]`` takes the key in ``__aenter__``; the awaitable it answers is, on the
# uncontended path, one of these: awaiting it returns its value through the am_send slot
# (3.10+), with no frame and no StopIteration.

cdef extern from *:
    """
    typedef struct { PyObject_HEAD PyObject *value; } lockmgr_ready_object;

    static void lockmgr_ready_dealloc(PyObject *self) {
        Py_XDECREF(((lockmgr_ready_object *)self)->value);
        PyObject_Free(self);
    }
    static PyObject *lockmgr_ready_self(PyObject *self) { return Py_NewRef(self); }
    static PySendResult lockmgr_ready_send(PyObject *self, PyObject *arg, PyObject **result) {
        *result = Py_NewRef(((lockmgr_ready_object *)self)->value);
        return PYGEN_RETURN;
    }
    static PyObject *lockmgr_ready_next(PyObject *self) {  /* iterated without am_send */
        PyErr_SetObject(PyExc_StopIteration, ((lockmgr_ready_object *)self)->value);
        return NULL;
    }
    static PyAsyncMethods lockmgr_ready_async = {
        lockmgr_ready_self, NULL, NULL, lockmgr_ready_send,
    };
    static PyTypeObject lockmgr_ready_type = {
        PyVarObject_HEAD_INIT(NULL, 0)
        .tp_name = "lockmgr._core.Ready",
        .tp_doc = "An awaitable whose outcome is known already (its value, at once).",
        .tp_basicsize = sizeof(lockmgr_ready_object),
        .tp_dealloc = lockmgr_ready_dealloc,
        .tp_flags = Py_TPFLAGS_DEFAULT,
        .tp_as_async = &lockmgr_ready_async,
        .tp_iter = lockmgr_ready_self,
        .tp_iternext = lockmgr_ready_next,
    };
    static PyObject *lockmgr_ready_value(PyObject *ready) {  /* borrowed */
        return ((lockmgr_ready_object *)ready)->value;
    }
    static PyObject *lockmgr_ready_new(PyObject *value) {
        lockmgr_ready_object *ready;
        if (PyType_Ready(&lockmgr_ready_type) < 0)
            return NULL;
        ready = PyObject_New(lockmgr_ready_object, &lockmgr_ready_type);
        if (ready != NULL)
            ready->value = Py_NewRef(value);
        return (PyObject *)ready;
    }
    """
    object lockmgr_ready_new(object value)
    PyObject *lockmgr_ready_value(object ready)

cdef object READY_TRUE = lockmgr_ready_new(True)
cdef object READY_FALSE = lockmgr_ready_new(False)
cdef object READY_NONE = lockmgr_ready_new(None)


@cython.final
cdef class _TaskOwner:
    """One asyncio task's token, from its first ``aio`` acquisition until it is done; its
    done-callback then releases what the task still holds, as a thread's exit does. The
    ``async with`` objects a task is inside record this owner (see _BlockRecord)."""
    cdef Token *token   # the task's token (Token.is_task); freed once the task is done
    cdef object task    # the task (a strong reference: ``task_owners`` is released when
                        # done); None once ended, so no record keeps an ended task alive
    cdef object loop    # the task's event loop (where a block's exit run elsewhere sends
                        # its release); None once ended. ``task`` and ``loop`` are read by
                        # any thread (a block's exit): both are written and read in a
                        # critical section of this owner (free-threaded)
    cdef Py_ssize_t loop_ident  # the thread running that loop (the token's loop_ident, kept
                                # here too: the token may be freed under another thread)
    cdef bint ended     # set once by _task_done, first thing: what the task held is
                        # released, or being released, by its ending; never cleared
    cdef _TaskWait wait # its queued wait, from the moment its section queued it until
                        # settle or abandon ends it (whatever happens to the coroutine's
                        # frame meanwhile); a task has one at a time (the table refuses a
                        # second: NestedWaitError)

    def __dealloc__(self):
        if self.token is not NULL:  # never used after its task was done
            free_token(self.token)

    cdef tuple task_and_loop(self):
        """``task`` and ``loop``, read in this owner's section (None, None once ended)."""
        with cython.critical_section(self):
            return self.task, self.loop

    cdef int abandon_stranded(self) except -1:
        """Abandon the task's wait if nothing ever awaited it: an exception came between the
        call that queued it and the await (a signal handler's, at a check point in Python
        code), or a caller dropped what ``__aenter__`` answered. Called when the task starts
        another acquisition or an exception ends one; a wait being awaited is left alone
        (code running inside it, as a finalizer, may start an acquisition of its own)."""
        if self.wait is not None and self.wait.runner is None:
            self.wait.abandon()
        return 0

    def _task_done(self, task):
        cdef Token *token = self.token
        cdef int rounds
        # Three callers may end a task, on different threads: its done-callback, a grant
        # that found its loop closed, and lockmgr.postgres's sweep (end_stranded_task). The
        # first to take its entry out of task_owners (one atomic step, before any Python
        # code of the ending runs: warnings, finalizers) ends it; the others return.
        if token is NULL or task_owners.pop(task, None) is not self:
            return
        self.ended = True  # a block's exit from now on releases nothing: the ending does
        owners_by_ident.pop(token.ident, None)
        if self.wait is not None:
            # A done task awaits nothing: its wait was stranded (see abandon_stranded).
            self.wait.abandon()
        # What the released keys' finalizers and the warning filters run may use this task's
        # token no more (the task is done), so the rounds only bound pathological loops.
        for rounds in range(EXIT_ROUNDS):
            if not release_abandoned(token, task):
                break
        if token.request is NULL:  # else a wait object still runs (it frees nothing)
            self.token = NULL
            free_token(token)
        with cython.critical_section(self):
            task, loop = self.task, self.loop
            self.task = self.loop = None
        del task, loop  # (their last references may go here, after the section)


def end_stranded_task(task):
    """A task whose event loop was closed while it was pending can never run again: end it
    here, as its done-callback would (its wait abandoned, AbandonedLockWarning for what it
    held). For lockmgr.postgres, which finds such tasks; the pure twin has the same."""
    owner = task_owners.get(task)
    if owner is not None:
        (<_TaskOwner>owner)._task_done(task)


cdef Token* task_token(bint create) except? NULL:
    """The current task's token (RuntimeError outside a running task); NULL if it has none
    and ``create`` is false."""
    owner = task_owner(create)
    return NULL if owner is None else owner.token


cdef _TaskOwner task_owner(bint create):
    """The current task's owner (RuntimeError outside a running task); None if it has none
    and ``create`` is false."""
    task = current_task_or_raise()
    owner = task_owners.get(task)
    if owner is not None:
        return <_TaskOwner>owner
    if not create:
        return None
    cdef Token *token = <Token*>PyMem_RawCalloc(1, sizeof(Token))
    if token is NULL:
        raise MemoryError()
    cdef _TaskOwner created = _TaskOwner.__new__(_TaskOwner)
    created.token = token  # from here on the owner frees it
    created.task = task
    created.loop = task.get_loop()
    created.loop_ident = <Py_ssize_t>PyThread_get_thread_ident()
    token.ident = <unsigned long>id(task)
    token.is_task = True
    token.loop_ident = <Py_ssize_t>PyThread_get_thread_ident()
    task.add_done_callback(created._task_done)
    task_owners[task] = created
    CONTEXT_TASK.set(task)  # runs in the task's context: what it runs in a thread sees it
    owners_by_ident[token.ident] = created
    return created


cdef object task_of(unsigned long ident):
    """The task whose token has ``ident`` (None if it is done meanwhile)."""
    owner = owners_by_ident.get(ident)
    return None if owner is None else (<_TaskOwner>owner).task_and_loop()[0]


@cython.final
@cython.no_gc_clear  # __dealloc__ may still need its fields to leave the queues
cdef class _TaskWait:
    """A task's queued request: the C memory a section links into queues (which this object
    keeps until the request left them), and the Waker that a grant posts."""
    cdef Request single         # a single request's memory
    cdef Request *request       # ``&single``, or a set's nodes (``nodes`` memory)
    cdef Request *nodes         # a set's nodes (PyMem_Raw), or NULL
    cdef Py_ssize_t n           # how many nodes ``request`` has
    cdef _Engine manager        # whose table it waits in (kept alive while it waits)
    cdef _TaskOwner owner       # the task's (keeps the token alive while it waits)
    cdef readonly object waker  # the task's Waker (see lockmgr._owners.Waker)
    cdef bint queued            # its request is (or may still be) in the table's queues
    # Set once queued, read by whoever awaits it (lockmgr._aio._wait_for_grant):
    cdef readonly double deadline  # monotonic seconds when it times out; < 0: never
    cdef bint raises_timeout    # hold(): running out of time raises LockTimeout, naming
    cdef object keys            # these key(s) and
    cdef double seconds         # this timeout; else the wait answers False
    cdef object runner          # the coroutine that waits, once this is awaited
    cdef readonly double log_at # when the slow-wait log is due (< 0: never)
    cdef object logged_keys     # the keys it logged as waited for
    cdef _BlockRecord entering  # the record of the ``async with`` object whose
                                # ``__aenter__`` queued it, else None: the grant enters it
    # Whether the wait has ended (timed out, left the queues, or completed): decided in a
    # section, so of two threads ending it at once (a grant finding its loop closed, and
    # whoever closes its coroutine) one does, and only that one runs _ended() and finish.
    cdef bint over              # engine_mutex
    # Once completed, what it took (for ``give_back``, if an exception ends the await
    # before it returns): the table's key, its hash and mode, or the items of a set; and
    # the record it entered. Written by the task that awaits it.
    cdef object taken_key
    cdef Py_hash_t taken_hash
    cdef int taken_mode
    cdef list taken_items
    cdef _BlockRecord entered
    cdef bint completed

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.queued:  # never left by settle or abandon (a coroutine dropped mid-wait)
            self._leave()
        if self.request is not NULL:
            for i in range(self.n):
                PyMem_RawFree(self.request[i].hold)
        PyMem_RawFree(self.nodes)

    def settle(self, bint consumed, double deadline):
        """True (granted: ``complete()`` follows), False (timed out), None (still waiting),
        or AWAIT_POST."""
        cdef After after
        cdef Outcome outcome
        cdef Token *token = self.request.token
        if not self.queued:
            raise RuntimeError("this wait has ended")
        after_init(&after, NULL, 0)
        lock()
        if self.over:  # ended meanwhile by another thread
            unlock()
            raise RuntimeError("this wait has ended")
        if self.request.state == LEFT:  # a forked child dropped it (keep_only)
            outcome = TIMED_OUT
        else:
            outcome = settle(&self.manager.table, self.request, consumed, deadline, &after)
        if outcome == TIMED_OUT:
            self.over = True
        unlock()
        if outcome == TIMED_OUT:
            self._ended()
        finish(&after, token)
        if outcome == DONE:
            return True
        if outcome == TIMED_OUT:
            return False
        return AWAIT_POST if outcome == NEED_POST else None

    def complete(self):
        """The granted wait returns: the task holds what it asked for. The block that
        queued it is entered first: if another task is inside that object, RuntimeError,
        and the caller's ``abandon()`` gives the grant back."""
        cdef After after
        cdef _BlockRecord record = self.entering
        if not self.queued:
            raise RuntimeError("this wait has ended")
        if record is not None:
            record.enter(self.owner)
        after_init(&after, NULL, 0)
        lock()
        if self.over:  # another thread ended it meanwhile: its grant is given back
            unlock()
            if record is not None:
                record.leave()
            raise RuntimeError("this wait has ended")
        self.over = True
        complete(&self.manager.table, self.request, &after)
        unlock()
        self.entered = record
        self.completed = True
        self._ended()
        finish(&after, self.request.token)

    def abandon(self):
        """Leave the queues, or give back a grant that raced the exception ending the wait."""
        if self.queued:
            self._leave()

    cdef int give_back(self) except -1:
        """An exception ends the await: leave the queues (``abandon``), or, once completed
        (a signal handler's exception as the wait returns), give back what it took and
        leave the record it entered, as the block's exit would have."""
        cdef _BlockRecord record = self.entered
        if not self.completed:
            self.abandon()
            return 0
        self.completed = False
        self.entered = None
        if record is not None:
            record.leave()
        if self.taken_items is not None:
            self.manager._release_many_as(self.owner.token, self.taken_items)
        else:
            self.manager._task_release_at(self.owner.token, <PyObject*>self.taken_key,
                                          self.taken_hash, self.taken_mode)
        return 0

    def log_slow(self):
        if self.queued:
            self.logged_keys = self.manager._log_slow_wait(self.request)

    def observe(self):
        self.manager._observe_wait(self.request)

    def log_end(self, bint granted):
        if self.logged_keys is not None:
            log_wait_end(token_owner(self.request.token), self.logged_keys,
                         max(self.request.ended - self.request.since, 0.0), granted)

    def timed_out(self):
        """What a wait that timed out answers: False, or for ``hold()`` a LockTimeout."""
        if not self.raises_timeout:
            return False
        raise timed_out(self.keys, self.seconds)

    # Awaiting it runs lockmgr._aio._wait_for_grant. Being its own iterator (rather than
    # handing out that coroutine) leaves no moment between ``__aenter__`` and the wait's
    # own exception handling where a signal handler's exception could strand the request.

    def __await__(self):
        if self.runner is not None:
            raise RuntimeError("this acquisition's wait was awaited already")
        self.runner = wait_for_grant(self)
        return self

    def __next__(self):
        return self.send(None)

    def send(self, value):
        if self.runner is None:  # driven without await
            self.runner = wait_for_grant(self)
        try:
            return self.runner.send(value)
        except StopIteration:
            raise
        except BaseException:
            self.give_back()
            raise

    def throw(self, *error):
        if self.runner is None:
            self.runner = wait_for_grant(self)
        try:
            return self.runner.throw(*error)
        except StopIteration:
            raise
        except BaseException:
            self.give_back()
            raise

    def close(self):
        if self.runner is not None:
            self.runner.close()
        self.abandon()

    def _loop_closed(self):
        """A grant found the task's loop closed: the task can never run again, so it is
        ended here, as its done-callback would (AbandonedLockWarning for what it held)."""
        self.abandon()
        self.owner._task_done(self.owner.task_and_loop()[0])

    cdef int _leave(self) except -1:
        cdef After after
        cdef bint ends = False
        after_init(&after, NULL, 0)
        lock()
        # A post still on its way holds its own reference to this object, and a request
        # that left is never woken again: nothing waits for that post.
        if not self.over:  # else another thread ended it (only one may: see ``over``)
            self.over = ends = True
            if self.request.state != LEFT:  # else a forked child dropped it (keep_only)
                abandon(&self.manager.table, self.request, True, &after)
        unlock()
        if ends:
            self._ended()
            finish(&after, NULL)
        return 0

    cdef int _ended(self) except -1:
        self.queued = False
        self.entering = None
        self.waker.lost = None
        if self.owner.wait is self:
            self.owner.wait = None
        return 0


# -- ``await aio.acquire(key)`` without a Python frame ---------------------------------------
# The view's ``acquire`` answers an _Acquiring: a coroutine in all but its type (registered
# as a collections.abc.Coroutine, so ``asyncio.create_task`` takes it). Nothing happens when
# it is made; its first send acquires for the task driving it (as the body of an ``async
# def`` would), and answers through its am_send slot: the outcome at once, with no frame
# and no StopIteration, or the queued wait's yields until the wait's outcome.

cdef extern from *:
    """
    /* Points ``type``'s am_send at ``send`` (a Cython class has no slot of its own). */
    static int lockmgr_set_am_send(PyTypeObject *type, sendfunc send) {
        if (type->tp_as_async == NULL) {
            PyErr_SetString(PyExc_ImportError, "lockmgr._core: _Acquiring has no async slots");
            return -1;
        }
        type->tp_as_async->am_send = send;
        PyType_Modified(type);
        return 0;
    }
    """
    ctypedef enum PySendResult:
        PYGEN_RETURN
        PYGEN_ERROR
        PYGEN_NEXT
    ctypedef PySendResult (*sendfunc)(PyObject *, PyObject *, PyObject **) except? PYGEN_ERROR
    int lockmgr_set_am_send(PyTypeObject *type, sendfunc send) except -1
    PySendResult PyIter_Send(PyObject *iterator, PyObject *arg, PyObject **result)


@cython.final
@cython.freelist(8)
@cython.no_gc_clear  # __dealloc__ needs ``wait`` to leave the queues
cdef class _Acquiring:
    """``await aio.acquire(key, blocking, timeout)`` (``aio[key].acquire``, and with
    ``many``, ``aio.acquire_many``): see above."""
    cdef _Engine manager  # whose table (and the acquisition's arguments, as given:
    cdef object key       # checked when it runs, as an ``async def`` would; with ``many``,
                          # a callable that makes the set's items from them)
    cdef int mode
    cdef bint many        # ``aio.acquire_many``
    cdef object blocking
    cdef object timeout
    cdef object wait      # the queued _TaskWait it drives, once it queued one
    cdef bint started     # its first send (or throw) came
    cdef bint done        # it returned or raised: it answers no more sends

    def __await__(self):
        # As CPython refuses a coroutine to a second awaiter (two tasks would share one
        # wait, and the wrong one be told it holds the key).
        if self.done:
            raise RuntimeError("cannot reuse already awaited coroutine")
        if self.started:
            raise RuntimeError("coroutine is being awaited already")
        return self

    def __next__(self):
        return self.send(None)

    def send(self, value):
        cdef PyObject *result = NULL
        outcome = acquiring_send(<PyObject*>self, <PyObject*>value, &result)
        answer = <object>result
        Py_DECREF(answer)
        if outcome == PYGEN_RETURN:
            raise StopIteration(answer)
        return answer

    def throw(self, *error):
        """As a coroutine's: the arguments as given (3.12+ deprecates three of them)."""
        if not self.started or self.done:  # nothing acquired, or all over: it raises here
            self.started = self.done = True
            raise (error[1] if len(error) > 1 and error[1] is not None else error[0])
        try:
            return self.wait.throw(*error)
        except BaseException:
            self.done = True
            raise

    def close(self):
        self.started = self.done = True
        if self.wait is not None:
            self.wait.close()

    def __dealloc__(self):
        # Dropped while it waits (a coroutine driven by hand): leave the queues, as a
        # coroutine is closed when it is collected. (Not a __del__: an object reused from
        # the freelist keeps CPython's "finalized" mark, and its __del__ would not run.)
        if self.wait is not None:
            self.wait.close()
        elif not self.started:  # as CPython warns of a coroutine never awaited nor closed
            warn_never_awaited(self)


cdef int warn_never_awaited(_Acquiring dropped) except -1:
    if dropped.many:
        name = ("AsyncRWLockManager" if isinstance(dropped.manager, RWLockManager)
                else "AsyncLockManager") + ".acquire_many"
    elif dropped.mode == READ:
        name = "AsyncRWLockManager.acquire_read"
    elif isinstance(dropped.manager, RWLockManager):
        name = "AsyncRWLockManager.acquire_write"
    else:
        name = "AsyncLockManager.acquire"
    PyErr_WarnEx(RuntimeWarning, f"coroutine '{name}' was never awaited".encode(), 1)
    return 0


cdef object acquiring(_Engine manager, object key, int mode, object blocking,
                      object timeout, bint many=False):
    cdef _Acquiring made = _Acquiring.__new__(_Acquiring)
    made.manager = manager
    made.key = key
    made.mode = mode
    made.many = many
    made.blocking = blocking
    made.timeout = timeout
    return made


cdef PySendResult acquiring_send(PyObject *op, PyObject *arg,
                                 PyObject **result) except? PYGEN_ERROR:
    cdef _Acquiring self = <_Acquiring>op
    cdef PyObject *answer
    cdef PySendResult sent
    if self.done:
        raise RuntimeError("cannot reuse already awaited coroutine")
    if self.wait is None:
        if arg is not <PyObject*>None:
            raise TypeError("can't send non-None value to a just-started coroutine")
        self.started = self.done = True  # until it turns out to wait
        if self.many:
            got = self.manager._task_acquire_many_as(self.key, self.blocking, self.timeout)
        else:
            got = self.manager._task_acquire_as(self.key, self.mode, self.blocking,
                                                self.timeout)
        if type(got) is not _TaskWait:  # known at once: READY_TRUE or READY_FALSE
            answer = lockmgr_ready_value(got)
            Py_INCREF(<object>answer)
            result[0] = answer
            return PYGEN_RETURN
        self.wait = got
        self.done = False
        arg = <PyObject*>None
    sent = PyIter_Send(<PyObject*>self.wait, arg, result)
    if sent != PYGEN_NEXT:
        self.done = True
    return sent


lockmgr_set_am_send(<PyTypeObject*>_Acquiring, acquiring_send)
collections.abc.Coroutine.register(_Acquiring)  # asyncio.create_task takes it
