// specfleet's row-wise float32 kernels (shared/runner/rowwise.py).
//
// The matmul: out = x @ w.T (float32 activations and sums; float32 or bfloat16 weights, the latter
// widened exactly in registers, so half the bytes stream), where every output is ONE fused multiply-add chain over the inputs in
// ascending order, in one vector lane. Which tile computes an output, how many rows the call holds
// and how many threads run it never change that chain, so a row's result is bitwise the same in any
// batch: batch invariance by construction.
//
// The weight is packed once into panels of 16 outputs, [panels, in, 16], so a 1-row product streams
// each panel front to back (memory-bound decode), and a many-row one reuses a panel pair from cache
// across row tiles of 3 (compute-bound verification): 3 rows x 32 outputs = 12 accumulators.
//
// On a CPU with AVX512-BF16, a bfloat16 weight is packed in pairs instead ([panels, in / 2, 16 x 2]),
// and each output is ONE chain of vdpbf16ps over the input pairs in ascending order, in one 512-bit
// lane, over the activations rounded to bfloat16 (as oneDNN's bfloat16 matmul rounds them): the
// same invariance by construction, at the native dot product's rate for verification's many rows
// and the weight's bytes for decode's one.
//
// The decoder layer (Layer, below): one call runs a Llama-family block's every op on these
// matmuls, each row alone, in an order fixed by the row (see there).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kPanel = 16;

// Each panel's stream asks for its weights kAhead inputs ahead (2 KB for float32 and pairs, 1 KB for bfloat16)
// while it multiplies these: the hardware's prefetcher alone kept a SmolLM2-135M pass well above the time its
// bytes take to stream. One core of the Xeon VM, 30 layers and head in bfloat16, 1 / 4 / 9 rows (2026-12-06):
// pairs 20.7-20.9 / 24.8-25.2 / 37.4-39.0 ms before, 18.6-19.3 / 20.0-21.5 / 34.3-35.4 after; widened on AVX2
// 24.9-26.1 / 36.5-36.8 / 53.5-53.7 before, 20.8-22.0 / 28.6-30.0 / 45.5-46.7 after (16 inputs ahead: between).
// A prefetch never faults: past a weight's end it is simply dropped.
constexpr int64_t kAhead = 32;
template <typename T>
inline void prefetch(const T* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// 8 weights as float32: float32 ones as they are, bfloat16 ones (uint16 bits) widened exactly
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <int R, int PP, typename W>
inline void tile(const W* p, const float* x, float* out, int64_t K, int64_t N, int64_t j0, int64_t ldp) {
  __m256 acc[R][PP * 2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < PP * 2; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
#pragma GCC unroll 8
    for (int q = 0; q < PP; ++q) prefetch(p + q * ldp + (k + kAhead) * kPanel);
    __m256 wv[PP * 2];
#pragma GCC unroll 8
    for (int q = 0; q < PP; ++q) {
      wv[2 * q] = load8(p + q * ldp + k * kPanel);
      wv[2 * q + 1] = load8(p + q * ldp + k * kPanel + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
#pragma GCC unroll 8
      for (int c = 0; c < PP * 2; ++c) acc[r][c] = _mm256_fmadd_ps(wv[c], xv, acc[r][c]);
    }
  }
  alignas(32) float buf[kPanel];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int q = 0; q < PP; ++q) {
      const int64_t j = j0 + q * kPanel;
      if (j + kPanel <= N) {
        _mm256_storeu_ps(out + r * N + j, acc[r][2 * q]);
        _mm256_storeu_ps(out + r * N + j + 8, acc[r][2 * q + 1]);
      } else {  // the last panel's padding outputs are dropped
        _mm256_store_ps(buf, acc[r][2 * q]);
        _mm256_store_ps(buf + 8, acc[r][2 * q + 1]);
        for (int64_t jj = j; jj < N; ++jj) out[r * N + jj] = buf[jj - j];
      }
    }
}

// Every row against panels [q, q + PP): rows in tiles of 3, then the 1 or 2 left.
template <int PP, typename W>
void panels(const W* p, const float* x, float* out, int64_t R, int64_t K, int64_t N, int64_t q, int64_t ldp) {
  const W* pq = p + q * ldp;
  const int64_t j0 = q * kPanel;
  int64_t r = 0;
  for (; r + 3 <= R; r += 3) tile<3, PP>(pq, x + r * K, out + r * N, K, N, j0, ldp);
  if (R - r == 2) tile<2, PP>(pq, x + r * K, out + r * N, K, N, j0, ldp);
  if (R - r == 1) tile<1, PP>(pq, x + r * K, out + r * N, K, N, j0, ldp);
}

// --- bfloat16 pairs on AVX512-BF16 ------------------------------------------------------------
//
// The weight [P, K2, 16] in 32-bit words, each (w[j][2k] low, w[j][2k + 1] high); the activations
// [R, K2] words, each (x[2k] low, x[2k + 1] high), rounded to bfloat16. acc += both products, per lane.

#if defined(__clang__) || __GNUC__ >= 10  // the compilers that know AVX512-BF16's intrinsics
#define SPECFLEET_PAIRS 1
#define SPECFLEET_BF16 __attribute__((target("avx512f,avx512bf16")))

template <int R, int PP>
SPECFLEET_BF16 void pair_tile(const uint32_t* p, const uint32_t* x, float* out, int64_t K2, int64_t N, int64_t j0,
                              int64_t ldp) {
  __m512 acc[R][PP];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < PP; ++q) acc[r][q] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K2; ++k) {
#pragma GCC unroll 4
    for (int q = 0; q < PP; ++q) prefetch(p + q * ldp + (k + kAhead) * kPanel);
    __m512i wv[PP];
#pragma GCC unroll 4
    for (int q = 0; q < PP; ++q) wv[q] = _mm512_loadu_si512(p + q * ldp + k * kPanel);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i xv = _mm512_set1_epi32(static_cast<int>(x[r * K2 + k]));
#pragma GCC unroll 4
      for (int q = 0; q < PP; ++q) acc[r][q] = _mm512_dpbf16_ps(acc[r][q], (__m512bh)xv, (__m512bh)wv[q]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int q = 0; q < PP; ++q) {
      const int64_t j = j0 + q * kPanel;
      const int64_t left = std::clamp<int64_t>(N - j, 0, kPanel);  // the last panel's padding outputs are dropped
      _mm512_mask_storeu_ps(out + r * N + j, static_cast<__mmask16>((1u << left) - 1u), acc[r][q]);
    }
}

// Every row against panels [q, q + PP): rows in tiles of 4, then the 1 to 3 left.
template <int PP>
SPECFLEET_BF16 void pair_panels(const uint32_t* p, const uint32_t* x, float* out, int64_t R, int64_t K2, int64_t N,
                                int64_t q, int64_t ldp) {
  const uint32_t* pq = p + q * ldp;
  const int64_t j0 = q * kPanel;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) pair_tile<4, PP>(pq, x + r * K2, out + r * N, K2, N, j0, ldp);
  if (R - r == 3) pair_tile<3, PP>(pq, x + r * K2, out + r * N, K2, N, j0, ldp);
  if (R - r == 2) pair_tile<2, PP>(pq, x + r * K2, out + r * N, K2, N, j0, ldp);
  if (R - r == 1) pair_tile<1, PP>(pq, x + r * K2, out + r * N, K2, N, j0, ldp);
}

SPECFLEET_BF16 void pair_group(const uint32_t* p, const uint32_t* x, float* out, int64_t R, int64_t K2, int64_t N,
                               int64_t q, int64_t P, int64_t ldp) {
  switch (std::min<int64_t>(4, P - q)) {
    case 4: pair_panels<4>(p, x, out, R, K2, N, q, ldp); break;
    case 3: pair_panels<3>(p, x, out, R, K2, N, q, ldp); break;
    case 2: pair_panels<2>(p, x, out, R, K2, N, q, ldp); break;
    default: pair_panels<1>(p, x, out, R, K2, N, q, ldp); break;
  }
}

#endif  // SPECFLEET_PAIRS

// float32 to bfloat16 bits, rounded to nearest even (as torch's .bfloat16())
inline uint32_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;  // NaN stays NaN
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x [R, K] (K even) rounded to bfloat16, as input pairs: each word (x[2k] low, x[2k + 1] high), which is
// also the row-major bfloat16 matrix AMX's A tiles read; rows R to Rp are zeros
std::vector<uint32_t> bf16_pairs(const float* xp, int64_t R, int64_t K, int64_t Rp) {
  const int64_t K2 = K / 2;
  std::vector<uint32_t> x(Rp * K2, 0);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t k = 0; k < K2; ++k)
      x[r * K2 + k] = bf16_bits(xp[r * K + 2 * k]) | (bf16_bits(xp[r * K + 2 * k + 1]) << 16);
  return x;
}

// out[R, N] = x[R, K] @ the pairs-packed weight's [N, K].T (K even), on the dot product's chains
void pairs_into(const float* xp, const uint32_t* pp, float* op, int64_t R, int64_t K, int64_t N, int64_t P) {
#ifdef SPECFLEET_PAIRS
  if (R == 0 || N == 0) return;
  const int64_t K2 = K / 2, ldp = K2 * kPanel;
  const std::vector<uint32_t> x = bf16_pairs(xp, R, K, R);
  at::parallel_for(0, (P + 3) / 4, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) pair_group(pp, x.data(), op, R, K2, N, 4 * t, P, ldp);
  });
#else
  TORCH_CHECK(false, "rowwise: this build has no bfloat16 pairs");
#endif
}

// whether a packed weight is in pairs ([P, K / 2, 32] bfloat16) rather than panels ([P, K, 16])
inline bool is_pairs(const torch::Tensor& p) { return p.scalar_type() == torch::kBFloat16 && p.size(2) == 2 * kPanel; }

// whether a packed weight is in 4-bit blocks ([P, K / 32, 320] bytes, quant4.cpp)
inline bool is_q4(const torch::Tensor& p) { return p.scalar_type() == torch::kUInt8 && p.size(2) == 320; }

// whether a packed weight multiplies activations K wide into N outputs
inline bool fits(const torch::Tensor& p, int64_t K, int64_t N) {
  const int64_t width = is_q4(p) ? 32 * p.size(1) : is_pairs(p) ? 2 * p.size(1) : p.size(1);
  return width == K && p.size(0) == (N + kPanel - 1) / kPanel;
}

// whether ``p`` is a weight one of the packers made (rowwise.pack, rowwise.pack_q4) that runs here
bool any_packed(const torch::Tensor& p);

}  // namespace

// amx.cpp
bool amx_supported();
bool amx_fits(int64_t K);
void amx_pairs_into(const uint16_t* a, const uint16_t* pp, float* op, int64_t R, int64_t K, int64_t N, int64_t P);

// the same product on AMX's tiles (amx.cpp), over the activations rounded as the pairs round them, in rows
// padded to AMX's 16
void amx_into(const float* xp, const torch::Tensor& p, float* op, int64_t R, int64_t K, int64_t N) {
  TORCH_CHECK(amx_supported() && amx_fits(K), "rowwise: AMX cannot multiply this weight here");
  if (R == 0 || N == 0) return;
  const std::vector<uint32_t> a = bf16_pairs(xp, R, K, (R + 15) / 16 * 16);
  amx_pairs_into(reinterpret_cast<const uint16_t*>(a.data()), reinterpret_cast<const uint16_t*>(p.data_ptr()), op, R,
                 K, N, p.size(0));
}

// quant4.cpp
bool q4_vnni();
void q4_into(const float* xp, const uint8_t* pp, float* op, int64_t R, int64_t K, int64_t N, int64_t P, bool wide);
torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m);

bool pairs_supported() {
#ifdef SPECFLEET_PAIRS
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

torch::Tensor pack(torch::Tensor w, bool pairs) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16) &&
                  w.device().is_cpu(),
              "rowwise.pack wants a 2-D float32 or bfloat16 CPU weight");
  TORCH_CHECK(!pairs || (w.scalar_type() == torch::kBFloat16 && w.size(1) % 2 == 0 && pairs_supported()),
              "rowwise.pack: pairs need a bfloat16 weight of an even width and a CPU with AVX512-BF16");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  if (pairs) {
    auto padded = torch::zeros({P * kPanel, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
    return padded.view({P, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({P, K / 2, 2 * kPanel});
  }
  auto padded = torch::zeros({P * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// out[R, N] = x[R, K] @ the packed weight's [N, K].T
template <typename W>
void linear_into(const float* xp, const W* pp, float* op, int64_t R, int64_t K, int64_t N, int64_t P) {
  if (R == 0 || N == 0) return;
  const int64_t ldp = K * kPanel;
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int64_t q = 2 * t;
      if (q + 2 <= P) panels<2>(pp, xp, op, R, K, N, q, ldp);
      else panels<1>(pp, xp, op, R, K, N, q, ldp);
    }
  });
}

// a packed weight's product, on its dtype's loads (the activations and the sums float32 either way)
void linear_packed(const float* xp, const torch::Tensor& p, float* op, int64_t R, int64_t K, int64_t N) {
  static const bool wide = q4_vnni();
  if (is_q4(p))
    q4_into(xp, p.data_ptr<uint8_t>(), op, R, K, N, p.size(0), wide);
  else if (is_pairs(p) && amx_supported() && amx_fits(K))  // the host's one kernel for every row count
    amx_into(xp, p, op, R, K, N);
  else if (is_pairs(p))
    pairs_into(xp, reinterpret_cast<const uint32_t*>(p.data_ptr()), op, R, K, N, p.size(0));
  else if (p.scalar_type() == torch::kBFloat16)
    linear_into(xp, reinterpret_cast<const uint16_t*>(p.data_ptr()), op, R, K, N, p.size(0));
  else
    linear_into(xp, p.data_ptr<float>(), op, R, K, N, p.size(0));
}

namespace {
bool any_packed(const torch::Tensor& p) {
  return p.dim() == 3 && p.is_contiguous() && p.device().is_cpu() &&
         ((p.size(2) == kPanel && (p.scalar_type() == torch::kFloat32 || p.scalar_type() == torch::kBFloat16)) ||
          (is_pairs(p) && pairs_supported()) || is_q4(p));
}
}  // namespace

// the 4-bit product on AVX2's instructions even where AVX512-VNNI runs (the tests: the same bits)
torch::Tensor linear_q4(torch::Tensor x, torch::Tensor p, int64_t N, bool wide) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && any_packed(p) &&
                  is_q4(p) && fits(p, x.size(1), N) && (!wide || q4_vnni()),
              "rowwise.linear_q4 wants float32 activations and a weight from pack_q4 that fits them");
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  q4_into(x.data_ptr<float>(), p.data_ptr<uint8_t>(), out.data_ptr<float>(), x.size(0), x.size(1), N, p.size(0), wide);
  return out;
}

// the pairs' product on the dot product's chains even where AMX runs, or on AMX (the tests: each invariant)
torch::Tensor linear_pairs(torch::Tensor x, torch::Tensor p, int64_t N, bool amx) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && any_packed(p) &&
                  is_pairs(p) && fits(p, x.size(1), N) && (!amx || (amx_supported() && amx_fits(x.size(1)))),
              "rowwise.linear_pairs wants float32 activations and a pairs weight that fits them (amx: where it runs)");
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  if (amx)
    amx_into(x.data_ptr<float>(), p, out.data_ptr<float>(), x.size(0), x.size(1), N);
  else
    pairs_into(x.data_ptr<float>(), reinterpret_cast<const uint32_t*>(p.data_ptr()), out.data_ptr<float>(), x.size(0),
               x.size(1), N, p.size(0));
  return out;
}

torch::Tensor linear(torch::Tensor x, torch::Tensor p, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "rowwise.linear wants 2-D float32 CPU activations");
  TORCH_CHECK(any_packed(p) && fits(p, x.size(1), N),
              "rowwise.linear wants a weight from rowwise.pack or pack_q4 with the activations' width and N outputs");
  x = x.contiguous();
  auto out = torch::empty({x.size(0), N}, x.options());
  linear_packed(x.data_ptr<float>(), p, out.data_ptr<float>(), x.size(0), x.size(1), N);
  return out;
}

// --- a Llama-family decoder block in one call ---------------------------------------------------
//
// shared.runner.lean runs a block as ~15 torch ops (and far more ATen calls beneath them): on a small
// model each costs microseconds of dispatch, which at one row is half of a decode step. Here the
// whole block is one C++ call over the step's T rows:
//
//   h = rmsnorm(x) -> qkv = h @ Wqkv (+b) -> [q/k rmsnorm per head] -> rotary on q and k
//   -> keys and values written to the arena -> attention of each row over its session's keys
//   -> x += attn @ Wo (+b) -> h = rmsnorm(x) -> g, u = h @ Wgu (+b) -> x += (silu(g) * u) @ Wd (+b)
//
// Batch invariance by construction: every matmul is the row-wise kernel; the norms reduce one row,
// each in lanes fixed by the width; attention computes each (row, head) alone over the keys its
// position sees, in key order (a decode step's arithmetic, whatever else the step holds); the rest
// is elementwise. No reduction's order depends on the number of rows, the sessions or the threads.

namespace {

// exp of 8 floats (Cephes' expf: 2^n times a degree-5 polynomial on [-ln2/2, ln2/2]; within 2 ulp of
// std::exp on [-87, 88], clamped outside it). Elementwise, so a value's result never depends on its
// neighbours; the loops below use it for whole groups of 8 and std::exp for a row's last few.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-87.3365447504f));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                 _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(y, _mm256_mul_ps(x, x)), x), _mm256_set1_ps(1.0f));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2));
}

inline float lanes_sum(__m256 acc) {  // the 8 lanes, in a fixed order
  alignas(32) float l[8];
  _mm256_store_ps(l, acc);
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// 8 (1) values of a KV row as float32 (load8 above for a float32 arena, the verifier's), or of a float16
// arena (a 4-bit draft's: half the bytes that attention streams; F16C widens exactly)
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float load1(const float* p) { return *p; }
inline float load1(const at::Half* p) { return static_cast<float>(*p); }

// The sum of a[0..n) * b[0..n): 8 lanes, each in index order, then the lanes in a fixed order, then
// the last n % 8 products in order.
template <typename B>
inline float dot(const float* a, const B* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
  float s = lanes_sum(acc);
  for (; i < n; ++i) s += a[i] * load1(b + i);
  return s;
}

// dot(q, k_t, n) for 4 rows k_t = k + t * n at once: the same arithmetic per row as dot(), but four
// independent chains, so the FMAs' latency overlaps (one chain at a time waits on each FMA)
template <typename K>
inline void dot4(const float* q, const K* k, int64_t n, float* out) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[t] = _mm256_fmadd_ps(qv, load8(k + t * n + i), acc[t]);
  }
  for (int t = 0; t < 4; ++t) {
    float s = lanes_sum(acc[t]);
    for (int64_t r = i; r < n; ++r) s += q[r] * load1(k + t * n + r);
    out[t] = s;
  }
}

// The 8 lanes of each of a[0..8), in lanes_sum()'s order, as the 8 lanes of one vector: hadd pairs
// lanes (0+1, 2+3) within each half, the second hadd adds those pairs, and the halves' sum adds the
// result of lanes 0-3 to that of lanes 4-7, so each sum is ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
inline __m256 lanes_sum8(const __m256* a) {
  const __m256 lo = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 hi = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  const __m128 first = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
  const __m128 second = _mm_add_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1));
  return _mm256_set_m128(second, first);
}

// dot(q, k_t, n) for 8 rows k_t = k + t * n at once, n a multiple of 8: dot()'s arithmetic per row
// (the same lanes, the same chains, lanes_sum()'s order), eight chains in flight, and the eight sums
// reduced together rather than one by one
template <typename K>
inline void dot8(const float* q, const K* k, int64_t n, float* out) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) acc[t] = _mm256_fmadd_ps(qv, load8(k + t * n + i), acc[t]);
  }
  _mm256_storeu_ps(out, lanes_sum8(acc));
}

// out[0..8 * NV) = sum over j in order of p[j] * v_j[0..8 * NV), v_j = v + j * stride: in registers
template <int NV, typename V>
inline void weighted_sum(const float* p, const V* v, int64_t len, int64_t stride, float* out) {
  __m256 acc[NV];
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const __m256 pv = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
    for (int c = 0; c < NV; ++c) acc[c] = _mm256_fmadd_ps(pv, load8(v + j * stride + 8 * c), acc[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NV; ++c) _mm256_storeu_ps(out + 8 * c, acc[c]);
}

// out = x * rsqrt(mean(x^2) + eps) * w over one row of n (as torch's rms_norm: the scale, then the weight)
inline void rmsnorm(const float* x, const float* w, float* out, int64_t n, double eps) {
  const float r = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * r) * w[i];
}

// out = silu(g) * u = g / (1 + exp(-g)) * u, elementwise over n
inline void silu_mul(const float* g, const float* u, float* out, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

inline void add_bias(float* out, const std::optional<torch::Tensor>& bias, int64_t rows, int64_t n) {
  if (!bias) return;
  const float* b = bias->data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) out[r * n + j] += b[j];
}

// v = v * cos + rotate_half(v) * sin, where sin already carries rotate_half's sign (lean.py's rot_sign)
inline void rotary(float* v, const float* cos, const float* sin, int64_t d, float* tmp) {
  const int64_t half = d / 2;  // v[(i + half) % d] in two runs: no division per element
  for (int64_t i = 0; i < d - half; ++i) tmp[i] = v[i] * cos[i] + v[i + half] * sin[i];
  for (int64_t i = d - half; i < d; ++i) tmp[i] = v[i] * cos[i] + v[i - (d - half)] * sin[i];
  std::memcpy(v, tmp, d * sizeof(float));
}

// One query row of one head over `len` keys/values (rows of [tokens, d]): softmax(q.k * scale) @ v.
// Every score is dot()'s arithmetic, the softmax sums in key order, and each output element sums its
// values in key order: fixed by the row's own query and length.
template <typename KV>
void attend(const float* q, const KV* keys, const KV* values, int64_t len, int64_t d, float scale,
            float* scores, float* out) {
  int64_t j = 0;
  if (d % 8 == 0)
    for (; j + 8 <= len; j += 8) dot8(q, keys + j * d, d, scores + j);
  for (; j + 4 <= len; j += 4) dot4(q, keys + j * d, d, scores + j);
  for (; j < len; ++j) scores[j] = dot(q, keys + j * d, d);
  // scale, max, exp and the normalisation are elementwise (the max exact in any order); only the sum
  // runs in key order, one add at a time
  const __m256 scale8 = _mm256_set1_ps(scale);
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  for (j = 0; j + 8 <= len; j += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(scores + j), scale8);
    _mm256_storeu_ps(scores + j, v);
    top8 = _mm256_max_ps(top8, v);
  }
  alignas(32) float tops[8];
  _mm256_store_ps(tops, top8);
  float top = -INFINITY;
  for (const float t : tops) top = std::max(top, t);
  for (; j < len; ++j) {
    scores[j] *= scale;
    top = std::max(top, scores[j]);
  }
  for (j = 0; j + 8 <= len; j += 8)
    _mm256_storeu_ps(scores + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top))));
  for (; j < len; ++j) scores[j] = std::exp(scores[j] - top);
  float sum = 0.0f;
  for (j = 0; j < len; ++j) sum += scores[j];  // in key order
  const float inv = 1.0f / sum;
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (j = 0; j + 8 <= len; j += 8) _mm256_storeu_ps(scores + j, _mm256_mul_ps(_mm256_loadu_ps(scores + j), inv8));
  for (; j < len; ++j) scores[j] *= inv;
  int64_t i = 0;
  for (; i + 64 <= d; i += 64) weighted_sum<8, KV>(scores, values + i, len, d, out + i);
  switch ((d - i) / 8) {
    case 7: weighted_sum<7, KV>(scores, values + i, len, d, out + i); break;
    case 6: weighted_sum<6, KV>(scores, values + i, len, d, out + i); break;
    case 5: weighted_sum<5, KV>(scores, values + i, len, d, out + i); break;
    case 4: weighted_sum<4, KV>(scores, values + i, len, d, out + i); break;
    case 3: weighted_sum<3, KV>(scores, values + i, len, d, out + i); break;
    case 2: weighted_sum<2, KV>(scores, values + i, len, d, out + i); break;
    case 1: weighted_sum<1, KV>(scores, values + i, len, d, out + i); break;
    default: break;
  }
  for (i += (d - i) / 8 * 8; i < d; ++i) {  // the last d % 8 elements
    float acc = 0.0f;
    for (j = 0; j < len; ++j) acc += scores[j] * load1(values + j * d + i);
    out[i] = acc;
  }
}

torch::Tensor checked(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu() && t.is_contiguous(),
              "rowwise.Layer: ", what, " must be a contiguous float32 CPU tensor");
  return t;
}

torch::Tensor packed(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(any_packed(t), "rowwise.Layer: ", what, " must be a weight from rowwise.pack or pack_q4");
  return t;
}

std::optional<torch::Tensor> checked(const std::optional<torch::Tensor>& t, const char* what) {
  if (t) checked(*t, what);
  return t;
}

}  // namespace

struct Layer {
  torch::Tensor norm_in, qkv, o, norm_post, gate_up, down;
  std::optional<torch::Tensor> qkv_bias, o_bias, gu_bias, down_bias, q_norm, k_norm;
  int64_t heads, kv_heads, dim, inter, hidden;
  double eps;
  float scale;

  Layer(torch::Tensor norm_in_, torch::Tensor qkv_, std::optional<torch::Tensor> qkv_bias_, torch::Tensor o_,
        std::optional<torch::Tensor> o_bias_, torch::Tensor norm_post_, torch::Tensor gate_up_,
        std::optional<torch::Tensor> gu_bias_, torch::Tensor down_, std::optional<torch::Tensor> down_bias_,
        std::optional<torch::Tensor> q_norm_, std::optional<torch::Tensor> k_norm_, int64_t heads_,
        int64_t kv_heads_, int64_t dim_, int64_t inter_, double eps_, double scale_)
      : norm_in(checked(norm_in_, "norm_in")), qkv(packed(qkv_, "qkv")), o(packed(o_, "o")),
        norm_post(checked(norm_post_, "norm_post")), gate_up(packed(gate_up_, "gate_up")),
        down(packed(down_, "down")), qkv_bias(checked(qkv_bias_, "qkv_bias")), o_bias(checked(o_bias_, "o_bias")),
        gu_bias(checked(gu_bias_, "gu_bias")), down_bias(checked(down_bias_, "down_bias")),
        q_norm(checked(q_norm_, "q_norm")), k_norm(checked(k_norm_, "k_norm")), heads(heads_),
        kv_heads(kv_heads_), dim(dim_), inter(inter_), hidden(norm_in_.size(0)), eps(eps_),
        scale(static_cast<float>(scale_)) {
    TORCH_CHECK(heads % kv_heads == 0, "rowwise.Layer: heads must be a multiple of kv_heads");
    TORCH_CHECK(fits(qkv, hidden, (heads + 2 * kv_heads) * dim) && fits(o, heads * dim, hidden) &&
                    fits(gate_up, hidden, 2 * inter) && fits(down, inter, hidden),
                "rowwise.Layer: the packed weights' shapes do not fit the hidden size ", hidden);
  }

  // x [T, hidden], updated in place; cos/sin [T, dim]; kv [2, kv_heads, tokens, dim] (one layer of the
  // arena: float32, or float16 for a draft, each new key and value rounded to it once); rows [T]: the
  // arena row each new key/value goes to; spans [S, 4]: (first row, rows, first arena row, keys seen by
  // the last row) per session, rows in session order.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor kv, torch::Tensor rows,
                        torch::Tensor spans) {
    checked(x, "x"), checked(cos, "cos"), checked(sin, "sin");
    const bool half = kv.scalar_type() == torch::kHalf;
    TORCH_CHECK((half || kv.scalar_type() == torch::kFloat32) && kv.device().is_cpu() && kv.is_contiguous(),
                "rowwise.Layer: kv must be a contiguous float32 or float16 CPU tensor");
    const int64_t T = x.size(0), width = (heads + 2 * kv_heads) * dim, tokens = kv.size(2);
    TORCH_CHECK(x.size(1) == hidden && cos.size(0) == T && cos.size(1) == dim && kv.size(1) == kv_heads &&
                    kv.size(3) == dim && rows.numel() == T && spans.dim() == 2 && spans.size(1) == 4,
                "rowwise.Layer.forward: inputs of the wrong shape");
    rows = rows.to(torch::kLong).contiguous();
    spans = spans.to(torch::kLong).contiguous();
    const int64_t* row = rows.data_ptr<int64_t>();
    const int64_t* span = spans.data_ptr<int64_t>();
    float* xp = x.data_ptr<float>();
    auto opts = x.options();
    auto h = torch::empty({T * std::max({hidden, heads * dim, inter})}, opts);  // each use packed [T, its width]
    auto qkv_out = torch::empty({T, width}, opts);
    auto gu = torch::empty({T, 2 * inter}, opts);
    auto delta = torch::empty({T, hidden}, opts);
    float* hp = h.data_ptr<float>();
    float* qp = qkv_out.data_ptr<float>();
    float* dp = delta.data_ptr<float>();

    // attention's half: norm, q/k/v, rotary, the arena write
    for (int64_t r = 0; r < T; ++r) rmsnorm(xp + r * hidden, norm_in.data_ptr<float>(), hp + r * hidden, hidden, eps);
    linear_packed(hp, qkv, qp, T, hidden, width);
    add_bias(qp, qkv_bias, T, width);
    std::vector<float> tmp(dim);
    for (int64_t r = 0; r < T; ++r) {
      TORCH_CHECK(0 <= row[r] && row[r] < tokens, "rowwise.Layer.forward: arena row out of range");
      for (int64_t hd = 0; hd < heads + kv_heads; ++hd) {
        float* v = qp + r * width + hd * dim;
        const auto& norm = hd < heads ? q_norm : k_norm;
        if (norm) rmsnorm(v, norm->data_ptr<float>(), v, dim, eps);
        rotary(v, cos.data_ptr<float>() + r * dim, sin.data_ptr<float>() + r * dim, dim, tmp.data());
      }
    }
    if (half) {
      at::Half* keys = kv.data_ptr<at::Half>();
      write_kv(qp, keys, keys + kv_heads * tokens * dim, row, T, width, tokens);
      attention(qp, keys, keys + kv_heads * tokens * dim, span, spans.size(0), T, width, tokens, hp);
    } else {
      float* keys = kv.data_ptr<float>();
      write_kv(qp, keys, keys + kv_heads * tokens * dim, row, T, width, tokens);
      attention(qp, keys, keys + kv_heads * tokens * dim, span, spans.size(0), T, width, tokens, hp);
    }
    linear_packed(hp, o, dp, T, heads * dim, hidden);
    add_bias(dp, o_bias, T, hidden);
    for (int64_t i = 0; i < T * hidden; ++i) xp[i] += dp[i];

    // the MLP's half
    float* gp = gu.data_ptr<float>();
    for (int64_t r = 0; r < T; ++r)
      rmsnorm(xp + r * hidden, norm_post.data_ptr<float>(), hp + r * hidden, hidden, eps);
    linear_packed(hp, gate_up, gp, T, hidden, 2 * inter);
    add_bias(gp, gu_bias, T, 2 * inter);
    for (int64_t r = 0; r < T; ++r) silu_mul(gp + r * 2 * inter, gp + r * 2 * inter + inter, hp + r * inter, inter);
    linear_packed(hp, down, dp, T, inter, hidden);
    add_bias(dp, down_bias, T, hidden);
    for (int64_t i = 0; i < T * hidden; ++i) xp[i] += dp[i];
    return x;
  }

 private:
  // each row's new keys and values (its q/k/v row's last 2 * kv_heads heads) to its arena row, in the arena's type
  template <typename KV>
  void write_kv(const float* qp, KV* keys, KV* values, const int64_t* row, int64_t T, int64_t width,
                int64_t tokens) const {
    for (int64_t r = 0; r < T; ++r)
      for (int64_t g = 0; g < kv_heads; ++g) {
        const float* k = qp + r * width + (heads + g) * dim;
        const float* v = qp + r * width + (heads + kv_heads + g) * dim;
        KV* kd = keys + (g * tokens + row[r]) * dim;
        KV* vd = values + (g * tokens + row[r]) * dim;
        for (int64_t i = 0; i < dim; ++i) kd[i] = static_cast<KV>(k[i]), vd[i] = static_cast<KV>(v[i]);
      }
  }

  // every row of every span over its session's keys: out [T, heads * dim]
  template <typename KV>
  void attention(const float* qp, const KV* keys, const KV* values, const int64_t* span, int64_t S, int64_t T,
                 int64_t width, int64_t tokens, float* out) const {
    const int64_t per_kv = heads / kv_heads;
    int64_t longest = 1;
    for (int64_t s = 0; s < S; ++s) longest = std::max(longest, span[4 * s + 3]);
    std::vector<float> scores(longest);
    for (int64_t s = 0; s < S; ++s) {
      const int64_t first = span[4 * s], n = span[4 * s + 1], start = span[4 * s + 2], seen = span[4 * s + 3];
      TORCH_CHECK(first >= 0 && n >= 1 && first + n <= T && start >= 0 && seen >= n && start + seen <= tokens,
                  "rowwise.Layer.forward: a span outside the step or the arena");
      // a key/value group's rows, for every row of the span and every head that reads them, while
      // they are in cache (a row's arithmetic is the same in any order of the loops)
      for (int64_t g = 0; g < kv_heads; ++g) {
        const KV* k = keys + (g * tokens + start) * dim;
        const KV* v = values + (g * tokens + start) * dim;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t r = first + i, len = seen - n + i + 1;
          for (int64_t hd = g * per_kv; hd < (g + 1) * per_kv; ++hd)
            attend(qp + r * width + hd * dim, k, v, len, dim, scale, scores.data(), out + r * heads * dim + hd * dim);
        }
      }
    }
  }
};

// The products and the block run without the GIL (their arguments are converted before and the result after):
// a drafter's event loop then takes a verdict off the network while its compute thread is in a forward, rather
// than waiting for Python's switch interval (5 ms) and the call's end. They touch no Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("pack", &pack, "a float32 or bfloat16 weight [out, in] packed into panels of 16 outputs (pairs: in "
                       "bfloat16 input pairs, for AVX512-BF16)");
  m.def("pairs_supported", &pairs_supported, "whether this CPU runs the bfloat16 pairs (AVX512-BF16)");
  m.def("linear", &linear, no_gil(), "x @ w.T from a packed weight, each output one in-order FMA chain");
  m.def("pack_q4", &q4_pack, "4-bit codes [N, K], scales and minimums [N, K / 32] (float16 bits) packed in panels");
  m.def("q4_vnni", &q4_vnni, "whether the 4-bit product runs on AVX512-VNNI here (else on AVX2)");
  m.def("amx_supported", &amx_supported, "whether bfloat16 pairs multiply on AMX here (every row count)");
  m.def("linear_pairs", &linear_pairs, no_gil(),
        "x @ w.T from a pairs weight, on AMX (amx) or the dot product's chains");
  m.def("linear_q4", &linear_q4, no_gil(), "x @ w.T from a pack_q4 weight, on AVX512-VNNI (wide) or AVX2");
  py::class_<Layer>(m, "Layer")
      .def(py::init<torch::Tensor, torch::Tensor, std::optional<torch::Tensor>, torch::Tensor,
                    std::optional<torch::Tensor>, torch::Tensor, torch::Tensor, std::optional<torch::Tensor>,
                    torch::Tensor, std::optional<torch::Tensor>, std::optional<torch::Tensor>,
                    std::optional<torch::Tensor>, int64_t, int64_t, int64_t, int64_t, double, double>())
      .def("forward", &Layer::forward, no_gil(), "the block over the step's rows: x updated in place and returned");
}
