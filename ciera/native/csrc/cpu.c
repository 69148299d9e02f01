/* CPU features, checked per call (the environment variables let the tests force each path). */
#include "internal.h"

#if CIERA_X86
const uint8_t even_bytes[64] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
                                64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94,
                                96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};

int cpu_avx2(void) {
    const char *env = getenv("CIERA_NATIVE_AVX2");
    if (env && env[0] == '0') return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
}

int cpu_avx512(void) {
    const char *env = getenv("CIERA_NATIVE_AVX512");
    if ((env && env[0] == '0') || !cpu_avx2()) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi");
}

int cpu_avx512cd(void) {
    return cpu_avx512() && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vbmi2");
}
#else
int cpu_avx2(void) { return 0; }
int cpu_avx512(void) { return 0; }
int cpu_avx512cd(void) { return 0; }
#endif
