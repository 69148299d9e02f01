/* What ciera/native/_lib.py reads back from the library instead of keeping a copy: the ABI
 * version, whether OpenMP is in, the statuses' names and messages, the codec ids and the layouts'
 * fields (every one an int64_t, in struct order). The tables by codec id come from CIERA_CODECS. */
#include "internal.h"

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

#define CIERA_CASE_NAME(id, name, sym) \
    case id:                           \
        return #name;
const char *ciera_codec_name(int codec) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_NAME)
    default:
        return NULL;
    }
}
#undef CIERA_CASE_NAME

#define CIERA_CASE_SYMBOL(id, name, sym) \
    case id:                             \
        return #sym;
const char *ciera_codec_symbol(int codec) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_SYMBOL)
    default:
        return NULL;
    }
}
#undef CIERA_CASE_SYMBOL

#define CIERA_CASE_FIELDS(id, name, sym) \
    case id:                             \
        return ciera_##sym##_layout_fields();
const char *ciera_layout_fields(int codec) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_FIELDS)
    default:
        return NULL;
    }
}
#undef CIERA_CASE_FIELDS

#define CIERA_CASE_BYTES(id, name, sym) \
    case id:                            \
        return ciera_##sym##_layout_bytes();
int64_t ciera_layout_bytes(int codec) {
    switch (codec) {
        CIERA_CODECS(CIERA_CASE_BYTES)
    default:
        return 0;
    }
}
#undef CIERA_CASE_BYTES
