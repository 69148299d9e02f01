/* Native CPU twins of the CIERA codecs (exponent_reuse and delta): the library's interface.
 *
 * Plain C11 (+ OpenMP when the compiler has it), no Python or torch headers: loaded with ctypes
 * on tensors' data pointers by ciera/native/_lib.py, which reads this interface back from the
 * library (ciera_layout_fields, ciera_strerror, ciera_status_name, ciera_codec_name) rather than
 * keeping a copy. The payload formats are defined by the pure-torch references in
 * ciera/codecs/<name>/codec.py; every function here writes the same bytes (everything
 * the reference writes up to `needed`, and nothing else) and decodes to the same bits. Section
 * offsets come from the Python layout dataclasses (one source of truth), filled in by field name.
 *
 * Threads: every entry point takes `threads`; the work is claimed in grains of whole blocks as
 * threads get to it (claims.c: no thread waits on a fixed share of a slower one), and claims never
 * share an output byte, so results depend neither on the thread count nor on who claimed what.
 *
 * Decoders never read or write outside the buffers they are given: a payload whose sections run
 * past its length, or whose counts, widths or indices are impossible, returns a negative status
 * (the target may then be partly written, as with the reference's errors).
 *
 * Files: internal.h (shared helpers), claims.c (work sharing), cpu.c (CPU features),
 * exponent_reuse.c, delta.c, delta_ans.c (entry points, per-call choice of path) over delta_scalar.h (portable
 * kernels), delta_avx2.h and delta_avx512.c, dispatch.c (by codec id, with the payload header),
 * abi.c (what _lib.py reads back); both tables by id come from CIERA_CODECS below.
 */
#ifndef CIERA_CODECS_H
#define CIERA_CODECS_H

#include <stdint.h>

/* Bumped with every change of an entry point's signature or a layout: _lib.py refuses a build
 * whose ciera_abi() differs from its own. */
#define CIERA_ABI 6

#define CIERA_API __attribute__((visibility("default")))

/* Status of every entry point: CIERA_OK (or, for encoders, the bytes needed, >= 0), else one of
 * these. X(name, value, message): ciera_strerror / ciera_status_name give them to the caller. */
#define CIERA_STATUSES(X)                                                                                   \
    X(CIERA_OK, 0, "ok")                                                                                    \
    X(CIERA_E_TOO_MANY_BLOCKS, -1, "corrupt payload: more changed blocks than the payload has room for")    \
    X(CIERA_E_TRUNCATED, -2, "corrupt payload: a section runs past the payload's end")                      \
    X(CIERA_E_BAD_COUNT, -3, "corrupt payload: an exception count above the block's values")                \
    X(CIERA_E_BAD_TABLE, -4, "corrupt payload: a width above the value's bits in the width table")          \
    X(CIERA_E_BAD_INDEX, -5, "corrupt payload: an exception index past the block's values")                 \
    X(CIERA_E_ARGS, -6, "unsupported layout or arguments")                                                  \
    X(CIERA_E_NOMEM, -7, "out of memory")                                                                   \
    X(CIERA_E_HEADER, -8, "payload header is not a valid, non-overflowed payload of this codec and layout") \
    X(CIERA_E_SIZES, -9, "corrupt payload: the blocks' sizes do not add up to the header's needed bytes")  \
    X(CIERA_E_FREQ, -10, "corrupt payload: a frequency table does not sum to 2^12")                          \
    X(CIERA_E_STREAM, -11, "corrupt payload: an entropy-coded stream does not end on its last word and initial state") \
    X(CIERA_E_NO_TABLE, -12, "corrupt payload: a value's context has no frequency table")                  \
    X(CIERA_E_RAW_MARKS, -13, "corrupt payload: a raw block's streams are not all marked raw")             \
    X(CIERA_E_WORDS, -14, "corrupt payload: a stream holds more words than its values can emit") \
    X(CIERA_E_CODEC, -15, "unknown codec id (not one of the CIERA_CODECS ids this library was built with)")

typedef enum {
#define CIERA_STATUS_ENUM(name, value, message) name = value,
    CIERA_STATUSES(CIERA_STATUS_ENUM)
#undef CIERA_STATUS_ENUM
} ciera_status;

/* The codecs this library implements, one line each: X(id, name, symbol). `id` is the codec's wire
 * word (the codec byte of its payload header and the `codec_id` of its Python descriptor, > 0: raw,
 * 0, is never passed here), `name` its registry name, `symbol` the prefix of its entry points
 * ciera_<symbol>_encode / ciera_<symbol>_decode and of its layout struct ciera_<symbol>_layout. The
 * tables by id (abi.c, dispatch.c) and the entry points _lib.py declares are derived from this list;
 * an entry point given any other id returns CIERA_E_CODEC.
 *
 * Adding a codec: its own C file(s), which define its layout (CIERA_LAYOUT_STRUCT in the codec's
 * header, CIERA_LAYOUT_INFO and ciera_<symbol>_fixed_bytes in its C file, see internal.h) and its
 * two entry points, and one line here. */
#define CIERA_CODECS(X)       \
    X(1, exponent_reuse, er)  \
    X(2, delta, delta)        \
    X(3, delta_ans, dans)

/* Layouts: one payload shape each, every field an int64_t, filled by _lib.py by name from the
 * Python layout dataclass (or its FloatFormat); each codec's own files define the struct. */
#define CIERA_LAYOUT_TYPEDEF(id, name, sym) typedef struct ciera_##sym##_layout ciera_##sym##_layout;
CIERA_CODECS(CIERA_LAYOUT_TYPEDEF)
#undef CIERA_LAYOUT_TYPEDEF

/* --- what _lib.py reads back (abi.c) ---------------------------------------------------------- */
CIERA_API int ciera_abi(void);
/* 1 when built with OpenMP (else every call runs one thread). */
CIERA_API int ciera_openmp(void);
/* The message of a status; NULL for a code that is none. */
CIERA_API const char *ciera_strerror(int status);
/* The enumerator's name of a status ("CIERA_E_HEADER"); NULL for a code that is none. */
CIERA_API const char *ciera_status_name(int status);
/* The codec's name ("exponent_reuse", "delta"); NULL for an unknown id. */
CIERA_API const char *ciera_codec_name(int codec);
/* The prefix of the codec's entry points ("er": ciera_er_encode, ciera_er_decode); NULL for an
 * unknown id. */
CIERA_API const char *ciera_codec_symbol(int codec);
/* The field names of the codec's layout struct in order, space separated; NULL for an unknown id. */
CIERA_API const char *ciera_layout_fields(int codec);
/* sizeof the codec's layout struct; 0 for an unknown id. */
CIERA_API int64_t ciera_layout_bytes(int codec);

/* --- the codecs (one C file each, listed by CIERA_CODECS) ------------------------------------- */
/* Encoders write the payload's sections (not the header; nothing past `capacity`), update
 * `state` and return the bytes needed (> capacity: the payload overflowed) or a status.
 * Decoders turn `target` (the previous values) into the encoded shard; CIERA_OK or a status. */
#define CIERA_CODEC_ENTRY_POINTS(id, name, sym)                                                              \
    CIERA_API int64_t ciera_##sym##_encode(const ciera_##sym##_layout *l, const void *shard, void *state,   \
                                           uint8_t *out, int64_t capacity, int threads);                    \
    CIERA_API int ciera_##sym##_decode(const ciera_##sym##_layout *l, const uint8_t *payload, int64_t length, \
                                       void *target, int threads);
CIERA_CODECS(CIERA_CODEC_ENTRY_POINTS)
#undef CIERA_CODEC_ENTRY_POINTS

/* The counts delta's width table is chosen from, over values [lo, hi): hist[e * (W + 1) + L]
 * (2^E * (W + 1) entries, overwritten) = values whose previous exponent is e and whose z has bit
 * length L, counted by the path an encode on this CPU takes. For the tests. */
CIERA_API int ciera_delta_histogram(const ciera_delta_layout *l, const void *shard, const void *state, int64_t lo,
                                    int64_t hi, int64_t *hist);

/* --- by codec id, with the payload header (dispatch.c) ---------------------------------------- */
/* Encodes and writes the header [magic|codec, flags, needed, capacity]; returns needed (the
 * overflow flag set when it exceeds the capacity) or a status. */
CIERA_API int64_t ciera_encode(int codec, const void *layout, const void *shard, void *state, uint8_t *out,
                               int64_t capacity, int threads);
/* Checks the header as Codec.decode does (codec, not overflowed, needed within length), then
 * decodes; CIERA_E_HEADER when the header is refused (the caller names the reason). */
CIERA_API int ciera_decode(int codec, const void *layout, const uint8_t *payload, int64_t length, void *target,
                           int threads);
/* Decodes the payload at offsets[i] (its length: the needed bytes of its header, checked first)
 * into row rows[i] of `targets` (`world` rows of `row_bytes`) for i < k; CIERA_OK, or a status
 * with the failing entry's index in *bad. */
CIERA_API int ciera_decode_many(int codec, const void *layout, const uint8_t *payloads, int64_t payloads_len,
                                const int64_t *rows, const int64_t *offsets, int64_t k, void *targets, int64_t world,
                                int64_t row_bytes, int threads, int64_t *bad);

#endif
