/* lockmgr._core's mutexes: a shard's one-byte spin lock and the engine mutex. The rules for
   taking them (who, in which order, never blocking while holding one) are in lockmgr_core.pyx's
   docstring, "The mutexes and the lock-ordering rules". */
#ifndef LOCKMGR_LOCKS_H
#define LOCKMGR_LOCKS_H

#include <Python.h>
#include <string.h>
#include "lockmgr_platform.h"

/* A shard's mutex: a one-byte lock, taken by an atomic exchange and given back by a
   plain release store (half the atomic read-modify-writes of a PyMutex pair, which
   is what the uncontended path pays for). Its holders run a few hundred instructions
   and never block, detach or need the GIL, so a waiter spins, yielding its core when
   the holder was preempted; with a GIL it is never contended (no section releases it). */
typedef struct { char locked; } lockmgr_spinlock;
#if defined(_MSC_VER)
#  include <intrin.h>
#  define LOCKMGR_SPIN_XCHG(p) _InterlockedExchange8((p), 1)
#  define LOCKMGR_SPIN_PEEK(p) (*(volatile char *)(p))
#  define LOCKMGR_SPIN_PAUSE() YieldProcessor()
#  define LOCKMGR_SPIN_YIELD() SwitchToThread()
#  define lockmgr_spin_unlock(m) ((void)_InterlockedExchange8(&(m)->locked, 0))
#else
#  include <sched.h>
#  define LOCKMGR_SPIN_XCHG(p) __atomic_exchange_n((p), 1, __ATOMIC_ACQUIRE)
#  define LOCKMGR_SPIN_PEEK(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#  if defined(__x86_64__) || defined(__i386__)
#    define LOCKMGR_SPIN_PAUSE() __builtin_ia32_pause()
#  elif defined(__aarch64__)
#    define LOCKMGR_SPIN_PAUSE() __asm__ __volatile__("yield")
#  else
#    define LOCKMGR_SPIN_PAUSE() ((void)0)
#  endif
#  define LOCKMGR_SPIN_YIELD() sched_yield()
#  define lockmgr_spin_unlock(m) __atomic_store_n(&(m)->locked, 0, __ATOMIC_RELEASE)
#endif
static void lockmgr_spin_wait(lockmgr_spinlock *m) {
    int spins;
    do {
        for (spins = 0; spins < 100 && LOCKMGR_SPIN_PEEK(&m->locked); spins++)
            LOCKMGR_SPIN_PAUSE();
        if (LOCKMGR_SPIN_PEEK(&m->locked))
            LOCKMGR_SPIN_YIELD();
    } while (LOCKMGR_SPIN_XCHG(&m->locked));
}
static inline void lockmgr_spin_lock(lockmgr_spinlock *m) {
    if (LOCKMGR_SPIN_XCHG(&m->locked))
        lockmgr_spin_wait(m);
}
#define lockmgr_spin_forget(m) ((m)->locked = 0)

/* The engine mutex: PyMutex where CPython has it (3.13+, and every free-threaded
   build), else the lock above, whose waiters release the GIL while they wait (rule 2).
   Taken only with the GIL held (attached thread state). */
#if PY_VERSION_HEX >= 0x030D0000
typedef PyMutex lockmgr_mutex;
#  define lockmgr_mutex_lock(m) PyMutex_Lock(m)
#  define lockmgr_mutex_unlock(m) PyMutex_Unlock(m)
#else
typedef lockmgr_spinlock lockmgr_mutex;
static void lockmgr_mutex_lock(lockmgr_mutex *m) {
    if (!LOCKMGR_SPIN_XCHG(&m->locked)) return;
    Py_BEGIN_ALLOW_THREADS
    lockmgr_spin_wait(m);
    Py_END_ALLOW_THREADS
}
#  define lockmgr_mutex_unlock(m) lockmgr_spin_unlock(m)
#endif
#define lockmgr_mutex_forget(m) memset((m), 0, sizeof(lockmgr_mutex))

#endif  /* LOCKMGR_LOCKS_H */
