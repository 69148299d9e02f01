/* Work sharing by claims (internal.h: ciera_claims, claim) and the per-thread scratch. */
#include "internal.h"

int clamp_threads(int threads) {
#ifndef _OPENMP
    (void)threads;
    return 1;
#else
    if (threads < 1) return 1;
    /* Every region needs all the threads it asks for (chunk k is thread k's): never more than the
       runtime grants (OMP_THREAD_LIMIT; a region nested deeper than the active levels allow runs
       one thread). */
    if (omp_get_active_level() >= omp_get_max_active_levels()) return 1;
    int limit = omp_get_thread_limit();
    if (threads > limit) threads = limit;
    return threads > CIERA_MAX_THREADS ? CIERA_MAX_THREADS : threads;
#endif
}

uint8_t *thread_scratch(size_t nbytes) {
    static _Thread_local uint8_t *buf = NULL;
    static _Thread_local size_t cap = 0;
    if (nbytes > cap) {
        free(buf);
        buf = malloc(nbytes);
        cap = buf ? nbytes : 0;
    }
    return buf;
}

void claims_init(ciera_claims *c, int64_t units, int64_t grain, int threads) {
    c->word = (uint64_t)units << 32;
    c->grain = grain < 1 ? 1 : grain;
    c->threads = threads;
}

int64_t claims_share(int64_t units, int64_t grain, int threads) {
    return min64(units, ((3 * units + 2 * threads - 1) / (2 * threads) + grain - 1) / grain * grain);
}

void copy_overlap(uint8_t *out, int64_t off, const uint8_t *src, int64_t bytes, int64_t lo, int64_t hi) {
    const int64_t a = off > lo ? off : lo, b = min64(off + bytes, hi);
    if (a < b) memcpy(out + a, src + (a - off), (size_t)(b - a));
}

int claims_stalled(void) {
    const char *v = getenv("CIERA_NATIVE_STALL");
    return v && *v ? atoi(v) : -1;
}

void claims_stall(int k, int stalled) {
#ifdef _OPENMP
    if (k == stalled)
        for (const double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 2e-3;) {
        }
#else
    (void)k, (void)stalled;
#endif
}
