/* What the library's files share and do not export: build switches, byte access, the work
 * sharing of claims.c and the CPU features of cpu.c. */
#ifndef CIERA_INTERNAL_H
#define CIERA_INTERNAL_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ciera_codecs.h"

#ifdef _OPENMP
#include <omp.h>
#define CIERA_THREAD_ID() omp_get_thread_num()
#else
#define CIERA_THREAD_ID() 0
#endif

#define CIERA_MAX_THREADS 256
#define CIERA_MAX_NUMEL ((int64_t)1 << 35) /* values per shard: claims count units (>= 8 values) in 32 bits */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Hot loops get x86-64-v4 (AVX-512) and x86-64-v3 (AVX2, BMI2: one-uop variable shifts) clones
 * next to the baseline one, the widest the CPU has picked at load time (GNU ifunc), so one build
 * runs everywhere and vectorises where the CPU can (the same C source in every clone). delta's
 * byte gathers also have explicit AVX2 paths, and its 16-bit blocks explicit AVX-512 (VBMI,
 * VBMI2) ones, chosen per call (delta_wctx; CIERA_NATIVE_AVX2=0 / CIERA_NATIVE_AVX512=0 narrow
 * the choice). -DCIERA_NO_CLONES builds the portable paths alone (setup.py's fall-back). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && !defined(CIERA_NO_CLONES)
#define HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT
#endif

#if defined(__x86_64__) && defined(__GNUC__) && !defined(CIERA_NO_CLONES)
#define CIERA_X86 1
#include <immintrin.h>
#define AVX2_FN __attribute__((target("avx2,bmi,bmi2")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,bmi,bmi2,popcnt")))
#define AVX512_INLINE AVX512_FN static inline __attribute__((always_inline))
#define AVX512CD_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512cd,avx2,bmi,bmi2,popcnt")))
#else
#define CIERA_X86 0
#endif

/* Everything declared from here to the pop is the library's own, never exported. */
#pragma GCC visibility push(hidden)

/* ---- what each codec's files define besides its entry points --------------------------------- */
/* ciera_<symbol>_layout_fields / _layout_bytes (CIERA_LAYOUT_INFO: what abi.c reads back) and
 * ciera_<symbol>_fixed_bytes, the smallest payload of a layout (header and fixed sections: what
 * dispatch.c checks a header's needed bytes against). */
#define CIERA_CODEC_INTERNALS(id, name, sym)          \
    const char *ciera_##sym##_layout_fields(void);    \
    int64_t ciera_##sym##_layout_bytes(void);         \
    int64_t ciera_##sym##_fixed_bytes(const ciera_##sym##_layout *l);
CIERA_CODECS(CIERA_CODEC_INTERNALS)
#undef CIERA_CODEC_INTERNALS

/* A layout's fields are an X-macro list FIELDS(X) of names, in struct order, every one an int64_t.
 * In the codec's header: CIERA_LAYOUT_STRUCT(symbol, FIELDS) defines struct ciera_<symbol>_layout;
 * in one of its C files: CIERA_LAYOUT_INFO(symbol, FIELDS) defines what abi.c reads back. */
#define CIERA_LAYOUT_FIELD(f) int64_t f;
#define CIERA_LAYOUT_FIELD_NAME(f) " " #f
#define CIERA_LAYOUT_FIELD_COUNT(f) +1
#define CIERA_LAYOUT_STRUCT(sym, FIELDS) \
    struct ciera_##sym##_layout {        \
        FIELDS(CIERA_LAYOUT_FIELD)       \
    };
#define CIERA_LAYOUT_INFO(sym, FIELDS)                                                                       \
    _Static_assert(sizeof(ciera_##sym##_layout) == (0 FIELDS(CIERA_LAYOUT_FIELD_COUNT)) * sizeof(int64_t),   \
                   "every layout field is an int64_t, unpadded");                                            \
    const char *ciera_##sym##_layout_fields(void) { return FIELDS(CIERA_LAYOUT_FIELD_NAME) + 1; }            \
    int64_t ciera_##sym##_layout_bytes(void) { return (int64_t)sizeof(ciera_##sym##_layout); }

/* ---- byte access ---------------------------------------------------------------------------- */
ALWAYS_INLINE uint32_t load_u(const void *p, int64_t i, int W) {
    return W == 16 ? (uint32_t)((const uint16_t *)p)[i] : ((const uint32_t *)p)[i];
}

ALWAYS_INLINE void store_u(void *p, int64_t i, uint32_t v, int W) {
    if (W == 16) ((uint16_t *)p)[i] = (uint16_t)v;
    else ((uint32_t *)p)[i] = v;
}

ALWAYS_INLINE uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

ALWAYS_INLINE uint64_t load_le(const uint8_t *p, int nbytes) {
    uint64_t v = 0;
    for (int k = 0; k < nbytes; k++) v |= (uint64_t)p[k] << (8 * k);
    return v;
}

ALWAYS_INLINE void store_le(uint8_t *p, uint64_t v, int nbytes) {
    for (int k = 0; k < nbytes; k++) p[k] = (uint8_t)(v >> (8 * k));
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Bits [0, k) set, for any k >= 0 (BZHI reads only the index's low byte). */
ALWAYS_INLINE uint64_t lowmask64(int64_t k) { return k >= 64 ? ~0ull : k <= 0 ? 0 : ((1ull << k) - 1); }

/* ---- CPU features (cpu.c), checked per call: the environment variables let the tests force
 * each path ------------------------------------------------------------------------------------ */
/* AVX2 + BMI2; CIERA_NATIVE_AVX2=0 in the environment takes the portable paths. */
int cpu_avx2(void);
/* AVX-512 F, BW, VL, VBMI (implies cpu_avx2); CIERA_NATIVE_AVX512=0 keeps the AVX2 paths. */
int cpu_avx512(void);
/* cpu_avx512 and CD, VBMI2: delta's histogram in registers. */
int cpu_avx512cd(void);
#if CIERA_X86
/* Byte indices 0, 2, ..., 126: a two-register byte permute with them takes the low bytes of 64
 * 16-bit values held in two registers (with them + 1, the high bytes). */
extern const uint8_t even_bytes[64];
#endif

/* ---- work sharing (claims.c) ---------------------------------------------------------------- */
/* Threads a call runs: without OpenMP (setup.py's last fall-back) the parallel regions run once,
 * as chunk 0, so the work must be one chunk. */
int clamp_threads(int threads);

/* Scratch of the calling thread, kept for its next call (OpenMP workers persist): what threads
 * > 0 encode before its place is known. Grows to the largest size asked for; never shrinks. */
uint8_t *thread_scratch(size_t nbytes);

/* Work shared out as it is done, not in fixed shares: a slower, busier or preempted thread (vCPUs
 * of one VM often run 20-30% apart) then never leaves the others waiting on its half. Units
 * [0, units) are claimed in grains from both ends of one shared (front, back) pair, one CAS per
 * claim: thread 0 from the front, so its grains run on from unit 0 (it writes its output in
 * place), every other thread from the back. Front and back are 32-bit halves: units < 2^32. */
typedef struct {
    uint64_t word; /* front (low half) and back (high half), in units */
    int64_t grain, threads;
} ciera_claims;

void claims_init(ciera_claims *c, int64_t units, int64_t grain, int threads);

/* Grains that `units` units span (at least one, so a walk over pieces always moves on). */
ALWAYS_INLINE int64_t grains_of(int64_t units, int64_t grain) {
    const int64_t g = (units + grain - 1) / grain;
    return g > 0 ? g : 1;
}

/* Units a thread other than 0 may claim into its scratch: 1.5x an even share of `units`, in whole
 * grains (then it stops claiming and thread 0 takes the rest). */
int64_t claims_share(int64_t units, int64_t grain, int threads);

/* Copies what of [off, off + bytes) (from src) lies in [lo, hi): a thread's even range of a copy. */
void copy_overlap(uint8_t *out, int64_t off, const uint8_t *src, int64_t bytes, int64_t lo, int64_t hi);

/* For the tests: CIERA_NATIVE_STALL=k makes thread k of every claimed pass start 2 ms late, so
 * the others claim what they may (read per call, as the other CIERA_NATIVE_* are). */
int claims_stalled(void);
void claims_stall(int k, int stalled);

/* Claims [*lo, *hi) from the front or the back; 0 when nothing is left. Every cut is a multiple
 * of the grain, so with fixed grains (guided 0) a claim is grain lo / grain. Guided claims are an
 * eighth of what is left per thread, at least a grain (few claims where each costs a set-up,
 * small ones at the end). One thread claims everything at once. A claim holds at most `limit`
 * units (a multiple of the grain, >= 1 grain). */
ALWAYS_INLINE int claim(ciera_claims *c, int back, int guided, int64_t limit, int64_t *lo, int64_t *hi) {
    uint64_t w = __atomic_load_n(&c->word, __ATOMIC_RELAXED), nw;
    int64_t f, b;
    do {
        f = (int64_t)(w & 0xFFFFFFFFu), b = (int64_t)(w >> 32);
        if (f >= b) return 0;
        int64_t size = c->threads == 1 ? b - f : guided ? (b - f) / (8 * c->threads) : c->grain;
        if (size < c->grain) size = c->grain;
        if (size > limit) size = limit; /* a multiple of the grain, or the claim may overshoot it */
        /* cuts fall on multiples of the grain: a grain-aligned claim holds whole grains */
        if (back) f = (b - size) < f ? f : (b - size + c->grain - 1) / c->grain * c->grain;
        else b = min64(b, (f + size + c->grain - 1) / c->grain * c->grain);
        nw = back ? (w & 0xFFFFFFFFu) | ((uint64_t)f << 32) : (w & ~(uint64_t)0xFFFFFFFFu) | (uint64_t)b;
    } while (!__atomic_compare_exchange_n(&c->word, &w, nw, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED));
    *lo = f, *hi = b;
    return 1;
}

#pragma GCC visibility pop

#endif
