/* Native CPU twins of the CIERA codecs (exponent_reuse and delta).
 *
 * Plain C11 (+ OpenMP when the compiler has it), no Python or torch headers: loaded with ctypes
 * on tensors' data pointers by ciera/native/_lib.py. The payload formats are defined by the
 * pure-torch references in ciera/codecs/{exponent_reuse,delta}.py; every function here writes
 * the same bytes (everything the reference writes up to `needed`, and nothing else) and decodes
 * to the same bits. Section offsets come from the Python layout dataclasses (one source of truth).
 *
 * Threads: every entry point takes `threads`; the work is claimed in grains of whole blocks as
 * threads get to it (ciera_claims: no thread waits on a fixed share of a slower one), and claims
 * never share an output byte, so results depend neither on the thread count nor on who claimed
 * what.
 *
 * Decoders never read or write outside the buffers they are given: a payload whose sections run
 * past its length, or whose counts, widths or indices are impossible, returns a negative error
 * code (the target may then be partly written, as with the reference's errors).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#define CIERA_THREAD_ID() omp_get_thread_num()
#else
#define CIERA_THREAD_ID() 0
#endif

#define CIERA_ABI 3
#define CIERA_MAX_THREADS 256
#define CIERA_MAX_NUMEL ((int64_t)1 << 35) /* values per shard: claims count units (>= 8 values) in 32 bits */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Hot loops get x86-64-v4 (AVX-512) and x86-64-v3 (AVX2, BMI2: one-uop variable shifts) clones
 * next to the baseline one, the widest the CPU has picked at load time (GNU ifunc), so one build
 * runs everywhere and vectorises where the CPU can (the same C source in every clone). delta's
 * byte gathers also have explicit AVX2 paths, and its 16-bit blocks explicit AVX-512 (VBMI,
 * VBMI2) ones, chosen per call (delta_wctx; CIERA_NATIVE_AVX2=0 / CIERA_NATIVE_AVX512=0 narrow
 * the choice). */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && !defined(CIERA_NO_CLONES)
#define HOT __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HOT
#endif

enum {
    CIERA_OK = 0,
    CIERA_E_TOO_MANY_BLOCKS = -1, /* exponent_reuse: more changed blocks than slots */
    CIERA_E_TRUNCATED = -2,       /* a section runs past the payload */
    CIERA_E_BAD_COUNT = -3,       /* delta: an exception count above the block's values */
    CIERA_E_BAD_TABLE = -4,       /* delta: a width above W */
    CIERA_E_BAD_INDEX = -5,       /* delta: an exception index past the block's values */
    CIERA_E_ARGS = -6,            /* unsupported layout / arguments */
    CIERA_E_NOMEM = -7,
    CIERA_E_HEADER = -8,          /* decode_many: header magic, codec id, flags or capacity */
    CIERA_E_SIZES = -9,           /* delta: the blocks' sizes do not add up to the header's needed bytes */
};

int ciera_abi(void) { return CIERA_ABI; }

int ciera_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Threads a call runs: without OpenMP (setup.py's last fall-back) the parallel regions run once,
 * as chunk 0, so the work must be one chunk. */
static int clamp_threads(int threads) {
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

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Bits [0, k) set, for any k >= 0 (BZHI reads only the index's low byte). */
ALWAYS_INLINE uint64_t lowmask64(int64_t k) { return k >= 64 ? ~0ull : k <= 0 ? 0 : ((1ull << k) - 1); }

/* Scratch of the calling thread, kept for its next call (OpenMP workers persist): what threads
 * > 0 encode before its place is known. Grows to the largest size asked for; never shrinks. */
static uint8_t *thread_scratch(size_t nbytes) {
    static _Thread_local uint8_t *buf = NULL;
    static _Thread_local size_t cap = 0;
    if (nbytes > cap) {
        free(buf);
        buf = malloc(nbytes);
        cap = buf ? nbytes : 0;
    }
    return buf;
}

/* Work shared out as it is done, not in fixed shares: a slower, busier or preempted thread (vCPUs
 * of one VM often run 20-30% apart) then never leaves the others waiting on its half. Units
 * [0, units) are claimed in grains from both ends of one shared (front, back) pair, one CAS per
 * claim: thread 0 from the front, so its grains run on from unit 0 (it writes its output in
 * place), every other thread from the back. Front and back are 32-bit halves: units < 2^32. */
typedef struct {
    uint64_t word; /* front (low half) and back (high half), in units */
    int64_t grain, threads;
} ciera_claims;

static void claims_init(ciera_claims *c, int64_t units, int64_t grain, int threads) {
    c->word = (uint64_t)units << 32;
    c->grain = grain < 1 ? 1 : grain;
    c->threads = threads;
}

/* Grains that `units` units span (at least one, so a walk over pieces always moves on). */
static int64_t grains_of(int64_t units, int64_t grain) {
    const int64_t g = (units + grain - 1) / grain;
    return g > 0 ? g : 1;
}

/* Units a thread other than 0 may claim into its scratch: 1.5x an even share of `units`, in whole
 * grains (then it stops claiming and thread 0 takes the rest). */
static int64_t claims_share(int64_t units, int64_t grain, int threads) {
    return min64(units, ((3 * units + 2 * threads - 1) / (2 * threads) + grain - 1) / grain * grain);
}

/* Copies what of [off, off + bytes) (from src) lies in [lo, hi): a thread's even range of a copy. */
static void copy_overlap(uint8_t *out, int64_t off, const uint8_t *src, int64_t bytes, int64_t lo, int64_t hi) {
    const int64_t a = off > lo ? off : lo, b = min64(off + bytes, hi);
    if (a < b) memcpy(out + a, src + (a - off), (size_t)(b - a));
}

/* For the tests: CIERA_NATIVE_STALL=k makes thread k of every claimed pass start 2 ms late, so
 * the others claim what they may (read per call, as the other CIERA_NATIVE_* are). */
static int claims_stalled(void) {
    const char *v = getenv("CIERA_NATIVE_STALL");
    return v && *v ? atoi(v) : -1;
}

static void claims_stall(int k, int stalled) {
#ifdef _OPENMP
    if (k == stalled)
        for (const double t0 = omp_get_wtime(); omp_get_wtime() - t0 < 2e-3;) {
        }
#else
    (void)k, (void)stalled;
#endif
}

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

/* CPU features, checked per call (the environment variables let the tests force each path). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(CIERA_NO_CLONES)
#define CIERA_X86 1
#include <immintrin.h>
#define AVX2_FN __attribute__((target("avx2,bmi,bmi2")))
#define AVX512_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx2,bmi,bmi2,popcnt")))
#define AVX512_INLINE AVX512_FN static inline __attribute__((always_inline))
/* Byte indices 0, 2, ..., 126: a two-register byte permute with them takes the low bytes of 64
 * 16-bit values held in two registers (with them + 1, the high bytes). */
static const uint8_t even_bytes[64] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                       32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
                                       64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94,
                                       96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};
/* CIERA_NATIVE_AVX2=0 in the environment takes the portable paths (the tests compare both). */
static int cpu_avx2(void) {
    const char *env = getenv("CIERA_NATIVE_AVX2");
    if (env && env[0] == '0') return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
}
/* CIERA_NATIVE_AVX512=0 keeps the AVX2 paths (the tests compare all three). */
static int cpu_avx512(void) {
    const char *env = getenv("CIERA_NATIVE_AVX512");
    if ((env && env[0] == '0') || !cpu_avx2()) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
}
#else
#define CIERA_X86 0
static int cpu_avx2(void) { return 0; }
static int cpu_avx512(void) { return 0; }
#endif

/* ============================================================================================
 * exponent_reuse
 * ============================================================================================ */
typedef struct {
    int64_t numel, block_size, total_bits, exp_bits, mant_bits;
    int64_t sm_bytes, n_planes, plane_bytes;
    int64_t off_signmant, off_planes, off_bitmap, off_exps;
} ciera_er_layout;

/* Values a chunk must be a multiple of: whole bitmap bytes (8 blocks) and whole plane bytes. */
static int64_t er_unit(const ciera_er_layout *l) {
    int64_t u = 8 * l->block_size;
    return u < 64 ? 64 : u;
}

static int64_t er_slots(const ciera_er_layout *l, int64_t capacity) {
    int64_t nb = (l->numel + l->block_size - 1) / l->block_size;
    int64_t s = (capacity - l->off_exps) / l->block_size;
    if (capacity < l->off_exps) s = 0;
    return s < 0 ? 0 : min64(s, nb);
}

/* Sign|mantissa bytes, planes, bitmap and new state for values [lo, hi) (lo a multiple of 64). */
ALWAYS_INLINE int64_t er_encode_range(const ciera_er_layout *l, int W, int M, int E, int SMB, int NP,
                                      const void *shard, uint8_t *state, uint8_t *out, int64_t lo, int64_t hi,
                                      uint8_t *exps, int64_t room) {
    const int64_t B = l->block_size;
    const int64_t sub = B < 64 ? B : 64;
    const int lb = __builtin_ctzll((unsigned long long)B); /* B is a power of two */
    const uint32_t emask = (1u << E) - 1, mmask = (1u << M) - 1;
    uint8_t *sm_out = out + l->off_signmant;
    uint8_t *bitmap = out + l->off_bitmap;
    int64_t nb = (l->numel + B - 1) / B;
    int64_t b_lo = lo / B, b_hi = (hi + B - 1) / B;
    int64_t byte_lo = b_lo / 8, byte_hi = min64((b_hi + 7) / 8, (nb + 7) / 8);
    if (byte_hi > byte_lo) memset(bitmap + byte_lo, 0, (size_t)(byte_hi - byte_lo));
    int64_t n_changed = 0;
    for (int64_t t0 = lo; t0 < hi; t0 += 64) {
        int cnt = (int)min64(64, hi - t0);
        for (int q = 0; q < 64 * W / 8; q += 64) /* hints, 2048 values ahead (never fault) */
            __builtin_prefetch((const uint8_t *)shard + (t0 + 2048) * (W / 8) + q);
        __builtin_prefetch(state + t0 + 2048);
        uint8_t d[64];
        uint64_t planes[3] = {0, 0, 0};
        for (int j = 0; j < cnt; j++) {
            uint32_t u = load_u(shard, t0 + j, W);
            uint8_t e = (uint8_t)((u >> M) & emask);
            uint32_t sm = (u & mmask) | ((u >> (W - 1)) << M);
            d[j] = e ^ state[t0 + j];
            state[t0 + j] = e;
            for (int k = 0; k < SMB; k++) sm_out[(t0 + j) * SMB + k] = (uint8_t)(sm >> (8 * k));
            for (int p = 0; p < NP; p++) planes[p] |= (uint64_t)((sm >> (8 * SMB + p)) & 1) << j;
        }
        for (int j = cnt; j < 64; j++) d[j] = 0;
        for (int p = 0; p < NP; p++) {
            uint8_t *dst = out + l->off_planes + p * l->plane_bytes + t0 / 8;
            for (int k = 0; k < (cnt + 7) / 8; k++) dst[k] = (uint8_t)(planes[p] >> (8 * k));
        }
        for (int s = 0; s * sub < cnt; s++) {
            int any;
            if (sub == 8) {
                any = load64(d + 8 * s) != 0;
            } else {
                uint8_t o = 0;
                for (int j = 0; j < sub; j++) o |= d[s * sub + j];
                any = o != 0;
            }
            if (any) {
                int64_t b = (t0 + s * sub) >> lb;
                bitmap[b >> 3] |= (uint8_t)(1u << (b & 7));
                if (B <= 64 && n_changed < room) { /* the block's new exponents, still in L1 */
                    int64_t v0 = b * B, valid = min64(B, l->numel - v0);
                    memcpy(exps + n_changed * B, state + v0, (size_t)valid);
                    if (valid < B) memset(exps + n_changed * B + valid, 0, (size_t)(B - valid));
                }
                n_changed++;
            }
        }
    }
    return n_changed;
}

/* Encodes values [lo, hi); blocks of <= 64 values also append the exponents of their first `room`
 * changed blocks to exps. Returns the number of changed blocks. */
HOT static int64_t er_encode_range_dispatch(const ciera_er_layout *l, const void *shard, uint8_t *state,
                                            uint8_t *out, int64_t lo, int64_t hi, uint8_t *exps, int64_t room) {
    if (l->total_bits == 16 && l->mant_bits == 7)
        return er_encode_range(l, 16, 7, 8, 1, 0, shard, state, out, lo, hi, exps, room);
    if (l->total_bits == 16 && l->mant_bits == 10)
        return er_encode_range(l, 16, 10, 5, 1, 3, shard, state, out, lo, hi, exps, room);
    return er_encode_range(l, 32, 23, 8, 3, 0, shard, state, out, lo, hi, exps, room);
}

#if CIERA_X86
#define ER_STAGE 512 /* changed blocks' exponents staged before they are copied to their slots */
/* bf16, B = 8 on AVX-512 (VBMI): one 64-value tile per step, as the portable loop but in
 * registers. The tile's low and high bytes come out of its two vectors by two byte permutes;
 * sign|mantissa = high bit 7 | low bits 0-6, exponent = high << 1 | low >> 7. Its 8 blocks are the
 * tile's 8 qwords of exponent bytes: one test gives the tile's bitmap byte, one compress its
 * changed blocks' exponents. Those go to a staging buffer by whole-register stores, copied out a
 * few KB at a time (never past `room` slots, nothing else written): a masked store per tile into
 * the slots, each overlapping the last, took two thirds of the time (0.6 -> 0.25 ms per 4M values).
 * Encodes the whole tiles of [lo, hi) (lo a multiple of 64); *end: where they stop. */
AVX512_FN static int64_t er_encode_bf16_b8_avx512(const ciera_er_layout *l, const uint16_t *shard, uint8_t *state,
                                                  uint8_t *out, int64_t lo, int64_t hi, uint8_t *exps, int64_t room,
                                                  int64_t *end) {
    uint8_t *sm_out = out + l->off_signmant, *bitmap = out + l->off_bitmap;
    const __m512i even = _mm512_loadu_si512(even_bytes), odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
    const __m512i m80 = _mm512_set1_epi8((char)0x80), one = _mm512_set1_epi8(1);
    uint8_t stage[8 * ER_STAGE + 64];
    int64_t n_changed = 0, staged = 0, t0 = lo; /* n_changed counts the staged slots too */
#define CIERA_FLUSH()                                                                              \
    do {                                                                                           \
        const int64_t first = n_changed - staged, fit = min64(staged, room - first);                \
        if (fit > 0) memcpy(exps + first * 8, stage, (size_t)(fit * 8));                           \
        staged = 0;                                                                                \
    } while (0)
    for (; t0 + 64 <= hi; t0 += 64) {
        const __m512i a = _mm512_loadu_si512(shard + t0), b = _mm512_loadu_si512(shard + t0 + 32);
        const __m512i L = _mm512_permutex2var_epi8(a, even, b), H = _mm512_permutex2var_epi8(a, odd, b);
        const __m512i sm = _mm512_ternarylogic_epi32(m80, H, L, 0xCA);                       /* m ? H : L */
        const __m512i e = _mm512_ternarylogic_epi32(_mm512_add_epi8(H, H), _mm512_srli_epi16(L, 7), one, 0xF8);
        const __m512i old = _mm512_loadu_si512(state + t0);
        _mm512_storeu_si512(state + t0, e);
        _mm512_storeu_si512(sm_out + t0, sm);
        const __mmask8 ch = _mm512_test_epi64_mask(_mm512_xor_si512(e, old), _mm512_xor_si512(e, old));
        bitmap[t0 >> 6] = (uint8_t)ch;
        const int c = __builtin_popcount(ch);
        _mm512_storeu_si512(stage + staged * 8, _mm512_maskz_compress_epi64(ch, e));
        staged += c;
        n_changed += c;
        if (staged > ER_STAGE - 8) CIERA_FLUSH();
    }
    CIERA_FLUSH();
#undef CIERA_FLUSH
    *end = t0;
    return n_changed;
}
#endif

/* bf16 with blocks of 8 (the default) has the AVX-512 paths below, where the CPU has them. */
static int er_fast(const ciera_er_layout *l) {
    return l->total_bits == 16 && l->mant_bits == 7 && l->block_size == 8 && cpu_avx512();
}

/* Sign|mantissa, bitmap, exponents of the changed blocks (their first `room` slots into exps) and
 * new state for values [lo, hi) (lo a multiple of 64); returns the number of changed blocks. */
static int64_t er_encode_chunk(const ciera_er_layout *l, const void *shard, uint8_t *state, uint8_t *out, int64_t lo,
                               int64_t hi, uint8_t *exps, int64_t room, int fast) {
    int64_t c = 0;
#if CIERA_X86
    if (fast) c = er_encode_bf16_b8_avx512(l, (const uint16_t *)shard, state, out, lo, hi, exps, room, &lo);
#else
    (void)fast;
#endif
    if (lo >= hi) return c;
    const int64_t rest = room - c < 0 ? 0 : room - c;
    return c + er_encode_range_dispatch(l, shard, state, out, lo, hi, exps + min64(c, room) * l->block_size, rest);
}

static int er_supported(const ciera_er_layout *l) {
    int bf16 = l->total_bits == 16 && l->mant_bits == 7 && l->exp_bits == 8 && l->sm_bytes == 1 && l->n_planes == 0;
    int fp16 = l->total_bits == 16 && l->mant_bits == 10 && l->exp_bits == 5 && l->sm_bytes == 1 && l->n_planes == 3;
    int fp32 = l->total_bits == 32 && l->mant_bits == 23 && l->exp_bits == 8 && l->sm_bytes == 3 && l->n_planes == 0;
    return (bf16 || fp16 || fp32) && l->block_size >= 1 && (l->block_size & (l->block_size - 1)) == 0 &&
           l->numel >= 0 && l->numel < CIERA_MAX_NUMEL;
}

/* Set bits [blo, bhi) of a bitmap; blo is a multiple of 8 (chunks own whole bitmap bytes). */
static int64_t popcount_blocks(const uint8_t *p, int64_t blo, int64_t bhi) {
    int64_t c = 0, i = blo / 8, end = bhi / 8;
    for (; i + 8 <= end; i += 8) c += __builtin_popcountll(load64(p + i));
    for (; i < end; i++) c += __builtin_popcount(p[i]);
    if (bhi % 8) c += __builtin_popcount(p[end] & ((1u << (bhi % 8)) - 1));
    return c;
}

/* Units per claim of exponent_reuse's passes: about 16384 values, at least one unit. */
static int64_t er_grain(const ciera_er_layout *l) {
    const int64_t g = 16384 / er_unit(l);
    return g > 0 ? g : 1;
}

/* A claim of exponent_reuse's encode by a thread other than 0 (pieces[lo / grain]): its units and
 * changed blocks, whose exponents (blocks of <= 64 values) wait at src in the thread's scratch. */
typedef struct {
    const uint8_t *src;
    int64_t changed, units;
} er_piece;

/* Exponents of the changed blocks among [blo, bhi) (blo a multiple of 8), in block order, from
 * the (updated) state into slots [slot, slots). */
static void er_exps_from_state(const ciera_er_layout *l, const uint8_t *state, uint8_t *out, int64_t blo,
                               int64_t bhi, int64_t slot, int64_t slots) {
    const int64_t n = l->numel, B = l->block_size;
    const uint8_t *bitmap = out + l->off_bitmap;
    uint8_t *exps = out + l->off_exps;
    for (int64_t byte = blo / 8; byte < (bhi + 7) / 8 && slot < slots; byte++) {
        unsigned bits = bitmap[byte];
        while (bits && slot < slots) {
            int64_t b = byte * 8 + __builtin_ctz(bits);
            bits &= bits - 1;
            int64_t v0 = b * B, valid = min64(B, n - v0);
            memcpy(exps + slot * B, state + v0, (size_t)valid);
            if (valid < B) memset(exps + slot * B + valid, 0, (size_t)(B - valid));
            slot++;
        }
    }
}

/* Encodes units [lo, hi) of a claim (exponents of changed blocks of <= 64 values: their first
 * `room` into exps); returns its changed blocks. */
static int64_t er_encode_claim(const ciera_er_layout *l, const void *shard, uint8_t *state, uint8_t *out, int64_t lo,
                               int64_t hi, uint8_t *exps, int64_t room, int fast) {
    const int64_t n = l->numel, B = l->block_size, unit = er_unit(l);
    const int64_t v_lo = lo * unit, v_hi = min64(hi * unit, n);
    const int64_t c = er_encode_chunk(l, shard, state, out, v_lo, v_hi, exps, room, fast);
    return B <= 64 ? c : popcount_blocks(out + l->off_bitmap, v_lo / B, (v_hi + B - 1) / B);
}

/* Returns the bytes needed (>= 0) or a negative error code. Shared out by claims (ciera_claims):
 * thread 0 encodes from the front, with blocks of <= 64 values writing the changed blocks'
 * exponents straight into their slots while the tile is hot; the others encode from the back,
 * those exponents into scratch, copied to their slots once every claim's count is known. Larger
 * blocks copy the exponents from the state afterwards, by the bitmap. */
int64_t ciera_er_encode(const ciera_er_layout *l, const void *shard, uint8_t *state, uint8_t *out,
                        int64_t capacity, int threads) {
    if (!er_supported(l) || capacity < l->off_exps) return CIERA_E_ARGS;
    const int64_t n = l->numel, B = l->block_size, unit = er_unit(l);
    const int64_t slots = er_slots(l, capacity), units = (n + unit - 1) / unit;
    if (n == 0) return l->off_exps;
    const int64_t G = er_grain(l), ng = (units + G - 1) / G;
    threads = clamp_threads(threads);
    if (threads > units) threads = (int)units;
    er_piece *pieces = calloc((size_t)ng, sizeof(er_piece));
    if (!pieces) return CIERA_E_NOMEM;
    const int64_t share = claims_share(units, G, threads);
    const int fast = er_fast(l), inline_exps = B <= 64, stalled = claims_stalled();
    int64_t front_changed = 0, front_units = 0, back_changed = 0;
    ciera_claims cl;
    claims_init(&cl, units, G, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int k = CIERA_THREAD_ID();
        int64_t lo, hi;
        claims_stall(k, stalled);
        if (k == 0) {
            int64_t base = 0;
            while (claim(&cl, 0, 1, INT64_MAX, &lo, &hi)) {
                uint8_t *dst = inline_exps ? out + l->off_exps + min64(base, slots) * B : NULL;
                base += er_encode_claim(l, shard, state, out, lo, hi, dst,
                                        inline_exps && slots > base ? slots - base : 0, fast);
                front_units = hi;
            }
            front_changed = base;
        } else {
            uint8_t *scratch = inline_exps ? thread_scratch((size_t)(share * unit)) : NULL;
            int64_t used_units = 0, used = 0; /* scratch bytes */
            while ((scratch || !inline_exps) && used_units + G <= share &&
                   claim(&cl, 1, 1, share - used_units, &lo, &hi)) {
                uint8_t *dst = inline_exps ? scratch + used : NULL;
                const int64_t cnt = er_encode_claim(l, shard, state, out, lo, hi, dst,
                                                    inline_exps ? (share * unit - used) / B : 0, fast);
                pieces[lo / G] = (er_piece){.src = dst, .changed = cnt, .units = hi - lo};
                used += inline_exps ? cnt * B : 0;
                used_units += hi - lo;
            }
        }
#pragma omp barrier
        const int64_t fg = (front_units + G - 1) / G;
        int64_t back = 0; /* the back pieces' changed blocks (every thread the same) */
        for (int64_t g = fg; g < ng; g += grains_of(pieces[g].units, G)) back += pieces[g].changed;
        if (k == 0) back_changed = back;
        if (inline_exps) { /* the back pieces' exponents to their slots, in even slot ranges per thread */
            const int64_t s0 = front_changed, s1 = min64(front_changed + back, slots > s0 ? slots : s0);
            const int64_t c_lo = (s0 + (s1 - s0) * k / threads) * B, c_hi = (s0 + (s1 - s0) * (k + 1) / threads) * B;
            int64_t slot = s0;
            for (int64_t g = fg; g < ng && slot * B < c_hi; slot += pieces[g].changed, g += grains_of(pieces[g].units, G))
                copy_overlap(out + l->off_exps, slot * B, pieces[g].src, pieces[g].changed * B, c_lo, c_hi);
        } else { /* the front range by thread 0, back pieces round robin */
#define ER_BLOCKS_TO(u) ((min64((u) * unit, n) + B - 1) / B) /* blocks of units [0, u) */
            if (k == 0) er_exps_from_state(l, state, out, 0, ER_BLOCKS_TO(front_units), 0, slots);
            int64_t slot = front_changed, i = 0;
            for (int64_t g = fg; g < ng && slot < slots; slot += pieces[g].changed, g += grains_of(pieces[g].units, G), i++)
                if (i % threads == k)
                    er_exps_from_state(l, state, out, g * G * unit / B, ER_BLOCKS_TO(g * G + pieces[g].units), slot, slots);
#undef ER_BLOCKS_TO
        }
    }
    free(pieces);
    return l->off_exps + (front_changed + back_changed) * B;
}

/* Exponents of the changed blocks among [blo, bhi) from slot *slot on (block order). */
ALWAYS_INLINE void er_patch_blocks(const ciera_er_layout *l, int W, int M, uint32_t exp_field, const uint8_t *payload,
                                   void *target, int64_t blo, int64_t bhi, int64_t *slot) {
    const int64_t B = l->block_size;
    const uint8_t *bitmap = payload + l->off_bitmap;
    const uint8_t *exps = payload + l->off_exps;
    for (int64_t b = blo; b < bhi; b++) {
        if (!((bitmap[b >> 3] >> (b & 7)) & 1)) continue;
        int64_t v0 = b * B, valid = min64(B, l->numel - v0);
        const uint8_t *src = exps + *slot * B;
        for (int64_t j = 0; j < valid; j++) {
            uint32_t u = load_u(target, v0 + j, W);
            store_u(target, v0 + j, (u & ~exp_field) | ((uint32_t)src[j] << M), W);
        }
        ++*slot;
    }
}

ALWAYS_INLINE void er_decode_range(const ciera_er_layout *l, int W, int M, int E, int SMB, int NP,
                                   const uint8_t *payload, void *target, int64_t lo, int64_t hi, int64_t slot) {
    const int64_t B = l->block_size;
    const uint32_t exp_field = ((1u << E) - 1) << M, mmask = (1u << M) - 1, sign_bit = 1u << (W - 1);
    const uint8_t *sm_in = payload + l->off_signmant;
    for (int64_t t0 = lo; t0 < hi; t0 += 64) {
        int cnt = (int)min64(64, hi - t0);
        for (int q = 0; q < 64 * W / 8; q += 64) /* hints, 2048 values ahead (never fault) */
            __builtin_prefetch((const uint8_t *)target + (t0 + 2048) * (W / 8) + q);
        __builtin_prefetch(sm_in + (t0 + 2048) * SMB);
        uint64_t planes[3] = {0, 0, 0};
        for (int p = 0; p < NP; p++) {
            const uint8_t *src = payload + l->off_planes + p * l->plane_bytes + t0 / 8;
            for (int k = 0; k < (cnt + 7) / 8; k++) planes[p] |= (uint64_t)src[k] << (8 * k);
        }
        for (int j = 0; j < cnt; j++) {
            uint32_t sm = 0;
            for (int k = 0; k < SMB; k++) sm |= (uint32_t)sm_in[(t0 + j) * SMB + k] << (8 * k);
            for (int p = 0; p < NP; p++) sm |= (uint32_t)((planes[p] >> j) & 1) << (8 * SMB + p);
            uint32_t u = load_u(target, t0 + j, W);
            u = (u & exp_field) | (sm & mmask) | (((sm >> M) & 1) ? sign_bit : 0);
            store_u(target, t0 + j, u, W);
        }
        /* Blocks of at most 64 values lie inside one tile (tiles start at multiples of 64): patch
           their exponents while the tile is in L1, rather than in a second pass over the target. */
        if (B <= 64) er_patch_blocks(l, W, M, exp_field, payload, target, t0 / B, (t0 + cnt + B - 1) / B, &slot);
    }
    if (B > 64) er_patch_blocks(l, W, M, exp_field, payload, target, lo / B, (hi + B - 1) / B, &slot);
}

HOT static void er_decode_range_dispatch(const ciera_er_layout *l, const uint8_t *payload, void *target, int64_t lo,
                                     int64_t hi, int64_t slot) {
    if (l->total_bits == 16 && l->mant_bits == 7)
        er_decode_range(l, 16, 7, 8, 1, 0, payload, target, lo, hi, slot);
    else if (l->total_bits == 16 && l->mant_bits == 10)
        er_decode_range(l, 16, 10, 5, 1, 3, payload, target, lo, hi, slot);
    else
        er_decode_range(l, 32, 23, 8, 3, 0, payload, target, lo, hi, slot);
}

#if CIERA_X86
/* Inverse of er_encode_bf16_b8_avx512 over the whole tiles of [lo, hi), changed blocks from slot
 * on: each tile's changed blocks' exponents are loaded under a mask (slots past the bitmap's count
 * are never read) and expanded to their qwords; for the others the target's own high bits 0-6 and
 * low bit 7 stay. *end: where the tiles stop; returns the next slot. */
static const uint8_t er_ilv[128] = {
    0,  64,  1,  65,  2,  66,  3,  67,  4,  68,  5,  69,  6,  70,  7,  71,  8,  72,  9,  73,  10, 74,
    11, 75,  12, 76,  13, 77,  14, 78,  15, 79,  16, 80,  17, 81,  18, 82,  19, 83,  20, 84,  21, 85,
    22, 86,  23, 87,  24, 88,  25, 89,  26, 90,  27, 91,  28, 92,  29, 93,  30, 94,  31, 95,  32, 96,
    33, 97,  34, 98,  35, 99,  36, 100, 37, 101, 38, 102, 39, 103, 40, 104, 41, 105, 42, 106, 43, 107,
    44, 108, 45, 109, 46, 110, 47, 111, 48, 112, 49, 113, 50, 114, 51, 115, 52, 116, 53, 117, 54, 118,
    55, 119, 56, 120, 57, 121, 58, 122, 59, 123, 60, 124, 61, 125, 62, 126, 63, 127};

AVX512_FN static int64_t er_decode_bf16_b8_avx512(const ciera_er_layout *l, const uint8_t *payload, uint16_t *target,
                                                  int64_t lo, int64_t hi, int64_t slot, int64_t *end) {
    const uint8_t *sm_in = payload + l->off_signmant, *bitmap = payload + l->off_bitmap, *exps = payload + l->off_exps;
    const __m512i even = _mm512_loadu_si512(even_bytes), odd = _mm512_add_epi8(even, _mm512_set1_epi8(1));
    const __m512i i0 = _mm512_loadu_si512(er_ilv), i1 = _mm512_loadu_si512(er_ilv + 64);
    const __m512i m80 = _mm512_set1_epi8((char)0x80);
    int64_t t0 = lo;
    for (; t0 + 64 <= hi; t0 += 64) {
        const __m512i a = _mm512_loadu_si512(target + t0), b = _mm512_loadu_si512(target + t0 + 32);
        const __m512i sm = _mm512_loadu_si512(sm_in + t0);
        const __mmask8 ch = (__mmask8)bitmap[t0 >> 6];
        const int c = __builtin_popcount(ch);
        const __m512i e = _mm512_maskz_expand_epi64(ch, _mm512_maskz_loadu_epi64((__mmask8)lowmask64(c), exps + slot * 8));
        slot += c;
        /* exponent bits: high byte bits 0-6 = e >> 1, low byte bit 7 = e & 1 (changed blocks only) */
        __m512i L = _mm512_permutex2var_epi8(a, even, b), H = _mm512_permutex2var_epi8(a, odd, b);
        H = _mm512_mask_blend_epi64(ch, H, _mm512_srli_epi16(e, 1));
        L = _mm512_mask_blend_epi64(ch, L, _mm512_slli_epi16(e, 7));
        const __m512i hi8 = _mm512_ternarylogic_epi32(m80, sm, H, 0xCA), lo8 = _mm512_ternarylogic_epi32(m80, L, sm, 0xCA);
        _mm512_storeu_si512(target + t0, _mm512_permutex2var_epi8(lo8, i0, hi8));
        _mm512_storeu_si512(target + t0 + 32, _mm512_permutex2var_epi8(lo8, i1, hi8));
    }
    *end = t0;
    return slot;
}
#endif

/* Decodes values [lo, hi) (lo a multiple of 64), changed blocks from slot on. */
static void er_decode_chunk(const ciera_er_layout *l, const uint8_t *payload, void *target, int64_t lo, int64_t hi,
                            int64_t slot, int fast) {
#if CIERA_X86
    if (fast) slot = er_decode_bf16_b8_avx512(l, payload, (uint16_t *)target, lo, hi, slot, &lo);
#else
    (void)fast;
#endif
    if (lo < hi) er_decode_range_dispatch(l, payload, target, lo, hi, slot);
}

/* Shared out by claims (ciera_claims) of whole grains; grain g's first slot comes from the
 * bitmap's counts before it (one serial popcount pass over the bitmap, 1/64 of the values). */
int ciera_er_decode(const ciera_er_layout *l, const uint8_t *payload, int64_t length, void *target, int threads) {
    if (!er_supported(l)) return CIERA_E_ARGS;
    const int64_t n = l->numel, B = l->block_size, unit = er_unit(l);
    if (length < l->off_exps) return CIERA_E_TRUNCATED;
    if (n == 0) return CIERA_OK;
    const int64_t units = (n + unit - 1) / unit;
    const int64_t G = er_grain(l), ng = (units + G - 1) / G;
    threads = clamp_threads(threads);
    if (threads > ng) threads = (int)ng;
    const uint8_t *bitmap = payload + l->off_bitmap;
    int64_t *base = malloc((size_t)(ng + 1) * sizeof(int64_t)); /* grain g's first slot */
    if (!base) return CIERA_E_NOMEM;
    base[0] = 0;
    for (int64_t g = 0; g < ng; g++)
        base[g + 1] = base[g] + popcount_blocks(bitmap, g * G * unit / B, (min64((g + 1) * G * unit, n) + B - 1) / B);
    if (base[ng] > er_slots(l, length)) {
        free(base);
        return CIERA_E_TOO_MANY_BLOCKS;
    }
    const int fast = er_fast(l), stalled = claims_stalled();
    ciera_claims cl;
    claims_init(&cl, units, G, threads);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int k = CIERA_THREAD_ID();
        int64_t lo, hi;
        claims_stall(k, stalled);
        while (claim(&cl, k > 0, 1, INT64_MAX, &lo, &hi))
            er_decode_chunk(l, payload, target, lo * unit, min64(hi * unit, n), base[lo / G], fast);
    }
    free(base);
    return CIERA_OK;
}

/* ============================================================================================
 * delta
 * ============================================================================================ */
typedef struct {
    int64_t numel, block_size, total_bits, exp_bits, mant_bits;
    int64_t group_size, count_bytes, index_bytes, high_bytes;
    int64_t off_table, off_counts, off_data;
} ciera_delta_layout;

#define DELTA_MAX_BLOCK 4096

static int delta_supported(const ciera_delta_layout *l) {
    int fmt = (l->total_bits == 16 && ((l->mant_bits == 7 && l->exp_bits == 8) || (l->mant_bits == 10 && l->exp_bits == 5))) ||
              (l->total_bits == 32 && l->mant_bits == 23 && l->exp_bits == 8);
    int64_t B = l->block_size;
    return fmt && B >= 8 && B <= DELTA_MAX_BLOCK && (B & (B - 1)) == 0 && l->numel >= 0 && l->numel < CIERA_MAX_NUMEL &&
           l->group_size == (B < 64 ? B : 64) && l->count_bytes == (B < 255 ? 1 : 2) &&
           l->index_bytes == (B <= 256 ? 1 : 2) && l->high_bytes == l->total_bits / 8;
}

ALWAYS_INLINE uint32_t zigzag_u(uint32_t u_new, uint32_t u_old, int W) {
    uint32_t mask = W == 32 ? 0xFFFFFFFFu : ((1u << W) - 1);
    uint32_t d = (u_new - u_old) & mask;
    return ((d << 1) ^ (0u - (d >> (W - 1)))) & mask;
}

ALWAYS_INLINE uint32_t unzigzag_add_u(uint32_t u_old, uint32_t z, int W) {
    uint32_t mask = W == 32 ? 0xFFFFFFFFu : ((1u << W) - 1);
    return (u_old + ((z >> 1) ^ (0u - (z & 1)))) & mask;
}

/* Bits of z (0 for 0), without a branch (z is 0 for about half the values, unpredictably). Below
 * 2^24 the float conversion is exact and its exponent field is the bit length + 126: that form
 * vectorises; wider values use the count of leading zeros. */
ALWAYS_INLINE int bitlen_u(uint32_t z) { return 32 - __builtin_clz(z | 1) - (z == 0); }

ALWAYS_INLINE int bitlen_w(uint32_t z, int W) {
    if (W > 24) return bitlen_u(z);
    float f = (float)(int32_t)z;
    uint32_t b;
    memcpy(&b, &f, 4);
    int t = (int)(b >> 23) - 126;
    return t < 0 ? 0 : t;
}

/* Width lookups: ww[j] = table[idx[j]] (one width per previous exponent). This byte gather is
 * the hot spot of both directions; on AVX2 it is 16-entry shuffles (pshufb) over the rows of the
 * table that hold a nonzero width (a value whose row is all zeros gets 0 either way), usually 2-3
 * of the 16 for real weights, so its cost follows the spread of exponents, never the result. */
typedef struct {
    const uint8_t *table; /* 2^E widths */
    uint32_t rows;        /* bit h: table[16h .. 16h+15] holds a nonzero width */
    int avx2;             /* AVX2 + BMI2 paths (checked on this CPU once per call) */
    int avx512;           /* AVX-512 (F, BW, VL, VBMI) + BMI2 paths: implies avx2 */
    uint8_t tab[256];     /* the table, zero padded to 256 entries (whole-vector loads) */
} delta_wctx;

static void delta_wctx_init(delta_wctx *c, const uint8_t *table, int E) {
    c->table = table;
    c->rows = 0;
    c->avx2 = cpu_avx2();
    c->avx512 = c->avx2 && cpu_avx512();
    memset(c->tab, 0, sizeof c->tab);
    memcpy(c->tab, table, (size_t)1 << E);
    for (int i = 0; i < (1 << E); i++)
        if (table[i]) c->rows |= 1u << (i >> 4);
}

#if CIERA_X86
/* n values; idx and ww may be read / written up to 31 bytes past n. */
AVX2_FN static void widths_avx2(const delta_wctx *c, const uint8_t *idx, uint8_t *ww, int n) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int i = 0; i < n; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(idx + i));
        __m256i lo = _mm256_and_si256(v, nib), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
        __m256i r = _mm256_setzero_si256();
        for (uint32_t rows = c->rows; rows; rows &= rows - 1) {
            int h = __builtin_ctz(rows);
            __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(c->table + 16 * h)));
            __m256i sel = _mm256_cmpeq_epi8(hi, _mm256_set1_epi8((char)h));
            r = _mm256_or_si256(r, _mm256_and_si256(_mm256_shuffle_epi8(t, lo), sel));
        }
        _mm256_storeu_si256((__m256i *)(ww + i), r);
    }
}

/* Indices j < n with zm[j] != zz[j] (a value wider than its width), ascending, into exc; returns
 * their count. zz and zm may be read up to 7 values past n. */
AVX2_FN static int exceptions_avx2(const uint32_t *zz, const uint32_t *zm, int n, uint16_t *exc) {
    int k = 0;
    for (int i = 0; i < n; i += 8) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(zz + i)), b = _mm256_loadu_si256((const __m256i *)(zm + i));
        uint32_t m = ~(uint32_t)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b))) & 0xFFu;
        if (n - i < 8) m &= (1u << (n - i)) - 1;
        for (; m; m &= m - 1) exc[k++] = (uint16_t)(i + __builtin_ctz(m));
    }
    return k;
}

/* Sum of each 64-value group's widths, as bytes (groups byte aligned); ww is zero from n up to
 * the next multiple of 64. */
AVX2_FN static int64_t group_bytes64_avx2(const uint8_t *ww, int n) {
    int64_t bytes = 0;
    const __m256i zero = _mm256_setzero_si256();
    for (int g0 = 0; g0 < n; g0 += 64) {
        __m256i s = _mm256_add_epi64(_mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(ww + g0)), zero),
                                     _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(ww + g0 + 32)), zero));
        __m128i t = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        uint64_t bits = (uint64_t)_mm_cvtsi128_si64(t) + (uint64_t)_mm_extract_epi64(t, 1);
        bytes += (int64_t)((bits + 7) / 8);
    }
    return bytes;
}
#endif

#if CIERA_X86
/* Width lookups on AVX-512 VBMI: the 256-entry table is four registers, looked up 64 indices at a
 * time with two two-register byte permutes (index bits 0-6) and a blend on bit 7. ww gets zeros
 * from n up to the next multiple of 64 (it is written that far); idx is read only below n. */
AVX512_INLINE void table_avx512(const delta_wctx *c, __m512i t[4]) {
    for (int q = 0; q < 4; q++) t[q] = _mm512_loadu_si512(c->tab + 64 * q);
}

/* The widths of 64 exponent bytes e: table t[e]. */
AVX512_INLINE __m512i widths64_avx512(const __m512i t[4], __m512i e) {
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(e), _mm512_permutex2var_epi8(t[0], e, t[1]),
                                  _mm512_permutex2var_epi8(t[2], e, t[3]));
}

/* The exponent bytes (field at bit M, under emask) of 64 16-bit values in a and b. */
AVX512_INLINE __m512i exps64_avx512(__m512i a, __m512i b, __m128i sm, __m512i emask) {
    return _mm512_permutex2var_epi8(_mm512_and_si512(_mm512_srl_epi16(a, sm), emask), _mm512_loadu_si512(even_bytes),
                                    _mm512_and_si512(_mm512_srl_epi16(b, sm), emask));
}

/* Bytes of a byte-aligned group whose (<= 64) widths are the bytes of w: ceil(sum / 8). */
AVX512_INLINE int group_bytes_w8(__m512i w) {
    return (int)(((uint64_t)_mm512_reduce_add_epi64(_mm512_sad_epu8(w, _mm512_setzero_si512())) + 7) >> 3);
}

/* z = zigzag(new - old) of 32 16-bit values. */
AVX512_INLINE __m512i zigzag16_avx512(__m512i nw, __m512i old) {
    const __m512i d = _mm512_sub_epi16(nw, old);
    return _mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15));
}

AVX512_FN static void widths_avx512(const delta_wctx *c, const uint8_t *idx, uint8_t *ww, int n) {
    __m512i t[4];
    table_avx512(c, t);
    for (int i = 0; i < n; i += 64) {
        __mmask64 k = lowmask64(n - i);
        _mm512_storeu_si512(ww + i, _mm512_maskz_mov_epi8(k, widths64_avx512(t, _mm512_maskz_loadu_epi8(k, idx + i))));
    }
}

/* Table-mode bytes of the groups of 64 of the `valid` previous 16-bit values at prev, in registers
 * (exponents packed to bytes by one permute, widths by two, group bits by SAD): the sizing pass of
 * a threaded decode, and with ww (not NULL) also the widths (zero up to the next multiple of 64). */
AVX512_FN static int64_t block_bytes16_avx512(const delta_wctx *c, int M, int E, const uint16_t *prev, int valid,
                                              uint8_t *ww, int ahead) {
    __m512i t[4];
    table_avx512(c, t);
    const __m512i emask = _mm512_set1_epi16((short)((1 << E) - 1));
    const __m128i sm = _mm_cvtsi32_si128(M);
    int64_t bytes = 0;
    for (int j = 0; j < valid; j += 64) {
        _mm_prefetch((const char *)(prev + j + ahead), _MM_HINT_T0); /* hints: never fault */
        _mm_prefetch((const char *)(prev + j + ahead + 32), _MM_HINT_T0);
        const __m512i a = _mm512_maskz_loadu_epi16((__mmask32)lowmask64(valid - j), prev + j);
        const __m512i b = _mm512_maskz_loadu_epi16((__mmask32)lowmask64(valid - j - 32), prev + j + 32);
        const __m512i w = _mm512_maskz_mov_epi8(lowmask64(valid - j), widths64_avx512(t, exps64_avx512(a, b, sm, emask)));
        if (ww) _mm512_storeu_si512(ww + j, w);
        bytes += group_bytes_w8(w);
    }
    return bytes;
}

/* Widths of the `valid` previous 16-bit values at prev (exponent field at bit M, E bits) into ww
 * (zero up to the next multiple of 64; ww holds DELTA_MAX_BLOCK + 128 bytes); returns the
 * table-mode bytes of its groups of G values. */
AVX512_FN static int64_t block_widths16_avx512(const delta_wctx *c, int M, int E, const uint16_t *prev, int valid,
                                               int G, uint8_t *ww, int ahead) {
    if (G == 64) return block_bytes16_avx512(c, M, E, prev, valid, ww, ahead);
    uint8_t ee[DELTA_MAX_BLOCK + 64];
    const __m512i emask = _mm512_set1_epi16((short)((1 << E) - 1));
    const __m128i sm = _mm_cvtsi32_si128(M);
    for (int j = 0; j < valid; j += 32) {
        _mm_prefetch((const char *)(prev + j + ahead), _MM_HINT_T0); /* a hint: never faults */
        __m512i old = _mm512_maskz_loadu_epi16((__mmask32)lowmask64(valid - j), prev + j);
        _mm256_storeu_si256((__m256i *)(ee + j), _mm512_cvtepi16_epi8(_mm512_and_si512(_mm512_srl_epi16(old, sm), emask)));
    }
    widths_avx512(c, ee, ww, valid);
    if (G == 64) return group_bytes64_avx2(ww, valid);
    int64_t bytes = 0;
    for (int g0 = 0; g0 < valid; g0 += G) {
        uint32_t gbits = 0;
        for (int j = g0; j < g0 + G; j++) gbits += ww[j]; /* zero past valid */
        bytes += (gbits + 7) / 8;
    }
    return bytes;
}

/* The n <= 64 values of the 16-bit group at p (widths w8, zero from n on) into z[q] (values
 * 16q .. 16q + 15, 32-bit lanes; those at n and past are garbage); returns the group's bytes. No
 * serial chain: every value's bit offset is a prefix sum of the widths (two 32-lane scans), its
 * three bytes (a value spans <= 16 + 7 bits) come out of the group's <= 128 bytes (loaded with a
 * mask: never past the group) by one two-register byte permute per 16 values, then a shift and a
 * mask. */
AVX512_INLINE int unpack64_regs(const uint8_t *p, __m512i w8, int n, __m512i z[4]) {
    static const uint16_t iota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                      16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
    const int gb = group_bytes_w8(w8);
    const __m512i lo = _mm512_maskz_loadu_epi8(lowmask64(gb), p), hi = _mm512_maskz_loadu_epi8(lowmask64(gb - 64), p + 64);
    const __m512i wa = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(w8)), wb = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(w8, 1));
    const __m512i io = _mm512_loadu_si512(iota);
    __m512i a = wa, b = wb;
    for (int s = 1; s < 32; s *= 2) {
        const __m512i idx = _mm512_sub_epi16(io, _mm512_set1_epi16((short)s));
        const __mmask32 km = (__mmask32)(0xFFFFFFFFu << s);
        a = _mm512_add_epi16(a, _mm512_maskz_permutexvar_epi16(km, idx, a));
        b = _mm512_add_epi16(b, _mm512_maskz_permutexvar_epi16(km, idx, b));
    }
    b = _mm512_add_epi16(b, _mm512_permutexvar_epi16(_mm512_set1_epi16(31), a));
    a = _mm512_sub_epi16(a, wa); /* exclusive: bit offset of each value */
    b = _mm512_sub_epi16(b, wb);
    const __m512i bcast = _mm512_set_epi32(0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0,
                                           0x0C0C0C0C, 0x08080808, 0x04040404, 0, 0x0C0C0C0C, 0x08080808, 0x04040404, 0);
    const __m512i seq = _mm512_set1_epi32(0x03020100), seven = _mm512_set1_epi32(7), one = _mm512_set1_epi32(1);
#define CIERA_Q(t, off16, w128)                                                                           \
    if (16 * (t) < n) {                                                                                   \
        const __m512i o = _mm512_cvtepu16_epi32(off16), w = _mm512_cvtepu8_epi32(w128);                   \
        const __m512i ix = _mm512_add_epi8(_mm512_shuffle_epi8(_mm512_srli_epi32(o, 3), bcast), seq);    \
        const __m512i v = _mm512_srlv_epi32(_mm512_permutex2var_epi8(lo, ix, hi), _mm512_and_si512(o, seven)); \
        z[t] = _mm512_and_si512(v, _mm512_sub_epi32(_mm512_sllv_epi32(one, w), one));                     \
    }
    CIERA_Q(0, _mm512_castsi512_si256(a), _mm512_castsi512_si128(w8))
    CIERA_Q(1, _mm512_extracti64x4_epi64(a, 1), _mm512_extracti32x4_epi32(w8, 1))
    CIERA_Q(2, _mm512_castsi512_si256(b), _mm512_extracti32x4_epi32(w8, 2))
    CIERA_Q(3, _mm512_extracti64x4_epi64(b, 1), _mm512_extracti32x4_epi32(w8, 3))
#undef CIERA_Q
    return gb;
}

/* unpack64_regs of the group at p (widths ww, read below n only) into zz[0, n) (and garbage up to
 * the next multiple of 16, which a later group overwrites). */
AVX512_FN static int unpack_group16_avx512(const uint8_t *p, const uint8_t *ww, int n, uint32_t *zz) {
    __m512i z[4];
    const int gb = unpack64_regs(p, _mm512_maskz_loadu_epi8(lowmask64(n), ww), n, z);
    if (n > 0) _mm512_storeu_si512(zz, z[0]);
    if (n > 16) _mm512_storeu_si512(zz + 16, z[1]);
    if (n > 32) _mm512_storeu_si512(zz + 32, z[2]);
    if (n > 48) _mm512_storeu_si512(zz + 48, z[3]);
    return gb;
}
#endif

ALWAYS_INLINE void delta_widths(const delta_wctx *c, const uint8_t *idx, uint8_t *ww, int n) {
#if CIERA_X86
    if (c->avx2) {
        widths_avx2(c, idx, ww, n);
        return;
    }
#endif
    for (int j = 0; j < n; j++) ww[j] = c->table[idx[j]];
}

ALWAYS_INLINE int delta_exceptions(const delta_wctx *c, const uint32_t *zz, const uint32_t *zm, int n, uint16_t *exc) {
#if CIERA_X86
    if (c->avx2) return exceptions_avx2(zz, zm, n, exc);
#else
    (void)c;
#endif
    int k = 0;
    for (int j = 0; j < n; j++) {
        exc[k] = (uint16_t)j;
        k += zm[j] != zz[j];
    }
    return k;
}

/* Bytes of the groups of G values over ww[0, n): each group is byte aligned. ww is zero from n
 * up to the next multiple of 64. */
ALWAYS_INLINE int64_t delta_group_bytes(const delta_wctx *c, const uint8_t *ww, int n, int G) {
#if CIERA_X86
    if (c->avx2 && G == 64) return group_bytes64_avx2(ww, n);
#else
    (void)c;
#endif
    int64_t bytes = 0;
    for (int g0 = 0; g0 < n; g0 += G) {
        int g1 = g0 + G < n ? g0 + G : n;
        uint32_t gbits = 0;
        for (int j = g0; j < g1; j++) gbits += ww[j];
        bytes += (gbits + 7) / 8;
    }
    return bytes;
}

/* hist[key[j]]++ for j < n into four interleaved histograms of nh counters (key j into number
 * j % 4): a run of equal keys (most values of a class do not move) would otherwise serialise on one
 * counter's load-add-store. */
ALWAYS_INLINE void count_keys(uint32_t *hist, int64_t nh, const uint16_t *key, int n) {
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        hist[key[j]]++;
        hist[nh + key[j + 1]]++;
        hist[2 * nh + key[j + 2]]++;
        hist[3 * nh + key[j + 3]]++;
    }
    for (; j < n; j++) hist[key[j]]++;
}

ALWAYS_INLINE void delta_hist_range(int W, int M, int E, const void *shard, const void *state, int64_t lo, int64_t hi,
                                    uint32_t *hist) {
    const uint32_t emask = (1u << E) - 1;
    const int64_t nh = ((int64_t)1 << E) * (W + 1);
    uint16_t key[256]; /* counted into four interleaved histograms (count_keys) */
    for (int64_t t0 = lo; t0 < hi; t0 += 256) {
        int cnt = (int)min64(256, hi - t0);
        for (int q = 0; q < 256 * W / 8; q += 64) { /* hints, 1024 values ahead (never fault) */
            __builtin_prefetch((const uint8_t *)shard + (t0 + 1024) * (W / 8) + q);
            __builtin_prefetch((const uint8_t *)state + (t0 + 1024) * (W / 8) + q);
        }
        for (int j = 0; j < cnt; j++) { /* vectorisable */
            uint32_t u_old = load_u(state, t0 + j, W);
            uint32_t z = zigzag_u(load_u(shard, t0 + j, W), u_old, W);
            key[j] = (uint16_t)(((u_old >> M) & emask) * (W + 1) + bitlen_w(z, W));
        }
        count_keys(hist, nh, key, cnt);
    }
}

#if CIERA_X86
#define AVX512CD_FN __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512vbmi2,avx512cd,avx2,bmi,bmi2,popcnt")))
#define HIST_SLOTS 8     /* consecutive exponents whose bit lengths 0-7 are counted in registers */
#define HIST_LEVELS 16    /* bit planes of a counter: up to 2^16 per bit, flushed at 2^14 */
#define HIST_FLUSH 4096   /* iterations (128 values) between flushes: 2^14 inputs per bit at most */
#define HIST_BUF 2048     /* the other keys, counted when this many wait */
_Static_assert(4 * HIST_FLUSH < (1 << HIST_LEVELS), "a flush comes before a count outgrows the planes");

static int cpu_avx512cd(void) {
    return cpu_avx512() && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vbmi2");
}

/* Carry-save adder: (*sum, carry) = a + b + c, bit by bit (ternary-logic XOR3 and majority). */
AVX512_INLINE __m512i csa512(__m512i *sum, __m512i b, __m512i c) {
    const __m512i a = *sum;
    *sum = _mm512_ternarylogic_epi32(a, b, c, 0x96);
    return _mm512_ternarylogic_epi32(a, b, c, 0xE8);
}

/* Adds bit plane v of weight 2^j of group g (bit b of a 16-bit lane counts bin 16 g + b = slot * 8
 * + bit length, in any lane) to hist: keys of exponent e0 + slot. */
AVX512CD_FN static void hist_plane_add(__m512i v, int j, int g, int e0, uint32_t *hist) {
    for (int b = 0; b < 16; b++) {
        const uint32_t c = (uint32_t)__builtin_popcount(_mm512_test_epi16_mask(v, _mm512_set1_epi16((short)(1 << b))));
        const int bin = 16 * g + b;
        hist[(e0 + (bin >> 3)) * 17 + (bin & 7)] += c << j;
    }
}

/* The window's first exponent for values [lo, hi) (at least 4096 of them): the HIST_SLOTS
 * consecutive previous exponents holding the most of 1024 values spread over the range. */
static int hist_window(int M, int E, const uint16_t *state, int64_t lo, int64_t hi) {
    const int n_exp = 1 << E;
    uint32_t ecount[256];
    memset(ecount, 0, sizeof ecount);
    for (int64_t i = 0; i < 1024; i++) ecount[(state[lo + (hi - lo) * i / 1024] >> M) & (uint32_t)(n_exp - 1)]++;
    int e0 = 0;
    uint32_t best = 0, run = 0;
    for (int e = 0; e < n_exp; e++) {
        run += ecount[e] - (e >= HIST_SLOTS ? ecount[e - HIST_SLOTS] : 0);
        if (e >= HIST_SLOTS - 1 && run > best) best = run, e0 = e - (HIST_SLOTS - 1);
    }
    return e0;
}

/* delta_hist_range for 16-bit values on AVX-512 (+CD, VBMI2): the same counts. A scalar increment
 * per value is the floor of the portable loop (about one per cycle). Weights span few exponents,
 * mostly neighbours, and most values move by few ulps, so the values whose previous exponent lies
 * in the window of HIST_SLOTS consecutive exponents holding most of a 1024-value sample
 * (hist_window: chosen once per pass, as its sampling costs ~1024 cache misses), and whose
 * bit length is at most 7, are counted in registers: bin slot * 8 + length (64 bins) becomes one
 * set bit in a 16-bit lane of one of four groups of 16 bins, and each group's bits are summed
 * vertically by carry-save adders into bit planes (a binary counter of planes: about two
 * ternary-logic operations per 32 values and group). Only the other values are incremented one
 * by one, from a compressed buffer, with no branch per step. Which window is chosen changes the
 * speed, never the counts. */
AVX512CD_FN static void hist16_avx512(int M, int E, const uint16_t *shard, const uint16_t *state, int64_t lo,
                                      int64_t hi, int e0, uint32_t *hist) {
    const int64_t nh = ((int64_t)1 << E) * 17;
    const int n_exp = 1 << E;
    if (hi - lo < 4096) {
        delta_hist_range(16, M, E, shard, state, lo, hi, hist);
        return;
    }
    /* group g's counter: planes 0 and 1 in p0[g], p1[g]; plane j >= 2 in planes[j][g], and a
       pending carry of weight 2^j in pend[j][g] while bit j - 2 of `it` is set */
    __m512i planes[HIST_LEVELS][4], pend[HIST_LEVELS][4], p0[4], p1[4];
    memset(planes, 0, sizeof planes);
    for (int g = 0; g < 4; g++) p0[g] = p1[g] = _mm512_setzero_si512();
    const __m512i emask = _mm512_set1_epi16((short)(n_exp - 1)), c17 = _mm512_set1_epi16(17), c16 = _mm512_set1_epi16(16);
    const __m512i top = _mm512_set1_epi32(0x8000), one = _mm512_set1_epi16(1), c8 = _mm512_set1_epi16(8);
    const __m512i ev0 = _mm512_set1_epi16((short)e0);
    const __m128i sm = _mm_cvtsi32_si128(M);
    uint16_t buf[HIST_BUF + 32];
    int nbuf = 0;
    int64_t it = 0; /* iterations (128 values each) since the last flush */
    int64_t t0 = lo;
    for (; t0 + 128 <= hi; t0 += 128) {
        __m512i xa[4], ca[4], c4[4];
        for (int g = 0; g < 4; g++) xa[g] = ca[g] = c4[g] = _mm512_setzero_si512(); /* dead once unrolled */
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) { /* four chunks of 32 values */
            const int64_t t = t0 + 32 * c;
            _mm_prefetch((const char *)(shard + t + 1024), _MM_HINT_T0); /* hints: never fault */
            _mm_prefetch((const char *)(state + t + 1024), _MM_HINT_T0);
            const __m512i o = _mm512_loadu_si512(state + t), nw = _mm512_loadu_si512(shard + t);
            const __m512i z = zigzag16_avx512(nw, o);
            /* bit lengths: 16 - leading zeros of each 16-bit half moved to the top of a 32-bit lane
               with bit 15 set (16 for zero) */
            const __m512i lz_odd = _mm512_lzcnt_epi32(_mm512_or_si512(z, top));
            const __m512i lz_even = _mm512_lzcnt_epi32(_mm512_or_si512(_mm512_slli_epi32(z, 16), top));
            const __m512i L = _mm512_sub_epi16(c16, _mm512_or_si512(lz_even, _mm512_slli_epi32(lz_odd, 16)));
            const __m512i e = _mm512_and_si512(_mm512_srl_epi16(o, sm), emask);
            const __m512i sl = _mm512_sub_epi16(e, ev0); /* the slot: below 8 inside the window */
            const __mmask32 hot = _mm512_cmplt_epu16_mask(sl, c8) & _mm512_cmplt_epu16_mask(L, c8);
            const __m512i bin = _mm512_add_epi16(_mm512_slli_epi16(sl, 3), L);
            /* the other keys, appended to a buffer (no branch per step) and counted from it */
            const __mmask32 rest = (__mmask32)~hot;
            const __m512i k = _mm512_add_epi16(_mm512_mullo_epi16(e, c17), L);
            _mm512_storeu_si512(buf + nbuf, _mm512_maskz_compress_epi16(rest, k));
            nbuf += __builtin_popcount((uint32_t)rest);
            if (nbuf > HIST_BUF - 32) {
                count_keys(hist, nh, buf, nbuf);
                nbuf = 0;
            }
            for (int g = 0; g < 4; g++) { /* group g: one set bit, at bin - 16 g, per hot value */
                const __m512i x = _mm512_maskz_sllv_epi16(hot, one, _mm512_sub_epi16(bin, _mm512_set1_epi16((short)(16 * g))));
                if (!(c & 1)) xa[g] = x;
                else if (c == 1) ca[g] = csa512(&p0[g], xa[g], x);          /* weight 2 */
                else c4[g] = csa512(&p1[g], ca[g], csa512(&p0[g], xa[g], x)); /* weight 4 */
            }
        }
        for (int j = 2; j < HIST_LEVELS; j++) { /* the weight-4 carries up a binary counter of planes */
            if (!((it >> (j - 2)) & 1)) {
                for (int g = 0; g < 4; g++) pend[j][g] = c4[g];
                break;
            }
            for (int g = 0; g < 4; g++) c4[g] = csa512(&planes[j][g], pend[j][g], c4[g]);
        }
        it++;
        if (it == HIST_FLUSH || t0 + 256 > hi) { /* flush: no carry reaches plane 15 */
            for (int g = 0; g < 4; g++) {
                hist_plane_add(p0[g], 0, g, e0, hist);
                hist_plane_add(p1[g], 1, g, e0, hist);
                p0[g] = p1[g] = _mm512_setzero_si512();
                for (int j = 2; j < HIST_LEVELS; j++) {
                    hist_plane_add(planes[j][g], j, g, e0, hist);
                    planes[j][g] = _mm512_setzero_si512();
                    if ((it >> (j - 2)) & 1) hist_plane_add(pend[j][g], j, g, e0, hist);
                }
            }
            it = 0;
        }
    }
    count_keys(hist, nh, buf, nbuf);
    if (t0 < hi) delta_hist_range(16, M, E, shard, state, t0, hi, hist);
}
#endif

/* Bit packing, word at a time. Values are first merged in registers' worth: for W = 16 pairs
 * (<= 32 bits) then quads (<= 64 bits), for W = 32 pairs (<= 64 bits), in independent (vectorisable)
 * loops; the serial part then appends one <= 64-bit chunk per step to a 64-bit accumulator that
 * holds fewer than 8 bits between steps. The stream is the same LSB-first concatenation of the
 * values' low w bits. */

/* Chunks of group [0, n) of zm (values already masked to their widths) and ww; n <= 64, and zm,
 * ww are zero from n up to the next multiple of 4. Returns the number of chunks. */
ALWAYS_INLINE int pack_chunks(int W, const uint32_t *zm, const uint8_t *ww, int n, uint64_t *q, uint8_t *qw) {
    if (W == 16) {
        uint32_t p[32];
        uint8_t pw[32];
        int np = (n + 1) / 2 + ((n + 1) / 2 & 1), nq = np / 2;
        for (int i = 0; i < np; i++) {
            p[i] = zm[2 * i] | (zm[2 * i + 1] << ww[2 * i]);
            pw[i] = (uint8_t)(ww[2 * i] + ww[2 * i + 1]);
        }
        for (int i = 0; i < nq; i++) {
            q[i] = (uint64_t)p[2 * i] | ((uint64_t)p[2 * i + 1] << pw[2 * i]);
            qw[i] = (uint8_t)(pw[2 * i] + pw[2 * i + 1]);
        }
        return nq;
    }
    int nq = (n + 1) / 2;
    for (int i = 0; i < nq; i++) {
        q[i] = (uint64_t)zm[2 * i] | ((uint64_t)zm[2 * i + 1] << ww[2 * i]);
        qw[i] = (uint8_t)(ww[2 * i] + ww[2 * i + 1]);
    }
    return nq;
}

/* Appends the chunks to dst; returns one past the group's last byte. Writes up to 8 bytes past
 * it: dst needs that slack. */
ALWAYS_INLINE uint8_t *pack_stream(const uint64_t *q, const uint8_t *qw, int nq, uint8_t *dst) {
    uint64_t acc = 0;
    unsigned nb = 0; /* bits in acc, < 8 */
    for (int i = 0; i < nq; i++) {
        uint64_t lo = acc | (q[i] << nb);
        memcpy(dst, &lo, 8);
        unsigned t = nb + qw[i], adv = t >> 3; /* t <= 71, adv <= 8 */
        uint64_t spill = (q[i] >> 1) >> (63 - nb); /* the bits of q shifted out of lo */
        acc = adv == 8 ? spill : lo >> (adv * 8);
        dst += adv;
        nb = t & 7;
    }
    if (nb) memcpy(dst, &acc, 8), dst++;
    return dst;
}

ALWAYS_INLINE uint8_t *pack_group(int W, const uint32_t *zm, const uint8_t *ww, int n, uint8_t *dst) {
    uint64_t q[32];
    uint8_t qw[32];
    int nq = pack_chunks(W, zm, ww, n, q, qw);
    return pack_stream(q, qw, nq, dst);
}

#if CIERA_X86
/* Table-mode bytes of groups of G < 64 values over ww (zero past n up to a multiple of 64). */
ALWAYS_INLINE int64_t group_bytes_small(const uint8_t *ww, int n, int G) {
    int64_t bytes = 0;
    for (int g0 = 0; g0 < n; g0 += G) {
        uint32_t gbits = 0;
        for (int j = g0; j < g0 + G; j++) gbits += ww[j];
        bytes += (gbits + 7) / 8;
    }
    return bytes;
}

/* Inclusive prefix sums of the 8 qwords of x (three shifted adds). */
AVX512_INLINE __m512i scan8_epi64(__m512i x) {
    const __m512i zero = _mm512_setzero_si512();
    x = _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 7));
    x = _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 6));
    return _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 4));
}

/* The words of a group whose values merge into 8 octets of <= 64 bits each (their widths sum to
 * <= 64 per eight values: all but about one group in 600 on real weights) at dst, exactly
 * ceil(bits / 8) bytes; returns them. As pack64_regs, over one register: octet i starts at bit
 * O_i in word K_i = O_i / 64 and spills into K_i + 1; the words' running sums at each word's last
 * octet are compressed to lane j = word j. At most 512 bits: nothing spills past word 7. */
AVX512_INLINE int pack_octets64(__m512i oct, __m512i ow, uint8_t *dst) {
    const __m512i zero = _mm512_setzero_si512(), c63 = _mm512_set1_epi64(63);
    __m512i O = scan8_epi64(ow);
    const uint64_t bits = (uint64_t)_mm_extract_epi64(_mm512_extracti32x4_epi32(O, 3), 1);
    O = _mm512_sub_epi64(O, ow); /* exclusive: each octet's first bit */
    const __m512i sh = _mm512_and_si512(O, c63), K = _mm512_srli_epi64(O, 6);
    const __m512i A = scan8_epi64(_mm512_sllv_epi64(oct, sh));
    const __m512i Bs = _mm512_srlv_epi64(_mm512_srli_epi64(oct, 1), _mm512_sub_epi64(c63, sh));
    const __mmask8 m = _mm512_cmpneq_epi64_mask(K, _mm512_alignr_epi64(_mm512_set1_epi64(-1), K, 1));
    const int nw = __builtin_popcount(m);
    const __m512i xa = _mm512_maskz_compress_epi64(m, A), xb = _mm512_maskz_compress_epi64(m, Bs);
    /* word j < nw: SA[j] - SA[j-1] + spill[j-1]; word nw: spill[nw-1] (0 when it lies past bit 512) */
    const __m512i d = _mm512_maskz_sub_epi64((__mmask8)lowmask64(nw), xa, _mm512_alignr_epi64(xa, zero, 7));
    const int gb = (int)((bits + 7) >> 3);
    _mm512_mask_storeu_epi8(dst, lowmask64(gb), _mm512_add_epi64(d, _mm512_alignr_epi64(xb, zero, 7)));
    return gb;
}

/* Packs a group of 64 16-bit values (z masked to their widths, and the widths, 32 per register;
 * zero widths past the group's values) at dst, exactly its ceil(bits / 8) bytes; returns them. No serial chain:
 * values merge into pairs (32-bit lanes) and quads (64-bit lanes, <= 64 bits each) by variable
 * shifts; quad i starts at bit O_i (a prefix sum) in 64-bit word k_i = O_i / 64, where its low
 * part goes and its high part spills into word k_i + 1. Inside a word the parts occupy disjoint
 * bits, so their OR is their sum, and a word's sum is the difference of running sums taken at
 * the last quad of the word and of the word before (no word lacks a quad: a quad spans <= 64 bits,
 * so consecutive quads' words differ by at most one). Where every pair of quads fits in 64 bits
 * they merge once more and pack_octets64 packs them from one register. */
AVX512_INLINE int pack64_regs(const __m512i zm[2], const __m512i wv[2], uint8_t *dst) {
    const __m512i zero = _mm512_setzero_si512(), l7 = _mm512_set1_epi64(7);
    const __m512i lo32 = _mm512_set1_epi32(0xFFFF), lo64 = _mm512_set1_epi64(0xFFFFFFFF), c63 = _mm512_set1_epi64(63);
    __m512i Q[2], O[2], A[2], Bs[2], K[2], Oc[2], Ow[2];
    for (int h = 0; h < 2; h++) {
        const __m512i w = wv[h], z = zm[h];
        __m512i wl = _mm512_and_si512(w, lo32);
        __m512i p = _mm512_or_si512(_mm512_and_si512(z, lo32), _mm512_sllv_epi32(_mm512_srli_epi32(z, 16), wl));
        __m512i pw = _mm512_add_epi32(wl, _mm512_srli_epi32(w, 16));
        __m512i pwl = _mm512_and_si512(pw, lo64);
        Q[h] = _mm512_or_si512(_mm512_and_si512(p, lo64), _mm512_sllv_epi64(_mm512_srli_epi64(p, 32), pwl));
        O[h] = _mm512_add_epi64(pwl, _mm512_srli_epi64(pw, 32)); /* quad widths */
        /* octets in the even lanes: quad 2i | quad 2i+1 << its width (0 when that width is 64) */
        Oc[h] = _mm512_or_si512(Q[h], _mm512_sllv_epi64(_mm512_bsrli_epi128(Q[h], 8), O[h]));
        Ow[h] = _mm512_add_epi64(O[h], _mm512_bsrli_epi128(O[h], 8));
    }
    const __m512i evens = _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i ow = _mm512_permutex2var_epi64(Ow[0], evens, Ow[1]);
    if (!_mm512_cmpgt_epu64_mask(ow, _mm512_set1_epi64(64)))
        return pack_octets64(_mm512_permutex2var_epi64(Oc[0], evens, Oc[1]), ow, dst);
    __m512i qw0 = O[0], qw1 = O[1];
    O[0] = scan8_epi64(O[0]);
    O[1] = scan8_epi64(O[1]);
    O[1] = _mm512_add_epi64(O[1], _mm512_permutexvar_epi64(l7, O[0]));
    const uint64_t bits = (uint64_t)_mm_extract_epi64(_mm512_extracti32x4_epi32(O[1], 3), 1);
    O[0] = _mm512_sub_epi64(O[0], qw0); /* exclusive: each quad's first bit */
    O[1] = _mm512_sub_epi64(O[1], qw1);
    for (int h = 0; h < 2; h++) {
        __m512i sh = _mm512_and_si512(O[h], c63);
        K[h] = _mm512_srli_epi64(O[h], 6);
        A[h] = _mm512_sllv_epi64(Q[h], sh);
        Bs[h] = _mm512_srlv_epi64(_mm512_srli_epi64(Q[h], 1), _mm512_sub_epi64(c63, sh)); /* spill into K + 1 */
        A[h] = scan8_epi64(A[h]);
    }
    A[1] = _mm512_add_epi64(A[1], _mm512_permutexvar_epi64(l7, A[0]));
    /* the last quad of each word: its word differs from the next quad's (quad 15 is always last) */
    const __mmask8 m0 = _mm512_cmpneq_epi64_mask(K[0], _mm512_alignr_epi64(K[1], K[0], 1));
    const __mmask8 m1 = _mm512_cmpneq_epi64_mask(K[1], _mm512_alignr_epi64(_mm512_set1_epi64(-1), K[1], 1));
    const int c0 = __builtin_popcount(m0), nw = c0 + __builtin_popcount(m1);
    /* Only a word's last quad can spill into the next word. The running sums of A at word ends and
       the last quads' spills, concatenated over the two halves (word j's at lane j; past the last
       word the sums repeat and the spills are 0: those words get nothing more), by two-register
       permutes. */
    const __m512i iota = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0), c0v = _mm512_set1_epi64(c0);
    const __m512i last = _mm512_set1_epi64(nw - 1);
    const __m512i g0 = _mm512_min_epu64(iota, last), g1 = _mm512_min_epu64(_mm512_add_epi64(iota, _mm512_set1_epi64(8)), last);
    const __m512i ix0 = _mm512_mask_add_epi64(g0, _mm512_cmpge_epu64_mask(g0, c0v), g0, _mm512_set1_epi64(8 - c0));
    const __m512i ix1 = _mm512_sub_epi64(g1, c0v); /* lanes 8..15 all lie in the second half's words */
    const __m512i ca0 = _mm512_maskz_compress_epi64(m0, A[0]), ca1 = _mm512_maskz_compress_epi64(m1, A[1]);
    const __m512i cb0 = _mm512_maskz_compress_epi64(m0, Bs[0]), cb1 = _mm512_maskz_compress_epi64(m1, Bs[1]);
    const __m512i xa0 = _mm512_permutex2var_epi64(ca0, ix0, ca1), xa1 = _mm512_permutexvar_epi64(ix1, ca1);
    const __m512i xb0 = _mm512_maskz_permutex2var_epi64((__mmask8)lowmask64(nw), cb0, ix0, cb1);
    const __m512i xb1 = _mm512_maskz_permutexvar_epi64((__mmask8)lowmask64(nw - 8), ix1, cb1);
    /* word j = (SA[j] - SA[j-1]) + spill[j-1], both 0 before word 0 */
    const __m512i w0 = _mm512_add_epi64(_mm512_sub_epi64(xa0, _mm512_alignr_epi64(xa0, zero, 7)), _mm512_alignr_epi64(xb0, zero, 7));
    const __m512i w1 = _mm512_add_epi64(_mm512_sub_epi64(xa1, _mm512_alignr_epi64(xa1, xa0, 7)), _mm512_alignr_epi64(xb1, xb0, 7));
    const int gb = (int)((bits + 7) >> 3);
    _mm512_mask_storeu_epi8(dst, lowmask64(gb), w0);
    _mm512_mask_storeu_epi8(dst + 64, lowmask64(gb - 64), w1);
    return gb;
}

/* pack64_regs on a group in memory: z16 and its widths ww (bytes). */
AVX512_FN static int pack_group64_avx512(const uint16_t *z16, const uint8_t *ww, uint8_t *dst) {
    const __m512i one16 = _mm512_set1_epi16(1);
    __m512i zm[2], wv[2];
    for (int h = 0; h < 2; h++) {
        wv[h] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ww + 32 * h)));
        zm[h] = _mm512_and_si512(_mm512_loadu_si512(z16 + 32 * h), _mm512_sub_epi16(_mm512_sllv_epi16(one16, wv[h]), one16));
    }
    return pack64_regs(zm, wv, dst);
}

/* n bytes from src to dst by masked 64-byte moves (no library call for a few bytes). */
AVX512_INLINE void copy_small(uint8_t *dst, const uint8_t *src, int64_t n) {
    for (int64_t i = 0; i < n; i += 64) {
        const __mmask64 k = lowmask64(n - i);
        _mm512_mask_storeu_epi8(dst + i, k, _mm512_maskz_loadu_epi8(k, src + i));
    }
}

/* Whole blocks [b_lo, b_hi) of groups of 64 16-bit values on AVX-512, back to back from dst + pos
 * (dst holds `room` bytes), in one pass and in registers: per group, the previous and new values
 * are loaded once; the new state, z, the widths (byte permutes of the previous exponents), the
 * exceptions (z against the width masks, their records compressed out of the same registers) and
 * the packed group all come out of those registers. A block's groups go straight to dst when its
 * room holds a raw block (no block is larger), else into a local buffer copied once the block's
 * size is known. Each block has delta_encode_block's bytes and contract; ends[b - b_lo] gets the
 * end of block b from dst (when ends is not NULL). Returns the end of the last block. */
AVX512_FN static int64_t delta_encode_run16_g64(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                                const uint16_t *shard, uint16_t *state, uint8_t *counts, int64_t b_lo,
                                                int64_t b_hi, uint8_t *dst, int64_t room, int64_t pos, int64_t *ends) {
    static const int32_t iota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const int64_t B = l->block_size, raw_size = B * 2;
    const int I = (int)l->index_bytes, C = (int)l->count_bytes, ng = (int)(B / 64);
    uint16_t z16[DELTA_MAX_BLOCK], xh[DELTA_MAX_BLOCK + 16];
    uint8_t buf[DELTA_MAX_BLOCK * 2], xi[DELTA_MAX_BLOCK * 2 + 32];
    __m512i t[4];
    table_avx512(wc, t);
    const __m512i emask = _mm512_set1_epi16((short)((1 << E) - 1)), one = _mm512_set1_epi16(1);
    const __m512i io = _mm512_loadu_si512(iota);
    const __m128i sm = _mm_cvtsi32_si128(M);
    for (int64_t b = b_lo; b < b_hi; b++) {
        const int64_t v0 = b * B, r = room - pos < 0 ? 0 : room - pos;
        uint8_t *const bd = dst + pos, *const gd = r >= raw_size ? bd : buf;
        int64_t gpos = 0;
        int n_exc = 0;
        for (int g = 0; g < ng; g++) {
            const uint16_t *sp = shard + v0 + 64 * g;
            uint16_t *st = state + v0 + 64 * g;
            _mm_prefetch((const char *)(st + 1024), _MM_HINT_T0); /* hints: never fault */
            _mm_prefetch((const char *)(sp + 1024), _MM_HINT_T0);
            const __m512i o0 = _mm512_loadu_si512(st), o1 = _mm512_loadu_si512(st + 32);
            const __m512i n0 = _mm512_loadu_si512(sp), n1 = _mm512_loadu_si512(sp + 32);
            _mm512_storeu_si512(st, n0);
            _mm512_storeu_si512(st + 32, n1);
            const __m512i z0 = zigzag16_avx512(n0, o0), z1 = zigzag16_avx512(n1, o1);
            _mm512_storeu_si512(z16 + 64 * g, z0); /* for a raw block */
            _mm512_storeu_si512(z16 + 64 * g + 32, z1);
            const __m512i w8 = widths64_avx512(t, exps64_avx512(o0, o1, sm, emask));
            __m512i wv[2], zm[2];
            wv[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(w8));
            wv[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(w8, 1));
            const __m512i m0 = _mm512_sub_epi16(_mm512_sllv_epi16(one, wv[0]), one); /* w = 16: all ones */
            const __m512i m1 = _mm512_sub_epi16(_mm512_sllv_epi16(one, wv[1]), one);
            const uint64_t x = (uint64_t)_mm512_test_epi16_mask(z0, _mm512_ternarylogic_epi32(m0, m0, m0, 0x55)) |
                               (uint64_t)_mm512_test_epi16_mask(z1, _mm512_ternarylogic_epi32(m1, m1, m1, 0x55)) << 32;
            if (x) { /* about one group in nine: the records (index, z >> w) of its exceptions, in order */
                const __m512i h0 = _mm512_srlv_epi16(z0, wv[0]), h1 = _mm512_srlv_epi16(z1, wv[1]);
                const __m256i hq[4] = {_mm512_castsi512_si256(h0), _mm512_extracti64x4_epi64(h0, 1),
                                       _mm512_castsi512_si256(h1), _mm512_extracti64x4_epi64(h1, 1)};
                for (int q = 0; q < 4; q++) {
                    const __mmask16 xq = (__mmask16)(x >> (16 * q)), km = (__mmask16)lowmask64(__builtin_popcount(xq));
                    const __m512i ix = _mm512_maskz_compress_epi32(xq, _mm512_add_epi32(io, _mm512_set1_epi32(64 * g + 16 * q)));
                    _mm512_mask_cvtepi32_storeu_epi16(xh + n_exc, km, _mm512_maskz_compress_epi32(xq, _mm512_cvtepu16_epi32(hq[q])));
                    if (I == 1) _mm512_mask_cvtepi32_storeu_epi8(xi + n_exc, km, ix);
                    else _mm512_mask_cvtepi32_storeu_epi16(xi + 2 * n_exc, km, ix); /* little endian */
                    n_exc += __builtin_popcount(xq);
                }
            }
            zm[0] = _mm512_and_si512(z0, m0);
            zm[1] = _mm512_and_si512(z1, m1);
            gpos += pack64_regs(zm, wv, gd + gpos);
        }
        const int64_t table_size = gpos + (int64_t)n_exc * (I + 2);
        const int raw = table_size > raw_size;
        const int64_t size = raw ? raw_size : table_size;
        store_le(counts + b * C, raw ? (C == 1 ? 0xFF : 0xFFFF) : (uint64_t)n_exc, C);
        if (size <= r) {
            if (raw) {
                memcpy(bd, z16, (size_t)raw_size); /* little endian */
            } else {
                if (gd == buf) memcpy(bd, buf, (size_t)gpos);
                copy_small(bd + gpos, xi, (int64_t)n_exc * I);
                copy_small(bd + gpos + (int64_t)n_exc * I, (const uint8_t *)xh, (int64_t)n_exc * 2);
            }
        }
        pos += size;
        if (ends) ends[b - b_lo] = pos;
    }
    return pos;
}

/* delta_encode_block for 16-bit values on AVX-512 (same bytes, same contract): z, the new state
 * and the previous exponents 32 values per step; widths by byte permutes; the exceptions are the
 * set bits of one test against the width masks; each quad of values is one PEXT of their four
 * 16-bit z under their four width masks (the same LSB-first concatenation), appended by
 * pack_stream. */
AVX512_FN static int64_t delta_encode_block16_avx512(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                                     const uint16_t *shard, uint16_t *state, uint8_t *counts, int64_t b,
                                                     uint8_t *dst, int64_t room) {
    const int64_t B = l->block_size, n = l->numel;
    const int G = (int)l->group_size, I = (int)l->index_bytes, C = (int)l->count_bytes;
    const int64_t v0 = b * B;
    const int valid = (int)min64(B, n - v0);
    uint16_t z16[DELTA_MAX_BLOCK + 64], m16[DELTA_MAX_BLOCK + 64];
    uint8_t ee[DELTA_MAX_BLOCK + 64], ww[DELTA_MAX_BLOCK + 128];
    uint16_t exc[DELTA_MAX_BLOCK];
    const __m512i emask = _mm512_set1_epi16((short)((1 << E) - 1)), one = _mm512_set1_epi16(1);
    const __m128i sm = _mm_cvtsi32_si128(M);
    /* groups of 64: widths and group bytes in registers from the previous values (before the
       loop below replaces them with the new ones) */
    int64_t bytes = G == 64 ? block_bytes16_avx512(wc, M, E, state + v0, valid, ww, 1024) : 0;
    for (int j = 0; j < valid; j += 32) { /* lanes past valid: 0 (masked loads) */
        const __mmask32 k = (__mmask32)lowmask64(valid - j);
        _mm_prefetch((const char *)(state + v0 + j + 1024), _MM_HINT_T0); /* a hint: never faults */
        _mm_prefetch((const char *)(shard + v0 + j + 1024), _MM_HINT_T0);
        __m512i old = _mm512_maskz_loadu_epi16(k, state + v0 + j), nw = _mm512_maskz_loadu_epi16(k, shard + v0 + j);
        _mm512_mask_storeu_epi16(state + v0 + j, k, nw);
        _mm512_storeu_si512(z16 + j, zigzag16_avx512(nw, old));
        if (G != 64)
            _mm256_storeu_si256((__m256i *)(ee + j), _mm512_cvtepi16_epi8(_mm512_and_si512(_mm512_srl_epi16(old, sm), emask)));
    }
    if (G != 64) {
        widths_avx512(wc, ee, ww, valid);
        bytes = group_bytes_small(ww, valid, G);
    }
    int n_exc = 0;
    for (int j = 0; j < valid; j += 32) {
        __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(ww + j)));
        __m512i m = _mm512_sub_epi16(_mm512_sllv_epi16(one, w), one); /* w = 16: 0 - 1, all ones */
        _mm512_storeu_si512(m16 + j, m);
        uint32_t x = _mm512_test_epi16_mask(_mm512_loadu_si512(z16 + j), _mm512_ternarylogic_epi32(m, m, m, 0x55));
        for (; x; x &= x - 1) exc[n_exc++] = (uint16_t)(j + __builtin_ctz(x));
    }
    int64_t table_size = bytes + (int64_t)n_exc * (I + 2), raw_size = (int64_t)valid * 2;
    int raw = table_size > raw_size;
    int64_t size = raw ? raw_size : table_size;
    store_le(counts + b * C, raw ? (C == 1 ? 0xFF : 0xFFFF) : (uint64_t)n_exc, C);
    if (size > room) return size;
    uint8_t tmp[DELTA_MAX_BLOCK * 2 + 16], saved[8] = {0};
    uint8_t *base = size + 8 <= room ? dst : tmp;
    if (base == dst) memcpy(saved, dst + size, 8);
    if (raw) {
        memcpy(base, z16, (size_t)valid * 2); /* little endian */
    } else {
        uint8_t *p = base;
        uint64_t q[16];
        uint8_t qw[16];
        if (G == 64)
            for (int g0 = 0; g0 < valid; g0 += 64) p += pack_group64_avx512(z16 + g0, ww + g0, p);
        else
        for (int g0 = 0; g0 < valid; g0 += G) {
            int nq = ((int)min64(G, valid - g0) + 3) / 4; /* G >= 8: quads never cross groups */
            for (int i = 0; i < nq; i++) {
                uint64_t mk = load64((const uint8_t *)(m16 + g0 + 4 * i));
                q[i] = _pext_u64(load64((const uint8_t *)(z16 + g0 + 4 * i)), mk);
                qw[i] = (uint8_t)__builtin_popcountll(mk);
            }
            p = pack_stream(q, qw, nq, p);
        }
        uint8_t *hi_p = p + (int64_t)n_exc * I;
        for (int r = 0; r < n_exc; r++) {
            int j = exc[r];
            store_le(p + (int64_t)r * I, (uint64_t)j, I);
            store_le(hi_p + (int64_t)r * 2, (uint64_t)(z16[j] >> ww[j]), 2);
        }
    }
    if (base == tmp) memcpy(dst, tmp, (size_t)size);
    else memcpy(dst + size, saved, 8);
    return size;
}

/* Whole blocks [b_lo, b_hi) of groups of 64 16-bit values on AVX-512, decoded into target:
 * forward from their data's start pos (rev = 0: returns their end) or last block first from
 * their data's end pos (rev = 1: returns their start); a negative error code otherwise. Same
 * checks and results as delta_decode_chunk, in one call: per block, the widths come from the
 * previous values in registers, and a block without exceptions (most of them) adds each group's
 * values to target straight from the registers they were unpacked into. */
AVX512_FN static int64_t delta_decode_run16_g64(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                                const uint8_t *payload, int64_t length, uint16_t *target, int64_t b_lo,
                                                int64_t b_hi, int64_t pos, int rev) {
    const int64_t B = l->block_size;
    const int I = (int)l->index_bytes, C = (int)l->count_bytes, ng = (int)(B / 64);
    const uint64_t mark = C == 1 ? 0xFF : 0xFFFF;
    const uint8_t *counts = payload + l->off_counts;
    uint8_t ww[DELTA_MAX_BLOCK];
    uint32_t zz[DELTA_MAX_BLOCK];
    __m512i t[4];
    table_avx512(wc, t);
    const __m512i emask = _mm512_set1_epi16((short)((1 << E) - 1)), one32 = _mm512_set1_epi32(1), one16 = _mm512_set1_epi16(1);
    const __m128i sm = _mm_cvtsi32_si128(M);
    const int ahead = rev ? -1024 : 1024; /* prefetch hints in the direction of travel */
#define CIERA_ADD16(dst, z32) /* 16 values: dst += unzigzag(z) mod 2^16 */                                      \
    _mm256_storeu_si256((__m256i *)(dst),                                                                           \
                        _mm512_cvtepi32_epi16(_mm512_add_epi32(                                                     \
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(dst))),                      \
                            _mm512_xor_si512(_mm512_srli_epi32(z32, 1),                                            \
                                             _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_and_si512(z32, one32))))))
    for (int64_t i = 0; i < b_hi - b_lo; i++) {
        const int64_t b = rev ? b_hi - 1 - i : b_lo + i;
        uint16_t *tg = target + b * B;
        const uint64_t c = load_le(counts + b * C, C);
        int64_t size;
        if (c == mark) {
            size = B * 2;
        } else {
            if ((int64_t)c > B) return CIERA_E_BAD_COUNT;
            size = (int64_t)c * (I + 2);
            for (int g = 0; g < ng; g++) {
                _mm_prefetch((const char *)(tg + 64 * g + ahead), _MM_HINT_T0); /* hints: never fault */
                _mm_prefetch((const char *)(tg + 64 * g + ahead + 32), _MM_HINT_T0);
                const __m512i w8 = widths64_avx512(t, exps64_avx512(_mm512_loadu_si512(tg + 64 * g),
                                                                  _mm512_loadu_si512(tg + 64 * g + 32), sm, emask));
                _mm512_storeu_si512(ww + 64 * g, w8);
                size += group_bytes_w8(w8);
            }
        }
        if (rev) {
            _mm_prefetch((const char *)(payload + pos - 768), _MM_HINT_T0);
            if (pos - size < l->off_data) return CIERA_E_TRUNCATED;
            pos -= size;
        }
        if (pos + size > length) return CIERA_E_TRUNCATED;
        const uint8_t *p = payload + pos; /* every group lies inside [pos, pos + size) */
        if (c == mark) { /* raw: little-endian z */
            for (int j = 0; j < B; j += 32) {
                const __m512i z = _mm512_loadu_si512(p + 2 * j);
                const __m512i d = _mm512_xor_si512(_mm512_srli_epi16(z, 1), _mm512_sub_epi16(_mm512_setzero_si512(), _mm512_and_si512(z, one16)));
                _mm512_storeu_si512(tg + j, _mm512_add_epi16(_mm512_loadu_si512(tg + j), d));
            }
        } else if (c == 0) {
            for (int g = 0; g < ng; g++) {
                __m512i z[4];
                p += unpack64_regs(p, _mm512_loadu_si512(ww + 64 * g), 64, z);
                for (int q = 0; q < 4; q++) CIERA_ADD16(tg + 64 * g + 16 * q, z[q]);
            }
        } else {
            for (int g = 0; g < ng; g++) p += unpack_group16_avx512(p, ww + 64 * g, 64, zz + 64 * g);
            const uint8_t *hi_p = p + (int64_t)c * I;
            for (int r = 0; r < (int)c; r++) {
                const int64_t j = (int64_t)load_le(p + (int64_t)r * I, I);
                if (j >= B) return CIERA_E_BAD_INDEX;
                zz[j] |= (uint32_t)(load_le(hi_p + (int64_t)r * 2, 2) << ww[j]);
            }
            for (int j = 0; j < B; j += 16) CIERA_ADD16(tg + j, _mm512_loadu_si512(zz + j));
        }
        if (!rev) pos += size;
    }
#undef CIERA_ADD16
    return pos;
}

/* Decodes table-mode block b (c exceptions) of 16-bit values on AVX-512 into target. Its data
 * starts at pos (rev = 0: returns the block's end) or ends at pos (rev = 1: returns its start); a
 * negative error code otherwise. Same checks as delta_decode_chunk. */
AVX512_FN static int64_t delta_decode_block16_avx512(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                                     const uint8_t *payload, int64_t length, uint16_t *target, int64_t b,
                                                     int c, int64_t pos, int rev) {
    const int64_t B = l->block_size, n = l->numel;
    const int G = (int)l->group_size, I = (int)l->index_bytes;
    const int64_t v0 = b * B;
    const int valid = (int)min64(B, n - v0);
    uint8_t ww[DELTA_MAX_BLOCK + 128];
    uint32_t zz[DELTA_MAX_BLOCK + 64];
    /* prefetch hints in the direction of travel (a backward chunk's next blocks lie below) */
    int64_t size = block_widths16_avx512(wc, M, E, target + v0, valid, G, ww, rev ? -1024 : 1024) + (int64_t)c * (I + 2);
    if (rev) {
        _mm_prefetch((const char *)(payload + pos - 768), _MM_HINT_T0);
        if (pos - size < l->off_data) return CIERA_E_TRUNCATED;
        pos -= size;
    }
    int64_t end = pos + size;
    if (end > length) return CIERA_E_TRUNCATED;
    const uint8_t *p = payload + pos; /* every group lies inside [pos, end) */
    for (int g0 = 0; g0 < valid; g0 += G) p += unpack_group16_avx512(p, ww + g0, (int)min64(G, valid - g0), zz + g0);
    const uint8_t *hi_p = p + (int64_t)c * I;
    for (int r = 0; r < c; r++) {
        int64_t j = (int64_t)load_le(p + (int64_t)r * I, I);
        if (j >= valid) return CIERA_E_BAD_INDEX;
        zz[j] |= (uint32_t)(load_le(hi_p + (int64_t)r * 2, 2) << ww[j]);
    }
    const __m512i one = _mm512_set1_epi32(1);
    for (int j = 0; j < valid; j += 16) { /* target += unzigzag(z) mod 2^16 */
        const __mmask16 k = (__mmask16)lowmask64(valid - j);
        __m512i t = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, target + v0 + j));
        __m512i z = _mm512_loadu_si512(zz + j);
        __m512i d = _mm512_xor_si512(_mm512_srli_epi32(z, 1), _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_and_si512(z, one)));
        _mm256_mask_storeu_epi16(target + v0 + j, k, _mm512_cvtepi32_epi16(_mm512_add_epi32(t, d)));
    }
    return rev ? pos : end;
}
#endif

/* Encodes block b: writes its count field and the new state, and packs it at `dst` when its size
 * is at most `room` bytes (the bytes dst may hold; packing past them never happens). Returns the
 * block's size in bytes. */
ALWAYS_INLINE int64_t delta_encode_block(const ciera_delta_layout *l, int W, int M, int E, const delta_wctx *wc,
                                         const void *shard, void *state, uint8_t *counts, int64_t b, uint8_t *dst,
                                         int64_t room) {
    const int64_t B = l->block_size, G = l->group_size, n = l->numel;
    const int I = (int)l->index_bytes, S = (int)l->high_bytes, C = (int)l->count_bytes;
    const uint32_t emask = (1u << E) - 1;
    const int64_t v0 = b * B;
    const int valid = (int)min64(B, n - v0);
    uint32_t zz[DELTA_MAX_BLOCK + 8], zm[DELTA_MAX_BLOCK + 8];
    uint8_t ww[DELTA_MAX_BLOCK + 128], ee[DELTA_MAX_BLOCK + 32];
    uint16_t exc[DELTA_MAX_BLOCK];
    /* Vectorisable: z and previous exponent of every value; then the new state. */
    for (int j = 0; j < valid; j++) {
        uint32_t u_old = load_u(state, v0 + j, W), u_new = load_u(shard, v0 + j, W);
        store_u(state, v0 + j, u_new, W);
        zz[j] = zigzag_u(u_new, u_old, W);
        ee[j] = (uint8_t)((u_old >> M) & emask);
    }
    /* Widths from the table; values masked to them (those that change are the exceptions, whose
       high bits go in the exception list); group sizes. */
    delta_widths(wc, ee, ww, valid);
    memset(ww + valid, 0, 64);
    for (int j = 0; j < valid; j++) { /* vectorisable */
        uint32_t w = ww[j];
        zm[j] = zz[j] & (w >= 32 ? 0xFFFFFFFFu : (1u << (w & 31)) - 1);
    }
    memset(zm + valid, 0, 8 * sizeof(uint32_t));
    memset(zz + valid, 0, 8 * sizeof(uint32_t));
    int n_exc = delta_exceptions(wc, zz, zm, valid, exc);
    int64_t bytes = delta_group_bytes(wc, ww, valid, (int)G);
    int64_t table_size = bytes + (int64_t)n_exc * (I + S), raw_size = (int64_t)valid * S;
    int raw = table_size > raw_size;
    int64_t size = raw ? raw_size : table_size;
    store_le(counts + b * C, raw ? (C == 1 ? 0xFF : 0xFFFF) : (uint64_t)n_exc, C);
    if (size > room) return size;
    /* The packer's slack (8 bytes past the block) must stay inside dst, and is put back as it was:
       only the block's own bytes change, as with the reference. */
    uint8_t tmp[DELTA_MAX_BLOCK * 4 + 16], saved[8] = {0};
    uint8_t *base = size + 8 <= room ? dst : tmp;
    if (base == dst) memcpy(saved, dst + size, 8);
    if (raw) {
        for (int j = 0; j < valid; j++) store_le(base + (int64_t)j * S, zz[j], S);
    } else {
        uint8_t *p = base;
        for (int g0 = 0; g0 < valid; g0 += (int)G) p = pack_group(W, zm + g0, ww + g0, (int)min64(G, valid - g0), p);
        uint8_t *hi_p = p + (int64_t)n_exc * I;
        for (int r = 0; r < n_exc; r++) {
            int j = exc[r];
            store_le(p + (int64_t)r * I, (uint64_t)j, I);
            store_le(hi_p + (int64_t)r * S, zz[j] >> ww[j], S);
        }
    }
    if (base == tmp) memcpy(dst, tmp, (size_t)size);
    else memcpy(dst + size, saved, 8);
    return size;
}

/* hist[i] = the sum of entry i over `tables` histograms of n_hist counters, back to back. */
static void delta_sum_hists(const uint32_t *hists, int tables, int64_t n_hist, int64_t *hist) {
    for (int64_t i = 0; i < n_hist; i++) hist[i] = 0;
    for (int t = 0; t < tables; t++)
        for (int64_t i = 0; i < n_hist; i++) hist[i] += hists[(int64_t)t * n_hist + i];
}

static void delta_choose_table(const ciera_delta_layout *l, const int64_t *hist, uint8_t *table) {
    const int W = (int)l->total_bits;
    const int64_t E_bits = 8 * (l->index_bytes + l->high_bytes);
    for (int64_t c = 0; c < ((int64_t)1 << l->exp_bits); c++) {
        const int64_t *h = hist + c * (W + 1);
        int64_t N = 0;
        for (int L = 0; L <= W; L++) N += h[L];
        int64_t cum = 0, best_key = INT64_MAX;
        int best = 0;
        for (int w = 0; w <= W; w++) {
            cum += h[w];
            int64_t key = (N * w + E_bits * (N - cum)) * 64 + w;
            if (key < best_key) {
                best_key = key;
                best = w;
            }
        }
        table[c] = (uint8_t)best;
    }
}

/* The window hist16_avx512 is given for a pass over values [lo, hi) (-1: the pass has no window). */
static int delta_hist_window(const ciera_delta_layout *l, const void *state, int64_t lo, int64_t hi) {
#if CIERA_X86
    if (l->total_bits == 16 && hi - lo >= 4096 && cpu_avx512cd())
        return hist_window((int)l->mant_bits, (int)l->exp_bits, state, lo, hi);
#endif
    (void)l, (void)state, (void)lo, (void)hi;
    return -1;
}

/* Counts values [lo, hi) into hist (adds); e0: delta_hist_window's for the pass. */
HOT static void delta_hist_dispatch(const ciera_delta_layout *l, const void *shard, const void *state, int64_t lo,
                                    int64_t hi, int e0, uint32_t *hist) {
#if CIERA_X86
    if (l->total_bits == 16 && e0 >= 0 && cpu_avx512cd())
        hist16_avx512((int)l->mant_bits, (int)l->exp_bits, shard, state, lo, hi, e0, hist);
    else
#else
    (void)e0;
#endif
    if (l->total_bits == 16 && l->mant_bits == 7) delta_hist_range(16, 7, 8, shard, state, lo, hi, hist);
    else if (l->total_bits == 16) delta_hist_range(16, 10, 5, shard, state, lo, hi, hist);
    else delta_hist_range(32, 23, 8, shard, state, lo, hi, hist);
}

/* The counts the width table is chosen from, over values [lo, hi): hist[e * (W + 1) + L] (int64,
 * 2^E * (W + 1) entries, overwritten) = values whose previous exponent is e and whose z has bit
 * length L, by the path an encode on this CPU takes. For tests; CIERA_E_NOMEM / CIERA_E_ARGS. */
int ciera_delta_histogram(const ciera_delta_layout *l, const void *shard, const void *state, int64_t lo, int64_t hi,
                          int64_t *hist) {
    if (!delta_supported(l) || lo < 0 || hi < lo || hi > l->numel) return CIERA_E_ARGS;
    const int64_t n_hist = ((int64_t)1 << l->exp_bits) * (l->total_bits + 1);
    uint32_t *hists = calloc((size_t)4 * n_hist, sizeof(uint32_t));
    if (!hists) return CIERA_E_NOMEM;
    delta_hist_dispatch(l, shard, state, lo, hi, delta_hist_window(l, state, lo, hi), hists);
    delta_sum_hists(hists, 4, n_hist, hist);
    free(hists);
    return CIERA_OK;
}

/* Encodes blocks [b_lo, b_hi) back to back from dst, which holds `room` bytes (packing stops at
 * the first block that does not fit; sizes go on). ends[b - b_lo]: end of block b from dst (when
 * ends is not NULL). Returns the bytes of the whole range. */
HOT static int64_t delta_encode_blocks(const ciera_delta_layout *l, const delta_wctx *wc, const void *shard, void *state,
                                   uint8_t *counts, int64_t b_lo, int64_t b_hi, uint8_t *dst, int64_t room,
                                   int64_t *ends) {
    int64_t pos = 0, b = b_lo;
#if CIERA_X86
    if (l->total_bits == 16 && wc->avx512 && l->group_size == 64) { /* the whole blocks in one run */
        const int64_t b_full = min64(b_hi, l->numel / l->block_size);
        if (b < b_full) {
            pos = delta_encode_run16_g64(l, (int)l->mant_bits, (int)l->exp_bits, wc, (const uint16_t *)shard,
                                         (uint16_t *)state, counts, b, b_full, dst, room, 0, ends);
            b = b_full;
        }
    }
#endif
    for (; b < b_hi; b++) {
        int64_t r = room - pos < 0 ? 0 : room - pos;
#if CIERA_X86
        if (l->total_bits == 16 && wc->avx512)
            pos += delta_encode_block16_avx512(l, (int)l->mant_bits, (int)l->exp_bits, wc, (const uint16_t *)shard,
                                               (uint16_t *)state, counts, b, dst + pos, r);
        else
#endif
        if (l->total_bits == 16 && l->mant_bits == 7)
            pos += delta_encode_block(l, 16, 7, 8, wc, shard, state, counts, b, dst + pos, r);
        else if (l->total_bits == 16)
            pos += delta_encode_block(l, 16, 10, 5, wc, shard, state, counts, b, dst + pos, r);
        else
            pos += delta_encode_block(l, 32, 23, 8, wc, shard, state, counts, b, dst + pos, r);
        if (ends) ends[b - b_lo] = pos;
    }
    return pos;
}

/* Blocks per claim of delta's packing, and 128-value units per claim (at least) of its histogram. */
#define DELTA_PACK_GRAIN 32
#define DELTA_HIST_GRAIN 256

/* A claim of blocks packed by a thread other than 0, waiting in that thread's scratch. */
typedef struct {
    const uint8_t *src;   /* its bytes, in the owner's scratch */
    int64_t bytes;        /* their number */
    const int64_t *ends;  /* its blocks' ends from src (in the owner's scratch) */
    int64_t blocks;       /* its blocks, from block lo (pieces[lo / grain]) */
} delta_piece;

/* Two passes, each shared out by claims (ciera_claims): the histogram (guided claims into per-thread
 * counters, summed), then, once the table is chosen, the packing in grains of blocks. Thread 0
 * packs its grains from the front straight into out; every other thread packs its grains (from
 * the back) into scratch, and copies them once every grain's size is known. A thread whose
 * scratch runs short claims no more (thread 0 takes the rest). */
int64_t ciera_delta_encode(const ciera_delta_layout *l, const void *shard, void *state, uint8_t *out,
                           int64_t capacity, int threads) {
    if (!delta_supported(l) || capacity < l->off_data) return CIERA_E_ARGS;
    const int64_t n = l->numel, B = l->block_size, S = l->high_bytes, G = DELTA_PACK_GRAIN;
    const int W = (int)l->total_bits;
    if (n == 0) return l->off_data;
    const int64_t nb = (n + B - 1) / B, ng = (nb + G - 1) / G, units = (n + 127) / 128;
    const int64_t n_hist = ((int64_t)1 << l->exp_bits) * (W + 1);
    threads = clamp_threads(threads);
    if (threads > nb) threads = (int)nb;
    uint32_t *hists = calloc((size_t)threads * 4 * n_hist, sizeof(uint32_t)); /* 4 per thread */
    int64_t *hist = calloc((size_t)n_hist, sizeof(int64_t));
    delta_piece *pieces = calloc((size_t)ng, sizeof(delta_piece));
    if (!hists || !hist || !pieces) {
        free(hists); free(hist); free(pieces);
        return CIERA_E_NOMEM;
    }
    const int64_t share = claims_share(nb, G, threads);
    uint8_t table[256];
    delta_wctx wc;
    ciera_claims hc, pc;
    const int stalled = claims_stalled();
    claims_init(&hc, units, DELTA_HIST_GRAIN, threads);
    claims_init(&pc, nb, G, threads);
    int64_t front_bytes = 0, front_grains = 0, back_bytes = 0;
    uint8_t *table_out = out + l->off_table, *counts = out + l->off_counts;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int k = CIERA_THREAD_ID();
        const int e0 = delta_hist_window(l, state, 0, n); /* every thread the same */
        int64_t lo, hi;
        claims_stall(k, stalled);
        while (claim(&hc, k > 0, 1, INT64_MAX, &lo, &hi))
            delta_hist_dispatch(l, shard, state, lo * 128, min64(hi * 128, n), e0, hists + (int64_t)k * 4 * n_hist);
#pragma omp barrier
#pragma omp single
        {
            delta_sum_hists(hists, 4 * threads, n_hist, hist);
            delta_choose_table(l, hist, table);
            for (int64_t c = 0; c < ((int64_t)1 << l->exp_bits); c++) table_out[c] = table[c];
            delta_wctx_init(&wc, table, (int)l->exp_bits);
        } /* implicit barrier: the table is ready, every state value has been read */
        uint8_t *scratch = NULL;
        claims_stall(k, stalled);
        if (k == 0) { /* grains [0, front_grains), back to back from off_data */
            int64_t pos = 0;
            while (claim(&pc, 0, 1, INT64_MAX, &lo, &hi)) {
                const int64_t room = capacity - l->off_data - pos;
                pos += delta_encode_blocks(l, &wc, shard, state, counts, lo, hi, out + l->off_data + pos,
                                           room < 0 ? 0 : room, NULL);
                front_grains = (hi + G - 1) / G;
            }
            front_bytes = pos;
        } else {
            const int64_t room = share * B * S + 64;
            scratch = thread_scratch((size_t)(share * 8 + room));
            int64_t *ends = (int64_t *)scratch, used = 0, used_blocks = 0;
            uint8_t *data = scratch + share * 8;
            while (scratch && used_blocks + G <= share && claim(&pc, 1, 1, share - used_blocks, &lo, &hi)) {
                const int64_t bytes = delta_encode_blocks(l, &wc, shard, state, counts, lo, hi, data + used,
                                                          room - used, ends + used_blocks);
                pieces[lo / G] = (delta_piece){.src = data + used, .bytes = bytes, .ends = ends + used_blocks,
                                               .blocks = hi - lo};
                used += bytes;
                used_blocks += hi - lo;
            }
        }
#pragma omp barrier
        /* the back pieces to their place (the blocks that end inside the capacity), in byte
           ranges of even size, one per thread, whoever packed them */
        int64_t total = 0; /* the back pieces' bytes (every thread the same) */
        for (int64_t g = front_grains; g < ng; g += grains_of(pieces[g].blocks, G)) total += pieces[g].bytes;
        if (k == 0) back_bytes = total;
        const int64_t base = l->off_data + front_bytes, end = base + min64(total, capacity - base < 0 ? 0 : capacity - base);
        const int64_t c_lo = base + (end - base) * k / threads, c_hi = base + (end - base) * (k + 1) / threads;
        int64_t off = base;
        for (int64_t g = front_grains; g < ng && off < c_hi; off += pieces[g].bytes, g += grains_of(pieces[g].blocks, G)) {
            const delta_piece *pc_ = &pieces[g];
            int64_t keep = pc_->bytes;
            if (off + keep > capacity) {
                keep = 0;
                for (int64_t i = 0; i < pc_->blocks && off + pc_->ends[i] <= capacity; i++) keep = pc_->ends[i];
            }
            copy_overlap(out, off, pc_->src, keep, c_lo, c_hi);
        }
    }
    free(hists); free(hist); free(pieces);
    return l->off_data + front_bytes + back_bytes;
}

/* Widths of block b's values from the previous values into ww (DELTA_MAX_BLOCK + 128 bytes; zero
 * from the block's end up to the next multiple of 64);
 * returns the table-mode size of its groups. */
ALWAYS_INLINE int64_t delta_block_widths(const ciera_delta_layout *l, int W, int M, int E, const delta_wctx *wc,
                                         const void *target, int64_t b, uint8_t *ww) {
    const uint32_t emask = (1u << E) - 1;
    const int64_t v0 = b * l->block_size;
    const int valid = (int)min64(l->block_size, l->numel - v0);
#if CIERA_X86
    if (W == 16 && wc->avx512)
        return block_widths16_avx512(wc, M, E, (const uint16_t *)target + v0, valid, (int)l->group_size, ww, 1024);
#endif
    uint8_t ee[DELTA_MAX_BLOCK + 32];
    for (int j = 0; j < valid; j++) ee[j] = (uint8_t)((load_u(target, v0 + j, W) >> M) & emask); /* vectorisable */
    delta_widths(wc, ee, ww, valid);
    memset(ww + valid, 0, 64);
    return delta_group_bytes(wc, ww, valid, (int)l->group_size);
}

/* Size of block b in bytes, or a negative error code. */
ALWAYS_INLINE int64_t delta_block_size(const ciera_delta_layout *l, int W, int M, int E, const delta_wctx *wc,
                                       const uint8_t *counts, const void *target, int64_t b, uint8_t *ww) {
    const int C = (int)l->count_bytes, S = (int)l->high_bytes, I = (int)l->index_bytes;
    const int64_t valid = min64(l->block_size, l->numel - b * l->block_size);
    uint64_t c = load_le(counts + b * C, C);
    uint64_t mark = C == 1 ? 0xFF : 0xFFFF;
    if (c == mark) return valid * S;
    if ((int64_t)c > valid) return CIERA_E_BAD_COUNT;
#if CIERA_X86
    if (W == 16 && wc->avx512 && l->group_size == 64)
        return block_bytes16_avx512(wc, M, E, (const uint16_t *)target + b * l->block_size, (int)valid, NULL, 1024) + (int64_t)c * (I + S);
#endif
    return delta_block_widths(l, W, M, E, wc, target, b, ww) + (int64_t)c * (I + S);
}

/* Inverse of pack_group: the n values of the group at p (widths ww, zero from n up to the next
 * multiple of 4) into zz; returns the group's bits. Chunks (quads or pairs, <= 64 bits) are read
 * serially, then split in independent loops. Reads up to 16 bytes past the group. */
ALWAYS_INLINE uint64_t unpack_group(int W, const uint8_t *p, const uint8_t *ww, int n, uint32_t *zz) {
    uint8_t pw[32], qw[32];
    uint64_t q[32];
    int np = W == 16 ? (n + 1) / 2 + ((n + 1) / 2 & 1) : (n + 1) / 2, nq = W == 16 ? np / 2 : np;
    for (int i = 0; i < np; i++) pw[i] = (uint8_t)(ww[2 * i] + ww[2 * i + 1]);
    if (W == 16)
        for (int i = 0; i < nq; i++) qw[i] = (uint8_t)(pw[2 * i] + pw[2 * i + 1]);
    else
        memcpy(qw, pw, (size_t)nq);
    uint64_t bp = 0;
    for (int i = 0; i < nq; i++) {
        const uint8_t *at = p + (bp >> 3);
        unsigned sh = bp & 7, w = qw[i];
        uint64_t x = (load64(at) >> sh) | (((uint64_t)at[8] << 1) << (63 - sh));
        q[i] = w >= 64 ? x : x & (((uint64_t)1 << w) - 1);
        bp += w;
    }
    if (W == 16) {
        uint32_t pv[32];
        for (int i = 0; i < nq; i++) { /* quad -> pairs */
            unsigned w = pw[2 * i];
            pv[2 * i] = (uint32_t)(q[i] & (((uint64_t)1 << w) - 1));
            pv[2 * i + 1] = (uint32_t)(q[i] >> w);
        }
        for (int i = 0; i < np; i++) { /* pair -> values (each pair holds exactly its widths' bits) */
            unsigned w = ww[2 * i];
            zz[2 * i] = pv[i] & ((1u << w) - 1);
            zz[2 * i + 1] = (uint32_t)((uint64_t)pv[i] >> w);
        }
    } else {
        for (int i = 0; i < nq; i++) {
            unsigned w = ww[2 * i];
            zz[2 * i] = (uint32_t)(q[i] & (((uint64_t)1 << w) - 1));
            zz[2 * i + 1] = (uint32_t)(q[i] >> w);
        }
    }
    return bp;
}

/* Decodes blocks [b_lo, b_hi): forward from their data's start pos (rev = 0: returns their end),
 * or last block first from their data's end pos (rev = 1: returns their start, so a chunk needs no
 * sizing pass when the data's end is known); a negative error code otherwise. */
ALWAYS_INLINE int64_t delta_decode_chunk(const ciera_delta_layout *l, int W, int M, int E, const delta_wctx *wc,
                                         const uint8_t *payload, int64_t length, void *target, int64_t b_lo,
                                         int64_t b_hi, int64_t pos, int rev) {
    const int64_t B = l->block_size, G = l->group_size, n = l->numel;
    const int C = (int)l->count_bytes, S = (int)l->high_bytes, I = (int)l->index_bytes;
    const uint8_t *counts = payload + l->off_counts;
    const uint64_t mark = C == 1 ? 0xFF : 0xFFFF;
    uint8_t ww[DELTA_MAX_BLOCK + 128];
    uint32_t zz[DELTA_MAX_BLOCK + 4];
    /* groups of 64 on AVX-512: the whole blocks [run_lo, run_hi) in one run; the trailing partial
       block (when in this chunk) in the loop below, after the run going forward, before it going
       backward */
    int64_t run_hi = b_lo;
#if CIERA_X86
    const int64_t run_lo = b_lo;
    if (W == 16 && wc->avx512 && G == 64) run_hi = b_lo > min64(b_hi, n / B) ? b_lo : min64(b_hi, n / B);
    if (run_hi > run_lo && !rev) {
        pos = delta_decode_run16_g64(l, M, E, wc, payload, length, (uint16_t *)target, run_lo, run_hi, pos, 0);
        if (pos < 0) return pos;
    }
#endif
    b_lo = run_hi;
    for (int64_t i = 0; i < b_hi - b_lo; i++) {
        const int64_t b = rev ? b_hi - 1 - i : b_lo + i;
        const int64_t v0 = b * B;
        const int valid = (int)min64(B, n - v0);
        uint64_t c = load_le(counts + b * C, C);
        if (c == mark) {
            const int64_t size = (int64_t)valid * S;
            if (rev) {
                if (pos - size < l->off_data) return CIERA_E_TRUNCATED;
                pos -= size;
            }
            if (pos + size > length) return CIERA_E_TRUNCATED;
            for (int j = 0; j < valid; j++) {
                uint32_t z = (uint32_t)load_le(payload + pos + (int64_t)j * S, S);
                store_u(target, v0 + j, unzigzag_add_u(load_u(target, v0 + j, W), z, W), W);
            }
            if (!rev) pos += size;
            continue;
        }
        if ((int64_t)c > valid) return CIERA_E_BAD_COUNT;
#if CIERA_X86
        if (W == 16 && wc->avx512) {
            int64_t e = delta_decode_block16_avx512(l, M, E, wc, payload, length, (uint16_t *)target, b, (int)c, pos, rev);
            if (e < 0) return e;
            pos = e;
            continue;
        }
#endif
        /* ww zero past valid: unpack_group reads whole quads */
        const int64_t size = delta_block_widths(l, W, M, E, wc, target, b, ww) + (int64_t)c * (I + S);
        if (rev) {
            if (pos - size < l->off_data) return CIERA_E_TRUNCATED;
            pos -= size;
        }
        int64_t end = pos + size;
        if (end > length) return CIERA_E_TRUNCATED;
        const uint8_t *p = payload + pos;
        for (int g0 = 0; g0 < valid; g0 += (int)G) {
            int g1 = (int)min64(g0 + G, valid);
            uint64_t bp = 0;
            if (p + 16 + (G * W + 7) / 8 <= payload + length) {
                bp = unpack_group(W, p, ww + g0, g1 - g0, zz + g0);
            } else { /* near the end of the payload: bytewise, never past it */
                for (int j = g0; j < g1; j++) {
                    unsigned w = ww[j];
                    uint64_t v = 0;
                    int64_t at = (int64_t)(bp >> 3);
                    for (int t = 0; t < 5 && p + at + t < payload + length; t++) v |= (uint64_t)p[at + t] << (8 * t);
                    zz[j] = (uint32_t)((v >> (bp & 7)) & (((uint64_t)1 << w) - 1));
                    bp += w;
                }
            }
            p += (bp + 7) >> 3;
        }
        const uint8_t *hi_p = p + (int64_t)c * I;
        for (int64_t r = 0; r < (int64_t)c; r++) {
            int64_t j = (int64_t)load_le(p + r * I, I);
            if (j >= valid) return CIERA_E_BAD_INDEX;
            uint64_t hi = load_le(hi_p + r * S, S);
            zz[j] |= (uint32_t)(hi << ww[j]);
        }
        for (int j = 0; j < valid; j++)
            store_u(target, v0 + j, unzigzag_add_u(load_u(target, v0 + j, W), zz[j], W), W);
        if (!rev) pos = end;
    }
#if CIERA_X86
    if (run_hi > run_lo && rev)
        pos = delta_decode_run16_g64(l, M, E, wc, payload, length, (uint16_t *)target, run_lo, run_hi, pos, 1);
#endif
    return pos;
}

HOT static int64_t delta_decode_chunk_dispatch(const ciera_delta_layout *l, const delta_wctx *wc, const uint8_t *payload,
                                               int64_t length, void *target, int64_t b_lo, int64_t b_hi, int64_t pos,
                                               int rev) {
    if (l->total_bits == 16 && l->mant_bits == 7)
        return delta_decode_chunk(l, 16, 7, 8, wc, payload, length, target, b_lo, b_hi, pos, rev);
    if (l->total_bits == 16) return delta_decode_chunk(l, 16, 10, 5, wc, payload, length, target, b_lo, b_hi, pos, rev);
    return delta_decode_chunk(l, 32, 23, 8, wc, payload, length, target, b_lo, b_hi, pos, rev);
}

HOT static int64_t delta_size_range(const ciera_delta_layout *l, const delta_wctx *wc, const uint8_t *counts,
                                const void *target, int64_t b_lo, int64_t b_hi) {
    int64_t total = 0;
    uint8_t ww[DELTA_MAX_BLOCK + 128];
    for (int64_t b = b_lo; b < b_hi; b++) {
        int64_t s;
        if (l->total_bits == 16 && l->mant_bits == 7) s = delta_block_size(l, 16, 7, 8, wc, counts, target, b, ww);
        else if (l->total_bits == 16) s = delta_block_size(l, 16, 10, 5, wc, counts, target, b, ww);
        else s = delta_block_size(l, 32, 23, 8, wc, counts, target, b, ww);
        if (s < 0) return s;
        total += s;
    }
    return total;
}

/* Threads decode equal chunks of blocks. The first chunk starts at off_data; the last one, when
 * the header's needed bytes (the end of the last block) are plausible, is decoded last block
 * first from that end; every other chunk k starts at the summed sizes of the blocks before it,
 * which come from a sizing pass (widths and counts only). That pass is itself split evenly over
 * all threads, so no thread waits for another's sizing; at 2 threads there is none. Where the
 * last chunk ran backwards, its start must be the end of the chunk before it (else the header
 * disagrees with the blocks: CIERA_E_SIZES). */
int ciera_delta_decode(const ciera_delta_layout *l, const uint8_t *payload, int64_t length, void *target, int threads) {
    if (!delta_supported(l)) return CIERA_E_ARGS;
    const int64_t n = l->numel, B = l->block_size;
    const int W = (int)l->total_bits;
    if (n == 0) return CIERA_OK;
    if (length < l->off_data) return CIERA_E_TRUNCATED;
    const int64_t nb = (n + B - 1) / B;
    const uint8_t *table = payload + l->off_table;
    for (int64_t c = 0; c < ((int64_t)1 << l->exp_bits); c++)
        if (table[c] > W) return CIERA_E_BAD_TABLE;
    delta_wctx wc;
    delta_wctx_init(&wc, table, (int)l->exp_bits);
    threads = clamp_threads(threads);
    if (threads > nb) threads = (int)nb;
    int64_t bnd[CIERA_MAX_THREADS + 1]; /* decode chunk k: blocks [bnd[k], bnd[k+1]) */
    for (int k = 0; k <= threads; k++) bnd[k] = nb * k / threads;
    int64_t data_end = -1; /* the header's needed bytes, when plausible */
    if (length >= 24) {
        memcpy(&data_end, payload + 16, 8);
        if (data_end < l->off_data || data_end > length) data_end = -1;
    }
    const int rev = threads > 1 && data_end >= 0; /* the last chunk runs backwards from data_end */
    const int sized = threads - rev;              /* chunks [0, sized) run forwards */
    /* Sizing intervals: [0, bnd[sized-1]) cut at those chunks' bounds and at `threads` equal
       pieces; interval i is sized by the thread whose piece holds it. */
    const int64_t L = bnd[sized - 1];
    int64_t cut[2 * CIERA_MAX_THREADS + 2], sizes[2 * CIERA_MAX_THREADS + 1];
    int owner[2 * CIERA_MAX_THREADS + 1], ncut = 0;
    for (int k = 0; k < sized; k++) cut[ncut++] = bnd[k];
    for (int q = 1; q <= threads; q++) cut[ncut++] = L * q / threads;
    for (int i = 1; i < ncut; i++) /* insertion sort: a few entries */
        for (int j = i; j > 0 && cut[j - 1] > cut[j]; j--) {
            int64_t t = cut[j]; cut[j] = cut[j - 1]; cut[j - 1] = t;
        }
    for (int i = 0, q = 0; i + 1 < ncut; i++) {
        while (q + 1 < threads && L * (q + 1) / threads <= cut[i]) q++;
        owner[i] = q;
    }
    int64_t rc[CIERA_MAX_THREADS]; /* a forward chunk's end, the backward chunk's start, or an error */
    if (rev && threads == 2) {
        /* Two threads meet wherever they get to (ciera_claims): thread 0 claims grains of blocks
           from the front, thread 1 from the back (running backwards from data_end). Each
           thread's grains are consecutive, so its position runs on. */
        ciera_claims cl;
        claims_init(&cl, nb, (16 * 128 + B - 1) / B, 2);
        const int stalled = claims_stalled();
        rc[1] = data_end; /* stays so if the runtime grants one thread: thread 0 then claims every grain */
#pragma omp parallel num_threads(2)
        {
            const int k = CIERA_THREAD_ID();
            int64_t pos = k == 0 ? l->off_data : data_end, lo, hi;
            claims_stall(k, stalled);
            while (pos >= 0 && claim(&cl, k, 0, INT64_MAX, &lo, &hi))
                pos = delta_decode_chunk_dispatch(l, &wc, payload, length, target, lo, hi, pos, k);
            rc[k] = pos;
        }
        if (rc[0] < 0) return (int)rc[0];
        if (rc[1] < 0) return (int)rc[1];
        return rc[0] == rc[1] ? CIERA_OK : CIERA_E_SIZES;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int k = CIERA_THREAD_ID();
        for (int i = 0; i + 1 < ncut; i++)
            if (owner[i] == k) sizes[i] = delta_size_range(l, &wc, payload + l->off_counts, target, cut[i], cut[i + 1]);
#pragma omp barrier
        int64_t pos = k < sized ? l->off_data : data_end;
        int64_t bad = CIERA_OK;
        for (int i = 0; i + 1 < ncut; i++) {
            if (sizes[i] < 0) bad = sizes[i];
            else if (k < sized && cut[i + 1] <= bnd[k]) pos += sizes[i];
        }
        rc[k] = bad != CIERA_OK ? bad
                                : delta_decode_chunk_dispatch(l, &wc, payload, length, target, bnd[k], bnd[k + 1], pos,
                                                              k >= sized);
    }
    for (int k = 0; k < threads; k++)
        if (rc[k] < 0) return (int)rc[k];
    if (rev && rc[threads - 1] != rc[threads - 2]) return CIERA_E_SIZES;
    return CIERA_OK;
}

/* ============================================================================================
 * decode_many: several payloads in one flat buffer, each decoded into one row of `targets`
 * ============================================================================================ */
#define CIERA_MAGIC 0xC1E7AL
#define CIERA_FLAG_OVERFLOW 1

/* codec: 1 exponent_reuse, 2 delta (the codec ids). Returns 0, or a negative code with the index
 * of the failing entry in *bad. Headers are checked before a payload is decoded. */
int ciera_decode_many(int codec, const void *layout, const uint8_t *payloads, int64_t payloads_len,
                      const int64_t *rows, const int64_t *offsets, int64_t k, void *targets, int64_t world,
                      int64_t row_bytes, int threads, int64_t *bad) {
    int64_t fixed = codec == 1 ? ((const ciera_er_layout *)layout)->off_exps
                               : ((const ciera_delta_layout *)layout)->off_data;
    for (int64_t i = 0; i < k; i++) {
        *bad = i;
        int64_t off = offsets[i], row = rows[i];
        if (row < 0 || row >= world || off < 0 || off % 16 || off + 32 > payloads_len) return CIERA_E_ARGS;
        int64_t h[4];
        memcpy(h, payloads + off, sizeof h);
        /* h = [magic|codec, flags, needed, capacity]: a payload is its first `needed` bytes (the
         * gather sends exactly those; the capacity is the sender's encode buffer). */
        if (h[0] != ((CIERA_MAGIC << 8) | codec) || (h[1] & CIERA_FLAG_OVERFLOW) || h[2] < fixed ||
            h[2] > h[3] || h[2] > payloads_len - off)
            return CIERA_E_HEADER;
        uint8_t *t = (uint8_t *)targets + row * row_bytes;
        int r = codec == 1 ? ciera_er_decode((const ciera_er_layout *)layout, payloads + off, h[2], t, threads)
                           : ciera_delta_decode((const ciera_delta_layout *)layout, payloads + off, h[2], t, threads);
        if (r != CIERA_OK) return r;
    }
    return CIERA_OK;
}

/* ============================================================================================
 * Codec.encode / Codec.decode on CPU in one call each: the header written / checked here, so the
 * Python side does no tensor operation around the codec (each costs tens of microseconds once the
 * codec's streams have left the caches: serial time that no thread count shortens).
 * ============================================================================================ */

/* Encodes and writes the header [magic|codec, flags, needed, capacity]; returns needed (the
 * overflow flag set when it exceeds the capacity) or a negative error code. */
int64_t ciera_encode(int codec, const void *layout, const void *shard, void *state, uint8_t *out, int64_t capacity,
                     int threads) {
    if (capacity < 32 || (codec != 1 && codec != 2)) return CIERA_E_ARGS;
    int64_t needed = codec == 1 ? ciera_er_encode((const ciera_er_layout *)layout, shard, (uint8_t *)state, out,
                                                  capacity, threads)
                                : ciera_delta_encode((const ciera_delta_layout *)layout, shard, state, out, capacity,
                                                     threads);
    if (needed < 0) return needed;
    int64_t h[4] = {(int64_t)((CIERA_MAGIC << 8) | codec), needed > capacity ? CIERA_FLAG_OVERFLOW : 0, needed,
                    capacity};
    memcpy(out, h, sizeof h);
    return needed;
}

/* Checks the header as Codec.decode does (codec, not overflowed, needed within length), then
 * decodes; CIERA_E_HEADER when the header is refused (the caller names the reason). */
int ciera_decode(int codec, const void *layout, const uint8_t *payload, int64_t length, void *target, int threads) {
    if (length < 32 || (codec != 1 && codec != 2)) return CIERA_E_HEADER;
    int64_t h[4];
    memcpy(h, payload, sizeof h);
    if (h[0] != ((CIERA_MAGIC << 8) | codec) || (h[1] & CIERA_FLAG_OVERFLOW) || h[2] > length) return CIERA_E_HEADER;
    return codec == 1 ? ciera_er_decode((const ciera_er_layout *)layout, payload, length, target, threads)
                      : ciera_delta_decode((const ciera_delta_layout *)layout, payload, length, target, threads);
}
