# lockmgr._core: asyncio tasks as owners and waiters (lockmgr._aio states the protocol).
# (included by lockmgr_core.pyx; see its docstring for the rules these follow)

cdef dict task_owners = {}  # running task -> its _TaskOwner, until the task is done
cdef dict owners_by_ident = {}  # id(task) -> its _TaskOwner (owner() and cycles name tasks)


@cython.final
cdef class _TaskOwner:
    """One asyncio task's token, from its first ``aio`` acquisition until it is done; its
    done-callback then releases what the task still holds, as a thread's exit does."""
    cdef Token *token   # the task's token (Token.is_task); freed once the task is done
    cdef object task    # the task (a strong reference: ``task_owners`` is released when done)

    def __dealloc__(self):
        if self.token is not NULL:  # never used after its task was done
            free_token(self.token)

    def _task_done(self, task):
        cdef Token *token = self.token
        cdef int rounds
        if token is NULL:  # ended already: its loop was found closed while it waited
            return
        task_owners.pop(task, None)
        owners_by_ident.pop(token.ident, None)
        # What the released keys' finalizers and the warning filters run may use this task's
        # token no more (the task is done), so the rounds only bound pathological loops.
        for rounds in range(EXIT_ROUNDS):
            if not release_abandoned(token, task):
                break
        if token.request is NULL:  # else a wait object still runs (it frees nothing)
            self.token = NULL
            free_token(token)


cdef Token* task_token(bint create) except? NULL:
    """The current task's token (RuntimeError outside a running task); NULL if it has none
    and ``create`` is false."""
    task = current_task_or_raise()
    owner = task_owners.get(task)
    if owner is not None:
        return (<_TaskOwner>owner).token
    if not create:
        return NULL
    cdef Token *token = <Token*>PyMem_RawCalloc(1, sizeof(Token))
    if token is NULL:
        raise MemoryError()
    cdef _TaskOwner created = _TaskOwner.__new__(_TaskOwner)
    created.token = token  # from here on the owner frees it
    created.task = task
    token.ident = <unsigned long>id(task)
    token.is_task = True
    token.loop_ident = <Py_ssize_t>PyThread_get_thread_ident()
    task.add_done_callback(created._task_done)
    task_owners[task] = created
    owners_by_ident[token.ident] = created
    return token


cdef object task_of(unsigned long ident):
    """The task whose token has ``ident`` (None if it is done meanwhile)."""
    owner = owners_by_ident.get(ident)
    return None if owner is None else (<_TaskOwner>owner).task


@cython.final
cdef class _TaskWait:
    """A task's queued request: the C memory a section links into queues (which this object
    keeps until the request left them), and the Waker that a grant posts."""
    cdef Request single         # a single request's memory
    cdef Request *request       # ``&single``, or a set's nodes (``nodes`` memory)
    cdef Request *nodes         # a set's nodes (PyMem_Raw), or NULL
    cdef Py_ssize_t n           # how many nodes ``request`` has
    cdef _Engine manager        # whose table it waits in (kept alive while it waits)
    cdef object owner           # the task's _TaskOwner (keeps the token alive while it waits)
    cdef readonly object waker  # the task's Waker (see lockmgr._common.Waker)
    cdef bint queued            # its request is (or may still be) in the table's queues

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.queued:  # never left by settle or abandon (a coroutine dropped mid-wait)
            self._leave()
        if self.request is not NULL:
            for i in range(self.n):
                PyMem_RawFree(self.request[i].hold)
        PyMem_RawFree(self.nodes)

    def settle(self, bint consumed, double deadline):
        """True (granted), False (timed out), None (still waiting), or AWAIT_POST."""
        cdef After after
        cdef Outcome outcome
        cdef Token *token = self.request.token
        if not self.queued:
            raise RuntimeError("this wait has ended")
        after_init(&after, NULL, 0)
        lock()
        outcome = settle(&self.manager.table, self.request, consumed, deadline, &after)
        if outcome == DONE:
            complete(&self.manager.table, self.request, &after)
        unlock()
        if outcome == DONE or outcome == TIMED_OUT:
            self.queued = False
            self.waker.lost = None
        finish(&after, token)
        if outcome == DONE:
            return True
        if outcome == TIMED_OUT:
            return False
        return AWAIT_POST if outcome == NEED_POST else None

    def abandon(self):
        """Leave the queues, or give back a grant that raced the exception ending the wait."""
        if self.queued:
            self._leave()

    def _loop_closed(self):
        """A grant found the task's loop closed: the task can never run again, so it is
        ended here, as its done-callback would (AbandonedLockWarning for what it held)."""
        self.abandon()
        (<_TaskOwner>self.owner)._task_done((<_TaskOwner>self.owner).task)

    cdef int _leave(self) except -1:
        cdef After after
        after_init(&after, NULL, 0)
        self.waker.lost = None
        lock()
        # A post still on its way holds its own reference to this object, and a request
        # that left is never woken again: nothing waits for that post.
        abandon(&self.manager.table, self.request, True, &after)
        unlock()
        self.queued = False
        finish(&after, NULL)
        return 0
