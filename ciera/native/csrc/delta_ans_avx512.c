/* delta_ans on 16-bit values (bf16, fp16) on AVX-512 (F, BW, VL, VBMI, CD: Ice Lake and later,
 * Zen 4), chosen per call by delta_ans.c (cpu_avx512cd). A block's 32 rANS states are two
 * registers of 16 lanes: one step of every stream is a few dozen vector instructions, table
 * lookups are gathers, the encoder's renormalisation words go to each lane's buffer by a masked
 * scatter and the decoder's come in by a masked gather. Same bytes and statuses as the portable
 * paths (tests/ciera/native/test_native.py runs both). */
#include "delta_ans.h"

#if CIERA_X86
#define DANS_FN AVX512CD_FN
#define DANS_INLINE AVX512CD_FN static inline __attribute__((always_inline))

/* z = zigzag(new - old) and the context (previous exponent) of 32 16-bit values (zero where m
 * is clear). */
DANS_INLINE void dans_z_ctx32(const uint16_t *shard, const uint16_t *state, int64_t i0, __mmask32 m, __m128i sm,
                              __m512i emask, __m512i *z16, __m512i *e16) {
    const __m512i nw = _mm512_maskz_loadu_epi16(m, shard + i0), od = _mm512_maskz_loadu_epi16(m, state + i0);
    const __m512i d = _mm512_sub_epi16(nw, od);
    *z16 = _mm512_xor_si512(_mm512_slli_epi16(d, 1), _mm512_srai_epi16(d, 15));
    *e16 = _mm512_and_si512(_mm512_srl_epi16(od, sm), emask);
}

/* Half h (values 16h .. 16h + 15) of 32 16-bit lanes, zero-extended to 32 bits. */
DANS_INLINE __m512i dans_half(__m512i v16, int h) {
    return _mm512_cvtepu16_epi32(h ? _mm512_extracti64x4_epi64(v16, 1) : _mm512_castsi512_si256(v16));
}

/* Symbol and raw bit count k of 16 values z: z itself below 16 (k = 0), else 11 + bit length. */
DANS_INLINE void dans_sym16(__m512i z, __m512i *sym, __m512i *k) {
    const __m512i bl = _mm512_sub_epi32(_mm512_set1_epi32(32), _mm512_lzcnt_epi32(z));
    const __mmask16 direct = _mm512_cmplt_epu32_mask(z, _mm512_set1_epi32(DANS_DIRECT));
    *sym = _mm512_mask_blend_epi32(direct, _mm512_add_epi32(bl, _mm512_set1_epi32(DANS_DIRECT - 5)), z);
    *k = _mm512_maskz_sub_epi32((__mmask16)~direct, bl, _mm512_set1_epi32(1));
}

DANS_FN void dans_hist16_avx512(const ciera_dans_layout *l, const uint16_t *shard, const uint16_t *state, int64_t lo,
                                int64_t hi, int64_t *hist) {
    const int64_t CA = l->n_classes * l->n_symbols;
    const __m128i sm = _mm_cvtsi32_si128((int)l->mant_bits);
    const __m512i emask = _mm512_set1_epi16((short)((1 << l->exp_bits) - 1)), vA = _mm512_set1_epi32((int)l->n_symbols);
    /* Four copies, value j counted in copy j % 4: a run of one bin (most changes are 0 in a few
     * contexts) is then four independent chains, not one chain of store-to-load forwarding.
     * 32-bit counts, flushed every 2^30 values. */
    uint32_t *h4 = calloc((size_t)(4 * CA), sizeof(uint32_t));
    for (int64_t c0 = lo; c0 < hi; c0 += (int64_t)1 << 30) {
        const int64_t c1 = min64(hi, c0 + ((int64_t)1 << 30));
        for (int64_t i = c0; i < c1; i += 32) {
            const int n = (int)min64(32, c1 - i);
            __m512i z16, e16;
            dans_z_ctx32(shard, state, i, (__mmask32)lowmask64(n), sm, emask, &z16, &e16);
            int32_t idx[32];
            for (int h = 0; h < 2; h++) {
                __m512i sym, k;
                dans_sym16(dans_half(z16, h), &sym, &k);
                _mm512_storeu_si512(idx + 16 * h, _mm512_add_epi32(_mm512_mullo_epi32(dans_half(e16, h), vA), sym));
            }
            if (h4 && n == 32) {
                uint32_t *h1 = h4 + CA, *h2 = h4 + 2 * CA, *h3 = h4 + 3 * CA;
                for (int j = 0; j < 32; j += 4) h4[idx[j]]++, h1[idx[j + 1]]++, h2[idx[j + 2]]++, h3[idx[j + 3]]++;
            } else if (h4) {
                for (int j = 0; j < n; j++) h4[(j & 3) * CA + idx[j]]++;
            } else {
                for (int j = 0; j < n; j++) hist[idx[j]]++;
            }
        }
        if (h4)
            for (int64_t q = 0; q < 4 * CA; q++) hist[q % CA] += h4[q], h4[q] = 0;
    }
    free(h4);
}

DANS_FN void dans_encode_block16_avx512(const ciera_dans_layout *l, const uint16_t *shard, const uint16_t *state,
                                        const uint32_t *fc, int64_t b, uint16_t *words, int64_t *nw, uint32_t *xs) {
    const int64_t B = l->block_size, base = b * B, nv = min64(B, l->numel - base);
    const int64_t steps = (nv + DANS_LANES - 1) / DANS_LANES;
    const int stride = (int)DANS_STRIDE(l->max_words);
    const __m128i sm = _mm_cvtsi32_si128((int)l->mant_bits);
    const __m512i emask = _mm512_set1_epi16((short)((1 << l->exp_bits) - 1)), vA = _mm512_set1_epi32((int)l->n_symbols);
    const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512(), c32 = _mm512_set1_epi32(32);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i x[2] = {_mm512_set1_epi32((int)DANS_LOW), _mm512_set1_epi32((int)DANS_LOW)};
    /* pos: the word index of each lane's next word in `words` (lane j's buffer from j * stride) */
    __m512i pos[2] = {_mm512_mullo_epi32(lane, _mm512_set1_epi32(stride)),
                      _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), _mm512_set1_epi32(stride))};
    for (int64_t t = steps - 1; t >= 0; t--) {
        const __mmask32 m = (__mmask32)lowmask64(nv - t * DANS_LANES);
        __m512i z16, e16;
        dans_z_ctx32(shard, state, base + t * DANS_LANES, m, sm, emask, &z16, &e16);
        for (int h = 0; h < 2; h++) {
            const __mmask16 v = (__mmask16)(m >> (16 * h));
            const __m512i z = dans_half(z16, h);
            __m512i sym, k, xh = x[h], ph = pos[h];
            dans_sym16(z, &sym, &k);
            /* Raw bits (k <= 15): a word out when x << k would pass 2^32 (k = 0: x >> 32 = 0). The
             * scatter writes 32 bits: the word and the next slot, which a later word overwrites
             * or lies past the count. Lanes without a value have z = 0: nothing happens. */
            const __m512i sh = _mm512_srlv_epi32(xh, _mm512_sub_epi32(c32, k));
            const __mmask16 r1 = _mm512_test_epi32_mask(sh, sh);
            if (r1) {
                _mm512_mask_i32scatter_epi32(words, r1, ph, xh, 2);
                ph = _mm512_mask_add_epi32(ph, r1, ph, one);
                xh = _mm512_mask_srli_epi32(xh, r1, xh, 16);
            }
            xh = _mm512_or_si512(_mm512_sllv_epi32(xh, k), _mm512_and_si512(z, _mm512_sub_epi32(_mm512_sllv_epi32(one, k), one)));
            /* The symbol: frequency and cumulative frequency by context; a word out when x >= f << 20
             * (compared as x > (f << 20) - 1, which wraps to 2^32 - 1 for f = 2^12: never). */
            const __m512i idx = _mm512_add_epi32(_mm512_mullo_epi32(dans_half(e16, h), vA), sym);
            const __m512i fcv = _mm512_mask_i32gather_epi32(one, v, idx, fc, 4);
            const __m512i f = _mm512_and_si512(fcv, _mm512_set1_epi32(0xFFFF)), c = _mm512_srli_epi32(fcv, 16);
            const __mmask16 r2 = _mm512_mask_cmpgt_epu32_mask(v, xh, _mm512_sub_epi32(_mm512_slli_epi32(f, 32 - DANS_P), one));
            if (r2) {
                _mm512_mask_i32scatter_epi32(words, r2, ph, xh, 2);
                ph = _mm512_mask_add_epi32(ph, r2, ph, one);
                xh = _mm512_mask_srli_epi32(xh, r2, xh, 16);
            }
            /* q = floor(x / f): x < f 2^20, so x / f < 2^20 and the float quotient of the rounded x
             * is within 1/8 of it (two roundings of 2^-24 relative): q or one off, mended by the
             * remainder's range. */
            __m512i q = _mm512_cvttps_epu32(_mm512_div_ps(_mm512_cvtepu32_ps(xh), _mm512_cvtepu32_ps(f)));
            __m512i r = _mm512_sub_epi32(xh, _mm512_mullo_epi32(q, f));
            const __mmask16 neg = _mm512_cmplt_epi32_mask(r, zero);
            q = _mm512_mask_sub_epi32(q, neg, q, one);
            r = _mm512_mask_add_epi32(r, neg, r, f);
            const __mmask16 over = _mm512_cmpge_epi32_mask(r, f);
            q = _mm512_mask_add_epi32(q, over, q, one);
            r = _mm512_mask_sub_epi32(r, over, r, f);
            x[h] = _mm512_mask_mov_epi32(xh, v, _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(q, DANS_P), r), c));
            pos[h] = ph;
        }
    }
    for (int h = 0; h < 2; h++) {
        int32_t p[16];
        _mm512_storeu_si512(xs + 16 * h, x[h]);
        _mm512_storeu_si512(p, pos[h]);
        for (int j = 0; j < 16; j++) nw[16 * h + j] = p[j] - (int64_t)(16 * h + j) * stride;
    }
}

/* 16 int64 stream offsets from p, less s0, as int32 (a block's bytes are well under 2^31). */
DANS_INLINE __m512i dans_rel16(const int64_t *p, int64_t s0) {
    const __m512i b = _mm512_set1_epi64(s0);
    const __m256i a0 = _mm512_cvtepi64_epi32(_mm512_sub_epi64(_mm512_loadu_si512(p), b));
    const __m256i a1 = _mm512_cvtepi64_epi32(_mm512_sub_epi64(_mm512_loadu_si512(p + 8), b));
    return _mm512_inserti64x4(_mm512_castsi256_si512(a0), a1, 1);
}

/* The portable path's refill on 16 lanes: where `cond` and x < 2^16, x takes the lane's next word
 * (read as the upper half of the 4 bytes ending at it: never past the stream's end) when the
 * stream holds one; a needed word the stream lacks sets *bad. */
DANS_INLINE __m512i dans_refill16(__m512i x, __mmask16 cond, const uint8_t *pb, __m512i *at, __m512i end,
                                  __mmask16 *bad) {
    const __mmask16 need = _mm512_mask_cmplt_epu32_mask(cond, x, _mm512_set1_epi32((int)DANS_LOW));
    const __mmask16 has = _mm512_cmple_epi32_mask(_mm512_add_epi32(*at, _mm512_set1_epi32(2)), end);
    *bad |= need & (__mmask16)~has;
    const __m512i w = _mm512_srli_epi32(
        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), need & has, _mm512_sub_epi32(*at, _mm512_set1_epi32(2)), pb, 1), 16);
    *at = _mm512_mask_add_epi32(*at, need, *at, _mm512_set1_epi32(2));
    return _mm512_mask_or_epi32(x, need, _mm512_slli_epi32(x, 16), w);
}

DANS_FN int dans_decode_block16_avx512(const ciera_dans_layout *l, const uint8_t *payload, const dans_dtable *tabs,
                                       const uint8_t *tab8, const int64_t *stream_start, const int64_t *stream_end,
                                       int64_t b, uint16_t *target) {
    const int64_t B = l->block_size, base = b * B, nv = min64(B, l->numel - base);
    const int64_t steps = (nv + DANS_LANES - 1) / DANS_LANES, s0 = stream_start[b * DANS_LANES];
    const uint8_t *pb = payload + s0;
    const __m128i sm = _mm_cvtsi32_si128((int)l->mant_bits);
    const __m512i emask = _mm512_set1_epi16((short)((1 << l->exp_bits) - 1));
    const __m512i one = _mm512_set1_epi32(1), zero = _mm512_setzero_si512(), c16 = _mm512_set1_epi32(DANS_DIRECT);
    /* tab8 in four registers: 64 contexts' tables looked up by two permutes and a blend (VBMI) */
    const __m512i t0 = _mm512_loadu_si512(tab8), t1 = _mm512_loadu_si512(tab8 + 64);
    const __m512i t2 = _mm512_loadu_si512(tab8 + 128), t3 = _mm512_loadu_si512(tab8 + 192);
    const int can_miss = tab8[DANS_CONTEXTS] != 0;
    __m512i x[2], at[2], end[2];
    __mmask16 live[2], bad = 0;
    for (int h = 0; h < 2; h++) {
        const __m512i st = dans_rel16(stream_start + b * DANS_LANES + 16 * h, s0);
        live[h] = (__mmask16)lowmask64(nv - 16 * h);
        x[h] = _mm512_mask_i32gather_epi32(zero, live[h], st, pb, 1);
        at[h] = _mm512_add_epi32(st, _mm512_set1_epi32(4));
        end[h] = dans_rel16(stream_end + b * DANS_LANES + 16 * h, s0);
    }
    for (int64_t t = 0; t < steps; t++) {
        const int64_t i0 = base + t * DANS_LANES;
        const __mmask32 m = (__mmask32)lowmask64(nv - t * DANS_LANES);
        const __m512i od16 = _mm512_maskz_loadu_epi16(m, target + i0);
        const __m512i e16 = _mm512_and_si512(_mm512_srl_epi16(od16, sm), emask);
        /* The 32 values' tables first: a context without one stops the block before it writes. */
        const __m512i e8 = _mm512_castsi256_si512(_mm512_cvtepi16_epi8(e16));
        const __m512i tb = _mm512_mask_blend_epi8(_mm512_movepi8_mask(e8), _mm512_permutex2var_epi8(t0, e8, t1),
                                                  _mm512_permutex2var_epi8(t2, e8, t3));
        if (can_miss && _mm512_mask_cmpeq_epi8_mask((__mmask64)m, tb, _mm512_set1_epi8((char)0xFF)))
            return CIERA_E_NO_TABLE;
        const __m512i ti[2] = {_mm512_cvtepu8_epi32(_mm512_castsi512_si128(tb)),
                               _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(tb, 1))};
        __m256i out[2];
        for (int h = 0; h < 2; h++) {
            const __mmask16 v = (__mmask16)(m >> (16 * h));
            __m512i xh = x[h];
            const __m512i slot = _mm512_and_si512(xh, _mm512_set1_epi32((int)DANS_M - 1));
            const __m512i ent = _mm512_mask_i32gather_epi32(zero, v, _mm512_add_epi32(_mm512_slli_epi32(ti[h], DANS_P), slot),
                                                            tabs, 4);
            const __m512i s = _mm512_and_si512(ent, _mm512_set1_epi32(63));
            const __m512i f = _mm512_and_si512(_mm512_srli_epi32(ent, 6), _mm512_set1_epi32(0x1FFF));
            xh = _mm512_mask_mov_epi32(xh, v, _mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srli_epi32(xh, DANS_P)),
                                                               _mm512_srli_epi32(ent, 19)));
            xh = dans_refill16(xh, v, pb, &at[h], end[h], &bad);
            const __mmask16 raw = _mm512_cmpge_epu32_mask(s, c16);
            const __m512i k = _mm512_maskz_sub_epi32(raw, s, _mm512_set1_epi32(DANS_DIRECT - 4));
            const __m512i lo = _mm512_and_si512(xh, _mm512_sub_epi32(_mm512_sllv_epi32(one, k), one));
            xh = _mm512_srlv_epi32(xh, k);
            xh = dans_refill16(xh, v & _mm512_test_epi32_mask(k, k), pb, &at[h], end[h], &bad);
            const __m512i z = _mm512_mask_blend_epi32(raw, s, _mm512_or_si512(_mm512_sllv_epi32(one, k), lo));
            const __m512i dz = _mm512_xor_si512(_mm512_srli_epi32(z, 1), _mm512_sub_epi32(zero, _mm512_and_si512(z, one)));
            out[h] = _mm512_cvtepi32_epi16(_mm512_add_epi32(dans_half(od16, h), dz));
            x[h] = xh;
        }
        _mm512_mask_storeu_epi16(target + i0, m, _mm512_inserti64x4(_mm512_castsi256_si512(out[0]), out[1], 1));
        if (bad) return CIERA_E_STREAM;
    }
    for (int h = 0; h < 2; h++)
        if (_mm512_mask_cmpneq_epi32_mask(live[h], at[h], end[h]) ||
            _mm512_mask_cmpneq_epi32_mask(live[h], x[h], _mm512_set1_epi32((int)DANS_LOW)))
            return CIERA_E_STREAM;
    return CIERA_OK;
}
#endif
