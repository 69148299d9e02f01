/* delta_ans's internals shared by its files: the format's constants, the tables as the coders use
 * them, and the AVX-512 paths delta_ans_avx512.c gives delta_ans.c (16-bit values). */
#ifndef CIERA_DELTA_ANS_H
#define CIERA_DELTA_ANS_H

#include "internal.h"

/* delta_ans's layout: every field an int64_t, read back by _lib.py by name (see CIERA_LAYOUT_INFO). */
#define CIERA_DANS_LAYOUT(X)                                                 \
    X(numel) X(block_size) X(total_bits) X(exp_bits) X(mant_bits)           \
    X(lanes) X(steps) X(n_blocks) X(n_streams) X(n_classes) X(n_symbols)     \
    X(prob_bits) X(high_bytes) X(max_words) X(off_map) X(map_bytes)          \
    X(off_tables) X(table_bytes)
CIERA_LAYOUT_STRUCT(dans, CIERA_DANS_LAYOUT)

#pragma GCC visibility push(hidden)

#define DANS_LANES 32
#define DANS_P 12
#define DANS_M (1u << DANS_P)
#define DANS_DIRECT 16
#define DANS_LOW (1u << 16)
#define DANS_RAW 0xFFFF
#define DANS_MAX_SYMBOLS 44 /* W + 12 for W = 32 */
#define DANS_CONTEXTS 256   /* the most contexts: 2^8 exponents */
/* Words between two lanes' buffers in the encoder's scratch: the most words plus 37, so the 32
 * write positions do not share one cache set (a power-of-two stride would: 4K aliasing). */
#define DANS_STRIDE(mw) ((mw) + 37)

/* Decode table: slot -> the slot's symbol | frequency << 6 | (slot - cumulative) << 19 (one load). */
typedef struct {
    uint32_t slot[DANS_M];
} dans_dtable;

#if CIERA_X86
/* AVX-512 F, BW, VL, VBMI and CD (the bit lengths): cpu_avx512cd(). */
/* Counts of (context, symbol) of values [lo, hi) added to hist ([C x A] int64). */
void dans_hist16_avx512(const ciera_dans_layout *l, const uint16_t *shard, const uint16_t *state, int64_t lo,
                        int64_t hi, int64_t *hist);
/* Encodes block b's 32 streams, as dans_encode_block in delta_ans.c: words of lane j at
 * words + j * DANS_STRIDE(max_words), in emission order, their counts in nw, final states in xs.
 * fc: per context e (not per table), A entries frequency | cumulative << 16. */
void dans_encode_block16_avx512(const ciera_dans_layout *l, const uint16_t *shard, const uint16_t *state,
                                const uint32_t *fc, int64_t b, uint16_t *words, int64_t *nw, uint32_t *xs);
/* Decodes ANS block b into target (the previous values on entry), as dans_decode_block; the same
 * status for the same payload. tab8: DANS_CONTEXTS + 1 bytes, context e's table (0xFF: none), then
 * 1 when some context has none (fewer than 256 tables). */
int dans_decode_block16_avx512(const ciera_dans_layout *l, const uint8_t *payload, const dans_dtable *tabs,
                               const uint8_t *tab8, const int64_t *stream_start, const int64_t *stream_end,
                               int64_t b, uint16_t *target);
#endif

#pragma GCC visibility pop

#endif
