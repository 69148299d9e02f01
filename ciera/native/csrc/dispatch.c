/* The entry points by codec id (the tables from CIERA_CODECS), with the payload header: Codec.encode / Codec.decode on CPU in
 * one call each, and decode_many. The header is written and checked here, so the Python side does
 * no tensor operation around the codec (each costs tens of microseconds once the codec's streams
 * have left the caches: serial time that no thread count shortens). */
#include "internal.h"

/* Header: int64 [magic << 8 | codec, flags, needed, capacity], then the codec's sections. */
#define CIERA_MAGIC 0xC1E7AL
#define CIERA_FLAG_OVERFLOW 1

#define CIERA_CASE_KNOWN(id, name, sym) case id:
static int known_codec(int codec) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_KNOWN)
        return 1;
    default:
        return 0;
    }
}
#undef CIERA_CASE_KNOWN

/* The smallest payload of the codec's layout: header and fixed sections; CIERA_E_CODEC for an
 * unknown id. */
#define CIERA_CASE_FIXED(id, name, sym) \
    case id:                            \
        return ciera_##sym##_fixed_bytes(layout);
static int64_t fixed_bytes(int codec, const void *layout) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_FIXED)
    default:
        return CIERA_E_CODEC;
    }
}
#undef CIERA_CASE_FIXED

#define CIERA_CASE_DECODE(id, name, sym) \
    case id:                             \
        return ciera_##sym##_decode(layout, payload, length, target, threads);
static int decode_by_id(int codec, const void *layout, const uint8_t *payload, int64_t length, void *target,
                        int threads) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_DECODE)
    default:
        return CIERA_E_CODEC;
    }
}
#undef CIERA_CASE_DECODE

#define CIERA_CASE_ENCODE(id, name, sym) \
    case id:                             \
        return ciera_##sym##_encode(layout, shard, state, out, capacity, threads);
static int64_t encode_by_id(int codec, const void *layout, const void *shard, void *state, uint8_t *out,
                            int64_t capacity, int threads) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_ENCODE)
    default:
        return CIERA_E_CODEC;
    }
}
#undef CIERA_CASE_ENCODE

/* Headers are checked before a payload is decoded. */
int ciera_decode_many(int codec, const void *layout, const uint8_t *payloads, int64_t payloads_len,
                      const int64_t *rows, const int64_t *offsets, int64_t k, void *targets, int64_t world,
                      int64_t row_bytes, int threads, int64_t *bad) {
    *bad = -1;
    if (!known_codec(codec)) return CIERA_E_CODEC;
    int64_t fixed = fixed_bytes(codec, layout);
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
        int r = decode_by_id(codec, layout, payloads + off, h[2], t, threads);
        if (r != CIERA_OK) return r;
    }
    return CIERA_OK;
}

int64_t ciera_encode(int codec, const void *layout, const void *shard, void *state, uint8_t *out, int64_t capacity,
                     int threads) {
    if (!known_codec(codec)) return CIERA_E_CODEC;
    if (capacity < 32) return CIERA_E_ARGS;
    int64_t needed = encode_by_id(codec, layout, shard, state, out, capacity, threads);
    if (needed < 0) return needed;
    int64_t h[4] = {(int64_t)((CIERA_MAGIC << 8) | codec), needed > capacity ? CIERA_FLAG_OVERFLOW : 0, needed,
                    capacity};
    memcpy(out, h, sizeof h);
    return needed;
}

int ciera_decode(int codec, const void *layout, const uint8_t *payload, int64_t length, void *target, int threads) {
    if (!known_codec(codec)) return CIERA_E_CODEC;
    if (length < 32) return CIERA_E_HEADER;
    int64_t h[4];
    memcpy(h, payload, sizeof h);
    if (h[0] != ((CIERA_MAGIC << 8) | codec) || (h[1] & CIERA_FLAG_OVERFLOW) || h[2] > length) return CIERA_E_HEADER;
    return decode_by_id(codec, layout, payload, length, target, threads);
}
