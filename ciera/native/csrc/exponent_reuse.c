/* exponent_reuse: the portable loops (one per format, compiled for each CPU level: HOT), the
 * AVX-512 tile paths for bf16 with blocks of 8 (the default), and the threaded entry points. */
#include "internal.h"

/* exponent_reuse's layout: every field an int64_t, read back by _lib.py by name. */
#define CIERA_ER_LAYOUT(X)                                                   \
    X(numel) X(block_size) X(total_bits) X(exp_bits) X(mant_bits)           \
    X(sm_bytes) X(n_planes) X(plane_bytes)                                   \
    X(off_signmant) X(off_planes) X(off_bitmap) X(off_exps)
CIERA_LAYOUT_STRUCT(er, CIERA_ER_LAYOUT)
CIERA_LAYOUT_INFO(er, CIERA_ER_LAYOUT)

/* The smallest payload: header and the fixed sections, no changed block. */
int64_t ciera_er_fixed_bytes(const ciera_er_layout *l) { return l->off_exps; }

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
 * the slots, each overlapping the last, cost most of the encode's time.
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
int64_t ciera_er_encode(const ciera_er_layout *l, const void *shard, void *state_bytes, uint8_t *out,
                        int64_t capacity, int threads) {
    uint8_t *state = state_bytes; /* one exponent byte per value */
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
