/* delta's portable per-block kernels, written once for every format (W, M, E are constants where
 * delta.c's per-call dispatchers instantiate them, in each CPU level's clone: HOT). Each takes the
 * AVX-512 path of delta_avx512.c for 16-bit values where the CPU has it (delta_wctx), and the
 * AVX2 kernels of delta_avx2.h where it has those. */
#ifndef CIERA_DELTA_SCALAR_H
#define CIERA_DELTA_SCALAR_H

#include "delta_avx2.h"


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

#endif
