// specfleet's row-wise float32 matmul (shared/runner/rowwise.py): out = x @ w.T, where every output
// is ONE fused multiply-add chain over the inputs in ascending order, in one vector lane. Which tile
// computes an output, how many rows the call holds and how many threads run it never change that
// chain, so a row's result is bitwise the same in any batch: batch invariance by construction.
//
// The weight is packed once into panels of 16 outputs, [panels, in, 16], so a 1-row product streams
// each panel front to back (memory-bound decode), and a many-row one reuses a panel pair from cache
// across row tiles of 3 (compute-bound verification): 3 rows x 32 outputs = 12 accumulators.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

constexpr int64_t kPanel = 16;

template <int R, int PP>
inline void tile(const float* p, const float* x, float* out, int64_t K, int64_t N, int64_t j0, int64_t ldp) {
  __m256 acc[R][PP * 2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < PP * 2; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 wv[PP * 2];
#pragma GCC unroll 8
    for (int q = 0; q < PP; ++q) {
      wv[2 * q] = _mm256_loadu_ps(p + q * ldp + k * kPanel);
      wv[2 * q + 1] = _mm256_loadu_ps(p + q * ldp + k * kPanel + 8);
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
template <int PP>
void panels(const float* p, const float* x, float* out, int64_t R, int64_t K, int64_t N, int64_t q, int64_t ldp) {
  const float* pq = p + q * ldp;
  const int64_t j0 = q * kPanel;
  int64_t r = 0;
  for (; r + 3 <= R; r += 3) tile<3, PP>(pq, x + r * K, out + r * N, K, N, j0, ldp);
  if (R - r == 2) tile<2, PP>(pq, x + r * K, out + r * N, K, N, j0, ldp);
  if (R - r == 1) tile<1, PP>(pq, x + r * K, out + r * N, K, N, j0, ldp);
}

}  // namespace

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.device().is_cpu(),
              "rowwise.pack wants a 2-D float32 CPU weight");
  const int64_t N = w.size(0), K = w.size(1), P = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({P * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

torch::Tensor linear(torch::Tensor x, torch::Tensor p, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "rowwise.linear wants 2-D float32 CPU activations");
  TORCH_CHECK(p.dim() == 3 && p.size(1) == x.size(1) && p.size(2) == kPanel && p.is_contiguous(),
              "rowwise.linear wants a weight from rowwise.pack with the activations' width");
  x = x.contiguous();
  const int64_t R = x.size(0), K = x.size(1), P = p.size(0), ldp = K * kPanel;
  auto out = torch::empty({R, N}, x.options());
  if (R == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* pp = p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (P + 1) / 2, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int64_t q = 2 * t;
      if (q + 2 <= P) panels<2>(pp, xp, op, R, K, N, q, ldp);
      else panels<1>(pp, xp, op, R, K, N, q, ldp);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "a float32 weight [out, in] packed into panels of 16 outputs");
  m.def("linear", &linear, "x @ w.T from a packed weight, each output one in-order FMA chain");
}
