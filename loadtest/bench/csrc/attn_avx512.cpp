// A candidate CPU attention for short queries over the slot KV cache (loadtest/bench/attn_op.py
// builds it; loadtest/bench/attn_kernel.py measures it against torch's SDPA; the engine does
// not run it).
//
// out[b, h, r] = softmax_j(scale * q[b, h, r] . k[b, h, j]) . v[b, h, j] over the keys j with
// mask[b, 0, r % T, j] true (T = mask.size(2): the query tokens, or every row when the mask is
// already grouped; a row r is query token r % T of one of the kv head's grouped query heads, as
// engine.layer.grouped_sdpa lays them out). Keys past a row's last allowed one are not read.
// bf16 in and out; dot products, softmax and the weighted sum in float32. Each output row
// depends only on its own query row and keys (batch- and width-invariant), and the keys past
// a row's position are never read.
#include <immintrin.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {


inline __m512 load16(const at::BFloat16* p) {  // 16 bf16 -> 16 float32
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (softmax after the max is subtracted): 2^(x log2 e), the fraction by a
// degree-6 polynomial, the integer part by scalef; x below -87 is taken as -87 (~1.6e-38), and
// -inf (a masked key) gives exactly 0.
inline __m512 exp16(__m512 x) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}

// One query row of one (batch, kv head): scores over keys [0, n), softmax, weighted values.
void row(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v, int64_t ks,
         int64_t vs, const bool* allow, int64_t n, int64_t hd, float scale, at::BFloat16* out,
         float* s) {
  const int64_t parts = hd / 16;
  __m512 qv[8];
  for (int64_t c = 0; c < parts; ++c) qv[c] = _mm512_mul_ps(load16(q + 16 * c), _mm512_set1_ps(scale));
  float mx = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const at::BFloat16* kj = k + j * ks;
    __m512 acc = _mm512_mul_ps(qv[0], load16(kj));
    for (int64_t c = 1; c < parts; ++c) acc = _mm512_fmadd_ps(qv[c], load16(kj + 16 * c), acc);
    s[j] = allow[j] ? _mm512_reduce_add_ps(acc) : -INFINITY;
    mx = s[j] > mx ? s[j] : mx;
  }
  const __m512 m = _mm512_set1_ps(mx);
  __m512 tot = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, e);
    tot = _mm512_add_ps(tot, e);
  }
  if (j < n) {
    __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m));
    e = _mm512_maskz_mov_ps(tail, e);
    _mm512_mask_storeu_ps(s + j, tail, e);
    tot = _mm512_add_ps(tot, e);
  }
  const float inv = 1.0f / _mm512_reduce_add_ps(tot);
  __m512 o[8];
  for (int64_t c = 0; c < parts; ++c) o[c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    if (!allow[i]) continue;  // a masked key's value is never read
    const __m512 p = _mm512_set1_ps(s[i]);
    const at::BFloat16* vi = v + i * vs;
    for (int64_t c = 0; c < parts; ++c) o[c] = _mm512_fmadd_ps(p, load16(vi + 16 * c), o[c]);
  }
  for (int64_t c = 0; c < parts; ++c) {
    __m256bh r = _mm512_cvtneps_pbh(_mm512_mul_ps(o[c], _mm512_set1_ps(inv)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * c), (__m256i)r);
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& mask, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16 && mask.scalar_type() == at::kBool,
              "specd_attn: bf16 q, k, v and a bool mask");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && mask.dim() == 4, "specd_attn: ranks");
  const int64_t B = q.size(0), H = q.size(1), R = q.size(2), hd = q.size(3), L = k.size(2);
  const int64_t T = mask.size(2);
  TORCH_CHECK(hd % 16 == 0 && hd <= 128, "specd_attn: head_dim a multiple of 16, at most 128");
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(1) == H && v.size(1) == H &&
              v.size(2) == L && k.size(3) == hd && v.size(3) == hd && mask.size(0) == B &&
              mask.size(1) == 1 && mask.size(3) == L && R % T == 0, "specd_attn: shapes");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "specd_attn: head_dim contiguous");
  at::Tensor qc = q.contiguous();
  at::Tensor mc = mask.contiguous();
  at::Tensor out = at::empty({B, H, R, hd}, q.options());
  const auto* qp = qc.data_ptr<at::BFloat16>();
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vp = v.data_ptr<at::BFloat16>();
  const bool* mp = mc.data_ptr<bool>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(L > 0 ? L : 1);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const at::BFloat16* kb = kp + b * k.stride(0) + h * k.stride(1);
      const at::BFloat16* vb = vp + b * v.stride(0) + h * v.stride(1);
      for (int64_t r = 0; r < R; ++r) {
        const bool* allow = mp + (b * T + r % T) * L;
        int64_t n = L;
        while (n > 0 && !allow[n - 1]) --n;  // past the last allowed key: not read
        at::BFloat16* o = op + ((b * H + h) * R + r) * hd;
        if (n == 0) {  // no key allowed: zeros (SDPA would give NaN)
          for (int64_t d = 0; d < hd; ++d) o[d] = at::BFloat16(0.0f);
          continue;
        }
        row(qp + ((b * H + h) * R + r) * hd, kb, vb, k.stride(2), v.stride(2), allow, n, hd, sc,
            o, s.data());
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(specd_attn, m) {
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(specd_attn, CPU, m) { m.impl("attend", &attend); }
