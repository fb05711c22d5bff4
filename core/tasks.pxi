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

cdef object READY_TRUE = lockmgr_ready_new(True)
cdef object READY_FALSE = lockmgr_ready_new(False)
cdef object READY_NONE = lockmgr_ready_new(None)


@cython.final
cdef class _TaskOwner:
    """One asyncio task's token, from its first ``aio`` acquisition until it is done; its
    done-callback then releases what the task still holds, as a thread's exit does."""
    cdef Token *token   # the task's token (Token.is_task); freed once the task is done
    cdef object task    # the task (a strong reference: ``task_owners`` is released when done)
    cdef object task_ref # a weak reference to it, made once: whose block an exit was, as
                         # _Blocks answers, and what it keeps of the task once ended
    cdef _TaskWait wait # its queued wait, from its section until settle or abandon ends it
                        # (whatever happens to the coroutine's frame meanwhile); a task has
                        # one at a time (the table refuses a second: NestedWaitError)
    cdef list blocks    # the _Blocks holding a block of the task by its frame, once per
                        # such frame, in its first n_blocks slots (the rest None): a slot
                        # comes with the frame's first entry and goes with its last, whoever's
                        # exit that is (another task's may close the frame's coroutine);
                        # taken by the task's ending, which moves the entries aside (see
                        # _Blocks). Changed in a critical section of this owner (free-threaded)
    cdef Py_ssize_t n_blocks

    def __dealloc__(self):
        if self.token is not NULL:  # never used after its task was done
            free_token(self.token)

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int remember_block(self, _Blocks inside) except -1:
        """``inside`` holds one more block of the task by its frame."""
        with cython.critical_section(self):
            if self.n_blocks < len(self.blocks):
                self.blocks[self.n_blocks] = inside
            else:
                self.blocks.append(inside)
            self.n_blocks += 1
        return 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    cdef int forget_block(self, _Blocks inside) except -1:
        """``inside`` holds one block fewer of the task by its frame. Blocks nest, so it is
        usually the last listed; the slots stay (a list that shrinks to nothing and grows
        again reallocates at every block), and order does not matter (the ending takes
        them all): the last fills the hole."""
        cdef Py_ssize_t last
        cdef Py_ssize_t index
        with cython.critical_section(self):
            last = self.n_blocks - 1
            for index in range(last, -1, -1):
                if self.blocks[index] is inside:  # (the caller holds it: no dealloc here)
                    self.blocks[index] = self.blocks[last]
                    self.blocks[last] = None
                    self.n_blocks = last
                    break
        return 0

    cdef list take_blocks(self):
        """The task's ending takes its list (see ``blocks``)."""
        with cython.critical_section(self):
            blocks, self.blocks = self.blocks[:self.n_blocks], []
            self.n_blocks = 0
        return blocks

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
        owners_by_ident.pop(token.ident, None)
        frames = [(<_Blocks>inside).forget_task(self) for inside in self.take_blocks()]
        del frames  # (their finalizers may run here, after every record is consistent)
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


cdef object running_frame():
    """The Python frame running: inside ``__aenter__``/``__aexit__`` of a C type, the frame
    of the ``async with`` block."""
    cdef PyFrameObject *frame = PyEval_GetFrame()
    return None if frame is NULL else <object><PyObject*>frame


cdef extern from *:
    """
    #if PY_VERSION_HEX < 0x030B0000
    #include "frameobject.h"  /* 3.10: the frame's struct, with f_gen */
    #endif
    /* The generator, coroutine or async generator that owns ``frame`` (a new reference),
       or NULL: a plain function's frame, or one whose code has returned or raised. */
    static PyObject *lockmgr_frame_owner(PyObject *frame) {
    #if PY_VERSION_HEX >= 0x030B0000
        return PyFrame_GetGenerator((PyFrameObject *)frame);
    #else
        PyObject *generator = ((PyFrameObject *)frame)->f_gen;
        Py_XINCREF(generator);
        return generator;
    #endif
    }
    """
    PyObject *lockmgr_frame_owner(object frame)


cdef object frame_owner(frame):
    """The generator, coroutine or async generator that owns ``frame``; None if none does
    (see lockmgr_frame_owner): such a frame can run no exit any more."""
    cdef PyObject *owner = lockmgr_frame_owner(frame)
    if owner is NULL:
        return None
    result = <object>owner
    Py_DECREF(<object>owner)
    return result


cdef int count_block_in(object got, _TaskOwner owner, _Blocks inside,
                        object frame) except -1:
    """Count an ``async with`` block (running in ``frame``) in once its task holds what it
    asked for: now, or when its wait is granted (see _Blocks)."""
    if inside is None or owner is None:  # (an empty hold_many makes no owner)
        return 0
    if got is True:
        inside.count_in(frame, owner)
    elif type(got) is _TaskWait:
        (<_TaskWait>got).entering = inside
        (<_TaskWait>got).entering_frame = frame
    return 0


cdef bint exit_releases(_Blocks blocks, object frame, object kind, object key,
                        Token **token) except -1:
    """Whether the exit of a block of ``blocks`` running in ``frame`` releases ``key``, for
    the current task (whose token, NULL if it holds nothing, goes to ``token``): not if
    the block was another task's (NotOwnedError unless its coroutine is being closed), nor
    under a GeneratorExit for a block entered in another frame (see BlocksInside).
    RuntimeError outside a task otherwise."""
    task = current_task()
    owner = None if task is None else task_owners.get(task)
    current_ref = None if owner is None else (<_TaskOwner>owner).task_ref
    entered = blocks.leave_block(frame, <_TaskOwner>owner)
    if entered is not NOT_ENTERED:
        if current_ref is None or entered is not current_ref:
            if kind is GeneratorExit:
                return False
            raise not_this_tasks_block(key)
    elif kind is GeneratorExit:
        return False
    elif task is None:
        not_in_task()
    token[0] = NULL if owner is None else (<_TaskOwner>owner).token
    return True


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
    created.task_ref = PyWeakref_NewRef(task, None)
    created.blocks = []
    token.ident = <unsigned long>id(task)
    token.is_task = True
    token.loop_ident = <Py_ssize_t>PyThread_get_thread_ident()
    task.add_done_callback(created._task_done)
    task_owners[task] = created
    owners_by_ident[token.ident] = created
    return created


cdef object task_of(unsigned long ident):
    """The task whose token has ``ident`` (None if it is done meanwhile)."""
    owner = owners_by_ident.get(ident)
    return None if owner is None else (<_TaskOwner>owner).task


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
    cdef readonly object waker  # the task's Waker (see lockmgr._common.Waker)
    cdef bint queued            # its request is (or may still be) in the table's queues
    # Set once queued, read by whoever awaits it (lockmgr._aio._wait_for_grant):
    cdef readonly double deadline  # monotonic seconds when it times out; < 0: never
    cdef bint raises_timeout    # hold(): running out of time raises LockTimeout, naming
    cdef object keys            # these key(s) and
    cdef double seconds         # this timeout; else the wait answers False
    cdef object runner          # the coroutine that waits, once this is awaited
    cdef readonly double log_at # when the slow-wait log is due (< 0: never)
    cdef object logged_keys     # the keys it logged as waited for
    cdef _Blocks entering       # the record of the ``async with`` object whose ``__aenter__``
                                # queued it, else None: counts the block in once granted
    cdef object entering_frame  # the frame running that block

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
        if self.request.state == LEFT:  # a forked child dropped it (keep_only)
            outcome = TIMED_OUT
        else:
            outcome = settle(&self.manager.table, self.request, consumed, deadline, &after)
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
        """The granted wait returns: the task holds what it asked for."""
        cdef After after
        if not self.queued:
            raise RuntimeError("this wait has ended")
        after_init(&after, NULL, 0)
        lock()
        complete(&self.manager.table, self.request, &after)
        unlock()
        self._ended()
        finish(&after, self.request.token)
        if self.entering is not None:
            self.entering.count_in(self.entering_frame, self.owner)

    def abandon(self):
        """Leave the queues, or give back a grant that raced the exception ending the wait."""
        if self.queued:
            self._leave()

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
            self.abandon()
            raise

    def throw(self, *error):
        if self.runner is None:
            self.runner = wait_for_grant(self)
        try:
            return self.runner.throw(*error)
        except StopIteration:
            raise
        except BaseException:
            self.abandon()
            raise

    def close(self):
        if self.runner is not None:
            self.runner.close()
        self.abandon()

    def _loop_closed(self):
        """A grant found the task's loop closed: the task can never run again, so it is
        ended here, as its done-callback would (AbandonedLockWarning for what it held)."""
        self.abandon()
        self.owner._task_done(self.owner.task)

    cdef int _leave(self) except -1:
        cdef After after
        after_init(&after, NULL, 0)
        lock()
        # A post still on its way holds its own reference to this object, and a request
        # that left is never woken again: nothing waits for that post.
        if self.request.state != LEFT:  # else a forked child dropped it (keep_only)
            abandon(&self.manager.table, self.request, True, &after)
        unlock()
        self._ended()
        finish(&after, NULL)
        return 0

    cdef int _ended(self) except -1:
        self.queued = False
        self.waker.lost = None
        if self.owner.wait is self:
            self.owner.wait = None
        return 0
