/* delta's AVX2 + BMI2 kernels (cpu_avx2), chosen per call by delta_scalar.c's portable loops. A
 * header, not a file of its own: the loops' x86-64-v3 / v4 clones (HOT) then inline them. */
#ifndef CIERA_DELTA_AVX2_H
#define CIERA_DELTA_AVX2_H

#include "delta.h"

#if CIERA_X86
/* n values; idx and ww may be read / written up to 31 bytes past n. */
AVX2_FN static inline void widths_avx2(const delta_wctx *c, const uint8_t *idx, uint8_t *ww, int n) {
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
AVX2_FN static inline int exceptions_avx2(const uint32_t *zz, const uint32_t *zm, int n, uint16_t *exc) {
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
AVX2_FN static inline int64_t group_bytes64_avx2(const uint8_t *ww, int n) {
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

#endif
