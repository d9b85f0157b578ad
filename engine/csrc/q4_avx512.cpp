// specd_q4::mm -- y = x @ W.T for a 4-bit weight W in specd's blocked layout (AVX-512 BF16).
//
// Layout of `packed` (uint8 [N/16, K/32, 320], engine/q4_matmul.py packs it): for each block of
// 16 output columns c and group g of 32 inputs, 8 chunks of 32 bytes, then the group's 16 scales
// d and 16 minimums m as fp16 (w = d * q + m, q in 0..15: GGUF's Q4_1, values exactly as stored).
// Chunk j covers inputs k0 = 32 g + 4 j .. k0 + 3:
//     byte 2c   = q[c, k0]     | q[c, k0 + 2] << 4
//     byte 2c+1 = q[c, k0 + 1] | q[c, k0 + 3] << 4
// so one zero-extension to 16-bit lanes and a mask give the pairs (k0, k0+1) of 16 columns, and a
// shift the pairs (k0+2, k0+3). The bf16 bit pattern 0x4300 | q is exactly 128 + q, so each pair
// becomes a bf16 operand of VDPBF16PS with one OR, and per group
//     sum_k x_k w_k = d * sum_k x_k (128 + q_k) + (m - 128 d) * sum_k x_k.
// Every product is exact in fp32 (8-bit by 8-bit mantissas); sums are fp32.
//
// Invariant: row m of y depends only on row m of x (no reduction across rows, the same order of
// operations whatever M and however the columns are blocked), so a forward is batch-invariant.
// The weights are read once per tile of up to 8 rows: a decode (M = 1) reads each byte once, a
// verify of 2..8 tokens costs little more than a decode.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kBlock = 320;  // bytes per 16 columns x 32 inputs
// Groups ahead that a tile asks the cache for (5 KiB): the hardware prefetcher alone left a decode
// waiting on memory (loadtest.bench.q4_prefetch; loadtest/results/bench_q4_prefetch.txt). A
// prefetch past the buffer's end is harmless, and none changes a result.
constexpr int64_t kAhead = 16;

// Rows [0, M) (M <= 8) x one block of 16 columns: the weights are read once, in order (one
// stream per thread, which the hardware prefetcher follows: tiles of 2-4 column blocks, four
// streams, measured slower). Two accumulator chains per row, pairs (k0, k0+1) and
// (k0+2, k0+3), whatever M: the order of the sums never depends on the batch.
template <int M>
inline void tile(const uint32_t* xw, int64_t kw, const float* xs, int64_t G, const uint8_t* w,
                 at::BFloat16* y, int64_t n, int64_t ahead) {
  const __m512i lo4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    const uint8_t* blk = w + g * kBlock;
    if (ahead) {
      const char* next = reinterpret_cast<const char*>(blk + ahead * kBlock);
      for (int c = 0; c < kBlock; c += 64) _mm_prefetch(next + c, _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i v = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * 32)));
      __m512bh wa = (__m512bh)_mm512_ternarylogic_epi32(v, lo4, bias, 0xEA);  // (v & lo4) | bias
      __m512bh wb = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
      for (int m = 0; m < M; ++m) {
        const uint32_t* xr = xw + m * kw + g * 16 + 2 * j;
        a0[m] = _mm512_dpbf16_ps(a0[m], (__m512bh)_mm512_set1_epi32(xr[0]), wa);
        a1[m] = _mm512_dpbf16_ps(a1[m], (__m512bh)_mm512_set1_epi32(xr[1]), wb);
      }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256)));
    __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 288)));
    __m512 mb = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), mn);  // m - 128 d
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(a0[m], a1[m]), d, acc[m]);
      acc[m] = _mm512_fmadd_ps(mb, _mm512_set1_ps(xs[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * n), (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

// Rows [0, mm) (mm <= 8) x column blocks [b0, b1).
void rows(int64_t mm, const uint32_t* xw, int64_t kw, const float* xs, int64_t G,
          const uint8_t* w, int64_t b0, int64_t b1, at::BFloat16* y, int64_t n, int64_t ahead) {
  const int64_t stride = G * kBlock;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * stride;
    at::BFloat16* yb = y + b * 16;
    switch (mm) {
      case 1: tile<1>(xw, kw, xs, G, wb, yb, n, ahead); break;
      case 2: tile<2>(xw, kw, xs, G, wb, yb, n, ahead); break;
      case 3: tile<3>(xw, kw, xs, G, wb, yb, n, ahead); break;
      case 4: tile<4>(xw, kw, xs, G, wb, yb, n, ahead); break;
      case 5: tile<5>(xw, kw, xs, G, wb, yb, n, ahead); break;
      case 6: tile<6>(xw, kw, xs, G, wb, yb, n, ahead); break;
      case 7: tile<7>(xw, kw, xs, G, wb, yb, n, ahead); break;
      default: tile<8>(xw, kw, xs, G, wb, yb, n, ahead); break;
    }
  }
}

// xs[m, g] = the sum of row m's 32 inputs of group g, in fp32.
void group_sums(const at::BFloat16* x, int64_t M, int64_t K, float* xs) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      __m512i v = _mm512_loadu_si512(x + m * K + g * 32);  // 32 bf16
      __m512 lo = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16));
      __m512 hi = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16));
      xs[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
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
  std::vector<float> xs(M * G);
  group_sums(x.data_ptr<at::BFloat16>(), M, K, xs.data());
  const auto* xw = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const int64_t kw = K / 2;
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += 8)
      rows(std::min<int64_t>(8, M - m0), xw + m0 * kw, kw, xs.data() + m0 * G, G, w, b0, b1,
           yp + m0 * N, N, ahead);
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
