/* lockmgr._core's signal masks (signals.pxi): the calling thread's mask blocked and restored
   from C sigset_t values, for lockmgr._quiet's held-off step. Where there is no
   pthread_sigmask (Windows), nothing is blocked and LOCKMGR_HAS_SIGMASK is 0. */
#ifndef LOCKMGR_SIGNALS_H
#define LOCKMGR_SIGNALS_H

#include <errno.h>

#if defined(_WIN32)
#  define LOCKMGR_HAS_SIGMASK 0
typedef struct { int unused; } lockmgr_sigset;
static int lockmgr_sigset_clear(lockmgr_sigset *set) { (void)set; return 0; }
static int lockmgr_sigset_add(lockmgr_sigset *set, int signum) { (void)set; (void)signum; return 0; }
static int lockmgr_sigset_has(const lockmgr_sigset *set, int signum) { (void)set; (void)signum; return 0; }
static int lockmgr_sigmask_block(const lockmgr_sigset *set, lockmgr_sigset *before) {
    (void)set; (void)before; return 0; }
static int lockmgr_sigmask_set(const lockmgr_sigset *set) { (void)set; return 0; }
#else
#  include <pthread.h>
#  include <signal.h>
#  define LOCKMGR_HAS_SIGMASK 1
typedef sigset_t lockmgr_sigset;
static int lockmgr_sigset_clear(lockmgr_sigset *set) { return sigemptyset(set); }
static int lockmgr_sigset_add(lockmgr_sigset *set, int signum) { return sigaddset(set, signum); }
static int lockmgr_sigset_has(const lockmgr_sigset *set, int signum) {
    return sigismember(set, signum) == 1; }
/* 0, or the error number (pthread_sigmask returns it rather than setting errno). */
static int lockmgr_sigmask_block(const lockmgr_sigset *set, lockmgr_sigset *before) {
    return pthread_sigmask(SIG_BLOCK, set, before); }
static int lockmgr_sigmask_set(const lockmgr_sigset *set) {
    return pthread_sigmask(SIG_SETMASK, set, NULL); }
#endif

#endif
