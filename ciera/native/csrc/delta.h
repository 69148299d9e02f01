/* delta's internals shared by its files: the width-lookup context, the scalar kernels that both
 * the portable and the AVX-512 paths use (inline: compiled into each caller's target), and the
 * AVX-512 paths delta_avx512.c gives the others. */
#ifndef CIERA_DELTA_H
#define CIERA_DELTA_H

#include "internal.h"

/* delta's layout: every field an int64_t, read back by _lib.py by name (see CIERA_LAYOUT_INFO). */
#define CIERA_DELTA_LAYOUT(X)                                                \
    X(numel) X(block_size) X(total_bits) X(exp_bits) X(mant_bits)           \
    X(group_size) X(count_bytes) X(index_bytes) X(high_bytes)                \
    X(off_table) X(off_counts) X(off_data)
CIERA_LAYOUT_STRUCT(delta, CIERA_DELTA_LAYOUT)

#pragma GCC visibility push(hidden)

#define DELTA_MAX_BLOCK 4096

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
/* ---- delta_avx512.c: 16-bit values on AVX-512 (cpu_avx512; the histogram cpu_avx512cd) ------- */
/* The window's first exponent for values [lo, hi) (at least 4096 of them): the HIST_SLOTS
 * consecutive previous exponents holding the most of 1024 values spread over the range. */
int hist_window(int M, int E, const uint16_t *state, int64_t lo, int64_t hi);
AVX512CD_FN void hist16_avx512(int M, int E, const uint16_t *shard, const uint16_t *state, int64_t lo, int64_t hi,
                               int e0, uint32_t *hist);
AVX512_FN int64_t block_bytes16_avx512(const delta_wctx *c, int M, int E, const uint16_t *prev, int valid, uint8_t *ww,
                                       int ahead);
AVX512_FN int64_t block_widths16_avx512(const delta_wctx *c, int M, int E, const uint16_t *prev, int valid, int G,
                                        uint8_t *ww, int ahead);
AVX512_FN int64_t delta_encode_run16_g64(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                         const uint16_t *shard, uint16_t *state, uint8_t *counts, int64_t b_lo,
                                         int64_t b_hi, uint8_t *dst, int64_t room, int64_t pos, int64_t *ends);
AVX512_FN int64_t delta_encode_block16_avx512(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                              const uint16_t *shard, uint16_t *state, uint8_t *counts, int64_t b,
                                              uint8_t *dst, int64_t room);
AVX512_FN int64_t delta_decode_run16_g64(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                         const uint8_t *payload, int64_t length, uint16_t *target, int64_t b_lo,
                                         int64_t b_hi, int64_t pos, int rev);
AVX512_FN int64_t delta_decode_block16_avx512(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
                                              const uint8_t *payload, int64_t length, uint16_t *target, int64_t b,
                                              int c, int64_t pos, int rev);
#endif

#pragma GCC visibility pop

#endif
