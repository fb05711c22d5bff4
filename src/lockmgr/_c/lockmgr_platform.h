/* lockmgr._core's platform shim: what differs between CPython versions, builds (GIL or
   free-threaded) and operating systems. Included by _core.pxd; no Python code runs in any
   of it, and nothing here can fail. */
#ifndef LOCKMGR_PLATFORM_H
#define LOCKMGR_PLATFORM_H

#include <Python.h>

#if PY_VERSION_HEX >= 0x030D0000
#  define lockmgr_is_finalizing() Py_IsFinalizing()
#else
#  define lockmgr_is_finalizing() _Py_IsFinalizing()
#endif

#if defined(_WIN32)
#  ifndef WIN32_LEAN_AND_MEAN
#    define WIN32_LEAN_AND_MEAN
#  endif
#  include <windows.h>
#endif

/* A word read by a thread that may not take the mutex while another writes it. */
#if PY_VERSION_HEX >= 0x030D0000
#  define lockmgr_load_ssize(p) _Py_atomic_load_ssize_relaxed(p)
#  define lockmgr_store_ssize(p, v) _Py_atomic_store_ssize_relaxed((p), (v))
#else  /* a GIL orders every access */
#  define lockmgr_load_ssize(p) (*(p))
#  define lockmgr_store_ssize(p, v) (*(p) = (v))
#endif
#ifdef Py_GIL_DISABLED
#  define LOCKMGR_FREE_THREADED 1
#else
#  define LOCKMGR_FREE_THREADED 0
#endif

/* A monotonic clock in seconds (time.monotonic()'s clock). */
#if defined(_WIN32)
static double lockmgr_monotonic(void) {
    LARGE_INTEGER frequency, now;  /* the frequency is fixed at boot */
    QueryPerformanceFrequency(&frequency);
    QueryPerformanceCounter(&now);
    return (double)now.QuadPart / (double)frequency.QuadPart;
}
#else
#  include <time.h>
static double lockmgr_monotonic(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}
#endif

#endif  /* LOCKMGR_PLATFORM_H */
