/* delta_ans: delta's symbols under interleaved rANS (the format: ciera/codecs/delta_ans/codec.py).
 *
 * Encode: one histogram pass (per thread, summed in a fixed order), the frequency tables, then
 * every block's 32 streams encoded backwards, interleaved (32 independent states: the divisions
 * overlap), into a staging copy of the block's raw area (a block whose streams would not fit there
 * is sent raw); sizes, prefix sums and the copy out follow. Decode: the tables become slot -> symbol
 * lookups, the counts give every block's offset, and blocks decode in parallel, 32 lanes per step.
 * Blocks are claimed dynamically; each block's bytes are its own, so nothing depends on threads.
 * 16-bit values take the AVX-512 paths of delta_ans_avx512.c where the CPU has them (the same
 * bytes and statuses; CIERA_NATIVE_AVX512=0 forces the portable ones). */
#include "delta_ans.h"

CIERA_LAYOUT_INFO(dans, CIERA_DANS_LAYOUT)

/* The smallest payload: header, map and counts, no table (the counts section follows the map). */
int64_t ciera_dans_fixed_bytes(const ciera_dans_layout *l) { return (l->off_tables + 2 * l->n_streams + 15) / 16 * 16; }

static int64_t al16(int64_t n) { return (n + 15) / 16 * 16; }
static int64_t dans_off_counts(const ciera_dans_layout *l, int64_t n_tab) {
    return al16(l->off_tables + n_tab * l->table_bytes);
}
static int64_t dans_off_data(const ciera_dans_layout *l, int64_t n_tab) {
    return al16(dans_off_counts(l, n_tab) + 2 * l->n_streams);
}

static int dans_supported(const ciera_dans_layout *l) {
    int fmt = (l->total_bits == 16 && ((l->mant_bits == 7 && l->exp_bits == 8) || (l->mant_bits == 10 && l->exp_bits == 5))) ||
              (l->total_bits == 32 && l->mant_bits == 23 && l->exp_bits == 8);
    int64_t B = l->block_size;
    return fmt && l->lanes == DANS_LANES && B >= 64 && B <= (1 << 19) && (B & (B - 1)) == 0 &&
           l->steps * DANS_LANES == B && l->numel >= 0 && l->numel < CIERA_MAX_NUMEL &&
           l->n_blocks == (l->numel + B - 1) / B && l->n_streams == l->n_blocks * DANS_LANES &&
           l->n_classes == (1 << l->exp_bits) && l->n_symbols == l->total_bits + 12 && l->prob_bits == DANS_P &&
           l->high_bytes == l->total_bits / 8 && l->map_bytes == l->n_classes / 8 &&
           l->table_bytes == 2 * l->n_symbols && l->max_words == l->steps * (1 + (l->total_bits - 1 + 15) / 16);
}

/* z, context and symbol of value i against the previous pattern. */
ALWAYS_INLINE void dans_value(int W, int M, int E, const void *shard, const void *state, int64_t i, uint32_t *z,
                              int *ctx, int *sym, int *k) {
    const uint32_t mask = W == 16 ? 0xFFFFu : 0xFFFFFFFFu;
    const uint32_t uo = load_u(state, i, W), d = (load_u(shard, i, W) - uo) & mask;
    const uint32_t zz = ((d << 1) ^ (0u - (d >> (W - 1)))) & mask;
    *z = zz;
    *ctx = (int)((uo >> M) & ((1u << E) - 1));
    if (zz < DANS_DIRECT) {
        *sym = (int)zz, *k = 0;
    } else {
        const int bl = 32 - __builtin_clz(zz);
        *sym = bl + DANS_DIRECT - 5, *k = bl - 1;
    }
}

ALWAYS_INLINE void dans_hist_range_fmt(const int W, const int M, const int E, int64_t A, const void *shard,
                                       const void *state, int64_t lo, int64_t hi, int64_t *hist) {
    for (int64_t i = lo; i < hi; i++) {
        uint32_t z;
        int ctx, sym, k;
        dans_value(W, M, E, shard, state, i, &z, &ctx, &sym, &k);
        hist[ctx * A + sym]++;
    }
}

HOT static void dans_hist_range(const ciera_dans_layout *l, const void *shard, const void *state, int64_t lo,
                                int64_t hi, int64_t *hist) {
    if (l->total_bits == 16 && l->mant_bits == 7) dans_hist_range_fmt(16, 7, 8, l->n_symbols, shard, state, lo, hi, hist);
    else if (l->total_bits == 16) dans_hist_range_fmt(16, 10, 5, l->n_symbols, shard, state, lo, hi, hist);
    else dans_hist_range_fmt(32, 23, 8, l->n_symbols, shard, state, lo, hi, hist);
}

/* A table as the encoder uses it: frequency, cumulative frequency and the division's magic. */
typedef struct {
    uint32_t freq[DANS_MAX_SYMBOLS], cum[DANS_MAX_SYMBOLS];
    uint64_t magic[DANS_MAX_SYMBOLS];
} dans_table;

/* floor(x / f) for x < 2^32, 1 <= f <= 2^12, as (x * magic) >> 63 with magic = floor(2^63 / f) + 1
 * (f = 1: 2^63 + 1): the product overshoots x / f by less than x / 2^63 < 2^-31, and x / f lies at
 * least 1 / f >= 2^-12 below the next integer. One multiply instead of a division (tens of cycles). */
static uint64_t dans_magic(uint32_t f) { return f ? ((uint64_t)1 << 63) / f + 1 : 0; }
ALWAYS_INLINE uint32_t dans_div(uint32_t x, uint64_t magic) {
    return (uint32_t)(((unsigned __int128)x * magic) >> 63);
}

/* Pushes nb (0..16) raw bits: a word out first when the shifted state would pass 2^32. The word is
 * stored whether or not it is kept (the buffer has a word of slack); no branch. */
ALWAYS_INLINE uint32_t dans_put_bits(uint32_t x, uint32_t bits, int nb, uint16_t *restrict w, int *nw) {
    const int renorm = ((uint64_t)x >> (32 - nb)) != 0; /* nb = 0: x >> 32 = 0 */
    w[*nw] = (uint16_t)x;
    *nw += renorm;
    x = renorm ? x >> 16 : x;
    return (uint32_t)(((uint64_t)x << nb) | bits);
}

/* Encodes block b's lanes into `words` (lane j's at words + j * DANS_STRIDE, emission order),
 * their counts into nw and final states into xs. W, M, E: the format, constants after inlining. */
ALWAYS_INLINE void dans_encode_block_fmt(const int W, const int M, const int E, const ciera_dans_layout *l,
                                         const void *shard, const void *state, const dans_table *tabs,
                                         const int *tab_of, int64_t b, uint16_t *restrict words, int64_t *nw,
                                         uint32_t *xs) {
    const uint32_t mask = W == 16 ? 0xFFFFu : 0xFFFFFFFFu;
    const int64_t B = l->block_size, base = b * B, nv = min64(B, l->numel - base), mw = DANS_STRIDE(l->max_words);
    const int64_t steps = (nv + DANS_LANES - 1) / DANS_LANES;
    uint32_t x[DANS_LANES];
    int cnt[DANS_LANES]; /* locals: stores to the words cannot alias them (the build has no strict aliasing) */
    for (int j = 0; j < DANS_LANES; j++) x[j] = DANS_LOW, cnt[j] = 0;
    for (int64_t t = steps - 1; t >= 0; t--) {
        const int lanes = (int)min64(DANS_LANES, nv - t * DANS_LANES);
        const int64_t i0 = base + t * DANS_LANES;
        /* The step's symbols first, in a loop over consecutive values the compiler vectorises. */
        int symv[DANS_LANES], kv[DANS_LANES], tabv[DANS_LANES];
        uint32_t lowv[DANS_LANES];
        for (int j = 0; j < lanes; j++) {
            const uint32_t uo = load_u(state, i0 + j, W), d = (load_u(shard, i0 + j, W) - uo) & mask;
            const uint32_t z = ((d << 1) ^ (0u - (d >> (W - 1)))) & mask;
            const int bl = z ? 32 - __builtin_clz(z) : 0;
            const int direct = z < DANS_DIRECT;
            symv[j] = direct ? (int)z : bl + DANS_DIRECT - 5;
            kv[j] = direct ? 0 : bl - 1;
            lowv[j] = direct ? 0 : z & ((1u << (bl - 1)) - 1);
            tabv[j] = tab_of[(uo >> M) & ((1u << E) - 1)];
        }
        for (int j = 0; j < lanes; j++) {
            const int sym = symv[j], k = kv[j];
            const uint32_t low = lowv[j];
            uint16_t *restrict w = words + j * mw;
            uint32_t xj = x[j];
            int c = cnt[j];
            if (W == 32) xj = dans_put_bits(xj, low >> 16, k > 16 ? k - 16 : 0, w, &c);
            xj = dans_put_bits(xj, low & 0xFFFF, k < 16 ? k : 16, w, &c);
            const dans_table *tb = &tabs[tabv[j]];
            const uint32_t f = tb->freq[sym];
            const int renorm = (uint64_t)xj >= ((uint64_t)f << (32 - DANS_P));
            w[c] = (uint16_t)xj;
            cnt[j] = c + renorm;
            xj = renorm ? xj >> 16 : xj;
            const uint32_t q = dans_div(xj, tb->magic[sym]);
            x[j] = (q << DANS_P) + (xj - q * f) + tb->cum[sym];
        }
    }
    for (int j = 0; j < DANS_LANES; j++) xs[j] = x[j], nw[j] = cnt[j];
}

HOT static void dans_encode_block(const ciera_dans_layout *l, const void *shard, const void *state,
                                  const dans_table *tabs, const int *tab_of, int64_t b, uint16_t *words,
                                  int64_t *nw, uint32_t *xs) {
    if (l->total_bits == 16 && l->mant_bits == 7) dans_encode_block_fmt(16, 7, 8, l, shard, state, tabs, tab_of, b, words, nw, xs);
    else if (l->total_bits == 16) dans_encode_block_fmt(16, 10, 5, l, shard, state, tabs, tab_of, b, words, nw, xs);
    else dans_encode_block_fmt(32, 23, 8, l, shard, state, tabs, tab_of, b, words, nw, xs);
}

int64_t ciera_dans_encode(const ciera_dans_layout *l, const void *shard, void *state, uint8_t *out, int64_t capacity,
                          int threads) {
    if (!dans_supported(l) || capacity < 0) return CIERA_E_ARGS;
    const int64_t n = l->numel, S = l->high_bytes, A = l->n_symbols, C = l->n_classes, nb = l->n_blocks;
    const int W = (int)l->total_bits;
    if (n == 0) return dans_off_data(l, 0);
    threads = clamp_threads(threads);
    const int avx = W == 16 && cpu_avx512cd(); /* the AVX-512 path: 16-bit values */
    const int64_t n_hist = C * A;
    int64_t *hists = calloc((size_t)(threads * n_hist), sizeof(int64_t));
    int64_t *cnt = malloc((size_t)l->n_streams * sizeof(int64_t));
    uint32_t *xs = malloc((size_t)l->n_streams * sizeof(uint32_t));
    int64_t *block_bytes = malloc((size_t)nb * sizeof(int64_t));
    uint8_t *staging = malloc((size_t)(n * S));
    dans_table *tabs = malloc((size_t)C * sizeof(dans_table));
    if (!hists || !cnt || !xs || !block_bytes || !staging || !tabs) {
        free(hists), free(cnt), free(xs), free(block_bytes), free(staging), free(tabs);
        return CIERA_E_NOMEM;
    }
    /* 1. histogram: thread k counts a fixed range, summed in thread order (integers: exact). */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        const int k = CIERA_THREAD_ID();
        const int64_t lo = n * k / threads, hi = n * (k + 1) / threads;
#if CIERA_X86
        if (avx) dans_hist16_avx512(l, shard, state, lo, hi, hists + k * n_hist);
        else
#endif
            dans_hist_range(l, shard, state, lo, hi, hists + k * n_hist);
    }
    for (int k = 1; k < threads; k++)
        for (int64_t i = 0; i < n_hist; i++) hists[i] += hists[k * n_hist + i];
    /* 2. tables: floor(n_s M / N), at least 1 where n_s > 0, the rest on the first most frequent. */
    int32_t tab_of[DANS_CONTEXTS];
    int64_t n_tab = 0;
    for (int64_t e = 0; e < C; e++) {
        const int64_t *h = hists + e * A;
        int64_t N = 0, top = 0;
        for (int64_t s = 0; s < A; s++) {
            N += h[s];
            if (h[s] > h[top]) top = s;
        }
        tab_of[e] = N ? (int)n_tab : -1;
        if (!N) continue;
        dans_table *tb = &tabs[n_tab++];
        int64_t sum = 0;
        for (int64_t s = 0; s < A; s++) {
            int64_t f = h[s] * DANS_M / N;
            if (h[s] > 0 && f == 0) f = 1;
            tb->freq[s] = (uint32_t)f;
            sum += f;
        }
        tb->freq[top] = (uint32_t)((int64_t)tb->freq[top] + DANS_M - sum);
        uint32_t c = 0;
        for (int64_t s = 0; s < A; s++) tb->cum[s] = c, c += tb->freq[s], tb->magic[s] = dans_magic(tb->freq[s]);
    }
    /* The AVX-512 path looks frequency | cumulative << 16 up by context, not by table. */
    uint32_t *fc = avx ? calloc((size_t)(C * A), sizeof(uint32_t)) : NULL;
    if (avx && !fc) {
        free(hists), free(cnt), free(xs), free(block_bytes), free(staging), free(tabs);
        return CIERA_E_NOMEM;
    }
    for (int64_t e = 0; fc && e < C; e++)
        for (int64_t s = 0; tab_of[e] >= 0 && s < A; s++)
            fc[e * A + s] = tabs[tab_of[e]].freq[s] | tabs[tab_of[e]].cum[s] << 16;
    /* 3. blocks: streams staged in the block's raw area when they fit there. */
    const size_t scratch = (size_t)(DANS_LANES * DANS_STRIDE(l->max_words)) * sizeof(uint16_t);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        uint16_t *words = (uint16_t *)thread_scratch(scratch);
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < nb; b++) {
            if (!words) {
                block_bytes[b] = -1;
                continue;
            }
            const int64_t base = b * l->block_size, nv = min64(l->block_size, n - base);
            int64_t *nw = cnt + b * DANS_LANES;
            uint32_t *xb = xs + b * DANS_LANES;
#if CIERA_X86
            if (fc) dans_encode_block16_avx512(l, shard, state, fc, b, words, nw, xb);
            else
#endif
                dans_encode_block(l, shard, state, tabs, tab_of, b, words, nw, xb);
            int64_t bytes = 0;
            for (int j = 0; j < DANS_LANES; j++)
                if (j < nv) bytes += 4 + 2 * nw[j];
            if (bytes > nv * S) {
                block_bytes[b] = -(nv * S) - 2; /* raw: -(bytes) - 2 */
                continue;
            }
            block_bytes[b] = bytes;
            uint8_t *p = staging + base * S;
            for (int j = 0; j < DANS_LANES && j < nv; j++) {
                store_le(p, xb[j], 4);
                p += 4;
                const uint16_t *w = words + j * DANS_STRIDE(l->max_words);
                for (int64_t r = nw[j] - 1; r >= 0; r--, p += 2) store_le(p, w[r], 2);
            }
        }
    }
    int64_t total = 0, nomem = 0;
    for (int64_t b = 0; b < nb; b++) {
        if (block_bytes[b] == -1) nomem = 1;
        total += block_bytes[b] >= 0 ? block_bytes[b] : -block_bytes[b] - 2;
    }
    free(fc);
    if (nomem) {
        free(hists), free(cnt), free(xs), free(block_bytes), free(staging), free(tabs);
        return CIERA_E_NOMEM;
    }
    int64_t needed = dans_off_data(l, n_tab) + total;
    const int64_t max_bytes = dans_off_data(l, 0) + n * S;
    int all_raw = needed > max_bytes;
    if (all_raw) n_tab = 0, needed = max_bytes;
    if (needed <= capacity) {
        const int64_t off_c = dans_off_counts(l, n_tab), off_d = dans_off_data(l, n_tab);
        memset(out + 32, 0, (size_t)(off_d - 32));
        if (n_tab) {
            for (int64_t e = 0; e < C; e++)
                if (tab_of[e] >= 0) out[l->off_map + e / 8] |= (uint8_t)(1u << (e % 8));
            for (int64_t t = 0; t < n_tab; t++)
                for (int64_t s = 0; s < A; s++) store_le(out + l->off_tables + (t * A + s) * 2, tabs[t].freq[s], 2);
        }
        int64_t pos = off_d;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t base = b * l->block_size, nv = min64(l->block_size, n - base);
            const int raw = all_raw || block_bytes[b] < 0;
            for (int j = 0; j < DANS_LANES; j++)
                store_le(out + off_c + 2 * (b * DANS_LANES + j), raw ? DANS_RAW : (uint64_t)cnt[b * DANS_LANES + j], 2);
            if (raw) {
                const uint32_t mask = W == 16 ? 0xFFFFu : 0xFFFFFFFFu;
                for (int64_t i = base; i < base + nv; i++) {
                    const uint32_t d = (load_u(shard, i, W) - load_u(state, i, W)) & mask;
                    store_le(out + pos + (i - base) * S, ((d << 1) ^ (0u - (d >> (W - 1)))) & mask, (int)S);
                }
                pos += nv * S;
            } else {
                memcpy(out + pos, staging + base * S, (size_t)block_bytes[b]);
                pos += block_bytes[b];
            }
        }
    }
    memcpy(state, shard, (size_t)(n * S));
    free(hists), free(cnt), free(xs), free(block_bytes), free(staging), free(tabs);
    return needed;
}

/* Refills the state from the lane's next word when it fell below 2^16 (and `cond`), without a
 * branch: the word is read when the stream still holds one; *bad is set when it was needed and
 * the stream had none. */
ALWAYS_INLINE uint32_t dans_refill(uint32_t x, int cond, const uint8_t *payload, int64_t *a, int64_t e, int *bad) {
    const int need = cond && x < DANS_LOW, has = *a + 2 <= e;
    const uint32_t w = has ? (uint32_t)load_le(payload + (has ? *a : 0), 2) : 0;
    *bad |= need && !has;
    *a += 2 * need;
    return need ? (x << 16) | w : x;
}

ALWAYS_INLINE int dans_decode_block_fmt(const int W, const int M, const int E, const ciera_dans_layout *l,
                                        const uint8_t *payload, const dans_dtable *tabs, const int *tab_of,
                                        const int64_t *stream_start, const int64_t *stream_end, int64_t b,
                                        void *target) {
    const uint32_t mask = W == 16 ? 0xFFFFu : 0xFFFFFFFFu;
    const int64_t B = l->block_size, base = b * B, nv = min64(B, l->numel - base);
    const int64_t steps = (nv + DANS_LANES - 1) / DANS_LANES;
    uint32_t x[DANS_LANES];
    int64_t at[DANS_LANES], end[DANS_LANES];
    int bad = 0;
    for (int j = 0; j < DANS_LANES && j < nv; j++) {
        const int64_t s = stream_start[b * DANS_LANES + j];
        x[j] = (uint32_t)load_le(payload + s, 4);
        at[j] = s + 4, end[j] = stream_end[b * DANS_LANES + j];
    }
    for (int64_t t = 0; t < steps; t++) {
        const int lanes = (int)min64(DANS_LANES, nv - t * DANS_LANES);
        const int64_t i0 = base + t * DANS_LANES;
        /* The step's contexts first, in a loop over consecutive values the compiler vectorises. */
        int tabv[DANS_LANES], missing = 0;
        uint32_t zv[DANS_LANES];
        for (int j = 0; j < lanes; j++) {
            tabv[j] = tab_of[(load_u(target, i0 + j, W) >> M) & ((1u << E) - 1)];
            missing |= tabv[j] < 0;
        }
        if (missing) return CIERA_E_NO_TABLE;
        for (int j = 0; j < lanes; j++) {
            const dans_dtable *tb = &tabs[tabv[j]];
            uint32_t xj = x[j];
            int64_t a = at[j];
            const uint32_t e = tb->slot[xj & (DANS_M - 1)];
            const int s = (int)(e & 63);
            xj = ((e >> 6) & 0x1FFF) * (xj >> DANS_P) + (e >> 19);
            xj = dans_refill(xj, 1, payload, &a, end[j], &bad);
            const int k = s >= DANS_DIRECT ? s - (DANS_DIRECT - 4) : 0, lo_n = k < 16 ? k : 16;
            const uint32_t lo = xj & ((1u << lo_n) - 1);
            xj >>= lo_n;
            xj = dans_refill(xj, lo_n > 0, payload, &a, end[j], &bad);
            uint32_t hi = 0;
            if (W == 32) {
                const int hi_n = k > 16 ? k - 16 : 0;
                hi = xj & ((1u << hi_n) - 1);
                xj >>= hi_n;
                xj = dans_refill(xj, hi_n > 0, payload, &a, end[j], &bad);
            }
            const uint32_t z = s < DANS_DIRECT ? (uint32_t)s : (1u << k) | (hi << 16) | lo;
            x[j] = xj, at[j] = a;
            zv[j] = z;
        }
        for (int j = 0; j < lanes; j++) {
            const uint32_t z = zv[j];
            store_u(target, i0 + j, (load_u(target, i0 + j, W) + ((z >> 1) ^ (0u - (z & 1)))) & mask, W);
        }
        if (bad) return CIERA_E_STREAM;
    }
    for (int j = 0; j < DANS_LANES && j < nv; j++)
        if (at[j] != end[j] || x[j] != DANS_LOW) return CIERA_E_STREAM;
    return CIERA_OK;
}

HOT static int dans_decode_block(const ciera_dans_layout *l, const uint8_t *payload, const dans_dtable *tabs,
                                 const int *tab_of, const int64_t *stream_start, const int64_t *stream_end,
                                 int64_t b, void *target) {
    if (l->total_bits == 16 && l->mant_bits == 7)
        return dans_decode_block_fmt(16, 7, 8, l, payload, tabs, tab_of, stream_start, stream_end, b, target);
    if (l->total_bits == 16)
        return dans_decode_block_fmt(16, 10, 5, l, payload, tabs, tab_of, stream_start, stream_end, b, target);
    return dans_decode_block_fmt(32, 23, 8, l, payload, tabs, tab_of, stream_start, stream_end, b, target);
}

int ciera_dans_decode(const ciera_dans_layout *l, const uint8_t *payload, int64_t length, void *target, int threads) {
    if (!dans_supported(l)) return CIERA_E_ARGS;
    const int64_t n = l->numel, S = l->high_bytes, A = l->n_symbols, C = l->n_classes, nb = l->n_blocks;
    const int W = (int)l->total_bits;
    if (n == 0) return CIERA_OK;
    if (length < dans_off_data(l, 0)) return CIERA_E_TRUNCATED;
    int32_t tab_of[DANS_CONTEXTS];
    int64_t n_tab = 0;
    for (int64_t e = 0; e < C; e++) tab_of[e] = (payload[l->off_map + e / 8] >> (e % 8)) & 1 ? (int)n_tab++ : -1;
    if (dans_off_data(l, n_tab) > length) return CIERA_E_TRUNCATED;
    const int64_t off_c = dans_off_counts(l, n_tab), off_d = dans_off_data(l, n_tab);
    /* counts: raw blocks marked in every stream, no stream above its most words, all inside */
    int64_t *start = malloc((size_t)(2 * l->n_streams) * sizeof(int64_t));
    int64_t *block_start = malloc((size_t)(nb + 1) * sizeof(int64_t));
    dans_dtable *tabs = malloc((size_t)(n_tab ? n_tab : 1) * sizeof(dans_dtable));
    if (!start || !block_start || !tabs) {
        free(start), free(block_start), free(tabs);
        return CIERA_E_NOMEM;
    }
    int64_t *end = start + l->n_streams;
    int rc = CIERA_OK;
    for (int64_t t = 0; t < n_tab && rc == CIERA_OK; t++) {
        dans_dtable *tb = &tabs[t];
        uint32_t freq[DANS_MAX_SYMBOLS], c = 0;
        for (int64_t s = 0; s < A; s++) c += freq[s] = (uint32_t)load_le(payload + l->off_tables + (t * A + s) * 2, 2);
        if (c != DANS_M) {
            rc = CIERA_E_FREQ;
            break;
        }
        c = 0;
        for (int64_t s = 0; s < A; s++) {
            const uint32_t head = (uint32_t)s | freq[s] << 6;
            for (uint32_t q = 0; q < freq[s]; q++) tb->slot[c + q] = head | q << 19;
            c += freq[s];
        }
    }
    int64_t pos = off_d;
    for (int64_t b = 0; b < nb && rc == CIERA_OK; b++) {
        const int64_t base = b * l->block_size, nv = min64(l->block_size, n - base);
        const uint8_t *cb = payload + off_c + 2 * b * DANS_LANES;
        const int raw = load_le(cb, 2) == DANS_RAW;
        block_start[b] = pos;
        for (int j = 0; j < DANS_LANES; j++) {
            const int64_t c = (int64_t)load_le(cb + 2 * j, 2);
            if ((c == DANS_RAW) != raw) rc = CIERA_E_RAW_MARKS;
            else if (!raw && c > l->max_words) rc = CIERA_E_WORDS;
            const int64_t bytes = raw || j >= nv ? 0 : 4 + 2 * c;
            start[b * DANS_LANES + j] = pos;
            end[b * DANS_LANES + j] = pos + bytes;
            pos += bytes;
        }
        if (raw) pos += nv * S, start[b * DANS_LANES] = -1; /* -1: raw block */
    }
    if (rc == CIERA_OK && pos > length) rc = CIERA_E_TRUNCATED;
    if (rc == CIERA_OK) {
        threads = clamp_threads(threads);
        const int avx = W == 16 && cpu_avx512cd(); /* the AVX-512 path: 16-bit values */
        uint8_t tab8[DANS_CONTEXTS + 1];
        memset(tab8, 0xFF, DANS_CONTEXTS);
        for (int64_t e = 0; e < C; e++)
            if (tab_of[e] >= 0) tab8[e] = (uint8_t)tab_of[e];
        tab8[DANS_CONTEXTS] = n_tab < DANS_CONTEXTS; /* with 256 tables, 0xFF is a table */
        (void)avx, (void)tab8;
        int err = CIERA_OK;
        const uint32_t mask = W == 16 ? 0xFFFFu : 0xFFFFFFFFu;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
        for (int64_t b = 0; b < nb; b++) {
            int r = CIERA_OK;
            if (start[b * DANS_LANES] < 0) {
                const int64_t base = b * l->block_size, nv = min64(l->block_size, n - base);
                const uint8_t *p = payload + block_start[b];
                for (int64_t i = base; i < base + nv; i++) {
                    const uint32_t z = (uint32_t)load_le(p + (i - base) * S, (int)S);
                    store_u(target, i, (load_u(target, i, W) + ((z >> 1) ^ (0u - (z & 1)))) & mask, W);
                }
            } else {
#if CIERA_X86
                if (avx) r = dans_decode_block16_avx512(l, payload, tabs, tab8, start, end, b, target);
                else
#endif
                    r = dans_decode_block(l, payload, tabs, tab_of, start, end, b, target);
            }
            if (r != CIERA_OK) {
#pragma omp critical(ciera_dans_err)
                if (err == CIERA_OK) err = r;
            }
        }
        rc = err;
    }
    free(start), free(block_start), free(tabs);
    return rc;
}
