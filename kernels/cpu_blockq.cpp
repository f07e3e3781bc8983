// Block-quantized linear layers for CPU decoding and prefill: y = x @ W^T.
//
// W [N, K] is held as unsigned integers u (4 or 8 bits) in blocks of 32 along K, each block with
// a float16 scale d and offset m per output row (as GGUF stores them): w = d * u + m. GGUF's Q4_0 (u = q, m = -8 d),
// Q4_1 (u = q, m as stored) and Q8_0 (u = q + 128, m = -128 d) are exactly this, so their weights
// are used as the file stores them. The input x [M, K] float32 is quantized per row and per block
// of 32 to int8 a with a scale s (x ~ s a, s = max|x| / 127), and each block contributes
//     sum_i w_i x_i ~ d s (sum_i u_i a_i) + m s (sum_i a_i),
// the integer sum computed exactly by AVX512-VNNI (vpdpbusd: unsigned u times signed a).
//
// Layout (packed once at load, kernels/cpu_blockq.py): output rows in tiles of 16, one 512-bit
// lane per row. For tile t and block b the weights are 8 groups of 4 consecutive k; a group is 64
// bytes (16 rows x 4 k). 8-bit: the 8 groups in order. 4-bit: 4 pairs of 64 bytes, pair p holding
// group 2p in the low nibbles and group 2p + 1 in the high ones. d and m are [tiles, blocks, 16]
// float16, widened to float32 exactly where they are read.
//
// Without VNNI, AVX2 (vpmaddubsw, then vpmaddwd by ones) computes the same exact integer block
// sums: a 4-bit weight times an int8 is at most 15 * 127, so the int16 pair sums of a block's 8
// groups stay under 2^15; an 8-bit weight is split into its two nibbles (u = 16 hi + lo) first.
//
// Every output element accumulates its blocks in order with the same two fused multiply-adds,
// whatever M, the row tile or the thread split: a row's result is bitwise the same alone and in
// a batch (tests/unit/test_cpu_blockq.py checks it).
#include <torch/extension.h>
#include <ATen/Parallel.h>   // OpenMP inline: built with -fopenmp (cpu_ext.py)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SLUICE_VNNI 1
#define SLUICE_AVX2 0
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_VNNI 0
#define SLUICE_AVX2 1
#include <immintrin.h>
#else
#define SLUICE_VNNI 0
#define SLUICE_AVX2 0
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 16;
constexpr int64_t kPanel = 128;   // input rows per pass over a thread's weight tiles (stay in L2)

// x [M, K] float32 -> a [M, K] int8, s [M, K/32] (block scale), ss [M, K/32] (s * sum a).
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* a, float* s, float* ss) {
  const int64_t nb = k / kBlock;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * k + b * kBlock;
        int8_t* ab = a + r * k + b * kBlock;
#if SLUICE_VNNI
        // The scalar loop below, 16 lanes at a time (cvtps rounds half to even, as nearbyint).
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        const float vmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const __m512 vinv = _mm512_set1_ps(vmax > 0.f ? 127.f / vmax : 0.f);
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vinv));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vinv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ab), _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(ab + 16), _mm512_cvtsepi32_epi8(q1));
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
        const int32_t vsum = _mm512_reduce_add_epi32(
            _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q0, lo), hi),
                             _mm512_min_epi32(_mm512_max_epi32(q1, lo), hi)));
        s[r * nb + b] = vmax / 127.f;
        ss[r * nb + b] = (vmax / 127.f) * static_cast<float>(vsum);
        continue;
#endif
        float amax = 0.f;
        for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
        const float scale = amax / 127.f;
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < kBlock; ++i) {
          float q = std::nearbyint(xb[i] * inv);
          q = std::fmin(127.f, std::fmax(-127.f, q));
          ab[i] = static_cast<int8_t>(q);
          sum += ab[i];
        }
        s[r * nb + b] = scale;
        ss[r * nb + b] = scale * static_cast<float>(sum);
      }
    }
  });
}

#if SLUICE_VNNI
// One tile of 16 output rows for MR input rows.
template <int MR, int BITS>
inline void tile_rows(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb,
                      const int8_t* a, const float* s, const float* ss, int64_t k,
                      float* out, int64_t ldo, __mmask16 mask) {
  __m512 acc[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    __m512i isum[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512();
    const int32_t* ab = reinterpret_cast<const int32_t*>(a + b * kBlock);   // 8 groups of 4 int8
    if (BITS == 4) {
      const uint8_t* wb = w + b * 256;
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * p);
        const __m512i w0 = _mm512_and_si512(v, low4);
        const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int32_t* ar = ab + r * (k / 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], w0, _mm512_set1_epi32(ar[2 * p]));
          isum[r] = _mm512_dpbusd_epi32(isum[r], w1, _mm512_set1_epi32(ar[2 * p + 1]));
        }
      }
    } else {
      const uint8_t* wb = w + b * 512;
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * g);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const int32_t* ar = ab + r * (k / 4);
          isum[r] = _mm512_dpbusd_epi32(isum[r], v, _mm512_set1_epi32(ar[g]));
        }
      }
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + b * kTile)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + b * kTile)));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int64_t nbr = r * nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dv, _mm512_set1_ps(s[nbr])), acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(ss[nbr]), acc[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, mask, acc[r]);
}

template <int BITS>
void tile_any(int64_t mr, const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb,
              const int8_t* a, const float* s, const float* ss, int64_t k, float* out, int64_t ldo,
              __mmask16 mask) {
  switch (mr) {
    case 8: tile_rows<8, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    case 7: tile_rows<7, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    case 6: tile_rows<6, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    case 5: tile_rows<5, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    case 4: tile_rows<4, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    case 3: tile_rows<3, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    case 2: tile_rows<2, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
    default: tile_rows<1, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, mask); break;
  }
}
#endif

#if SLUICE_AVX2
// One tile of 16 output rows (two halves of 8 lanes) for MR input rows: the integer block sums
// of the VNNI path, then the same two fused multiply-adds per block, so the same bits.
template <int MR, int BITS>
inline void tile_rows_avx2(const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb,
                           const int8_t* a, const float* s, const float* ss, int64_t k,
                           float* out, int64_t ldo, int64_t lanes) {
  __m256 acc[MR][2];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i isum[MR][2];
    const int32_t* ab = reinterpret_cast<const int32_t*>(a + b * kBlock);   // 8 groups of 4 int8
    if (BITS == 4) {
      __m256i p16[MR][2];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) p16[r][0] = p16[r][1] = _mm256_setzero_si256();
      const uint8_t* wb = w + b * 256;
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32 * h));
          const __m256i w0 = _mm256_and_si256(v, low4);
          const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const int32_t* ar = ab + r * (k / 4);
            p16[r][h] = _mm256_add_epi16(p16[r][h], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(ar[2 * p])));
            p16[r][h] = _mm256_add_epi16(p16[r][h], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(ar[2 * p + 1])));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < 2; ++h) isum[r][h] = _mm256_madd_epi16(p16[r][h], ones);
    } else {
      __m256i lo16[MR][2], hi16[MR][2];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) lo16[r][0] = lo16[r][1] = hi16[r][0] = hi16[r][1] = _mm256_setzero_si256();
      const uint8_t* wb = w + b * 512;
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * g + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low4);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const __m256i av = _mm256_set1_epi32(ab[r * (k / 4) + g]);
            lo16[r][h] = _mm256_add_epi16(lo16[r][h], _mm256_maddubs_epi16(lo, av));
            hi16[r][h] = _mm256_add_epi16(hi16[r][h], _mm256_maddubs_epi16(hi, av));
          }
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < 2; ++h)
          isum[r][h] = _mm256_add_epi32(_mm256_slli_epi32(_mm256_madd_epi16(hi16[r][h], ones), 4),
                                        _mm256_madd_epi16(lo16[r][h], ones));
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b * kTile + 8 * h)));
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b * kTile + 8 * h)));
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const int64_t nbr = r * nb + b;
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(dv, _mm256_set1_ps(s[nbr])), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(mv, _mm256_set1_ps(ss[nbr]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    if (lanes == kTile) {
      _mm256_storeu_ps(out + r * ldo, acc[r][0]);
      _mm256_storeu_ps(out + r * ldo + 8, acc[r][1]);
    } else {
      alignas(32) float buf[kTile];
      _mm256_store_ps(buf, acc[r][0]);
      _mm256_store_ps(buf + 8, acc[r][1]);
      std::memcpy(out + r * ldo, buf, sizeof(float) * static_cast<size_t>(lanes));
    }
  }
}

template <int BITS>
void tile_any_avx2(int64_t mr, const uint8_t* w, const uint16_t* d, const uint16_t* m, int64_t nb,
                   const int8_t* a, const float* s, const float* ss, int64_t k, float* out,
                   int64_t ldo, int64_t lanes) {
  switch (mr) {
    case 3: tile_rows_avx2<3, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, lanes); break;
    case 2: tile_rows_avx2<2, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, lanes); break;
    default: tile_rows_avx2<1, BITS>(w, d, m, nb, a, s, ss, k, out, ldo, lanes); break;
  }
}
#endif

// float16 bits -> float32 (exact), without F16C.
inline float widen(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// Element 4 g + j (g < 8, j < 4) of block b of output row `lane` in a tile's packed weights.
inline int unpacked(const uint8_t* w, int bits, int64_t b, int g, int64_t lane, int j) {
  if (bits == 4) {
    const uint8_t byte = w[b * 256 + 64 * (g / 2) + lane * 4 + j];
    return (g % 2 == 0) ? (byte & 0x0F) : (byte >> 4);
  }
  return w[b * 512 + 64 * g + lane * 4 + j];
}

// The same arithmetic in portable C++ (no AVX512-VNNI): the same per-block sums and the same two
// fused multiply-adds per block, so results agree with the vector path bit for bit.
void tile_scalar(int bits, int64_t rows, const uint8_t* w, const uint16_t* d, const uint16_t* m,
                 int64_t nb, const int8_t* a, const float* s, const float* ss, int64_t k,
                 float* out, int64_t ldo, int64_t lanes) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t lane = 0; lane < lanes; ++lane) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t isum = 0;
        const int8_t* ab = a + r * k + b * kBlock;
  #pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
          for (int j = 0; j < 4; ++j) {
            isum += unpacked(w, bits, b, g, lane, j) * static_cast<int32_t>(ab[4 * g + j]);
          }
        }
        const float scale = widen(d[b * kTile + lane]) * s[r * nb + b];
        acc = std::fma(static_cast<float>(isum), scale, acc);
        acc = std::fma(widen(m[b * kTile + lane]), ss[r * nb + b], acc);
      }
      out[r * ldo + lane] = acc;
    }
  }
}

// The packed weight and its scales for N = n outputs of K = k inputs.
void check_weights(const torch::Tensor& w, const torch::Tensor& d, const torch::Tensor& m, int64_t bits,
                   int64_t n, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "blockq: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(k % kBlock == 0, "blockq: K must be a multiple of 32, got ", k);
  const int64_t tiles = (n + kTile - 1) / kTile, nb = k / kBlock;
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() &&
                  w.numel() == tiles * nb * (bits == 4 ? 256 : 512),
              "blockq: packed weight does not match N = ", n, ", K = ", k, ", bits = ", bits);
  for (const auto* t : {&d, &m}) {
    TORCH_CHECK(t->scalar_type() == torch::kHalf && t->is_contiguous() &&
                    t->numel() == tiles * nb * kTile,
                "blockq: scales must be contiguous float16 [tiles, K/32, 16]");
  }
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& d,
                  const torch::Tensor& m, int64_t bits, int64_t n) {
  TORCH_CHECK(bits == 4 || bits == 8, "blockq: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "blockq: x must be a contiguous float32 [M, K]");
  check_weights(w, d, m, bits, n, x.size(1));
}

}  // namespace

// The input rounding above, shared with cpu_kquant.cpp's products (the same a, s and s * sum a).
void blockq_quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* a, float* s, float* ss) {
  quantize_rows(x, rows, k, a, s, ss);
}

// y [M, n] = x [M, K] @ W^T for W packed as above.
torch::Tensor blockq_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                            int64_t bits, int64_t n) {
  check_inputs(x, w, d, m, bits, n);
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock;
  const int64_t tiles = (n + kTile - 1) / kTile;
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0) return out;
  auto a = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({rows, nb}, x.options());
  auto ss = torch::empty({rows, nb}, x.options());
  quantize_rows(x.data_ptr<float>(), rows, k, a.data_ptr<int8_t>(), s.data_ptr<float>(),
                ss.data_ptr<float>());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  const int8_t* ap = a.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  const float* ssp = ss.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t wtile = nb * (bits == 4 ? 256 : 512);
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t p0 = 0; p0 < rows; p0 += kPanel) {
      const int64_t p1 = std::min(rows, p0 + kPanel);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lanes = std::min(kTile, n - t * kTile);
        const uint8_t* wt = wp + t * wtile;
        const uint16_t* dt = dp + t * nb * kTile;
        const uint16_t* mt = mp + t * nb * kTile;
#if SLUICE_VNNI
        const __mmask16 mask = static_cast<__mmask16>((1u << lanes) - 1u);
        for (int64_t r0 = p0; r0 < p1; r0 += 8) {
          const int64_t mr = std::min<int64_t>(8, p1 - r0);
          if (bits == 4) {
            tile_any<4>(mr, wt, dt, mt, nb, ap + r0 * k, sp + r0 * nb, ssp + r0 * nb, k,
                        op + r0 * n + t * kTile, n, mask);
          } else {
            tile_any<8>(mr, wt, dt, mt, nb, ap + r0 * k, sp + r0 * nb, ssp + r0 * nb, k,
                        op + r0 * n + t * kTile, n, mask);
          }
        }
#elif SLUICE_AVX2
        // Rows per pass: as many as 16 registers hold (8-bit keeps two int16 sums per row and half).
        const int64_t rows_per_pass = bits == 4 ? 3 : 2;
        for (int64_t r0 = p0; r0 < p1; r0 += rows_per_pass) {
          const int64_t mr = std::min<int64_t>(rows_per_pass, p1 - r0);
          if (bits == 4) {
            tile_any_avx2<4>(mr, wt, dt, mt, nb, ap + r0 * k, sp + r0 * nb, ssp + r0 * nb, k,
                             op + r0 * n + t * kTile, n, lanes);
          } else {
            tile_any_avx2<8>(mr, wt, dt, mt, nb, ap + r0 * k, sp + r0 * nb, ssp + r0 * nb, k,
                             op + r0 * n + t * kTile, n, lanes);
          }
        }
#else
        tile_scalar(static_cast<int>(bits), p1 - p0, wt, dt, mt, nb, ap + p0 * k, sp + p0 * nb,
                    ssp + p0 * nb, k, op + p0 * n + t * kTile, n, lanes);
#endif
      }
    }
  });
  return out;
}

// Rows ids [T] of W dequantized, [T, K] float32: d * u + m per element, which is exact in float32
// for these blocks (a float16 d times at most 8 bits, plus a float16 m or -2^(bits-1) d), so the
// values equal the torch reference (models.quant.BlockQLinear.rows) bit for bit. A tied model's
// token embedding reads its rows from the LM head's blocks this way.
torch::Tensor blockq_rows(torch::Tensor ids, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                          int64_t bits, int64_t n, int64_t k) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "blockq rows: ids must be a contiguous int64 [T]");
  check_weights(w, d, m, bits, n, k);
  const int64_t nb = k / kBlock;
  const int64_t rows = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "blockq rows: id ", ip[r], " is outside 0..", n - 1);
  }
  auto out = torch::empty({rows, k}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* op = out.data_ptr<float>();
  const int64_t wtile = nb * (bits == 4 ? 256 : 512);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = ip[r] / kTile, lane = ip[r] % kTile;
    const uint8_t* wt = wp + t * wtile;
    for (int64_t b = 0; b < nb; ++b) {
      const float db = widen(dp[(t * nb + b) * kTile + lane]);
      const float mb = widen(mp[(t * nb + b) * kTile + lane]);
      float* o = op + r * k + b * kBlock;
      for (int g = 0; g < 8; ++g) {
        for (int j = 0; j < 4; ++j) {
          o[4 * g + j] = static_cast<float>(unpacked(wt, static_cast<int>(bits), b, g, lane, j)) * db + mb;
        }
      }
    }
  }
  return out;
}

namespace {

// GGML type ids of the block types packed straight from a file's bytes, and their block sizes.
constexpr int64_t kGgmlQ4_0 = 2, kGgmlQ4_1 = 3, kGgmlQ8_0 = 8;

int64_t gguf_block_bytes(int64_t type) {
  return type == kGgmlQ4_0 ? 18 : type == kGgmlQ4_1 ? 20 : type == kGgmlQ8_0 ? 34 : 0;
}

inline uint16_t load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

// -c * d as float16 bits (Q4_0's m = -8 d, Q8_0's -128 d): exact unless it leaves float16's range.
inline uint16_t scaled_half(uint16_t d, float c) {
  const float v = -c * widen(d);
  const c10::Half h(v);
  TORCH_CHECK(widen(h.x) == v, "blockq: block scales and offsets must be float16 values (GGUF's precision): "
              "an offset ", v, " is outside float16's range");
  return h.x;
}

// One output row of GGML type Type into its tile lane, block after block: w is the lane's first
// 4 bytes in the tile, dl / ml its first scale and offset (a block's are kTile further on).
template <int64_t Type, int Bits>
void pack_gguf_row(const uint8_t* src, int64_t nb, uint8_t* w, uint16_t* dl, uint16_t* ml) {
  constexpr int64_t bb = Type == kGgmlQ4_0 ? 18 : Type == kGgmlQ4_1 ? 20 : 34;
  constexpr int64_t group_bytes = Bits == 4 ? 256 : 512;
  for (int64_t b = 0; b < nb; ++b, src += bb, w += group_bytes) {
    const uint16_t dh = load_half(src);
    dl[b * kTile] = dh;
    uint8_t u[kBlock];
    if constexpr (Type == kGgmlQ8_0) {
      ml[b * kTile] = scaled_half(dh, 128.f);
      for (int i = 0; i < kBlock; ++i) u[i] = static_cast<uint8_t>(src[2 + i] ^ 0x80);   // q + 128
    } else {
      ml[b * kTile] = Type == kGgmlQ4_1 ? load_half(src + 2) : scaled_half(dh, 8.f);
      const uint8_t* qs = src + (Type == kGgmlQ4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        u[j] = qs[j] & 0x0F;
        u[16 + j] = qs[j] >> 4;
      }
    }
    for (int g = 0; g < 8; ++g) {
      if constexpr (Bits == 8) {
        std::memcpy(w + 64 * g, u + 4 * g, 4);
      } else if (g % 2 == 0) {
        for (int j = 0; j < 4; ++j) w[64 * (g / 2) + j] = static_cast<uint8_t>(u[4 * g + j] | (u[4 * g + 4 + j] << 4));
      }
    }
  }
}

}  // namespace

// GGUF Q4_0 / Q4_1 / Q8_0 tensors, stacked by rows (a fused q/k/v or gate/up's parts, each
// [rows, K / 32 * block bytes] uint8 of GGML type types[i]), -> {packed, d, m} in the layout
// above, in one pass over the file's bytes: what kernels/cpu_blockq.py's pack_weights and
// pack_scales make of models.quant.block_parts' (u, d, m), bit for bit (tests/unit/test_cpu_ops.py).
// u = q (4-bit types, also in 8-bit blocks) or q + 128 (Q8_0); m = Q4_1's own, -8 d or -128 d.
std::vector<torch::Tensor> blockq_pack_gguf(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types,
                                            int64_t bits, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "blockq pack: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(k > 0 && k % kBlock == 0, "blockq pack: K must be a positive multiple of 32, got ", k);
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "blockq pack: one GGML type per part");
  const int64_t nb = k / kBlock;
  struct Row {
    const uint8_t* p;
    int64_t type;
  };
  std::vector<Row> rows;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t bb = gguf_block_bytes(types[i]);
    TORCH_CHECK(bb > 0, "blockq pack: GGML type ", types[i], " is not Q4_0, Q4_1 or Q8_0");
    TORCH_CHECK(!(bits == 4 && types[i] == kGgmlQ8_0), "blockq pack: Q8_0 blocks do not fit 4-bit blocks");
    const torch::Tensor& b = parts[i];
    TORCH_CHECK(b.scalar_type() == torch::kUInt8 && b.is_contiguous() && b.dim() == 2 && b.size(1) == nb * bb,
                "blockq pack: part ", i, " must be contiguous uint8 [rows, ", nb * bb, "] (GGML type ", types[i],
                ", K = ", k, ")");
    const uint8_t* p = b.data_ptr<uint8_t>();
    for (int64_t r = 0; r < b.size(0); ++r) rows.push_back({p + r * nb * bb, types[i]});
  }
  const int64_t n = static_cast<int64_t>(rows.size());
  TORCH_CHECK(n > 0, "blockq pack: no rows");
  const int64_t tiles = (n + kTile - 1) / kTile, group_bytes = bits == 4 ? 256 : 512;
  auto packed = torch::empty({tiles * nb * group_bytes}, torch::dtype(torch::kUInt8));
  auto d = torch::empty({tiles, nb, kTile}, torch::dtype(torch::kHalf));
  auto m = torch::empty({tiles, nb, kTile}, torch::dtype(torch::kHalf));
  uint8_t* wp = packed.data_ptr<uint8_t>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  uint16_t* mp = reinterpret_cast<uint16_t*>(m.data_ptr<at::Half>());
  const int64_t tile_bytes = nb * group_bytes;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t lane = 0; lane < kTile; ++lane) {
        const int64_t row = t * kTile + lane;
        uint8_t* w = wp + t * tile_bytes + lane * 4;
        uint16_t* dl = dp + t * nb * kTile + lane;
        uint16_t* ml = mp + t * nb * kTile + lane;
        if (row >= n) {                       // padding rows: zero weights and scales
          for (int64_t b = 0; b < nb; ++b) {
            for (int g = 0; g < group_bytes / 64; ++g) std::memset(w + b * group_bytes + 64 * g, 0, 4);
            dl[b * kTile] = ml[b * kTile] = 0;
          }
          continue;
        }
        const int64_t type = rows[row].type;
        if (type == kGgmlQ8_0) {
          pack_gguf_row<kGgmlQ8_0, 8>(rows[row].p, nb, w, dl, ml);
        } else if (type == kGgmlQ4_1) {
          bits == 8 ? pack_gguf_row<kGgmlQ4_1, 8>(rows[row].p, nb, w, dl, ml)
                    : pack_gguf_row<kGgmlQ4_1, 4>(rows[row].p, nb, w, dl, ml);
        } else {
          bits == 8 ? pack_gguf_row<kGgmlQ4_0, 8>(rows[row].p, nb, w, dl, ml)
                    : pack_gguf_row<kGgmlQ4_0, 4>(rows[row].p, nb, w, dl, ml);
        }
      }
    }
  });
  return {packed, d, m};
}

// The integer dot-product path compiled in: "avx512vnni", "avx2" or "portable".
std::string blockq_isa() { return SLUICE_VNNI ? "avx512vnni" : SLUICE_AVX2 ? "avx2" : "portable"; }
