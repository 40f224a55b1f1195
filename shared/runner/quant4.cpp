// specfleet's 4-bit matmul (shared/runner/rowwise.py: pack_q4, and the q4 weights of linear and Layer).
//
// A weight in Q4_1's blocks, as a GGUF file holds them: every 32 inputs of an output share a scale d
// and a minimum m (float16), and each weight is d * q + m with q a 4-bit code, 0 to 15. Packed once into
// panels of 16 outputs, [panels, in / 32, 320] bytes: per block, the 16 outputs' d, then their m, then
// 256 bytes of codes, laid out so that one 512-bit load holds 16 outputs x 4 inputs x 2 (low and high
// nibbles: input groups 2c and 2c + 1 of the block).
//
// The activations are quantized per row and block of 32 to int8 (as llama.cpp's Q8_1: dx = max |x| / 127,
// qx = round(x / dx), sx = dx * sum(qx)), so each block's products are integer dot products:
//   out[o] = sum over blocks b, in order, of (d[o,b] * dx[b]) * sum_i q[o,i] qx[i] + m[o,b] * sx[b]
// The integer sums are exact, on AVX512-VNNI (vpdpbusd) or on AVX2 (vpmaddubsw, vpmaddwd) alike, and the
// float steps are the same two fused multiply-adds per block in either, so both give the same bits,
// and a row's result never depends on the other rows, the tiling or the threads.
//
// Decode reads 5/8 of a byte per weight (about 0.31 of bfloat16's), with a few integer instructions per
// 64 weights: the memory's rate, where llama.cpp's own Q4_1 kernel ran at 9.5 GB/s on a core that
// streams 26 (bench/results, edge-drafts, 2026-12-04). One row (a draft's step) runs four panels at once
// and two rows two, each from its own quarter (half) of the weight: four (two) long sequential streams,
// and as many independent chains, so the loads overlap the integer work. The SmolLM2 draft's 30 layers
// and head (84 MB, one row, paired runs on one core), AVX512-VNNI / AVX2:
//   one stream, one panel:             Xeon VM 7.0-8.1 / 7.9-9.5 ms; AVX512-BF16 EPYC 4.2-4.5 / 4.2-4.6 ms
//   two adjacent panels:               Xeon VM 5.7-6.1 / 7.1-7.6 ms; EPYC 7.1-7.6 / 9.4-9.5 ms (its prefetch
//                                      lost the streams, which swapped places every 2 panels)
//   four streams (two for two rows):   EPYC 3.1-3.2 / 3.6 ms
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kPanel = 16, kBlock = 32, kBlockBytes = 320;
constexpr int kGroups = kBlock / 4;  // 4 inputs per 32-bit lane

#define SPECFLEET_AVX2 __attribute__((target("avx2,fma,f16c")))

// One row's activations, quantized: codes [K], and per block its scale and its scaled code sum.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

// One block of 32: its codes, and its scale (returned) and scaled code sum. The AVX2 lanes take the same
// steps as the scalar loop (|x|'s max is exact in any order, the sum of codes is an exact integer, and
// vroundps's nearest-even is nearbyint's in the default rounding mode), so the bits are the scalar's.
SPECFLEET_AVX2 float quantize_block(const float* xb, int8_t* q, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < kBlock; i += 8) {
    const __m256 v = _mm256_loadu_ps(xb + i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(v, v), _mm256_setzero_ps(), _CMP_NEQ_UQ));  // NaN or inf
  }
  alignas(32) float tops[8];
  _mm256_store_ps(tops, top);
  float amax = 0.0f;
  for (const float t : tops) amax = std::max(amax, t);
  float d = amax / 127.0f;
  if (_mm256_movemask_ps(bad)) d = NAN;  // a NaN or an infinity in the block makes its outputs NaN, never a finite guess
  else if (!std::isnormal(d)) d = 0.0f;  // a block of zeros, or too tiny for 1 / d: it adds nothing
  if (!(d > 0.0f)) {
    std::memset(q, 0, kBlock);
    *s = d * 0.0f;
    return d;
  }
  const __m256 inv = _mm256_set1_ps(1.0f / d), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i sum = _mm256_setzero_si256();
  for (int i = 0; i < kBlock; i += 8) {
    const __m256 scaled = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + i), inv), lo), hi);
    const __m256i v = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    sum = _mm256_add_epi32(sum, v);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
    for (int j = 0; j < 8; ++j) q[i + j] = static_cast<int8_t>(lanes[j]);
  }
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum);
  int total = 0;
  for (const int v : sums) total += v;
  *s = d * static_cast<float>(total);
  return d;
}

// activations quantized per row and block of 32 to int8 (as llama.cpp's Q8_1: dx = max |x| / 127,
// qx = round(x / dx), sx = dx * sum(qx))
Quantized quantize(const float* x, int64_t R, int64_t K) {
  const int64_t KB = K / kBlock;
  Quantized out{std::vector<int8_t>(R * K), std::vector<float>(R * KB), std::vector<float>(R * KB)};
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < KB; ++b)
      out.d[r * KB + b] = quantize_block(x + r * K + b * kBlock, out.q.data() + r * K + b * kBlock,
                                         out.s.data() + r * KB + b);
  return out;
}

inline int32_t group(const int8_t* q, int g) {  // 4 codes as one 32-bit lane
  int32_t v;
  std::memcpy(&v, q + 4 * g, sizeof v);
  return v;
}

// Ask for the block kPrefetch blocks ahead in the same stream (a panel's blocks, then the next panel's: the
// stream's next) while this one is multiplied. The hardware's prefetcher alone left the 4-bit product at
// 4.6 ms for the SmolLM2 draft's 30 layers and head on one core of the Xeon VM (one row, AVX512-VNNI), about
// 1.4x the 3.4 ms that streaming its 84 MB takes there; 8 blocks ahead (2.5 KB a stream) took it to 3.4 ms,
// and 2 rows from 6.0 to 3.8 (2, 4, 12, 16 and 24 blocks ahead: 3.8-3.9, 3.5, 3.4, 3.4-3.5, 3.6-3.7 ms).
// A prefetch never faults: past the weight's end (its last blocks') it is simply dropped.
constexpr int64_t kPrefetch = 8;
inline void prefetch_ahead(const uint8_t* blk) {
#pragma GCC unroll 5
  for (int64_t c = 0; c < kBlockBytes; c += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch * kBlockBytes + c), _MM_HINT_T0);
}

#if defined(__clang__) || __GNUC__ >= 8  // the compilers that know AVX512-VNNI's intrinsics
#define SPECFLEET_Q4_VNNI 1
#define SPECFLEET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,f16c,fma")))
#endif

// rows [0, R) of NP panels (16 outputs each, from j0, gap panels of ldp bytes apart), AVX2: each panel in two
// 8-output halves
template <int R, int NP>
SPECFLEET_AVX2 void tile2(const uint8_t* p, int64_t ldp, int64_t gap, const Quantized& x, int64_t r0, float* out,
                          int64_t K, int64_t N, int64_t j0) {
  const int64_t KB = K / kBlock;
  __m256 acc[NP][R][2];
  for (int n = 0; n < NP; ++n)
    for (int r = 0; r < R; ++r) acc[n][r][0] = acc[n][r][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < KB; ++b)
    for (int n = 0; n < NP; ++n) {
      const uint8_t* blk = p + n * gap * ldp + b * kBlockBytes;
      prefetch_ahead(blk);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
        __m256i w[kGroups];
        for (int c = 0; c < kGroups / 2; ++c) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 + 64 * c + 32 * h));
          w[2 * c] = _mm256_and_si256(v, low);
          w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        for (int r = 0; r < R; ++r) {
          const int64_t row = r0 + r;
          const int8_t* q = x.q.data() + row * K + b * kBlock;
          __m256i part[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
          for (int g = 0; g < kGroups; ++g)
            part[g % 2] = _mm256_add_epi32(
                part[g % 2], _mm256_madd_epi16(_mm256_maddubs_epi16(w[g], _mm256_set1_epi32(group(q, g))), ones));
          const __m256i isum = _mm256_add_epi32(part[0], part[1]);
          const __m256 scale = _mm256_mul_ps(d, _mm256_set1_ps(x.d[row * KB + b]));
          acc[n][r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[n][r][h]);
          acc[n][r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[row * KB + b]), acc[n][r][h]);
        }
      }
    }
  alignas(32) float buf[kPanel];
  for (int n = 0; n < NP; ++n)
    for (int r = 0; r < R; ++r) {
      _mm256_store_ps(buf, acc[n][r][0]);
      _mm256_store_ps(buf + 8, acc[n][r][1]);
      const int64_t j = j0 + n * gap * kPanel, left = std::clamp<int64_t>(N - j, 0, kPanel);  // padding dropped
      std::memcpy(out + (r0 + r) * N + j, buf, left * sizeof(float));
    }
}

#ifdef SPECFLEET_Q4_VNNI
// the same on AVX512-VNNI: 16 outputs in one register, 4 inputs per vpdpbusd, NP panels at once (NP
// streams, and independent chains, where few rows leave registers for them). A block's high nibbles are
// multiplied as 16 * code (masked, not shifted: vpdpbusd's sums do not saturate) and divided back by 16,
// exactly, once per block: the same integer sums
template <int R, int NP>
SPECFLEET_VNNI void tile512(const uint8_t* p, int64_t ldp, int64_t gap, const Quantized& x, int64_t r0,
                            float* out, int64_t K, int64_t N, int64_t j0) {
  const int64_t KB = K / kBlock;
  __m512 acc[NP][R];
  for (int n = 0; n < NP; ++n)
    for (int r = 0; r < R; ++r) acc[n][r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int64_t b = 0; b < KB; ++b) {
    for (int n = 0; n < NP; ++n) {
      const uint8_t* blk = p + n * gap * ldp + b * kBlockBytes;
      prefetch_ahead(blk);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      __m512i w[kGroups];
      for (int c = 0; c < kGroups / 2; ++c) {
        const __m512i v = _mm512_loadu_si512(blk + 64 + 64 * c);
        w[2 * c] = _mm512_and_si512(v, low);
        w[2 * c + 1] = _mm512_and_si512(v, high);
      }
      __m512i part[R][2];  // per row: the low nibbles' chain and the high nibbles' (x 16); every row's at once
      for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = _mm512_setzero_si512();
      for (int g = 0; g < kGroups; ++g)
        for (int r = 0; r < R; ++r) {
          const int8_t* q = x.q.data() + (r0 + r) * K + b * kBlock;
          part[r][g % 2] = _mm512_dpbusd_epi32(part[r][g % 2], w[g], _mm512_set1_epi32(group(q, g)));
        }
      for (int r = 0; r < R; ++r) {
        const int64_t row = r0 + r;
        const __m512i isum = _mm512_add_epi32(part[r][0], _mm512_srai_epi32(part[r][1], 4));
        const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(x.d[row * KB + b]));
        acc[n][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[n][r]);
        acc[n][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.s[row * KB + b]), acc[n][r]);
      }
    }
  }
  for (int n = 0; n < NP; ++n)
    for (int r = 0; r < R; ++r) {
      const int64_t j = j0 + n * gap * kPanel, left = std::clamp<int64_t>(N - j, 0, kPanel);
      _mm512_mask_storeu_ps(out + (r0 + r) * N + j, static_cast<__mmask16>((1u << left) - 1u), acc[n][r]);
    }
}
#endif  // SPECFLEET_Q4_VNNI

// rows [0, R) of NP panels (16 outputs each, j0.., gap panels apart), in tiles of up to 4 rows for one panel,
// 2 for two and 1 for four (the registers each leaves)
template <bool Wide, int NP>
void panels(const uint8_t* p, int64_t ldp, int64_t gap, const Quantized& x, float* out, int64_t R, int64_t K,
            int64_t N, int64_t j0) {
  int64_t r = 0;
  auto run = [&](auto rows) {
    constexpr int n = decltype(rows)::value;
#ifdef SPECFLEET_Q4_VNNI
    if constexpr (Wide) tile512<n, NP>(p, ldp, gap, x, r, out, K, N, j0);
    else tile2<n, NP>(p, ldp, gap, x, r, out, K, N, j0);
#else
    tile2<n, NP>(p, ldp, gap, x, r, out, K, N, j0);
#endif
    r += n;
  };
  if constexpr (NP == 1) {
    while (R - r >= 4) run(std::integral_constant<int, 4>{});
    if (R - r == 3) run(std::integral_constant<int, 3>{});
  }
  if constexpr (NP <= 2) {
    while (R - r >= 2) run(std::integral_constant<int, 2>{});
  }
  while (R - r >= 1) run(std::integral_constant<int, 1>{});
}

// np panels at once (4 for 1 row, 2 for 2 rows, else 1), gap panels apart
template <bool Wide>
void streams(int np, const uint8_t* p, int64_t ldp, int64_t gap, const Quantized& x, float* out, int64_t R,
             int64_t K, int64_t N, int64_t j0) {
  if (np == 4) panels<Wide, 4>(p, ldp, gap, x, out, R, K, N, j0);
  else if (np == 2) panels<Wide, 2>(p, ldp, gap, x, out, R, K, N, j0);
  else panels<Wide, 1>(p, ldp, gap, x, out, R, K, N, j0);
}

}  // namespace

bool q4_vnni() {
#ifdef SPECFLEET_Q4_VNNI
  return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
#else
  return false;
#endif
}

// out[R, N] = x[R, K] @ the Q4-packed weight's [N, K].T; wide: AVX512-VNNI (else AVX2, the same bits)
void q4_into(const float* xp, const uint8_t* pp, float* op, int64_t R, int64_t K, int64_t N, int64_t P, bool wide) {
  if (R == 0 || N == 0) return;
  const Quantized x = quantize(xp, R, K);
  const int64_t ldp = (K / kBlock) * kBlockBytes;
  // decode's 1 or 2 rows: S panels at once, one from each of S equal runs of the panels (S sequential
  // streams of the weight, and S times the independent chains); the remainder's panels one at a time
  const int S = R == 1 ? 4 : R == 2 ? 2 : 1;
  const int64_t run = S > 1 ? P / S : 0;  // panels per stream
  at::parallel_for(0, run ? run + P % S : P, 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const int64_t q = t < run ? t : S * run + (t - run);
      const int np = t < run ? S : 1;
      if (wide) streams<true>(np, pp + q * ldp, ldp, run, x, op, R, K, N, q * kPanel);
      else streams<false>(np, pp + q * ldp, ldp, run, x, op, R, K, N, q * kPanel);
    }
  });
}

// Q4_1 blocks of a float32 weight [N, K] (K a multiple of 32): codes [N, K] (0 to 15), d and m [N, K / 32]
// as float16 bits, packed into panels of 16 outputs (``pack_q4`` in rowwise.py computes the blocks).
torch::Tensor q4_pack(torch::Tensor codes, torch::Tensor d, torch::Tensor m) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8 && codes.size(1) % kBlock == 0 &&
                  codes.device().is_cpu() && d.device().is_cpu() && m.device().is_cpu() && d.dim() == 2 &&
                  d.scalar_type() == torch::kInt16 && m.scalar_type() == torch::kInt16 &&
                  d.size(0) == codes.size(0) && d.size(1) == codes.size(1) / kBlock && m.sizes() == d.sizes(),
              "rowwise.pack_q4: codes [N, K] uint8 (K a multiple of 32), d and m [N, K / 32] float16 bits");
  codes = codes.contiguous(), d = d.contiguous(), m = m.contiguous();
  const int64_t N = codes.size(0), K = codes.size(1), KB = K / kBlock, P = (N + kPanel - 1) / kPanel;
  auto out = torch::zeros({P, KB, kBlockBytes}, torch::kUInt8);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const int16_t* dp = d.data_ptr<int16_t>();
  const int16_t* mp = m.data_ptr<int16_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / kPanel, lane = n % kPanel;
    for (int64_t b = 0; b < KB; ++b) {
      uint8_t* blk = o + (p * KB + b) * kBlockBytes;
      std::memcpy(blk + 2 * lane, dp + n * KB + b, 2);
      std::memcpy(blk + 32 + 2 * lane, mp + n * KB + b, 2);
      for (int g = 0; g < kGroups; ++g)
        for (int i = 0; i < 4; ++i) {
          const uint8_t code = c[n * K + b * kBlock + 4 * g + i] & 0x0F;
          blk[64 + 64 * (g / 2) + 4 * lane + i] |= static_cast<uint8_t>(g % 2 ? code << 4 : code);
        }
    }
  }
  return out;
}
