// specd_q4::mm for CPUs with AVX2 but without AVX-512 VNNI: the same op, the same packed layout
// and the same result, bit for bit, as engine/model/csrc/q4_avx512.cpp (which describes both).
//
// The integer dot products are exact in either kernel, so only their instructions differ: here
// VPMADDUBSW (u8 x s8, pairs summed into 16 bits) on the nibbles as stored, the group's sixteen
// partial sums added in 16 bits (at most 16 x 15 x 128 = 30,720: no overflow), then one VPMADDWD
// into 32 bits. The float epilogue is the AVX-512 kernel's, operation for operation (int32 ->
// float, x d, fused multiply-add with s, fused multiply-add of m with s * sum(xq)), and the
// result is rounded to bf16 to nearest even as VCVTNEPS2BF16 rounds it. The activations are
// rounded to 8 bits by the same arithmetic (127 / amax in float, round to nearest even).
//
// AVX2 has 16 vector registers: a tile is at most 4 rows by 8 columns (half a block), so the
// weights are read once per 4 rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kBlock = 320;  // bytes per 16 columns x 32 inputs
constexpr int64_t kAhead = 16;   // groups ahead that a tile asks the cache for
constexpr int kRows = 4;         // rows a tile

// float -> bf16, nearest even, as VCVTNEPS2BF16: NaN stays a quiet NaN, denormals become zero
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return uint16_t((u >> 16) | 0x40);
  if ((u & 0x7F800000u) == 0) return uint16_t((u >> 16) & 0x8000);
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Rows [0, M) (M <= kRows) x half h (8 columns) of one block of 16 columns.
template <int M>
inline void tile(const int32_t* xq, int64_t kq, const float* s, const float* sm, int64_t G,
                 const uint8_t* w, int h, uint16_t* y, int64_t n, int64_t ahead) {
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* blk = w + g * kBlock;
    if (ahead) {
      const char* next = reinterpret_cast<const char*>(blk + ahead * kBlock);
      for (int c = 0; c < kBlock; c += 64) _mm_prefetch(next + c, _MM_HINT_T0);
    }
    __m256i a[M];  // 16-bit partial sums of the group
    for (int m = 0; m < M; ++m) a[m] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * 64 + h * 32));
      const __m256i wl = _mm256_and_si256(v, lo4);                         // q[c, k0 .. k0+3]
      const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);  // q[c, k0+4 .. k0+7]
      for (int m = 0; m < M; ++m) {
        const int32_t* xr = xq + m * kq + g * 8 + 2 * j;
        a[m] = _mm256_add_epi16(a[m], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(xr[0])));
        a[m] = _mm256_add_epi16(a[m], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(xr[1])));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 256 + h * 16)));
    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 288 + h * 16)));
    for (int m = 0; m < M; ++m) {
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(a[m], ones));
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(dot, d), _mm256_set1_ps(s[m * G + g]), acc[m]);
      acc[m] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sm[m * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    alignas(32) float out[8];
    _mm256_store_ps(out, acc[m]);
    for (int c = 0; c < 8; ++c) y[m * n + h * 8 + c] = to_bf16(out[c]);
  }
}

void rows(int64_t mm, const int32_t* xq, int64_t kq, const float* s, const float* sm, int64_t G,
          const uint8_t* w, int64_t b0, int64_t b1, uint16_t* y, int64_t n, int64_t ahead) {
  const int64_t stride = G * kBlock;
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = w + b * stride;
    uint16_t* yb = y + b * 16;
    for (int h = 0; h < 2; ++h) {
      switch (mm) {
        case 1: tile<1>(xq, kq, s, sm, G, wb, h, yb, n, ahead); break;
        case 2: tile<2>(xq, kq, s, sm, G, wb, h, yb, n, ahead); break;
        case 3: tile<3>(xq, kq, s, sm, G, wb, h, yb, n, ahead); break;
        default: tile<4>(xq, kq, s, sm, G, wb, h, yb, n, ahead); break;
      }
    }
  }
}

// Row m, group g of 32 bf16 inputs -> xq (int8), s[m, g] = amax / 127, sm[m, g] = s * sum(xq);
// the AVX-512 kernel's rule for tiny and non-finite groups.
constexpr float kTiny = 1e-30f;
void quantize(const uint16_t* x, int64_t M, int64_t K, int8_t* xq, float* s, float* sm) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t at = m * K + g * 32;
      float v[32];
      float amax = 0.f;
      bool finite = true;
      for (int i = 0; i < 32; ++i) {
        const uint32_t u = uint32_t(x[at + i]) << 16;
        std::memcpy(&v[i], &u, 4);
        const float a = std::fabs(v[i]);
        finite &= a < std::numeric_limits<float>::infinity();
        amax = std::max(amax, a);
      }
      if (!finite || !(amax >= kTiny)) {
        std::memset(xq + at, 0, 32);
        s[m * G + g] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
        sm[m * G + g] = s[m * G + g];
        continue;
      }
      const float inv = 127.f / amax;
      int32_t sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(v[i] * inv));  // nearest even
        xq[at + i] = static_cast<int8_t>(q);
        sum += q;
      }
      const float sc = amax / 127.f;
      s[m * G + g] = sc;
      sm[m * G + g] = sc * static_cast<float>(sum);
    }
}

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
  quantize(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, xq.data(),
           s.data(), sm.data());
  const auto* xw = reinterpret_cast<const int32_t*>(xq.data());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t kq = K / 4;
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      rows(std::min<int64_t>(kRows, M - m0), xw + m0 * kq, kq, s.data() + m0 * G,
           sm.data() + m0 * G, G, w, b0, b1, yp + m0 * N, N, ahead);
  });
  return y;
}

at::Tensor mm(const at::Tensor& x, const at::Tensor& packed) { return mm_ahead(x, packed, kAhead); }

}  // namespace

TORCH_LIBRARY(specd_q4, m) {
  m.def("mm(Tensor x, Tensor packed) -> Tensor");
  m.def("mm_ahead(Tensor x, Tensor packed, int ahead) -> Tensor");
}
TORCH_LIBRARY_IMPL(specd_q4, CPU, m) {
  m.impl("mm", &mm);
  m.impl("mm_ahead", &mm_ahead);
}
