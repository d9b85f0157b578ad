// Decode, verify and prefill attention over specd's KV caches (slots or paged), on CPU.
//
// specd_attention::attend(q [B, heads, Q, D], kc, vc, mask [B, 1, Q, kv_len] bool, slot_t [B],
//                    read_idx [B, kv_len] or empty, scale) -> [B, Q, heads * D]
//
// Slot cache: kc / vc [slots, kv_heads, max_len + 1, D], row b's key j at kc[slot_t[b], :, j].
// Paged cache: kc / vc [pool positions, kv_heads, D], row b's key j at kc[read_idx[b, j]].
//
// The work of one row b and KV head g: its rows are the group's query heads times the Q
// queries (grouped-query attention: every key of g is read once for all of them). Keys are
// taken in splits of CHUNK keys (flash-decoding: long contexts spread over the threads) and,
// within a split, in blocks of KB keys; a block no query of a tile of RT rows may see (the
// mask) is not read, so padded keys and a causal prefill's upper triangle cost nothing.
//
// The arithmetic of one query row is fixed whatever the batch, the number of queries, the
// threads, or which rows share a tile: its scores sum over the head dimension in order, its
// softmax runs online over the blocks in key order, each split's partial (max, sum, weighted
// values) is combined with the others in split order, and the boundaries of blocks and splits
// are absolute key positions. So a row's output is a function of its own query, keys, values
// and mask alone (batch invariance by construction). The file is built with -ffp-contract=off
// and its multiply-adds are written as fma16, so that arithmetic is the source's, not whatever the
// compiler contracts in each inlined copy of a loop.
//
// Where the time goes: a block's keys are transposed with lane shuffles (a 16 x 16 transpose in
// four stages), not element by element; a row's softmax works on whole lane vectors (masks,
// maximum, the weights' sum as a fixed tree); the rows of a tile go three at a time, so their
// independent multiply-add chains fill both FMA pipes. The same source is compiled for AVX-512
// and for AVX2 (engine/model/attention.py): GCC's vector extension emits either ISA.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t KB = 16;     // keys a block
constexpr int64_t CHUNK = 512;  // keys a split (a multiple of KB)
constexpr int64_t RT = 32;     // query rows a tile
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// KB float lanes: one AVX-512 register, two AVX2 ones (GCC's vector extension: the compiler
// keeps them in registers and emits the ISA it was built for)
typedef float vf16 __attribute__((vector_size(KB * 4)));
typedef int32_t vi16 __attribute__((vector_size(KB * 4)));

// e^x lane by lane for x <= 0 (Cephes' expf: range reduction by ln 2, a degree-6 polynomial);
// x below -87 gives ~0
inline vf16 exp_neg(vf16 x) {
  const vf16 lo = vf16{} - 87.0f;
  x = x < lo ? lo : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf16 n = (x * 1.44269504088896341f + magic) - magic;
  vf16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
  return p * reinterpret_cast<vf16&>(e);
}

inline float exp_scalar(float x) {
  vf16 v = vf16{} + x;
  return exp_neg(v)[0];
}

// a * b + c rounded once, lane by lane. The file is built with -ffp-contract=off, so every other
// expression rounds as written: a row's arithmetic is its source, whatever the compiler does
// with the loops around it (how many rows it interleaves, how it unrolls).
#if defined(__AVX512F__)
inline vf16 fma16(vf16 a, vf16 b, vf16 c) {
  return reinterpret_cast<vf16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a),
                                                reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
}
#else
typedef float vf8 __attribute__((vector_size(32)));
inline vf16 fma16(vf16 a, vf16 b, vf16 c) {
  vf8 h[3][2];
  std::memcpy(h[0], &a, 64), std::memcpy(h[1], &b, 64), std::memcpy(h[2], &c, 64);
  vf8 r[2];
  for (int i = 0; i < 2; ++i)
    r[i] = reinterpret_cast<vf8>(_mm256_fmadd_ps(reinterpret_cast<__m256>(h[0][i]),
                                                 reinterpret_cast<__m256>(h[1][i]),
                                                 reinterpret_cast<__m256>(h[2][i])));
  vf16 out;
  std::memcpy(&out, r, 64);
  return out;
}
#endif
inline vf16 fma16(float a, vf16 b, vf16 c) { return fma16(vf16{} + a, b, c); }

// Where the CPU multiplies bfloat16 pairs (AVX-512 BF16), a bf16 row's scores are dot products of
// bf16 pairs: c + a[2i] b[2i] + a[2i+1] b[2i+1] per float32 lane (the products exact), the
// query's pair broadcast over the block's 16 keys. Its keys then need no conversion and half the
// transposing, and its scores half the instructions.
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
inline vf16 dot2(vf16 c, uint32_t a, vi16 b) {
  return reinterpret_cast<vf16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(c),
                                                 reinterpret_cast<__m512bh>(_mm512_set1_epi32(a)),
                                                 reinterpret_cast<__m512bh>(b)));
}
#else
constexpr bool kBf16Dot = false;
inline vf16 dot2(vf16 c, uint32_t, vi16) { return c; }  // never called
#endif

// Two-source lane shuffles with constant indices (lanes 0-15 of a, 16-31 of b).
#if defined(__clang__)
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, vi16{__VA_ARGS__})
#endif

// 16 vectors transposed in place (m[j][l] -> m[l][j]) in four stages, stage k exchanging bit k
// of the row and the column index between rows r and r + 2^k: moves only, no arithmetic.
template <typename V>
inline void transpose16(V* m) {
  for (int r = 0; r < 16; ++r) {
    if (r & 1) continue;
    const V a = m[r], b = m[r | 1];
    m[r] = SHUF(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    m[r | 1] = SHUF(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  for (int r = 0; r < 16; ++r) {
    if (r & 2) continue;
    const V a = m[r], b = m[r | 2];
    m[r] = SHUF(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    m[r | 2] = SHUF(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int r = 0; r < 16; ++r) {
    if (r & 4) continue;
    const V a = m[r], b = m[r | 4];
    m[r] = SHUF(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    m[r | 4] = SHUF(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int r = 0; r < 16; ++r) {
    if (r & 8) continue;
    const V a = m[r], b = m[r | 8];
    m[r] = SHUF(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    m[r | 8] = SHUF(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
}

// The largest lane (exact in any order).
inline float hmax(vf16 v) {
  vf16 w = SHUF(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  v = v > w ? v : w;
  w = SHUF(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  v = v > w ? v : w;
  w = SHUF(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  v = v > w ? v : w;
  w = SHUF(v, v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  v = v > w ? v : w;
  return v[0];
}

// The lanes' sum as a fixed tree: lane j + lane j + 8, then + 4, + 2, + 1.
inline float hsum(vf16 v) {
  v += SHUF(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15);
  v += SHUF(v, v, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7, 4, 5, 6, 7);
  v += SHUF(v, v, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
  v += SHUF(v, v, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1);
  return v[0];
}

// KB consecutive elements as float32 lanes (bfloat16: its 16 bits are a float32's high half).
typedef uint16_t vh16 __attribute__((vector_size(KB * 2)));
typedef uint8_t vb16 __attribute__((vector_size(KB)));
inline vf16 load16(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf16 load16(const c10::BFloat16* p) {
  vh16 h;
  std::memcpy(&h, p, sizeof(h));
  vi16 u = __builtin_convertvector(h, vi16) << 16;
  return reinterpret_cast<vf16&>(u);
}

struct Geometry {
  int64_t B, H, G, Q, kv_len, group, rows, chunks, tiles;
};

// One work item's rows (a tile of a KV head's query rows) over one split of its keys. Per block
// of KB keys: the keys transposed to [D][KB] in float32, so a row's KB scores are D
// multiply-adds of a broadcast query element with a KB-lane vector (summed over d in order);
// then the row's online softmax and its weighted values, KB keys a time in key order.
template <typename T, int D>
void attend_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                 const at::Tensor& mask, const at::Tensor& slot_t, const at::Tensor& read_idx,
                 double scale, at::Tensor& out) {
  const bool paged = read_idx.numel() > 0;
  Geometry g;
  g.B = q.size(0), g.H = q.size(1), g.Q = q.size(2);
  g.G = kc.size(1);
  g.kv_len = mask.size(3);
  g.group = g.H / g.G;
  g.rows = g.group * g.Q;  // a KV head's query rows: row r = head (r / Q) of the group, query r % Q
  g.chunks = std::max<int64_t>(1, (g.kv_len + CHUNK - 1) / CHUNK);
  g.tiles = (g.rows + RT - 1) / RT;

  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const bool* mp = mask.data_ptr<bool>();
  const int64_t* sp = slot_t.data_ptr<int64_t>();
  const int64_t* rp = paged ? read_idx.data_ptr<int64_t>() : nullptr;
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = kc.stride(0), ks1 = kc.stride(1), ks2 = paged ? 0 : kc.stride(2);
  const int64_t vs0 = vc.stride(0), vs1 = vc.stride(1), vs2 = paged ? 0 : vc.stride(2);
  const int64_t ms0 = mask.stride(0), ms2 = mask.stride(2);
  const float sc = static_cast<float>(scale);

  // each split's partial per row: running max, sum of weights, weighted values [D]
  const int64_t items = g.B * g.G * g.chunks * g.tiles;
  std::vector<float> part_m(g.B * g.G * g.chunks * g.rows);
  std::vector<float> part_l(part_m.size());
  std::vector<float> part_o(part_m.size() * D);

  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    constexpr int NV = D / KB;  // lane vectors a row of D
    // bf16 rows where the CPU has bf16 pair products (kBf16Dot), else float32 rows
    constexpr bool DOT = kBf16Dot && std::is_same<T, c10::BFloat16>::value;
    constexpr int DP = D / 2;  // a row's bf16 pairs
    alignas(64) float qf[RT][D];      // float32: a row's query, scaled
    alignas(64) uint32_t qh[RT][DP];  // DOT: a row's query as bf16 pairs, unscaled
    vf16 kt[D];   // float32: the block's keys, transposed: kt[d][j] = key j's element d
    vi16 kt2[DP];  // DOT: kt2[i][j] = key j's pair i
    vf16 vv[KB][NV];  // the block's values
    vf16 acc[RT][NV];
    float m[RT], l[RT];
    vi16 see[RT];  // lane j: the row sees key j of the block (-1) or not (0)
    const vi16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vf16 neg_inf = vf16{} + NEG_INF;
    for (int64_t it = i0; it < i1; ++it) {
      int64_t rest = it;
      const int64_t tile = rest % g.tiles;
      rest /= g.tiles;
      const int64_t c = rest % g.chunks;
      rest /= g.chunks;
      const int64_t kvh = rest % g.G;
      const int64_t b = rest / g.G;
      const int64_t r0 = tile * RT, nr = std::min(RT, g.rows - r0);
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t h = kvh * g.group + (r0 + r) / g.Q, t = (r0 + r) % g.Q;
        const T* src = qp + b * qs0 + h * qs1 + t * qs2;
        if constexpr (DOT)
          std::memcpy(qh[r], src, D * sizeof(T));
        else
          for (int d = 0; d < D; ++d) qf[r][d] = to_float(src[d]) * sc;
        m[r] = NEG_INF, l[r] = 0.0f;
        for (int i = 0; i < NV; ++i) acc[r][i] = vf16{};
      }
      const int64_t k0 = c * CHUNK, k1 = std::min(g.kv_len, k0 + CHUNK);
      for (int64_t j0 = k0; j0 < k1; j0 += KB) {
        const int64_t nk = std::min(KB, k1 - j0);
        const vi16 in_block = lane < static_cast<int32_t>(nk);
        vi16 any{};
        for (int64_t r = 0; r < nr; ++r) {
          const bool* row = mp + b * ms0 + ((r0 + r) % g.Q) * ms2 + j0;
          vb16 bits{};
          std::memcpy(&bits, row, nk);  // bool is one byte, 0 or 1
          see[r] = (__builtin_convertvector(bits, vi16) != 0) & in_block;
          any |= see[r];
        }
        bool seen = false;
        for (int j = 0; j < KB; ++j) seen |= any[j] != 0;
        if (!seen) continue;  // no query of the tile sees these keys: not read
        constexpr int NP = DP / KB;  // DOT: lane vectors of a key's pairs
        vf16 kraw[KB][NV];
        vi16 kraw2[KB][NP];
        for (int64_t j = 0; j < KB; ++j) {
          if (j >= nk) {
            for (int i = 0; i < NV; ++i) kraw[j][i] = vv[j][i] = vf16{};
            for (int i = 0; i < NP; ++i) kraw2[j][i] = vi16{};
            continue;
          }
          const int64_t pos = j0 + j;
          const T *kj, *vj;
          if (paged) {
            const int64_t at = rp[b * g.kv_len + pos];
            kj = kp + at * ks0 + kvh * ks1;
            vj = vp + at * vs0 + kvh * vs1;
          } else {
            kj = kp + sp[b] * ks0 + kvh * ks1 + pos * ks2;
            vj = vp + sp[b] * vs0 + kvh * vs1 + pos * vs2;
          }
          for (int i = 0; i < NV; ++i) vv[j][i] = load16(vj + i * KB);
          if constexpr (DOT)
            std::memcpy(kraw2[j], kj, D * sizeof(T));
          else
            for (int i = 0; i < NV; ++i) kraw[j][i] = load16(kj + i * KB);
        }
        if constexpr (DOT) {
          for (int i = 0; i < NP; ++i) {  // KB x KB blocks of the keys' pairs, transposed
            vi16* blk = &kt2[i * KB];
            for (int j = 0; j < KB; ++j) blk[j] = kraw2[j][i];
            transpose16(blk);
          }
        } else {
          for (int i = 0; i < NV; ++i) {  // KB x KB blocks of the keys, transposed
            vf16* blk = &kt[i * KB];
            for (int j = 0; j < KB; ++j) blk[j] = kraw[j][i];
            transpose16(blk);
          }
        }
        // RR rows at a time: their independent chains keep both FMA pipes busy (one row's
        // four partial sums alone wait on the FMA latency); each row's arithmetic is its own
        auto step = [&](int64_t r, auto rows_tag) {
          constexpr int RR = decltype(rows_tag)::value;
          vf16 s0[RR], s1[RR], s2[RR], s3[RR];
          for (int x = 0; x < RR; ++x) s0[x] = s1[x] = s2[x] = s3[x] = vf16{};
          // scores of the block's KB keys: four partial sums over d (or d's pairs), added in a
          // fixed order
          if constexpr (DOT) {
            for (int i = 0; i < DP; i += 4) {
              for (int x = 0; x < RR; ++x) {
                const uint32_t* qr = qh[r + x];
                s0[x] = dot2(s0[x], qr[i], kt2[i]);
                s1[x] = dot2(s1[x], qr[i + 1], kt2[i + 1]);
                s2[x] = dot2(s2[x], qr[i + 2], kt2[i + 2]);
                s3[x] = dot2(s3[x], qr[i + 3], kt2[i + 3]);
              }
            }
            for (int x = 0; x < RR; ++x) s0[x] = ((s0[x] + s1[x]) + (s2[x] + s3[x])) * sc;
          } else {
            for (int d = 0; d < D; d += 4) {
              for (int x = 0; x < RR; ++x) {
                const float* qr = qf[r + x];
                s0[x] = fma16(qr[d], kt[d], s0[x]);
                s1[x] = fma16(qr[d + 1], kt[d + 1], s1[x]);
                s2[x] = fma16(qr[d + 2], kt[d + 2], s2[x]);
                s3[x] = fma16(qr[d + 3], kt[d + 3], s3[x]);
              }
            }
            for (int x = 0; x < RR; ++x) s0[x] = (s0[x] + s1[x]) + (s2[x] + s3[x]);
          }
          vf16 pv[RR], a[RR][NV];
          float corr[RR], mnew[RR];
          bool live[RR];
          for (int x = 0; x < RR; ++x) {
            const vf16 sv = see[r + x] != 0 ? s0[x] : neg_inf;
            const float bmax = hmax(sv);
            live[x] = bmax != NEG_INF;  // else the row sees none of these keys: unchanged
            const float m0 = m[r + x];
            mnew[x] = std::max(m0, bmax);
            // e^(m - mnew) is exactly 1 where the maximum stays (exp_neg(0) is 1)
            corr[x] = m0 == NEG_INF ? 0.0f : mnew[x] == m0 ? 1.0f : exp_scalar(m0 - mnew[x]);
            pv[x] = see[r + x] != 0 && live[x] ? exp_neg(sv - mnew[x]) : vf16{};
            for (int i = 0; i < NV; ++i) a[x][i] = acc[r + x][i] * corr[x];
          }
          for (int j = 0; j < KB; ++j) {
            for (int x = 0; x < RR; ++x) {
              const float pj = pv[x][j];
              for (int i = 0; i < NV; ++i) a[x][i] = fma16(pj, vv[j][i], a[x][i]);
            }
          }
          for (int x = 0; x < RR; ++x) {
            if (!live[x]) continue;
            for (int i = 0; i < NV; ++i) acc[r + x][i] = a[x][i];
            l[r + x] = l[r + x] * corr[x] + hsum(pv[x]);  // the weights' sum as a fixed tree
            m[r + x] = mnew[x];
          }
        };
        int64_t r = 0;
        for (; r + 3 <= nr; r += 3) step(r, std::integral_constant<int, 3>{});
        for (; r < nr; ++r) step(r, std::integral_constant<int, 1>{});
      }
      const int64_t base = ((b * g.G + kvh) * g.chunks + c) * g.rows + r0;
      for (int64_t r = 0; r < nr; ++r) {
        part_m[base + r] = m[r];
        part_l[base + r] = l[r];
        std::memcpy(&part_o[(base + r) * D], &acc[r][0], D * sizeof(float));
      }
    }
  });

  // combine the splits in key order: o = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c
  at::parallel_for(0, g.B * g.G, 1, [&](int64_t i0, int64_t i1) {
    alignas(64) float o[D];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / g.G, kvh = i % g.G;
      for (int64_t r = 0; r < g.rows; ++r) {
        const int64_t h = kvh * g.group + r / g.Q, t = r % g.Q;
        float M = NEG_INF;
        for (int64_t c = 0; c < g.chunks; ++c)
          M = std::max(M, part_m[((b * g.G + kvh) * g.chunks + c) * g.rows + r]);
        for (int d = 0; d < D; ++d) o[d] = 0.0f;
        float lsum = 0.0f;
        if (M != NEG_INF) {
          for (int64_t c = 0; c < g.chunks; ++c) {
            const int64_t at = ((b * g.G + kvh) * g.chunks + c) * g.rows + r;
            if (part_m[at] == NEG_INF) continue;
            const float w = std::exp(part_m[at] - M);
            lsum += w * part_l[at];
            const float* po = &part_o[at * D];
            for (int d = 0; d < D; ++d) o[d] += w * po[d];
          }
        }
        const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
        T* dst = op + (b * g.Q + t) * g.H * D + h * D;
        for (int d = 0; d < D; ++d) dst[d] = static_cast<T>(o[d] * inv);
      }
    }
  });
}

template <typename T>
void attend_dispatch(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                     const at::Tensor& mask, const at::Tensor& slot_t, const at::Tensor& read_idx,
                     double scale, at::Tensor& out) {
  switch (q.size(3)) {
    case 32: return attend_impl<T, 32>(q, kc, vc, mask, slot_t, read_idx, scale, out);
    case 64: return attend_impl<T, 64>(q, kc, vc, mask, slot_t, read_idx, scale, out);
    case 128: return attend_impl<T, 128>(q, kc, vc, mask, slot_t, read_idx, scale, out);
    case 256: return attend_impl<T, 256>(q, kc, vc, mask, slot_t, read_idx, scale, out);
    default: TORCH_CHECK(false, "attend: head_dim 32, 64, 128 or 256");
  }
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                  const at::Tensor& mask_in, const at::Tensor& slot_t_in,
                  const at::Tensor& read_idx_in, double scale) {
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1, "q must be [B, heads, Q, D], last dim dense");
  TORCH_CHECK(kc.scalar_type() == q.scalar_type() && vc.scalar_type() == q.scalar_type(),
              "q, k and v must share a dtype");
  TORCH_CHECK(kc.stride(-1) == 1 && vc.stride(-1) == 1, "the cache's last dim must be dense");
  const bool paged = read_idx_in.numel() > 0;
  TORCH_CHECK(paged ? kc.dim() == 3 : kc.dim() == 4, "cache layout and read_idx disagree");
  TORCH_CHECK(q.size(1) % kc.size(1) == 0, "heads must be a multiple of kv heads");
  at::Tensor mask = mask_in.contiguous();
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 4, "mask must be bool 4-d");
  TORCH_CHECK(mask.size(0) == q.size(0) && mask.size(2) == q.size(2), "mask shape");
  at::Tensor slot_t = slot_t_in.to(at::kLong).contiguous();
  at::Tensor read_idx = paged ? read_idx_in.to(at::kLong).contiguous() : read_idx_in;
  at::Tensor out = at::empty({q.size(0), q.size(2), q.size(1) * q.size(3)}, q.options());
  if (q.scalar_type() == at::kFloat)
    attend_dispatch<float>(q, kc, vc, mask, slot_t, read_idx, scale, out);
  else if (q.scalar_type() == at::kBFloat16)
    attend_dispatch<c10::BFloat16>(q, kc, vc, mask, slot_t, read_idx, scale, out);
  else
    TORCH_CHECK(false, "attend: float32 or bfloat16 only");
  return out;
}

}  // namespace

TORCH_LIBRARY(specd_attention, m) {
  m.def(
      "attend(Tensor q, Tensor kc, Tensor vc, Tensor mask, Tensor slot_t, Tensor read_idx, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(specd_attention, CPU, m) { m.impl("attend", &attend); }
