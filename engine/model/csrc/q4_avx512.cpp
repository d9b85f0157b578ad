// specd_q4::mm -- y = x @ W.T for a 4-bit weight W in specd's blocked layout (AVX-512 VNNI).
//
// Layout of `packed` (uint8 [N/16, K/32, 320], engine/q4_matmul.py packs it): for each block of
// 16 output columns c and group g of 32 inputs, 4 chunks of 64 bytes, then the group's 16 scales
// d and 16 minimums m as fp16 (w = d * q + m, q in 0..15: GGUF's Q4_1, values exactly as stored).
// Chunk j covers inputs k0 = 32 g + 8 j .. k0 + 7:
//     byte 4c + i = q[c, k0 + i] | q[c, k0 + 4 + i] << 4      (i = 0..3)
// so one AND gives, in 32-bit lane c, the bytes q[c, k0 .. k0+3], and a shift and an AND the
// bytes q[c, k0+4 .. k0+7]: operands of VPDPBUSD (u8 x s8, four products a lane) as they stand.
//
// The activations are rounded to 8 bits per row and group of 32 inputs, as llama.cpp does for
// its Q4_1 x Q8_1 dot products: s = amax / 127, xq = round(x * (127 / amax)) (to nearest even),
// so x ~ s * xq (engine/q4_matmul.py's `activations_8bit` is the reference). Then per group
//     sum_k x_k w_k ~ s * (d * sum_k xq_k q_k + m * sum_k xq_k),
// the integer sums exact in int32, the rest in fp32.
//
// Invariant: row m of y depends only on row m of x (the rounding is per row; no reduction across
// rows; the same order of operations whatever M and however the columns are blocked), so a
// forward is batch-invariant. The weights are read once per tile of up to 8 rows, and a row costs
// one VPDPBUSD per 64 weights: a verify of 2-4 tokens costs about what a decode does.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kBlock = 320;  // bytes per 16 columns x 32 inputs
// Groups ahead that a tile asks the cache for (5 KiB): the hardware prefetcher alone left a decode
// waiting on memory (loadtest.bench.q4_prefetch; loadtest/results/q4_prefetch.txt). A
// prefetch past the buffer's end is harmless, and none changes a result.
constexpr int64_t kAhead = 16;

// Rows [0, M) (M <= 8) x one block of 16 columns: the weights are read once, in order (one
// stream per thread). Two integer accumulators per row (the low and the high nibbles), whatever
// M: the order of the sums never depends on the batch. xq: row m's 8-bit activations as int32
// words (four inputs each), kq words a row; s / sm: row m's scale s and s * sum(xq) per group.
template <int M>
inline void tile(const int32_t* xq, int64_t kq, const float* s, const float* sm, int64_t G,
                 const uint8_t* w, at::BFloat16* y, int64_t n, int64_t ahead) {
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = w + g * kBlock;
    if (ahead) {
      const char* next = reinterpret_cast<const char*>(blk + ahead * kBlock);
      for (int c = 0; c < kBlock; c += 64) _mm_prefetch(next + c, _MM_HINT_T0);
    }
    __m512i a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512i v = _mm512_loadu_si512(blk + j * 64);
      __m512i wl = _mm512_and_si512(v, lo4);                         // q[c, k0 .. k0+3]
      __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);  // q[c, k0+4 .. k0+7]
      for (int m = 0; m < M; ++m) {
        const int32_t* xr = xq + m * kq + g * 8 + 2 * j;
        a0[m] = _mm512_dpbusd_epi32(a0[m], wl, _mm512_set1_epi32(xr[0]));
        a1[m] = _mm512_dpbusd_epi32(a1[m], wh, _mm512_set1_epi32(xr[1]));
      }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    for (int m = 0; m < M; ++m) {
      __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(a0[m], a1[m]));
      acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dot, d), _mm512_set1_ps(s[m * G + g]), acc[m]);
      acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sm[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

// Rows [0, mm) (mm <= 8) x column blocks [b0, b1).
void rows(int64_t mm, const int32_t* xq, int64_t kq, const float* s, const float* sm, int64_t G,
          const uint8_t* w, int64_t b0, int64_t b1, at::BFloat16* y, int64_t n, int64_t ahead) {
  const int64_t stride = G * kBlock;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * stride;
    at::BFloat16* yb = y + b * 16;
    switch (mm) {
      case 1: tile<1>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      case 2: tile<2>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      case 3: tile<3>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      case 4: tile<4>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      case 5: tile<5>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      case 6: tile<6>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      case 7: tile<7>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
      default: tile<8>(xq, kq, s, sm, G, wb, yb, n, ahead); break;
    }
  }
}

// Row m, group g of 32 bf16 inputs -> xq (int8), s[m, g] = amax / 127, sm[m, g] = s * sum(xq).
// A group whose amax is below kTiny (zeros, or so small that 127 / amax would overflow) gets
// s = 0 and xq = 0. A group holding a NaN or an infinity gets s = NaN, so the output row is NaN
// (as a bf16 product would make it), never a finite value made up from it.
constexpr float kTiny = 1e-30f;
void quantize(const at::BFloat16* x, int64_t M, int64_t K, int8_t* xq, float* s, float* sm) {
  const int64_t G = K / 32;
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = m * K + g * 32;
      __m512i v = _mm512_loadu_si512(x + at);  // 32 bf16
      __m512 lo = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi);
      // not (|x| < inf): NaN or an infinity
      const bool finite = !(_mm512_cmp_ps_mask(alo, inf, _CMP_NLT_UQ) |
                            _mm512_cmp_ps_mask(ahi, inf, _CMP_NLT_UQ));
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));
      if (!finite || !(amax >= kTiny)) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + at), _mm256_setzero_si256());
        s[m * G + g] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
        sm[m * G + g] = s[m * G + g];
        continue;
      }
      const __m512 inv = _mm512_set1_ps(127.f / amax);
      __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // round to nearest even
      __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));  // |values| <= 127: no saturation
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at), _mm512_cvtsepi32_epi8(ql));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at + 16), _mm512_cvtsepi32_epi8(qh));
      const float sc = amax / 127.f;
      s[m * G + g] = sc;
      sm[m * G + g] = sc * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(ql, qh)));
    }
}

// y = x @ W.T, asking for the weights `ahead` groups before they are read (0: never).
at::Tensor mm_ahead(const at::Tensor& x_in, const at::Tensor& packed, int64_t ahead) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "x: bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "packed: uint8 [N/16, K/32, 320]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), G = K / 32, NB = packed.size(0), N = NB * 16;
  TORCH_CHECK(K % 32 == 0 && packed.size(1) == G, "x's width does not match packed");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<int8_t> xq(M * K);
  std::vector<float> s(M * G), sm(M * G);
  quantize(x.data_ptr<at::BFloat16>(), M, K, xq.data(), s.data(), sm.data());
  const auto* xw = reinterpret_cast<const int32_t*>(xq.data());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t kq = K / 4;
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += 8)
      rows(std::min<int64_t>(8, M - m0), xw + m0 * kq, kq, s.data() + m0 * G, sm.data() + m0 * G,
           G, w, b0, b1, yp + m0 * N, N, ahead);
  });
  return y;
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& packed) { return mm_ahead(x, packed, kAhead); }

}  // namespace

TORCH_LIBRARY(specd_q4, m) {
  m.def("mm(Tensor x, Tensor packed) -> Tensor");
  m.def("mm_ahead(Tensor x, Tensor packed, int ahead) -> Tensor");  // loadtest.bench.q4_prefetch
}
TORCH_LIBRARY_IMPL(specd_q4, CPU, m) {
  m.impl("mm", &mm);
  m.impl("mm_ahead", &mm_ahead);
}
