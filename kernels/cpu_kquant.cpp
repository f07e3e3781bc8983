// GGUF's K-quants (Q2_K .. Q6_K), 5-bit blocks (Q5_0, Q5_1) and IQ4_NL / IQ4_XS as CPU linear layers, y = x @ W^T,
// with the weights as the file stores them (values, float16 super-block scales, 6- or 8-bit
// sub-block scales), repacked at load (kernels/cpu_kquant.py) into a layout for these loops.
//
// Every format is one case of: unsigned values u (2, 4, 5 or 6 bits) in sub-blocks of 16 or 32 along
// K, each sub-block with a float32 scale D and either a float32 offset M (w = D u + M) or an
// integer zero point z (w = D (u - z)):
//   Q4_K, Q5_K  D = d * sc, M = -(dmin * mn)  d, dmin float16 per 256; sc, mn 6-bit per 32
//   Q6_K        D = d * sc, z = 32            d float16 per 256; sc int8 per 16
//   Q5_0        D = d, z = 16                 d float16 per 32
//   Q5_1        D = d, M = m                  d, m float16 per 32
//   IQ4_NL      D = d, z = 128                d float16 per 32
//   Q3_K        D = d * sc, z = 4             d float16 per 256; sc 6-bit minus 32 per 16
//   IQ4_XS      D = d * sc, z = 128           d float16 per 256; sc 6-bit minus 32 per 32
//   Q2_K        D = d * sc, M = -(dmin * mn)  d, dmin float16 per 256; sc, mn 4-bit per 16
// IQ4_NL and IQ4_XS store 4-bit indices into llama.cpp's grid of 16 int8 values (-127 .. 113);
// the kernels look each index up as u = grid + 128 (unsigned, 1 .. 241: a vpshufb per vector),
// so they are zero-point formats like the others, with z = 128. Q3_K's 3-bit values (two low bits
// and a high one, u = q + 4) are held in the 4-bit fields.
// A float16 times an integer of at most 8 bits is exact in float32, so D and M are the file's
// values exactly (gguf's dequantize forms them the same way).
//
// The input is rounded to int8 per row (x ~ s a), in two ways:
// - Formats with sub-block scales (Q2_K .. Q6_K, IQ4_XS): one scale s per super-block of 256, as
//   llama.cpp's Q8_K (round_rows256, with the sums B of a per sub-block). A super-block's
//   sub-block sums then combine as integers, T = sum_i sc_i (I_i - z B_i) and O = sum_i mn_i B_i
//   (I_i = sum u a over sub-block i, exact), and a row takes two float operations per super-block:
//     acc = fma(T, d * s, acc)          then, with an offset,  acc = fma(-O, dmin * s, acc)
//   (tile_scalar says more). Per 32 this costs 8 vpdpbusd and 2 integer operations per row and
//   sub-block, where a float scale per sub-block costs 4 float operations.
// - Q5_0, Q5_1, IQ4_NL: per block of 32, by cpu_blockq.cpp's quantize_rows (the rounding of the
//   Q4_0/Q4_1/Q8_0 products). Each block's integer sum I = sum u a (minus z sum a) is exact, and
//   a row accumulates, block after block, in order:
//     acc = fma(I, d * s, acc)          then, with an offset,  acc = fma(m, s * sum a, acc)
//   (s * sum a is quantize_rows' float).
//
// Layout: output rows in tiles of 16 (one 32-bit lane per row in two 8-lane halves, as
// cpu_blockq.cpp's 4-bit layout). Per tile and super-block (256 along K; 32 for Q5_0 / Q5_1) one
// chunk: d [16] float16, dmin or m [16] float16 (with an offset), sc [sub-blocks][16] and mn
// [sub-blocks][16] bytes (K-quants), then per block of 32: 256 bytes of low nibbles (4 pairs of
// 64 bytes, [lane 16][j 4], pair p holding k = 4(2p) + j in its low nibbles and 4(2p + 1) + j in its
// high ones) and W = VB - 4 planes of 64 bytes ([lane 16][j 4]) for the bits above the fourth:
// the W high bits of k = 4g + j sit at bits W (g % P) .. W (g % P) + W - 1 of byte j of plane
// g / P, P = 8 / W groups a plane (Q5: bit g of one plane; Q6_K: two bits side by side, groups
// 0-3 in the first plane, 4-7 in the second, so a group's high bits are one shift and mask away).
// Q2_K's 2-bit values take 128 bytes a block instead: 2 rows of 64 ([lane 16][j 4]), row p holding
// k = 4(4p + m) + j at bits 2m .. 2m + 1. Bytes per weight: Q4_K 4.625 bits (file 4.5), Q5_K 5.625 (5.5),
// Q6_K 6.5625 (6.5625), Q5_0 5.5 (5.5), Q5_1 6 (6), IQ4_NL 4.5 (4.5), IQ4_XS 4.3125 (4.25), Q3_K
// 4.5625 (3.4375: its 3-bit values take 4-bit fields), Q2_K 3.125 (2.625: sc and mn a byte each).
//
// Paths, widest first, each with the same exact integer sums as the portable loop and the same
// float operations in the same order per lane, so all give the same bits:
//   AVX-512 VNNI  all 16 lanes of a tile in one vector; vpdpbusd (unsigned bytes times signed
//                 bytes, four products into each int32 lane) takes the stored values as they are
//   AVX-VNNI      the AVX2 tile (8 lanes a vector) with vpdpbusd in place of the two steps below
//   AVX2          vpmaddubsw, then vpmaddwd by ones. The int16 pair sums stay below 2^15: a byte
//                 product is at most 63 * 127, and the sums are widened every 8 (2- and 4-bit), 4
//                 (5-bit) or 2 (6-bit) groups of 4. The grid formats' values (up to 241) would
//                 overflow a pair, so there the grid's signed values multiply instead (|v| times
//                 the input with v's sign, vpsignb: at most 127 * 127), widened every group, and
//                 the sums start at zero rather than at the zero point's correction.
// Every output element's order of operations is fixed by K alone: a row's result is bitwise the
// same alone and in a batch, whatever the thread split.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_KQ_AVX2 1
#include <immintrin.h>
#else
#define SLUICE_KQ_AVX2 0
#endif
// -DSLUICE_KQ_VNNI256_EVEX (a test build, cpu_ext's "avxvnni_evex"): the AVX-VNNI tile below on a
// host with AVX-512 VNNI and VL, through the EVEX forms of the same 256-bit instructions, so hosts
// without AVX-VNNI (every AVX-512 one) run that path's code too.
#if defined(SLUICE_KQ_VNNI256_EVEX) && SLUICE_KQ_AVX2 && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SLUICE_KQ_EVEX256 1
#else
#define SLUICE_KQ_EVEX256 0
#endif
#if SLUICE_KQ_AVX2 && !SLUICE_KQ_EVEX256 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SLUICE_KQ_VNNI512 1
#else
#define SLUICE_KQ_VNNI512 0
#endif
// AVX-VNNI without AVX-512 (e.g. Alder Lake, Sierra Forest): the AVX2 tile with vpdpbusd.
#if SLUICE_KQ_AVX2 && !SLUICE_KQ_VNNI512 && (defined(__AVXVNNI__) || SLUICE_KQ_EVEX256)
#define SLUICE_KQ_VNNI256 1
#else
#define SLUICE_KQ_VNNI256 0
#endif
#if SLUICE_KQ_EVEX256
#define SLUICE_KQ_DPBUSD256 _mm256_dpbusd_epi32
#define SLUICE_KQ_DPWSSD256 _mm256_dpwssd_epi32
#else
#define SLUICE_KQ_DPBUSD256 _mm256_dpbusd_avx_epi32
#define SLUICE_KQ_DPWSSD256 _mm256_dpwssd_avx_epi32
#endif

void blockq_quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* a, float* s, float* ss);

namespace {

constexpr int64_t kTile = 16, kBlock = 32, kPanel = 128;
// Input rows per pass over a tile (at most 6; measured with bench/kquant.py on a 2-core AVX-512
// Xeon, 2026-12-06: 4 for Q4_K (and Q2_K, Q3_K), whose unpacking is cheap, 6 where merging high-bit planes costs
// more per weight vector and more rows share it). -DSLUICE_KQ_ROWS=R sets one count for all.
template <int VB> constexpr int64_t rows_avx2() {
#ifdef SLUICE_KQ_ROWS
  return SLUICE_KQ_ROWS;
#else
  return VB <= 4 ? 4 : 6;
#endif
}

// GGML type ids.
enum : int { kQ5_0 = 6, kQ5_1 = 7, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23 };

// IQ4_NL / IQ4_XS's grid (llama.cpp's kvalues_iq4nl) plus 128: the unsigned value of each index.
alignas(16) constexpr uint8_t kIq4Grid[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};

template <int FMT> struct Fmt;
// VB value bits, SBK super-block length, SUB sub-block length, OFFSET float offset (else ZERO),
// SUBSCALE per-sub-block integer scales, SIGNED those scales are int8, GRID the stored 4-bit
// value indexes kIq4Grid; BYTES of one GGML block (one super-block of this layout).
template <> struct Fmt<kQ5_0> { static constexpr int VB = 5, SBK = 32, SUB = 32, OFFSET = 0, ZERO = 16, SUBSCALE = 0, SIGNED = 0, GRID = 0, BYTES = 22; };
template <> struct Fmt<kQ5_1> { static constexpr int VB = 5, SBK = 32, SUB = 32, OFFSET = 1, ZERO = 0, SUBSCALE = 0, SIGNED = 0, GRID = 0, BYTES = 24; };
template <> struct Fmt<kQ2_K> { static constexpr int VB = 2, SBK = 256, SUB = 16, OFFSET = 1, ZERO = 0, SUBSCALE = 1, SIGNED = 0, GRID = 0, BYTES = 84; };
template <> struct Fmt<kQ3_K> { static constexpr int VB = 4, SBK = 256, SUB = 16, OFFSET = 0, ZERO = 4, SUBSCALE = 1, SIGNED = 1, GRID = 0, BYTES = 110; };
template <> struct Fmt<kQ4_K> { static constexpr int VB = 4, SBK = 256, SUB = 32, OFFSET = 1, ZERO = 0, SUBSCALE = 1, SIGNED = 0, GRID = 0, BYTES = 144; };
template <> struct Fmt<kQ5_K> { static constexpr int VB = 5, SBK = 256, SUB = 32, OFFSET = 1, ZERO = 0, SUBSCALE = 1, SIGNED = 0, GRID = 0, BYTES = 176; };
template <> struct Fmt<kQ6_K> { static constexpr int VB = 6, SBK = 256, SUB = 16, OFFSET = 0, ZERO = 32, SUBSCALE = 1, SIGNED = 1, GRID = 0, BYTES = 210; };
template <> struct Fmt<kIQ4_NL> { static constexpr int VB = 4, SBK = 32, SUB = 32, OFFSET = 0, ZERO = 128, SUBSCALE = 0, SIGNED = 0, GRID = 1, BYTES = 18; };
template <> struct Fmt<kIQ4_XS> { static constexpr int VB = 4, SBK = 256, SUB = 32, OFFSET = 0, ZERO = 128, SUBSCALE = 1, SIGNED = 1, GRID = 1, BYTES = 136; };

// Byte offsets within one (tile, super-block) chunk.
template <int FMT> struct Lay {
  using F = Fmt<FMT>;
  static constexpr int NSUB = F::SBK / F::SUB, NBLK = F::SBK / 32, PER = 32 / F::SUB;
  static constexpr int64_t D = 0, DM = 32;
  static constexpr int64_t SC = 32 + (F::OFFSET ? 32 : 0);
  static constexpr int64_t MN = SC + (F::SUBSCALE ? NSUB * kTile : 0);
  static constexpr int64_t BODY = MN + (F::SUBSCALE && F::OFFSET ? NSUB * kTile : 0);
  static constexpr int64_t BLK = F::VB == 2 ? 128 : 256 + 64 * (F::VB - 4);
  // Groups of 4 values per 64-byte row of the body: 2 (nibbles) or 4 (Q2_K's 2-bit fields).
  static constexpr int GPR = F::VB == 2 ? 4 : 2;
  static constexpr int64_t CHUNK = BODY + NBLK * BLK;
};

// A decode step reads each weight once, from memory. On the Intel Xeon hosts we measured, the
// hardware prefetcher alone leaves a thread waiting on DRAM between chunks; asking for the chunk
// `ahead` bytes further on while this one is computed takes 0.67-0.72x the time of a one-row Q4_K
// product (bench/kquant_ab.py --cold). On AMD EPYC (Zen 4) the hardware prefetcher keeps up by
// itself and the same instructions make it up to 2x slower. So the distance is chosen at run time:
// SLUICE_KQ_PREFETCH (bytes; 0 turns it off) when set, else 4096 on Intel and off elsewhere. A
// tile's chunks are contiguous and a thread's tiles follow each other, so "further on" is what the
// thread reads next; a prefetch past the end of the weights is harmless (it does not fault).
inline int64_t prefetch_distance() {
  static const int64_t ahead = [] {
    if (const char* e = std::getenv("SLUICE_KQ_PREFETCH")) return std::max<int64_t>(0, std::atoll(e)) & ~int64_t{63};
#if SLUICE_KQ_AVX2 && defined(__GNUC__)
    return __builtin_cpu_is("intel") ? int64_t{4096} : int64_t{0};
#else
    return int64_t{0};
#endif
  }();
  return ahead;
}

template <int64_t BYTES> inline void prefetch_ahead(const uint8_t* at) {
#if SLUICE_KQ_AVX2
#pragma GCC unroll 64
  for (int64_t off = 0; off < BYTES; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(at + off), _MM_HINT_T0);
#endif
}

inline float widen(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline uint16_t half_at(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return h; }

// Sub-block i's scale D and offset M for one lane of a chunk: exact products (see the top).
template <int FMT> inline float sub_scale(const uint8_t* chunk, int64_t lane, int i) {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  const float d = widen(half_at(chunk + L::D + 2 * lane));
  if (!F::SUBSCALE) return d;
  const uint8_t b = chunk[L::SC + kTile * i + lane];
  return d * static_cast<float>(F::SIGNED ? static_cast<int>(static_cast<int8_t>(b)) : static_cast<int>(b));
}
template <int FMT> inline float sub_offset(const uint8_t* chunk, int64_t lane, int i) {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  const float dm = widen(half_at(chunk + L::DM + 2 * lane));
  if (!F::SUBSCALE) return dm;
  return -(dm * static_cast<float>(chunk[L::MN + kTile * i + lane]));
}

// Element e (< 32) of one lane in a block's packed bytes.
template <int FMT> inline int value(const uint8_t* blk, int64_t lane, int e) {
  const int g = e / 4, j = e % 4;
  if constexpr (Fmt<FMT>::VB == 2) return (blk[64 * (g / 4) + lane * 4 + j] >> (2 * (g % 4))) & 3;
  const uint8_t byte = blk[64 * (g / 2) + lane * 4 + j];
  int u = (g % 2) ? (byte >> 4) : (byte & 0x0F);
  constexpr int W = Fmt<FMT>::VB - 4;
  if constexpr (W > 0) {
    constexpr int P = 8 / W;
    u |= ((blk[256 + 64 * (g / P) + lane * 4 + j] >> (W * (g % P))) & ((1 << W) - 1)) << 4;
  }
  return Fmt<FMT>::GRID ? kIq4Grid[u] : u;
}

// The formats with sub-block scales (see the top): s [row][super-block], and T and O per
// super-block, with z the zero point (0 with an offset). |T| < 2^28 (Q6_K: 16 sub-blocks of
// 16 * 32 * 127 times a scale of at most 128) and |O| < 2^22, so both are exact in int32.
template <int FMT> constexpr bool kQ8K = Fmt<FMT>::SUBSCALE != 0;
// log2 of the zero point of the formats with sub-block scales (the vector paths shift by it).
template <int FMT> constexpr int kZeroShift = Fmt<FMT>::ZERO == 4 ? 2 : Fmt<FMT>::ZERO == 32 ? 5 : Fmt<FMT>::ZERO == 128 ? 7 : 0;
static_assert(kZeroShift<kQ3_K> == 2 && kZeroShift<kQ6_K> == 5 && kZeroShift<kIQ4_XS> == 7, "zero points");

template <int FMT> inline int32_t sub_int(const uint8_t* chunk, int64_t lane, int i) {
  const uint8_t b = chunk[Lay<FMT>::SC + kTile * i + lane];
  return Fmt<FMT>::SIGNED ? static_cast<int32_t>(static_cast<int8_t>(b)) : static_cast<int32_t>(b);
}

// The portable loop: per row and lane, per block and sub-block, the exact integer sum and the
// fused multiply-adds above (formats with sub-block scales) or of the top comment (the others).
// bs: [row][sub-block] int16 sums B_i for the formats with sub-block scales.
template <int FMT>
void tile_scalar(int64_t rows, const uint8_t* w, int64_t nsb, const int8_t* a, const float* s, const float* ss,
                 const int32_t* zs, const int16_t* bs, int64_t k, float* out, int64_t ldo, int64_t lanes) {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  const int64_t nb = k / kBlock, n16 = k / 16, nsub = k / F::SUB;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t lane = 0; lane < lanes; ++lane) {
      float acc = 0.f;
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* chunk = w + sb * L::CHUNK;
        int32_t t = 0, o = 0;
        for (int blk = 0; blk < L::NBLK; ++blk) {
          const int64_t b = sb * L::NBLK + blk;
          const uint8_t* body = chunk + L::BODY + blk * L::BLK;
          const int8_t* ab = a + r * k + b * kBlock;
          for (int i2 = 0; i2 < L::PER; ++i2) {
            int32_t isum = 0;
            for (int e = i2 * F::SUB; e < (i2 + 1) * F::SUB; ++e) isum += value<FMT>(body, lane, e) * ab[e];
            const int i = blk * L::PER + i2;
            if constexpr (kQ8K<FMT>) {
              const int32_t bi = bs[r * nsub + sb * L::NSUB + i];
              t += sub_int<FMT>(chunk, lane, i) * (isum - (F::OFFSET ? 0 : F::ZERO) * bi);
              if (F::OFFSET) o += static_cast<int32_t>(chunk[L::MN + kTile * i + lane]) * bi;
              continue;
            }
            const float scale = sub_scale<FMT>(chunk, lane, i) * s[r * nb + b];
            if (F::OFFSET) {
              acc = std::fma(static_cast<float>(isum), scale, acc);
              acc = std::fma(sub_offset<FMT>(chunk, lane, i), ss[r * nb + b], acc);
            } else {
              isum += zs[r * n16 + 2 * b + i2];
              acc = std::fma(static_cast<float>(isum), scale, acc);
            }
          }
        }
        if constexpr (kQ8K<FMT>) {
          const float sr = s[r * nsb + sb];
          acc = std::fma(static_cast<float>(t), widen(half_at(chunk + L::D + 2 * lane)) * sr, acc);
          if (F::OFFSET) acc = std::fma(-static_cast<float>(o), widen(half_at(chunk + L::DM + 2 * lane)) * sr, acc);
        }
      }
      out[r * ldo + lane] = acc;
    }
  }
}

#if SLUICE_KQ_AVX2
// The W-bit field at bit F of each byte of v moved to bits 4 .. 3 + W (the others cleared): a
// 16-bit shift moves no bit across a byte boundary into the bits kept, as both places are within
// the byte.
template <int F, int W> inline __m256i field_to4(__m256i v) {
  const __m256i keep = _mm256_set1_epi8(static_cast<char>(((1 << W) - 1) << 4));
  if constexpr (F < 4) return _mm256_and_si256(_mm256_slli_epi16(v, 4 - F), keep);
  else if constexpr (F > 4) return _mm256_and_si256(_mm256_srli_epi16(v, F - 4), keep);
  else return _mm256_and_si256(v, keep);
}

// Group G (k = 4G .. 4G + 3) of one half's 8 lanes: values as bytes.
template <int VB, int G> inline __m256i group_values(__m256i nib, const __m256i* hi) {
  // 2-bit fields: a 16-bit shift moves only bits above the two kept into each byte's low two.
  if constexpr (VB == 2) return _mm256_and_si256(_mm256_srli_epi16(nib, 2 * (G % 4)), _mm256_set1_epi8(3));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i v = (G % 2) ? _mm256_and_si256(_mm256_srli_epi16(nib, 4), low4) : _mm256_and_si256(nib, low4);
  constexpr int W = VB - 4, P = W > 0 ? 8 / W : 1;
  if constexpr (W > 0) v = _mm256_or_si256(v, field_to4<W * (G % P), W>(hi[G / P]));
  return v;
}

// 8 bytes of a [lane 16] row (lanes 8 h ..) as int32 lanes.
template <bool SIGNED> inline __m256i bytes_i32(const uint8_t* p) {
  const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return SIGNED ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
}

// Two [lane 16] byte rows' lanes 8 h .. as int16 pairs, (row0, row1) in each 32-bit lane: one
// vpmaddwd against a row's pair (B_2j, B_2j+1) gives row0 B_2j + row1 B_2j+1.
template <bool SIGNED> inline __m256i byte_pairs(const uint8_t* row0, const uint8_t* row1) {
  const __m128i p = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row0)),
                                      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row1)));
  return SIGNED ? _mm256_cvtepi8_epi16(p) : _mm256_cvtepu8_epi16(p);
}

inline __m256i pair_dot(__m256i acc, __m256i pairs, __m256i b) {
#if SLUICE_KQ_VNNI256
  return SLUICE_KQ_DPWSSD256(acc, pairs, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, b));
#endif
}

// MR input rows against one tile. NH = 2: both 8-lane halves per block (acc [MR][2]; one pass
// over the tile's bytes, for one row, where the bytes' stream is the cost); NH = 1: one half per
// pass over K (acc [MR][1], so more rows fit in the 16 registers and each unpacked weight vector
// serves more of them, for many rows, where the arithmetic is the cost). Each lane's float
// operations are the same in the same order either way.
// With sub-block scales (kQ8K) the AVX2 steps widen the int16 pair sums with vpmaddwd by the
// sub-block's scale instead of by ones, straight into T; AVX-VNNI multiplies each sub-block's
// int32 sum by its scale (vpmulld). The zero point's part, z sum_i sc_i B_i, and the offset's
// sum_i mn_i B_i are pairs of bytes times pairs of int16 sums (vpmaddwd / vpdpwssd) per super-block.
template <int FMT, int MR, int NH> struct TileAvx2 {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  static constexpr bool kK = kQ8K<FMT>;
  // Groups of 4 between widening int16 pair sums to int32 (see the top), within a sub-block.
  static constexpr int FLUSH = F::GRID ? 1 : std::min(F::SUB / 4, F::VB <= 4 ? 8 : F::VB == 5 ? 4 : 2);
  // Plain AVX2 sums the grid formats' signed values (see the top): no zero-point correction.
  static constexpr bool kSigned = F::GRID && !SLUICE_KQ_VNNI256;

  const int8_t* a; int64_t k;
  __m256i p16[MR], isum[MR][L::PER];
  __m256i sc16[L::PER];   // kK, plain AVX2: the block's sub-block scales, each in both halves of a lane
  __m256i* tk;            // kK: this half's T per row (stride NH)

  template <int G> inline void group(const uint8_t* body, int h, const __m256i* hi, const int8_t* ab) {
    const __m256i nib = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 64 * (G / L::GPR) + 32 * h));
    __m256i v = group_values<F::VB, G>(nib, hi);
#if SLUICE_KQ_VNNI256
    if constexpr (F::GRID) v = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(
                                   reinterpret_cast<const __m128i*>(kIq4Grid))), v);
    // vpdpbusd: each lane's four unsigned-by-signed products straight into its exact int32 sum.
    constexpr int i2 = (4 * G) / F::SUB;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t a4;
      std::memcpy(&a4, ab + r * k + 4 * G, 4);
      isum[r][i2] = SLUICE_KQ_DPBUSD256(isum[r][i2], v, _mm256_set1_epi32(a4));
    }
#else
    __m256i sv = v;   // the grid's signed values: the sign goes onto the input, |v| is the unsigned operand
    if constexpr (F::GRID) {
      sv = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Grid))), v);
      sv = _mm256_xor_si256(sv, _mm256_set1_epi8(static_cast<char>(0x80)));   // u - 128 as int8
      v = _mm256_abs_epi8(sv);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t a4;
      std::memcpy(&a4, ab + r * k + 4 * G, 4);
      __m256i av = _mm256_set1_epi32(a4);
      if constexpr (F::GRID) av = _mm256_sign_epi8(av, sv);
      p16[r] = _mm256_add_epi16(p16[r], _mm256_maddubs_epi16(v, av));
    }
    if constexpr ((G + 1) % FLUSH == 0) {
      constexpr int i2 = (4 * G) / F::SUB;
      constexpr bool first = (G + 1 - FLUSH) * 4 % F::SUB == 0;
      const __m256i ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        if constexpr (kK) {
          tk[r * NH] = _mm256_add_epi32(tk[r * NH], _mm256_madd_epi16(p16[r], sc16[i2]));
        } else {
          const __m256i w32 = _mm256_madd_epi16(p16[r], ones);
          isum[r][i2] = first && F::OFFSET ? w32 : _mm256_add_epi32(isum[r][i2], w32);
        }
        p16[r] = _mm256_setzero_si256();
      }
    }
#endif
  }

  // One block's half h: the integer sums, then (kK) into T, else per sub-block acc = fma(I, D s, acc)
  // (+ fma(M, s sum a, acc)).
  inline void block_half(const uint8_t* chunk, int blk, int64_t b, int h, __m256 dv, __m256 dmv, const float* s,
                         const float* ss, const int32_t* zs, __m256* acc, int stride_acc) {
    const int64_t nb = k / kBlock, n16 = k / 16;
    const uint8_t* body = chunk + L::BODY + blk * L::BLK;
    const int8_t* ab = a + b * kBlock;
    __m256i hi[2];
    for (int pb = 0; pb < F::VB - 4; ++pb)
      hi[pb] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 256 + 64 * pb + 32 * h));
    if constexpr (kK && !SLUICE_KQ_VNNI256) {
      for (int i2 = 0; i2 < L::PER; ++i2) {
        const __m256i v = bytes_i32<F::SIGNED>(chunk + L::SC + kTile * (blk * L::PER + i2) + 8 * h);
        sc16[i2] = _mm256_or_si256(_mm256_slli_epi32(v, 16), _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)));
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      p16[r] = _mm256_setzero_si256();
      // Zero-point formats start each sum at its correction (see zs); VNNI adds into it from zero.
      for (int i2 = 0; i2 < L::PER; ++i2)
        if (!kK && !F::OFFSET && !kSigned) isum[r][i2] = _mm256_set1_epi32(zs[r * n16 + 2 * b + i2]);
        else if (SLUICE_KQ_VNNI256 || kSigned) isum[r][i2] = _mm256_setzero_si256();
    }
    group<0>(body, h, hi, ab); group<1>(body, h, hi, ab); group<2>(body, h, hi, ab); group<3>(body, h, hi, ab);
    group<4>(body, h, hi, ab); group<5>(body, h, hi, ab); group<6>(body, h, hi, ab); group<7>(body, h, hi, ab);
    if constexpr (kK) {
#if SLUICE_KQ_VNNI256
#pragma GCC unroll 2
      for (int i2 = 0; i2 < L::PER; ++i2) {
        const __m256i sc = bytes_i32<F::SIGNED>(chunk + L::SC + kTile * (blk * L::PER + i2) + 8 * h);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) tk[r * NH] = _mm256_add_epi32(tk[r * NH], _mm256_mullo_epi32(isum[r][i2], sc));
      }
#endif
      return;
    }
    // The other formats: one sub-block per block (L::PER == 1), d and m (or z) per block.
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      __m256& ar = acc[r * stride_acc];
      ar = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][0]), _mm256_mul_ps(dv, _mm256_set1_ps(s[r * nb + b])), ar);
      if (F::OFFSET) ar = _mm256_fmadd_ps(dmv, _mm256_set1_ps(ss[r * nb + b]), ar);
    }
  }

  // kK, after a super-block's blocks: T (less the zero point's part) and O into acc, for half h.
  inline void finish_k(const uint8_t* chunk, int64_t sb, int h, __m256 dv, __m256 dmv, const float* s,
                       const int16_t* bs, __m256* acc, int stride_acc) {
    constexpr int NP = L::NSUB / 2;
    const int64_t nsb = k / F::SBK, nsub = k / F::SUB;
    __m256i pairs[NP];
    if constexpr (!F::OFFSET && !kSigned)
      for (int j = 0; j < NP; ++j)
        pairs[j] = byte_pairs<F::SIGNED>(chunk + L::SC + kTile * 2 * j + 8 * h, chunk + L::SC + kTile * (2 * j + 1) + 8 * h);
    if constexpr (F::OFFSET)
      for (int j = 0; j < NP; ++j)
        pairs[j] = byte_pairs<false>(chunk + L::MN + kTile * 2 * j + 8 * h, chunk + L::MN + kTile * (2 * j + 1) + 8 * h);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const int16_t* br = bs + r * nsub + sb * L::NSUB;
      __m256i t = tk[r * NH], c = _mm256_setzero_si256();
      if constexpr (!kSigned) {
        for (int j = 0; j < NP; ++j) {
          int32_t b2;
          std::memcpy(&b2, br + 2 * j, 4);
          c = pair_dot(c, pairs[j], _mm256_set1_epi32(b2));
        }
        if constexpr (!F::OFFSET) t = _mm256_sub_epi32(t, _mm256_slli_epi32(c, kZeroShift<FMT>));
      }
      const __m256 sr = _mm256_set1_ps(s[r * nsb + sb]);
      __m256& ar = acc[r * stride_acc];
      ar = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_mul_ps(dv, sr), ar);
      if constexpr (F::OFFSET) ar = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(c), _mm256_mul_ps(dmv, sr), ar);
    }
  }

  void run(const uint8_t* w, int64_t nsb, const float* s, const float* ss, const int32_t* zs, const int16_t* bs,
           float* out, int64_t ldo, int64_t lanes) {
    const int64_t ahead = prefetch_distance();
    for (int h0 = 0; h0 < 2 && 8 * h0 < lanes; h0 += NH) {
      __m256 acc[MR * NH];
      __m256i tsum[MR * NH];
#pragma GCC unroll 8
      for (int r = 0; r < MR * NH; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t* chunk = w + sb * L::CHUNK;
        if (h0 == 0 && ahead) prefetch_ahead<L::CHUNK>(chunk + ahead);
        __m256 dv[NH], dmv[NH];
        for (int hh = 0; hh < NH; ++hh) {
          dv[hh] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + L::D + 16 * (h0 + hh))));
          dmv[hh] = F::OFFSET ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + L::DM + 16 * (h0 + hh))))
                              : _mm256_setzero_ps();
        }
        if constexpr (kK) {
#pragma GCC unroll 8
          for (int r = 0; r < MR * NH; ++r) tsum[r] = _mm256_setzero_si256();
        }
        for (int blk = 0; blk < L::NBLK; ++blk) {
          const int64_t b = sb * L::NBLK + blk;
          for (int hh = 0; hh < NH; ++hh) {
            tk = tsum + hh;
            block_half(chunk, blk, b, h0 + hh, dv[hh], dmv[hh], s, ss, zs, acc + hh, NH);
          }
        }
        if constexpr (kK) {
          for (int hh = 0; hh < NH; ++hh) {
            tk = tsum + hh;
            finish_k(chunk, sb, h0 + hh, dv[hh], dmv[hh], s, bs, acc + hh, NH);
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        alignas(32) float buf[kTile];
        for (int hh = 0; hh < NH; ++hh) _mm256_store_ps(buf + 8 * hh, acc[r * NH + hh]);
        const int64_t n_out = std::min<int64_t>(8 * NH, lanes - 8 * h0);
        std::memcpy(out + r * ldo + 8 * h0, buf, sizeof(float) * static_cast<size_t>(n_out));
      }
    }
  }
};
#endif

#if SLUICE_KQ_VNNI512
// Input rows per pass of the 512-bit tile: one int32 accumulator per row and sub-block of a block
// of 32 plus one float32 one per row must fit the 32 registers. Measured with bench/kquant_ab.py
// on a 2-core AVX-512 Xeon, 2026-12-06: Q4_K 12 rows 0.92-0.96x the time of 8; Q6_K (two
// sub-blocks) 6 rows 1.03-1.42x the time of 8. With T per row as well (the formats with sub-block
// scales), on a 2-core EPYC, 2026-12-07: Q4_K 10 or 8 rows and Q6_K 6 or 5 within the host's
// noise of 12 and 8 (0.83-1.08x), so the counts stayed. -DSLUICE_KQ_ROWS=R sets one count for all.
template <int FMT> constexpr int64_t rows_vnni() {
#ifdef SLUICE_KQ_ROWS
  return SLUICE_KQ_ROWS;
#else
  return Lay<FMT>::PER == 1 ? 12 : 8;
#endif
}

template <int F, int W> inline __m512i field_to4_512(__m512i v) {
  const __m512i keep = _mm512_set1_epi8(static_cast<char>(((1 << W) - 1) << 4));
  if constexpr (F < 4) return _mm512_and_si512(_mm512_slli_epi16(v, 4 - F), keep);
  else if constexpr (F > 4) return _mm512_and_si512(_mm512_srli_epi16(v, F - 4), keep);
  else return _mm512_and_si512(v, keep);
}

// Group G (k = 4G .. 4G + 3) of all 16 lanes: values as bytes, lane r in 32-bit lane r.
template <int VB, int G, int GRID> inline __m512i group_values512(__m512i nib, const __m512i* hi) {
  if constexpr (VB == 2) return _mm512_and_si512(_mm512_srli_epi16(nib, 2 * (G % 4)), _mm512_set1_epi8(3));
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i v = (G % 2) ? _mm512_and_si512(_mm512_srli_epi16(nib, 4), low4) : _mm512_and_si512(nib, low4);
  constexpr int W = VB - 4, P = W > 0 ? 8 / W : 1;
  if constexpr (W > 0) v = _mm512_or_si512(v, field_to4_512<W * (G % P), W>(hi[G / P]));
  if constexpr (GRID) v = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIq4Grid))), v);
  return v;
}

// MR input rows against one tile, all 16 lanes in one 512-bit vector. vpdpbusd multiplies the
// unsigned values by the signed int8 inputs and adds each lane's four products into its int32
// sum: the weights are the unsigned operand as stored (no sign trick or offset is needed), and
// the sums are exact in int32 (32 products of at most 63 * 128 per sub-block), so they equal the
// AVX2 path's and the portable loop's. The float operations per lane are the AVX2 path's, in its
// order: the same bits.
template <int FMT, int MR> struct TileVnni {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  static constexpr bool kK = kQ8K<FMT>;

  const int8_t* a; int64_t k;
  __m512i isum[MR][L::PER];
  __m512i tsum[MR];   // kK: T per row over the super-block

  template <int G> inline void group(const uint8_t* body, const __m512i* hi, const int8_t* ab) {
    const __m512i nib = _mm512_loadu_si512(body + 64 * (G / L::GPR));
    const __m512i v = group_values512<F::VB, G, F::GRID>(nib, hi);
    constexpr int i2 = (4 * G) / F::SUB;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t a4;
      std::memcpy(&a4, ab + r * k + 4 * G, 4);
      isum[r][i2] = _mm512_dpbusd_epi32(isum[r][i2], v, _mm512_set1_epi32(a4));
    }
  }

  inline void block(const uint8_t* chunk, int blk, int64_t b, __m512 dv, __m512 dmv, const float* s,
                    const float* ss, const int32_t* zs, __m512* acc) {
    const int64_t nb = k / kBlock, n16 = k / 16;
    const uint8_t* body = chunk + L::BODY + blk * L::BLK;
    const int8_t* ab = a + b * kBlock;
    __m512i hi[2];
    for (int pb = 0; pb < F::VB - 4; ++pb) hi[pb] = _mm512_loadu_si512(body + 256 + 64 * pb);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
      for (int i2 = 0; i2 < L::PER; ++i2)
        isum[r][i2] = F::OFFSET ? _mm512_setzero_si512()
                      : _mm512_set1_epi32(kK ? zs[r * (k / F::SUB) + b * L::PER + i2] : zs[r * n16 + 2 * b + i2]);
    group<0>(body, hi, ab); group<1>(body, hi, ab); group<2>(body, hi, ab); group<3>(body, hi, ab);
    group<4>(body, hi, ab); group<5>(body, hi, ab); group<6>(body, hi, ab); group<7>(body, hi, ab);
    if constexpr (kK) {
#pragma GCC unroll 2
      for (int i2 = 0; i2 < L::PER; ++i2) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + L::SC + kTile * (blk * L::PER + i2)));
        const __m512i sc = F::SIGNED ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw);
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) tsum[r] = _mm512_add_epi32(tsum[r], _mm512_mullo_epi32(isum[r][i2], sc));
      }
      return;
    }
    // The other formats: one sub-block per block (L::PER == 1), d and m (or z) per block.
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][0]), _mm512_mul_ps(dv, _mm512_set1_ps(s[r * nb + b])), acc[r]);
      if (F::OFFSET) acc[r] = _mm512_fmadd_ps(dmv, _mm512_set1_ps(ss[r * nb + b]), acc[r]);
    }
  }

  // Two [lane 16] rows of unsigned bytes as int16 pairs, (row0, row1) in each 32-bit lane (as byte_pairs).
  static inline __m512i byte_pairs512(const uint8_t* row0, const uint8_t* row1) {
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row0));
    const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row1));
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(r0, r1), _mm_unpacklo_epi8(r0, r1)));
  }

  // kK, after a super-block's blocks: T (its sums started at the zero point's part, -z B_i, as
  // the per-32 path's do) and O into acc.
  inline void finish_k(const uint8_t* chunk, int64_t sb, __m512 dv, __m512 dmv, const float* s, const int16_t* bs,
                       __m512* acc) {
    constexpr int NP = L::NSUB / 2;
    const int64_t nsb = k / F::SBK, nsub = k / F::SUB;
    __m512i pairs[NP];
    if constexpr (F::OFFSET)
      for (int j = 0; j < NP; ++j)
        pairs[j] = byte_pairs512(chunk + L::MN + kTile * 2 * j, chunk + L::MN + kTile * (2 * j + 1));
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 sr = _mm512_set1_ps(s[r * nsb + sb]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(tsum[r]), _mm512_mul_ps(dv, sr), acc[r]);
      if constexpr (F::OFFSET) {
        const int16_t* br = bs + r * nsub + sb * L::NSUB;
        __m512i o = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = 0; j < NP; ++j) {
          int32_t b2;
          std::memcpy(&b2, br + 2 * j, 4);
          o = _mm512_dpwssd_epi32(o, pairs[j], _mm512_set1_epi32(b2));
        }
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(o), _mm512_mul_ps(dmv, sr), acc[r]);
      }
    }
  }

  void run(const uint8_t* w, int64_t nsb, const float* s, const float* ss, const int32_t* zs, const int16_t* bs,
           float* out, int64_t ldo, int64_t lanes) {
    const int64_t ahead = prefetch_distance();
    __m512 acc[MR];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* chunk = w + sb * L::CHUNK;
      if (ahead) prefetch_ahead<L::CHUNK>(chunk + ahead);
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + L::D)));
      const __m512 dmv = F::OFFSET ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + L::DM)))
                                   : _mm512_setzero_ps();
      if constexpr (kK) {
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) tsum[r] = _mm512_setzero_si512();
      }
      for (int blk = 0; blk < L::NBLK; ++blk) block(chunk, blk, sb * L::NBLK + blk, dv, dmv, s, ss, zs, acc);
      if constexpr (kK) finish_k(chunk, sb, dv, dmv, s, bs, acc);
    }
    const __mmask16 keep = static_cast<__mmask16>((1u << lanes) - 1u);
    for (int r = 0; r < MR; ++r) _mm512_mask_storeu_ps(out + r * ldo, keep, acc[r]);
  }
};

// TileVnni<FMT, mr>::run for a run-time mr in 1..MR.
template <int FMT, int MR> inline void run_vnni(int64_t mr, const int8_t* a, int64_t k, const uint8_t* w, int64_t nsb,
                                                 const float* s, const float* ss, const int32_t* zs, const int16_t* bs,
                                                 float* out, int64_t ldo, int64_t lanes) {
  if constexpr (MR > 1) {
    if (mr < MR) return run_vnni<FMT, MR - 1>(mr, a, k, w, nsb, s, ss, zs, bs, out, ldo, lanes);
  }
  TileVnni<FMT, MR>{a, k}.run(w, nsb, s, ss, zs, bs, out, ldo, lanes);
}
#endif

// fn(std::integral_constant<int, FMT>) for the format with GGML type id `fmt`, otherwise() for
// any other id: the one list of formats, which every entry point goes through.
template <typename Fn, typename Else> auto with_format_or(int64_t fmt, Fn&& fn, Else&& otherwise) {
  switch (fmt) {
    case kQ5_0: return fn(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return fn(std::integral_constant<int, kQ5_1>{});
    case kQ2_K: return fn(std::integral_constant<int, kQ2_K>{});
    case kQ3_K: return fn(std::integral_constant<int, kQ3_K>{});
    case kQ4_K: return fn(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return fn(std::integral_constant<int, kQ5_K>{});
    case kQ6_K: return fn(std::integral_constant<int, kQ6_K>{});
    case kIQ4_NL: return fn(std::integral_constant<int, kIQ4_NL>{});
    case kIQ4_XS: return fn(std::integral_constant<int, kIQ4_XS>{});
    default: return otherwise();
  }
}

template <typename Fn> auto with_format(int64_t fmt, Fn&& fn) {
  return with_format_or(fmt, fn, [&]() -> decltype(fn(std::integral_constant<int, kQ4_K>{})) {
    TORCH_CHECK(false, "kquant: unknown format ", fmt,
                " (GGML type ids: Q5_0 6, Q5_1 7, Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20, IQ4_XS 23)");
  });
}

int64_t chunk_bytes(int64_t fmt) {
  return with_format(fmt, [](auto f) { return Lay<decltype(f)::value>::CHUNK; });
}

int64_t super_block(int64_t fmt) {
  return with_format(fmt, [](auto f) -> int64_t { return Fmt<decltype(f)::value>::SBK; });
}

void check_weight(const torch::Tensor& w, int64_t fmt, int64_t n, int64_t k) {
  const int64_t chunk = chunk_bytes(fmt), sbk = super_block(fmt);
  TORCH_CHECK(n > 0 && k > 0 && k % sbk == 0, "kquant: K must be a positive multiple of ", sbk, ", got ", k);
  const int64_t tiles = (n + kTile - 1) / kTile;
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.numel() == tiles * (k / sbk) * chunk,
              "kquant: packed weight does not match N = ", n, ", K = ", k, ", format ", fmt);
}

// s: [row][block of 32] (or [row][super-block] for kQ8K formats); ss, zs as kquant_linear forms
// them for the other formats, bs for kQ8K ones (the arrays a format does not use may be null).
template <int FMT>
void run_tiles(const uint8_t* wp, int64_t rows, int64_t n, int64_t k, const int8_t* ap, const float* sp,
               const float* ssp, const int32_t* zsp, const int16_t* bsp, float* op) {
  using L = Lay<FMT>;
  const int64_t nb = k / kBlock, n16 = k / 16, nsb = k / Fmt<FMT>::SBK, nsub = k / Fmt<FMT>::SUB;
  const int64_t tiles = (n + kTile - 1) / kTile, wtile = nsb * L::CHUNK;
  const int64_t ns = kQ8K<FMT> ? nsb : nb, nzs = kQ8K<FMT> ? nsub : n16;
  // Row r0's part of each per-row array (null stays null).
  const auto at = [](auto* p, int64_t off) { return p ? p + off : p; };
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t p0 = 0; p0 < rows; p0 += kPanel) {
      const int64_t p1 = std::min(rows, p0 + kPanel);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t lanes = std::min(kTile, n - t * kTile);
        const uint8_t* wt = wp + t * wtile;
#if SLUICE_KQ_VNNI512
        constexpr int64_t kRows = rows_vnni<FMT>();
        static_assert(kRows >= 1 && kRows <= 12, "SLUICE_KQ_ROWS: 1 to 12 rows per pass");
        for (int64_t r0 = p0; r0 < p1; r0 += kRows)
          run_vnni<FMT, kRows>(std::min<int64_t>(kRows, p1 - r0), ap + r0 * k, k, wt, nsb, sp + r0 * ns,
                               at(ssp, r0 * nb), at(zsp, r0 * nzs), at(bsp, r0 * nsub), op + r0 * n + t * kTile, n,
                               lanes);
#elif SLUICE_KQ_AVX2
        constexpr int64_t kRows = rows_avx2<Fmt<FMT>::VB>();
        static_assert(kRows >= 1 && kRows <= 6, "SLUICE_KQ_ROWS: 1 to 6 rows per pass");
        for (int64_t r0 = p0; r0 < p1; r0 += kRows) {
          const int64_t mr = std::min<int64_t>(kRows, p1 - r0);
          float* o = op + r0 * n + t * kTile;
          const int8_t* ar = ap + r0 * k;
          const float *sr = sp + r0 * ns, *ssr = at(ssp, r0 * nb);
          const int32_t* zsr = at(zsp, r0 * nzs);
          const int16_t* bsr = at(bsp, r0 * nsub);
          switch (mr) {
            case 6: TileAvx2<FMT, 6, 1>{ar, k}.run(wt, nsb, sr, ssr, zsr, bsr, o, n, lanes); break;
            case 5: TileAvx2<FMT, 5, 1>{ar, k}.run(wt, nsb, sr, ssr, zsr, bsr, o, n, lanes); break;
            case 4: TileAvx2<FMT, 4, 1>{ar, k}.run(wt, nsb, sr, ssr, zsr, bsr, o, n, lanes); break;
            case 3: TileAvx2<FMT, 3, 1>{ar, k}.run(wt, nsb, sr, ssr, zsr, bsr, o, n, lanes); break;
            case 2: TileAvx2<FMT, 2, 1>{ar, k}.run(wt, nsb, sr, ssr, zsr, bsr, o, n, lanes); break;
            default: TileAvx2<FMT, 1, 2>{ar, k}.run(wt, nsb, sr, ssr, zsr, bsr, o, n, lanes); break;
          }
        }
#else
        tile_scalar<FMT>(p1 - p0, wt, nsb, ap + p0 * k, sp + p0 * ns, at(ssp, p0 * nb), at(zsp, p0 * nzs),
                         at(bsp, p0 * nsub), k, op + p0 * n + t * kTile, n, lanes);
#endif
      }
    }
  });
}

template <int FMT>
void rows_of(const uint8_t* wp, const int64_t* ip, int64_t count, int64_t k, float* op) {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  const int64_t nsb = k / F::SBK, wtile = nsb * L::CHUNK;
  for (int64_t r = 0; r < count; ++r) {
    const int64_t t = ip[r] / kTile, lane = ip[r] % kTile;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* chunk = wp + t * wtile + sb * L::CHUNK;
      for (int blk = 0; blk < L::NBLK; ++blk) {
        const uint8_t* body = chunk + L::BODY + blk * L::BLK;
        float* o = op + r * k + sb * F::SBK + blk * kBlock;
        for (int e = 0; e < kBlock; ++e) {
          const int i = blk * L::PER + e / F::SUB;
          const float scale = sub_scale<FMT>(chunk, lane, i);
          const int u = value<FMT>(body, lane, e);
          // gguf's order: D q + M (D q exact for these sizes), D (u - z) rounded once.
          if (F::OFFSET) {
            const float dq = scale * static_cast<float>(u);
            o[e] = dq + sub_offset<FMT>(chunk, lane, i);
          } else {
            o[e] = scale * static_cast<float>(u - F::ZERO);
          }
        }
      }
    }
  }
}

// x [M, K] -> a [M, K] int8 and s [M, K/256], rounded per row and super-block of 256 as
// quantize_rows rounds per 32 (x ~ s a, |a| <= 127, half to even), and bs [M, K/sub] int16, the
// sums of a over each sub-block of `sub` (|B| <= 32 * 127).
void round_rows256(const float* x, int64_t rows, int64_t k, int64_t sub, int8_t* a, float* s, int16_t* bs) {
  constexpr int64_t kSuper = 256;
  const int64_t nsb = k / kSuper, nsub = k / sub;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const float* xb = x + r * k + sb * kSuper;
        int8_t* ab = a + r * k + sb * kSuper;
        float amax = 0.f;
        alignas(64) int32_t q[kSuper];
#if SLUICE_KQ_VNNI512
        __m512 m = _mm512_setzero_ps();
        for (int64_t i = 0; i < kSuper; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
        amax = _mm512_reduce_max_ps(m);
        const __m512 vinv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        // cvtps rounds half to even, as nearbyint; |x| <= amax keeps each within -127 .. 127.
        for (int64_t i = 0; i < kSuper; i += 16)
          _mm512_store_si512(q + i, _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv)));
#elif SLUICE_KQ_AVX2
        __m256 m = _mm256_setzero_ps();
        const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        for (int64_t i = 0; i < kSuper; i += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(xb + i), abs_mask));
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, m);
        for (float v : lanes) amax = std::max(amax, v);
        const __m256 vinv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        for (int64_t i = 0; i < kSuper; i += 8)
          _mm256_store_si256(reinterpret_cast<__m256i*>(q + i), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + i), vinv)));
#else
        for (int64_t i = 0; i < kSuper; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f;
        for (int64_t i = 0; i < kSuper; ++i)
          q[i] = static_cast<int32_t>(std::fmin(127.f, std::fmax(-127.f, std::nearbyint(xb[i] * inv))));
#endif
        for (int64_t i = 0; i < kSuper; ++i) ab[i] = static_cast<int8_t>(std::min(127, std::max(-127, q[i])));
        s[r * nsb + sb] = amax / 127.f;
        for (int64_t j = 0; j < kSuper / sub; ++j) {
          int32_t t = 0;
          for (int64_t e = 0; e < sub; ++e) t += ab[j * sub + e];
          bs[r * nsub + sb * (kSuper / sub) + j] = static_cast<int16_t>(t);
        }
      }
    }
  });
}

}  // namespace

// y [M, n] = x [M, K] @ W^T for W packed as above in format `fmt` (a GGML type id).
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "kquant: x must be a contiguous float32 [M, K]");
  const int64_t rows = x.size(0), k = x.size(1);
  check_weight(w, fmt, n, k);
  auto out = torch::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto a = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  int8_t* ap = a.data_ptr<int8_t>();
  const auto [q8k, z, per] = with_format(fmt, [](auto f) {
    using F = Fmt<decltype(f)::value>;
    return std::tuple<bool, int32_t, int64_t>{kQ8K<decltype(f)::value>, F::OFFSET ? 0 : F::ZERO, F::SUB};
  });
  if (q8k) {   // the formats with sub-block scales: the input per 256 (see tile_scalar)
    auto s = torch::empty({rows, k / 256}, x.options());
    auto bs = torch::empty({rows, k / per}, x.options().dtype(torch::kInt16));
    const int16_t* bsp = bs.data_ptr<int16_t>();
    round_rows256(x.data_ptr<float>(), rows, k, per, ap, s.data_ptr<float>(), bs.data_ptr<int16_t>());
    // The 512-bit tile starts a zero-point format's sub-block sums at -z B_i ([row][sub-block]):
    // one broadcast load each, where subtracting z sum_i sc_i B_i per super-block costs it a
    // vpdpwssd per pair of sub-blocks and row. The 256-bit tiles subtract that per super-block
    // (plain AVX2 widens its int16 sums by the scale, so they cannot start there).
    torch::Tensor zs;
    if (SLUICE_KQ_VNNI512 && z) {
      zs = torch::empty({rows, k / per}, x.options().dtype(torch::kInt32));
      int32_t* zp = zs.data_ptr<int32_t>();
      for (int64_t i = 0; i < rows * (k / per); ++i) zp[i] = -z * bsp[i];
    }
    with_format(fmt, [&](auto f) {
      run_tiles<decltype(f)::value>(wp, rows, n, k, ap, s.data_ptr<float>(), nullptr,
                                    zs.defined() ? zs.data_ptr<int32_t>() : nullptr, bsp, op);
    });
    return out;
  }
  const int64_t nb = k / kBlock, n16 = k / 16;
  auto s = torch::empty({rows, nb}, x.options());
  auto ss = torch::empty({rows, nb}, x.options());
  blockq_quantize_rows(x.data_ptr<float>(), rows, k, ap, s.data_ptr<float>(), ss.data_ptr<float>());
  // Zero-point formats (Q5_0, IQ4_NL): each block's integer sum starts at -z * (sum of a over
  // it), at [row][2 b] (the odd entries unused). The loops load it as their accumulator's first
  // value: the same exact sum, one subtraction fewer per row and block.
  auto zs = torch::empty({rows, n16}, x.options().dtype(torch::kInt32));   // unread without a zero point
  int32_t* zsp = zs.data_ptr<int32_t>();
  if (z) {
    for (int64_t i = 0; i < rows * n16; ++i) {
      int32_t t = 0;
      for (int64_t j = 0; j < per && i % 2 == 0; ++j) t += ap[16 * i + j];
      zsp[i] = -z * t;
    }
  }
  with_format(fmt, [&](auto f) {
    run_tiles<decltype(f)::value>(wp, rows, n, k, ap, s.data_ptr<float>(), ss.data_ptr<float>(), zsp, nullptr, op);
  });
  return out;
}

// Rows ids [T] of W dequantized, [T, K] float32, with gguf's float32 arithmetic (so its values bit for bit).
torch::Tensor kquant_rows(torch::Tensor ids, torch::Tensor w, int64_t fmt, int64_t n, int64_t k) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kInt64 && ids.is_contiguous(),
              "kquant rows: ids must be a contiguous int64 [T]");
  check_weight(w, fmt, n, k);
  const int64_t count = ids.size(0);
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t r = 0; r < count; ++r) {
    TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "kquant rows: id ", ip[r], " is outside 0..", n - 1);
  }
  auto out = torch::empty({count, k}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  with_format(fmt, [&](auto f) { rows_of<decltype(f)::value>(wp, ip, count, k, op); });
  return out;
}

namespace {

// One row lane of a (tile, super-block) chunk: its SBK values `ur`, float16 bits d (and dm), and
// its NSUB sub-block scales `sc` and minimums `mn` (each read only where the format has them).
template <int FMT>
inline void put_lane(uint8_t* chunk, int64_t lane, const uint8_t* ur, uint16_t d, uint16_t dm, const uint8_t* sc,
                     const uint8_t* mn) {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  std::memcpy(chunk + L::D + 2 * lane, &d, 2);
  if (F::OFFSET) std::memcpy(chunk + L::DM + 2 * lane, &dm, 2);
  for (int i = 0; i < L::NSUB && F::SUBSCALE; ++i) {
    chunk[L::SC + kTile * i + lane] = sc[i];
    if (F::OFFSET) chunk[L::MN + kTile * i + lane] = mn[i];
  }
  for (int blk = 0; blk < L::NBLK; ++blk) {
    uint8_t* body = chunk + L::BODY + blk * L::BLK;
    const uint8_t* ub = ur + blk * kBlock;
    if constexpr (F::VB == 2) {   // element 4 (4p + m) + j: bits 2m of byte j of the lane's 4 in row p
      for (int p = 0; p < 2; ++p)
        for (int j = 0; j < 4; ++j) {
          unsigned bits = 0;
          for (int m = 0; m < 4; ++m) bits |= (ub[4 * (4 * p + m) + j] & 3u) << (2 * m);
          body[64 * p + lane * 4 + j] = static_cast<uint8_t>(bits);
        }
      continue;
    }
    // Element 4 g + j: its low nibble in byte j of the lane's 4 in row 64 (g / 2), low half for
    // even g.
    for (int p = 0; p < 4; ++p)
      for (int j = 0; j < 4; ++j)
        body[64 * p + lane * 4 + j] = static_cast<uint8_t>((ub[8 * p + j] & 0x0F) | ((ub[8 * p + 4 + j] & 0x0F) << 4));
    // The high bits of element 4 g + j: bits W (g % P) .. of byte j of plane g / P (see the top).
    constexpr int W = std::max(F::VB - 4, 0), P = W > 0 ? 8 / W : 1;
    for (int p = 0; p < W; ++p)
      for (int j = 0; j < 4; ++j) {
        unsigned bits = 0;
        for (int m = 0; m < P; ++m) bits |= ((ub[4 * (P * p + m) + j] >> 4) & ((1u << W) - 1)) << (W * m);
        body[256 + 64 * p + lane * 4 + j] = static_cast<uint8_t>(bits);
      }
  }
}

// Each (tile, super-block) chunk of rows [0, n) zeroed, then lane(chunk, row, lane, sb, scratch) for
// each of its rows; tiles in parallel, `Scratch` a per-thread work area.
template <int FMT, typename Scratch, typename Lane>
void for_each_lane(int64_t n, int64_t k, uint8_t* out, const Lane& lane_fn) {
  using L = Lay<FMT>;
  const int64_t nsb = k / Fmt<FMT>::SBK, tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t sb = 0; sb < nsb; ++sb) {
        uint8_t* chunk = out + (t * nsb + sb) * L::CHUNK;
        std::memset(chunk, 0, L::CHUNK);
        for (int64_t lane = 0; lane < kTile && t * kTile + lane < n; ++lane)
          lane_fn(chunk, t * kTile + lane, lane, sb, scratch);
      }
    }
  });
}

// The parts (kernels/cpu_kquant.py's doc: u [N, K] values, d / dm [N, K/SBK] float16 bits,
// sc and mn [N, K/SUB] bytes) of rows [0, n) -> the layout above.
template <int FMT>
void pack_tiles(const uint8_t* u, const uint16_t* d, const uint16_t* dm, const uint8_t* sc, const uint8_t* mn,
                int64_t n, int64_t k, uint8_t* out) {
  using F = Fmt<FMT>; using L = Lay<FMT>;
  const int64_t nsb = k / F::SBK, nsub = k / F::SUB;
  struct None {};
  for_each_lane<FMT, None>(n, k, out, [&](uint8_t* chunk, int64_t row, int64_t lane, int64_t sb, None&) {
    put_lane<FMT>(chunk, lane, u + row * k + sb * F::SBK, d[row * nsb + sb], F::OFFSET ? dm[row * nsb + sb] : 0,
                  F::SUBSCALE ? sc + row * nsub + sb * L::NSUB : nullptr,
                  F::SUBSCALE && F::OFFSET ? mn + row * nsub + sb * L::NSUB : nullptr);
  });
}

// GGML's 2-bit planes (Q2_K's and Q3_K's low bits, Q6_K's high ones) -> t [256]: element
// e = 128 h + 32 s + l is bits 2 s of byte 32 h + l. Loops with l innermost, so that they vectorize
// (element by element, this was most of a Q6_K file's packing time at load).
inline void two_bits_all(const uint8_t* q, uint8_t* t) {
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int l = 0; l < 32; ++l) t[128 * h + 32 * s + l] = static_cast<uint8_t>((q[32 * h + l] >> (2 * s)) & 3);
}

// One GGUF block -> its values u [SBK], d / dm bits and sub-block scales sc / minimums mn, as
// engine/models/kquant.py's gguf_parts reads them (the tests hold the two paths equal).
template <int FMT>
inline void gguf_block(const uint8_t* b, uint8_t* u, uint16_t& d, uint16_t& dm, uint8_t* sc, uint8_t* mn) {
  std::memcpy(&d, b, 2);
  dm = 0;
  if constexpr (FMT == kQ5_0 || FMT == kQ5_1) {
    const int at = FMT == kQ5_0 ? 2 : 4;
    if (FMT == kQ5_1) std::memcpy(&dm, b + 2, 2);
    const uint8_t *qh = b + at, *qs = b + at + 4;
    for (int i = 0; i < 16; ++i) {
      u[i] = qs[i] & 15;
      u[16 + i] = qs[i] >> 4;
    }
    for (int e = 0; e < 32; ++e) u[e] |= static_cast<uint8_t>(((qh[e / 8] >> (e % 8)) & 1) << 4);
  } else if constexpr (FMT == kIQ4_NL) {
    for (int i = 0; i < 16; ++i) {
      u[i] = b[2 + i] & 15;
      u[16 + i] = b[2 + i] >> 4;
    }
  } else if constexpr (FMT == kIQ4_XS) {
    // d, 2 bytes of the scales' high 2 bits (sub-block i at bits 2i), 4 of their low nibbles
    // (sub-block i in nibble i % 2 of byte i / 2), then per sub-block of 32 16 bytes: elements
    // 0-15 in the low nibbles, 16-31 in the high ones. A scale is its 6 bits minus 32.
    const unsigned high = static_cast<unsigned>(b[2]) | (static_cast<unsigned>(b[3]) << 8);
    for (int i = 0; i < 8; ++i) {
      const int ls = static_cast<int>(((b[4 + i / 2] >> (4 * (i % 2))) & 15) | (((high >> (2 * i)) & 3) << 4));
      sc[i] = static_cast<uint8_t>(static_cast<int8_t>(ls - 32));
      for (int j = 0; j < 16; ++j) {
        u[32 * i + j] = b[8 + 16 * i + j] & 15;
        u[32 * i + 16 + j] = b[8 + 16 * i + j] >> 4;
      }
    }
  } else if constexpr (FMT == kQ3_K) {
    // hmask [32], qs [64], 12 scale bytes, d. Scale i: low nibble of byte i % 8 (high nibble for
    // i >= 8), top 2 bits at bits 2 (i / 4) of byte 8 + i % 4; minus 32. Element e = 128 h + 32 s + l:
    // bits 2 s of qs[32 h + l], and bit e / 32 of hmask[l] set means +4 (u = q + 4, z = 4).
    const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
    std::memcpy(&d, b + 108, 2);
    for (int i = 0; i < 16; ++i) {
      const int lo = (s[i % 8] >> (4 * (i / 8))) & 15, top = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
      sc[i] = static_cast<uint8_t>(static_cast<int8_t>((lo | (top << 4)) - 32));
    }
    two_bits_all(qs, u);
    for (int j = 0; j < 8; ++j)
      for (int l = 0; l < 32; ++l) u[32 * j + l] |= static_cast<uint8_t>(((hm[l] >> j) & 1) << 2);
  } else if constexpr (FMT == kQ2_K) {
    // 16 scale bytes (sc the low nibble, mn the high one), qs [64], d, dmin. Element
    // e = 128 h + 32 s + l: bits 2 s of qs[32 h + l]; sub-block e / 16.
    const uint8_t* qs = b + 16;
    std::memcpy(&d, b + 80, 2);
    std::memcpy(&dm, b + 82, 2);
    for (int i = 0; i < 16; ++i) {
      sc[i] = b[i] & 15;
      mn[i] = b[i] >> 4;
    }
    two_bits_all(qs, u);
  } else if constexpr (FMT == kQ6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    std::memcpy(&d, b + 208, 2);
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 64; ++i) {
        u[128 * h + i] = ql[64 * h + i] & 15;
        u[128 * h + 64 + i] = ql[64 * h + i] >> 4;
      }
    uint8_t high[256];
    two_bits_all(qh, high);
    for (int e = 0; e < 256; ++e) u[e] |= static_cast<uint8_t>(high[e] << 4);
    std::memcpy(sc, b + 192, 16);
  } else {   // Q4_K, Q5_K
    std::memcpy(&dm, b + 2, 2);
    const uint8_t* s = b + 4;
    for (int i = 0; i < 4; ++i) {
      sc[i] = s[i] & 63;
      mn[i] = s[4 + i] & 63;
      sc[4 + i] = static_cast<uint8_t>((s[8 + i] & 15) | ((s[i] >> 6) << 4));
      mn[4 + i] = static_cast<uint8_t>((s[8 + i] >> 4) | ((s[4 + i] >> 6) << 4));
    }
    const uint8_t* qs = b + (FMT == kQ4_K ? 16 : 48);
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < 32; ++i) {
        u[64 * r + i] = qs[32 * r + i] & 15;
        u[64 * r + 32 + i] = qs[32 * r + i] >> 4;
      }
    if constexpr (FMT == kQ5_K) {
      const uint8_t* qh = b + 16;
      for (int j = 0; j < 8; ++j)
        for (int i = 0; i < 32; ++i) u[32 * j + i] |= static_cast<uint8_t>(((qh[i] >> j) & 1) << 4);
    }
  }
}

// A GGUF tensor's rows of blocks (rows[r]: K / SBK blocks) -> the layout above, without the parts in between.
template <int FMT>
void pack_gguf_tiles(const std::vector<const uint8_t*>& rows, int64_t k, uint8_t* out) {
  const int64_t bb = Fmt<FMT>::BYTES;
  struct Block { uint8_t u[256], sc[16], mn[16]; };
  const auto n = static_cast<int64_t>(rows.size());
  for_each_lane<FMT, Block>(n, k, out, [&](uint8_t* chunk, int64_t row, int64_t lane, int64_t sb, Block& b) {
    uint16_t d, dm;
    gguf_block<FMT>(rows[row] + sb * bb, b.u, d, dm, b.sc, b.mn);
    put_lane<FMT>(chunk, lane, b.u, d, dm, b.sc, b.mn);
  });
}

}  // namespace

// The parts of a weight -> its packed layout, flat uint8 (kernels/cpu_kquant.py checks the parts
// first; tests hold this to its own Python unpacking). Absent parts are empty tensors.
torch::Tensor kquant_pack(torch::Tensor u, torch::Tensor d, torch::Tensor dm, torch::Tensor sc, torch::Tensor mn,
                          int64_t fmt) {
  TORCH_CHECK(u.dim() == 2 && u.scalar_type() == torch::kUInt8 && u.is_contiguous(), "kquant pack: u must be uint8 [N, K]");
  const int64_t n = u.size(0), k = u.size(1), chunk = chunk_bytes(fmt), sbk = super_block(fmt);
  TORCH_CHECK(k % sbk == 0, "kquant pack: K must be a multiple of ", sbk);
  for (const auto* t : {&d, &dm, &sc, &mn}) TORCH_CHECK(t->is_contiguous(), "kquant pack: parts must be contiguous");
  auto out = torch::empty({(n + kTile - 1) / kTile * (k / sbk) * chunk}, u.options());
  const uint8_t* up = u.data_ptr<uint8_t>();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* dmp = dm.numel() ? reinterpret_cast<const uint16_t*>(dm.data_ptr()) : nullptr;
  const uint8_t* scp = sc.numel() ? static_cast<const uint8_t*>(sc.data_ptr()) : nullptr;
  const uint8_t* mnp = mn.numel() ? static_cast<const uint8_t*>(mn.data_ptr()) : nullptr;
  uint8_t* op = out.data_ptr<uint8_t>();
  with_format(fmt, [&](auto f) { pack_tiles<decltype(f)::value>(up, dp, dmp, scp, mnp, n, k, op); });
  return out;
}

torch::Tensor kquant_pack_gguf_parts(const std::vector<torch::Tensor>& parts, int64_t fmt, int64_t k);

// A GGUF tensor's raw blocks (uint8, n rows of K / SBK blocks each, in GGML's block layout) ->
// the packed layout: the same bytes as kquant_pack of engine/models/kquant.py's gguf_parts, in one
// pass over the file's bytes. kquant_pack_gguf_parts of the one tensor (the loader calls that;
// this form is what bench/kquant_ab.py binds in every source it builds, older ones included).
torch::Tensor kquant_pack_gguf(torch::Tensor blocks, int64_t fmt, int64_t n, int64_t k) {
  const int64_t sbk = super_block(fmt);
  TORCH_CHECK(n > 0 && k > 0 && k % sbk == 0, "kquant pack: K must be a positive multiple of ", sbk, ", got ", k);
  const int64_t bb = with_format(fmt, [](auto f) -> int64_t { return Fmt<decltype(f)::value>::BYTES; });
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() && blocks.numel() == n * (k / sbk) * bb,
              "kquant pack: ", blocks.numel(), " bytes of GGML type ", fmt, " do not hold a [", n, ", ", k, "] tensor");
  return kquant_pack_gguf_parts({blocks.view({n, -1})}, fmt, k);
}

// The same for a weight stacked by rows from parts in one format (one tensor, or a fused
// projection's q, k, v or gate, up; each [rows, K / SBK * block bytes] uint8): packed from each
// part's bytes where they are (the file's mapping), without a copy of their concatenation first.
torch::Tensor kquant_pack_gguf_parts(const std::vector<torch::Tensor>& parts, int64_t fmt, int64_t k) {
  const int64_t sbk = super_block(fmt);
  TORCH_CHECK(k > 0 && k % sbk == 0, "kquant pack: K must be a positive multiple of ", sbk, ", got ", k);
  const int64_t bb = with_format(fmt, [](auto f) -> int64_t { return Fmt<decltype(f)::value>::BYTES; });
  std::vector<const uint8_t*> rows;
  for (size_t i = 0; i < parts.size(); ++i) {
    const torch::Tensor& b = parts[i];
    TORCH_CHECK(b.scalar_type() == torch::kUInt8 && b.is_contiguous() && b.dim() == 2 && b.size(1) == k / sbk * bb,
                "kquant pack: part ", i, " must be contiguous uint8 [rows, ", k / sbk * bb, "] (GGML type ", fmt,
                ", K = ", k, ")");
    const uint8_t* p = b.data_ptr<uint8_t>();
    for (int64_t r = 0; r < b.size(0); ++r) rows.push_back(p + r * b.size(1));
  }
  TORCH_CHECK(!rows.empty(), "kquant pack: no rows");
  const auto n = static_cast<int64_t>(rows.size());
  auto out = torch::empty({(n + kTile - 1) / kTile * (k / sbk) * chunk_bytes(fmt)}, torch::dtype(torch::kUInt8));
  uint8_t* op = out.data_ptr<uint8_t>();
  with_format(fmt, [&](auto f) { pack_gguf_tiles<decltype(f)::value>(rows, k, op); });
  return out;
}

// Bytes of one (tile, super-block) chunk of format `fmt` (for the packing code's checks).
int64_t kquant_chunk_bytes(int64_t fmt) { return chunk_bytes(fmt); }

// Whether `fmt` (a GGML type id) is one of these formats (kernels/cpu_stack.cpp checks its parts' kinds).
bool kquant_known(int64_t fmt) {
  return with_format_or(fmt, [](auto) { return true; }, [] { return false; });
}

// The integer path compiled in: "avx2" (also on AVX-512 hosts) or "portable".
std::string kquant_isa() {
  return SLUICE_KQ_VNNI512 ? "avx512vnni" : SLUICE_KQ_VNNI256 ? "avxvnni" : SLUICE_KQ_AVX2 ? "avx2" : "portable";
}
