/* What ciera/native/_lib.py reads back from the library instead of keeping a copy: the ABI
 * version, whether OpenMP is in, the statuses' names and messages, the codec ids and the layouts'
 * fields (every one an int64_t, in struct order). */
#include "internal.h"

#define CIERA_FIELD_NAME(f) " " #f
#define CIERA_FIELD_COUNT(f) +1
_Static_assert(sizeof(ciera_er_layout) == (0 CIERA_ER_LAYOUT(CIERA_FIELD_COUNT)) * sizeof(int64_t),
               "every layout field is an int64_t, unpadded");
_Static_assert(sizeof(ciera_delta_layout) == (0 CIERA_DELTA_LAYOUT(CIERA_FIELD_COUNT)) * sizeof(int64_t),
               "every layout field is an int64_t, unpadded");
_Static_assert(sizeof(ciera_dans_layout) == (0 CIERA_DANS_LAYOUT(CIERA_FIELD_COUNT)) * sizeof(int64_t),
               "every layout field is an int64_t, unpadded");

int ciera_abi(void) { return CIERA_ABI; }

int ciera_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

const char *ciera_strerror(int status) {
    switch (status) {
#define CIERA_STATUS_MESSAGE(name, value, message) \
    case value:                                     \
        return message;
        CIERA_STATUSES(CIERA_STATUS_MESSAGE)
#undef CIERA_STATUS_MESSAGE
    default:
        return NULL;
    }
}

const char *ciera_status_name(int status) {
    switch (status) {
#define CIERA_STATUS_NAME(name, value, message) \
    case value:                                  \
        return #name;
        CIERA_STATUSES(CIERA_STATUS_NAME)
#undef CIERA_STATUS_NAME
    default:
        return NULL;
    }
}

const char *ciera_codec_name(int codec) {
    switch (codec) {
    case CIERA_CODEC_EXPONENT_REUSE:
        return "exponent_reuse";
    case CIERA_CODEC_DELTA:
        return "delta";
    case CIERA_CODEC_DELTA_ANS:
        return "delta_ans";
    default:
        return NULL;
    }
}

/* The names with their leading space dropped. */
const char *ciera_layout_fields(int codec) {
    switch (codec) {
    case CIERA_CODEC_EXPONENT_REUSE:
        return CIERA_ER_LAYOUT(CIERA_FIELD_NAME) + 1;
    case CIERA_CODEC_DELTA:
        return CIERA_DELTA_LAYOUT(CIERA_FIELD_NAME) + 1;
    case CIERA_CODEC_DELTA_ANS:
        return CIERA_DANS_LAYOUT(CIERA_FIELD_NAME) + 1;
    default:
        return NULL;
    }
}

int64_t ciera_layout_bytes(int codec) {
    switch (codec) {
    case CIERA_CODEC_EXPONENT_REUSE:
        return (int64_t)sizeof(ciera_er_layout);
    case CIERA_CODEC_DELTA:
        return (int64_t)sizeof(ciera_delta_layout);
    case CIERA_CODEC_DELTA_ANS:
        return (int64_t)sizeof(ciera_dans_layout);
    default:
        return 0;
    }
}
