# lockmgr._core's signal masks, for ``lockmgr._quiet``'s held-off step on the compiled core's
# managers: the same calls as ``signal.pthread_sigmask(SIG_BLOCK, BLOCKABLE)`` and
# ``signal.pthread_sigmask(SIG_SETMASK, mask)``, handlers of pending signals run after the
# change as there, but with the masks kept as C ``sigset_t`` values: no set of some 60
# Python ints built from, or converted to, on every call.

cdef extern from "_c/lockmgr_signals.h":
    const bint LOCKMGR_HAS_SIGMASK
    ctypedef struct lockmgr_sigset:
        pass
    int lockmgr_sigset_clear(lockmgr_sigset *set) nogil
    int lockmgr_sigset_add(lockmgr_sigset *set, int signum) nogil
    int lockmgr_sigset_has(const lockmgr_sigset *set, int signum) nogil
    int lockmgr_sigmask_block(const lockmgr_sigset *set, lockmgr_sigset *before) nogil
    int lockmgr_sigmask_set(const lockmgr_sigset *set) nogil


cdef lockmgr_sigset _blockable  # lockmgr._quiet.BLOCKABLE
# What a mask may name, iterated: every valid signal (a thread's own mask may block one
# that BLOCKABLE leaves out, a fault's, and a mask iterated and set again keeps it).
cdef tuple _valid_signals = tuple(sorted(map(int, signal.valid_signals())))


cdef int _fill_sigset(lockmgr_sigset *into, signals) except -1:
    lockmgr_sigset_clear(into)
    for signum in signals:
        if lockmgr_sigset_add(into, <int>signum):
            raise ValueError(f"signal number out of range: {signum!r}")
    return 0


_fill_sigset(&_blockable, BLOCKABLE)


@cython.final
@cython.freelist(4)
cdef class SignalMask:
    """A thread's signal mask as ``hold_handlers_off`` found it; iterating gives the
    signals in it (as ``signal.pthread_sigmask`` takes them)."""

    cdef lockmgr_sigset signals

    def __iter__(self):
        return iter([signum for signum in _valid_signals
                     if lockmgr_sigset_has(&self.signals, signum)])


cdef int _mask_changed(int error) except -1:
    if error:
        raise OSError(error, os.strerror(error))
    # As signal.pthread_sigmask: handlers of the signals it let in (or that were pending)
    # run now, after the change; what they raise propagates.
    PyErr_CheckSignals()
    return 0


def hold_handlers_off():
    """Block ``lockmgr._quiet.BLOCKABLE`` on the calling thread; return its mask before
    (a ``SignalMask``). Handlers of pending signals run after the change: if one raises,
    the mask goes back as it was (the call changed nothing) and the exception propagates."""
    cdef SignalMask before = SignalMask.__new__(SignalMask)
    cdef int error = lockmgr_sigmask_block(&_blockable, &before.signals)
    if error:
        raise OSError(error, os.strerror(error))
    try:
        PyErr_CheckSignals()
    except BaseException:
        lockmgr_sigmask_set(&before.signals)
        raise
    return before


def hold_handlers_off_again():
    """Block ``lockmgr._quiet.BLOCKABLE`` on the calling thread, inside a held-off call
    after a wait let the handlers in: pending ones run after the change, and if one
    raises, the mask stays blocked (the call gives back what it took held off)."""
    cdef lockmgr_sigset before
    _mask_changed(lockmgr_sigmask_block(&_blockable, &before))


def set_signal_mask(mask):
    """Set the calling thread's mask to ``mask``: a ``SignalMask``, or signal numbers.
    Handlers of the signals it lets in run after the change."""
    cdef lockmgr_sigset signals
    if type(mask) is SignalMask:
        _mask_changed(lockmgr_sigmask_set(&(<SignalMask>mask).signals))
    else:
        _fill_sigset(&signals, mask)
        _mask_changed(lockmgr_sigmask_set(&signals))
