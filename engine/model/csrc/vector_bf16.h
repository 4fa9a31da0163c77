// bf16 on 16 AVX-512 lanes, and libmvec's 16-lane expf: what the attention kernels
// (attention_common.h) and the element-wise ops (elementwise.h) both use, declared once.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc's libmvec: expf on 16 lanes

// 16 bf16 values (the words of `raw`) as fp32, exactly: each word shifted into a lane's high half.
inline __m512 widen_bf16(__m256i raw) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif
