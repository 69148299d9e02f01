/* delta: the entry points (argument checks, the width table, threads) and the per-call choice of
 * block path (delta_scalar.h's portable kernels, compiled for each CPU level, or delta_avx512.c). */
#include "delta_scalar.h"

CIERA_LAYOUT_INFO(delta, CIERA_DELTA_LAYOUT)

/* The smallest payload: header, width table and counts. */
int64_t ciera_delta_fixed_bytes(const ciera_delta_layout *l) { return l->off_data; }

static int delta_supported(const ciera_delta_layout *l) {
    int fmt = (l->total_bits == 16 && ((l->mant_bits == 7 && l->exp_bits == 8) || (l->mant_bits == 10 && l->exp_bits == 5))) ||
              (l->total_bits == 32 && l->mant_bits == 23 && l->exp_bits == 8);
    int64_t B = l->block_size;
    return fmt && B >= 8 && B <= DELTA_MAX_BLOCK && (B & (B - 1)) == 0 && l->numel >= 0 && l->numel < CIERA_MAX_NUMEL &&
           l->group_size == (B < 64 ? B : 64) && l->count_bytes == (B < 255 ? 1 : 2) &&
           l->index_bytes == (B <= 256 ? 1 : 2) && l->high_bytes == l->total_bits / 8;
}

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
