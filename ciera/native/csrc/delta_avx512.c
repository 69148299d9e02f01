/* delta on 16-bit values (bf16, fp16) on AVX-512 (F, BW, VL, VBMI, VBMI2 + BMI2: Ice Lake and
 * later, Zen 4), chosen per call by delta_scalar.c (cpu_avx512; the histogram cpu_avx512cd):
 * width lookups 64 byte permutes at a time, groups of 64 values packed and unpacked without a
 * serial chain, and whole runs of blocks in one call. Same bytes as the portable paths. */
#include "delta.h"

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
AVX512_FN int64_t block_bytes16_avx512(const delta_wctx *c, int M, int E, const uint16_t *prev, int valid,
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
AVX512_FN int64_t block_widths16_avx512(const delta_wctx *c, int M, int E, const uint16_t *prev, int valid,
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

#define HIST_SLOTS 8     /* consecutive exponents whose bit lengths 0-7 are counted in registers */
#define HIST_LEVELS 16    /* bit planes of a counter: up to 2^16 per bit, flushed at 2^14 */
#define HIST_FLUSH 4096   /* iterations (128 values) between flushes: 2^14 inputs per bit at most */
#define HIST_BUF 2048     /* the other keys, counted when this many wait */
_Static_assert(4 * HIST_FLUSH < (1 << HIST_LEVELS), "a flush comes before a count outgrows the planes");

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
int hist_window(int M, int E, const uint16_t *state, int64_t lo, int64_t hi) {
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
AVX512CD_FN void hist16_avx512(int M, int E, const uint16_t *shard, const uint16_t *state, int64_t lo,
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
AVX512_FN int64_t delta_encode_run16_g64(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
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
AVX512_FN int64_t delta_encode_block16_avx512(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
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
AVX512_FN int64_t delta_decode_run16_g64(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
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
AVX512_FN int64_t delta_decode_block16_avx512(const ciera_delta_layout *l, int M, int E, const delta_wctx *wc,
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
