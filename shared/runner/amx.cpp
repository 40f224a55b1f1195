// The bfloat16 pairs' product on AMX (shared/runner/rowwise.py: rowwise.linear, and the Layer's matmuls).
//
// A weight packed in pairs ([panels, in / 2, 16 x 2] bfloat16, rowwise.cpp) is, 16 pair rows at a time,
// exactly an AMX B tile: 16 rows of 64 bytes, each one input pair for the panel's 16 outputs. The
// activations, rounded to bfloat16 as the pairs round them, are the A tiles: 16 rows x 32 inputs. One
// tdpbf16ps adds the 32 inputs' products into the panel's 16 x 16 float32 sums, and the sums run over the
// blocks of 32 inputs in ascending order.
//
// Batch invariance by construction, as in the pairs: the hardware computes every row of a tile the same
// way from that row's inputs alone, the blocks' order is fixed, and rows past the step's are zeros that
// are dropped. So a row's result never depends on the other rows, how many there are or the threads.
// The sums are not the pairs' bits (AMX's inner sums round less often: against float64, a 3000 x 576
// product's worst error was 2.0e-5 here and the pairs' 5.3e-5), so a host uses one or the other for
// every step, by its CPU: rowwise.amx_available().
//
// Why: the pairs' many-row products are bound by the dot product's rate, AMX's by the weight's bytes.
// SmolLM2-135M's 30 layers and head on one core of the Xeon VM (CPU flags avx512_bf16 amx_bf16,
// 2026-12-06), pairs / AMX, ms: 1 row 18.3 / 18.6, 4 rows 19.6 / 18.9, 8 rows 31.0 / 20.5, 16 rows
// 51.6 / 21.3, 32 rows 93.8 / 28.5, 64 rows 178.6 / 40.1. A verification of 8 drafts is 9 rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)  // the compilers that know AMX's intrinsics
#define SPECFLEET_AMX 1
#include <cpuid.h>
#define SPECFLEET_TILES __attribute__((target("amx-tile,amx-bf16")))
#endif

namespace {

constexpr int64_t kPanel = 16, kPairs = 16;  // a B tile: 16 input pairs (32 inputs) of one panel
constexpr int kGroup = 4;                    // panels at once: four sums tiles, four weight streams

#ifdef SPECFLEET_AMX
// The tiles' shapes, for ldtilecfg: palette 1, every tile used 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Tiles 0-3 hold the sums of panels q..q+3, tile 4 the activations, tiles 5-7 the weights in turn.
// ldtilecfg by asm: GCC 12 drops the stores to a config that only _tile_loadconfig reads.
SPECFLEET_TILES void configure() {
  static const TileConfig config;
  asm volatile("ldtilecfg %0" ::"m"(config));
}

SPECFLEET_TILES void release() { _tile_release(); }

// out[R, N] for panels [q, q + PP) from a[Rp, K] (bfloat16, rows padded to 16 with zeros): the row blocks
// of 16 in turn, each over the K2 / 16 blocks of inputs in ascending order.
template <int PP>
SPECFLEET_TILES void group(const uint16_t* p, const uint16_t* a, float* out, int64_t R, int64_t K2, int64_t N,
                           int64_t q, int64_t ldp) {
  alignas(64) float sums[kPanel * kPanel];
  const uint16_t* w = p + q * ldp;  // ldp: one panel's bfloat16s
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    _tile_zero(0);
    if (PP > 1) _tile_zero(1);
    if (PP > 2) _tile_zero(2);
    if (PP > 3) _tile_zero(3);
    const uint16_t* x = a + r0 * 2 * K2;
    for (int64_t k = 0; k < K2; k += kPairs) {
      _tile_loadd(4, x + 2 * k, 4 * K2);
      const uint16_t* b = w + 2 * kPanel * k;
      _tile_loadd(5, b, 64);
      _tile_dpbf16ps(0, 4, 5);
      if (PP > 1) { _tile_loadd(6, b + ldp, 64); _tile_dpbf16ps(1, 4, 6); }
      if (PP > 2) { _tile_loadd(7, b + 2 * ldp, 64); _tile_dpbf16ps(2, 4, 7); }
      if (PP > 3) { _tile_loadd(5, b + 3 * ldp, 64); _tile_dpbf16ps(3, 4, 5); }
    }
    const int64_t rows = std::min<int64_t>(16, R - r0);
    for (int t = 0; t < PP; ++t) {
      if (t == 0) _tile_stored(0, sums, 64);
      if (t == 1) _tile_stored(1, sums, 64);
      if (t == 2) _tile_stored(2, sums, 64);
      if (t == 3) _tile_stored(3, sums, 64);
      const int64_t j = (q + t) * kPanel, left = std::clamp<int64_t>(N - j, 0, kPanel);  // padding outputs dropped
      for (int64_t r = 0; r < rows; ++r) std::memcpy(out + (r0 + r) * N + j, sums + r * kPanel, left * sizeof(float));
    }
  }
}

SPECFLEET_TILES void groups(const uint16_t* p, const uint16_t* a, float* out, int64_t R, int64_t K2, int64_t N,
                            int64_t P, int64_t ldp, int64_t first, int64_t last) {
  configure();
  for (int64_t t = first; t < last; ++t) {
    const int64_t q = kGroup * t;
    switch (std::min<int64_t>(kGroup, P - q)) {
      case 4: group<4>(p, a, out, R, K2, N, q, ldp); break;
      case 3: group<3>(p, a, out, R, K2, N, q, ldp); break;
      case 2: group<2>(p, a, out, R, K2, N, q, ldp); break;
      default: group<1>(p, a, out, R, K2, N, q, ldp); break;
    }
  }
  release();
}

// whether the CPU lists AMX's tiles and their bfloat16 product (CPUID leaf 7: EDX bits 22 and 24)
bool cpu_lists_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  return (edx >> 22 & 1u) && (edx >> 24 & 1u);
}
#endif  // SPECFLEET_AMX

}  // namespace

// Whether the pairs run on AMX here: the CPU lists it and Linux grants this process its tile state
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA: without it the first tile instruction faults). Once.
bool amx_supported() {
#ifdef SPECFLEET_AMX
  static const bool granted = cpu_lists_amx() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

// Whether a pairs weight K inputs wide multiplies on AMX: whole A tiles (32 inputs) only. A weight of
// another width keeps the pairs' dot product at every row count, so its rows stay invariant too.
bool amx_fits(int64_t K) { return K % (2 * kPairs) == 0; }

// out[R, N] = x[R, K] @ the pairs-packed weight's [N, K].T on AMX (amx_supported() and amx_fits(K)), from
// the activations already rounded to bfloat16 (rowwise.cpp's bf16_pairs): a [Rp, K], rows R to Rp (the next
// multiple of 16) zeros
void amx_pairs_into(const uint16_t* a, const uint16_t* pp, float* op, int64_t R, int64_t K, int64_t N, int64_t P) {
#ifdef SPECFLEET_AMX
  const int64_t K2 = K / 2, ldp = K2 * 2 * kPanel;
  at::parallel_for(0, (P + kGroup - 1) / kGroup, 1, [&](int64_t first, int64_t last) {
    groups(pp, a, op, R, K2, N, P, ldp, first, last);
  });
#else
  TORCH_CHECK(false, "rowwise: this build has no AMX");
#endif
}
