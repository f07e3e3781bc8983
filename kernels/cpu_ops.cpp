// The float32 CPU ops a decoder layer is made of: norms, RoPE, SwiGLU, the KV store, paged
// attention (and its dense-cache form for EAGLE's draft layer), oneDNN's packed float32 product,
// and the sampler's row reductions. No model lives here: cpu_stack.cpp composes these ops into
// layer stacks from a per-architecture description, and this file's module binds both.
//
// Each op has a torch reference it is tested against (tests/unit/test_cpu_ops.py):
//   rms_norm        F.rms_norm
//   add_rms_norm    (h + d, F.rms_norm(h + d))
//   rotary          models.rope.apply_rotary (rotate-half layout)
//   silu_mul        F.silu(gate) * up over a fused [T, 2I] gate/up
//   store_kv        attention.torch_backend.store_kv
//   paged_decode    attention.torch_backend's decode (one query token per sequence, GQA; with a
//                   soft-cap, the backend's _short)
// Every row is computed on its own, in an order that does not depend on the batch: a sequence's
// bits are the same alone and among others. The KV caches hold float32 or float16
// (kv_cache_dtype); float16 values are widened exactly where they are read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

torch::Tensor blockq_linear(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                            int64_t bits, int64_t n);
torch::Tensor blockq_rows(torch::Tensor ids, torch::Tensor w, torch::Tensor d, torch::Tensor m,
                          int64_t bits, int64_t n, int64_t k);
std::string blockq_isa();
std::vector<torch::Tensor> blockq_pack_gguf(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types,
                                            int64_t bits, int64_t k);
torch::Tensor kquant_linear(torch::Tensor x, torch::Tensor w, int64_t fmt, int64_t n);
torch::Tensor kquant_rows(torch::Tensor ids, torch::Tensor w, int64_t fmt, int64_t n, int64_t k);
int64_t kquant_chunk_bytes(int64_t fmt);
torch::Tensor kquant_pack_gguf(torch::Tensor blocks, int64_t fmt, int64_t n, int64_t k);
torch::Tensor kquant_pack_gguf_parts(const std::vector<torch::Tensor>& parts, int64_t fmt, int64_t k);
torch::Tensor kquant_pack(torch::Tensor u, torch::Tensor d, torch::Tensor dm, torch::Tensor sc, torch::Tensor mn,
                          int64_t fmt);
std::string kquant_isa();
void bind_layer_stacks(pybind11::module_& mod);   // cpu_stack.cpp

namespace {

// 16 float lanes: one AVX-512 register, or two AVX2 registers with the same lane-wise operations
// (so one kernel source serves both; only the final horizontal sum's order differs between the
// two, and within one build it is fixed). Neither: the scalar loops alone.
#if defined(__AVX512F__)
#define SLUICE_V16 1
using v16 = __m512;
inline v16 v_load(const float* p) { return _mm512_loadu_ps(p); }
inline v16 v_load(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void v_store(float* p, v16 a) { _mm512_storeu_ps(p, a); }
inline v16 v_set1(float x) { return _mm512_set1_ps(x); }
inline v16 v_zero() { return _mm512_setzero_ps(); }
inline v16 v_add(v16 a, v16 b) { return _mm512_add_ps(a, b); }
inline v16 v_sub(v16 a, v16 b) { return _mm512_sub_ps(a, b); }
inline v16 v_mul(v16 a, v16 b) { return _mm512_mul_ps(a, b); }
inline v16 v_max(v16 a, v16 b) { return _mm512_max_ps(a, b); }
inline v16 v_min(v16 a, v16 b) { return _mm512_min_ps(a, b); }
inline v16 v_div(v16 a, v16 b) { return _mm512_div_ps(a, b); }
// Bit i set where lane i of a is NaN / where a == b.
inline uint32_t v_nan_mask(v16 a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline uint32_t v_eq_mask(v16 a, v16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline uint32_t v_gt_mask(v16 a, v16 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline v16 v_fmadd(v16 a, v16 b, v16 c) { return _mm512_fmadd_ps(a, b, c); }
inline v16 v_round(v16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline float v_sum(v16 a) { return _mm512_reduce_add_ps(a); }
// 2^k for integral k in float32's normal range: k + 127 placed in the exponent field.
inline v16 v_pow2(v16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SLUICE_V16 1
struct v16 {
  __m256 lo, hi;
};
inline v16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline v16 v_load(const at::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void v_store(float* p, v16 a) { _mm256_storeu_ps(p, a.lo); _mm256_storeu_ps(p + 8, a.hi); }
inline v16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline v16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline v16 v_add(v16 a, v16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline v16 v_sub(v16 a, v16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline v16 v_mul(v16 a, v16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline v16 v_max(v16 a, v16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline v16 v_min(v16 a, v16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline v16 v_div(v16 a, v16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline uint32_t v_nan_mask(v16 a) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, a.lo, _CMP_UNORD_Q))) |
         static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, a.hi, _CMP_UNORD_Q))) << 8;
}
inline uint32_t v_eq_mask(v16 a, v16 b) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_EQ_OQ))) |
         static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_EQ_OQ))) << 8;
}
inline uint32_t v_gt_mask(v16 a, v16 b) {
  return static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ))) |
         static_cast<uint32_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ))) << 8;
}
inline v16 v_fmadd(v16 a, v16 b, v16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline v16 v_round(v16 a) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kMode), _mm256_round_ps(a.hi, kMode)};
}
inline float v_sum(v16 a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
inline __m256 pow2_8(__m256 k) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
}
inline v16 v_pow2(v16 k) { return {pow2_8(k.lo), pow2_8(k.hi)}; }
#else
#define SLUICE_V16 0
#endif

void check_f32(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                  t.dim() == dim,
              "cpu_ops: ", name, " must be a contiguous float32 CPU tensor with ", dim, " dims");
}

// One fixed summation order per length n, whichever row or thread calls it.
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if SLUICE_V16
  if (n >= 32) {
    v16 acc0 = v_mul(v_load(a), v_load(b));
    v16 acc1 = v_mul(v_load(a + 16), v_load(b + 16));
    for (i = 32; i + 32 <= n; i += 32) {
      acc0 = v_fmadd(v_load(a + i), v_load(b + i), acc0);
      acc1 = v_fmadd(v_load(a + i + 16), v_load(b + i + 16), acc1);
    }
    s = v_sum(v_add(acc0, acc1));
  }
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void rms_norm_rows(const float* x, const float* w, float* out, int64_t rows, int64_t h, double eps) {
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * h;
      float* o = out + r * h;
      const float inv = 1.f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = xr[i] * inv * w[i];
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x", 2);
  check_f32(w, "weight", 1);
  TORCH_CHECK(w.size(0) == x.size(1), "rms_norm: weight has ", w.size(0), " features, x ", x.size(1));
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  return out;
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor d, torch::Tensor w, double eps) {
  check_f32(h, "h", 2);
  check_f32(d, "delta", 2);
  TORCH_CHECK(h.sizes() == d.sizes(), "add_rms_norm: h and delta differ in shape");
  auto sum = torch::empty_like(h);
  const int64_t n = h.numel();
  const float *hp = h.data_ptr<float>(), *dp = d.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) sp[i] = hp[i] + dp[i];
  return {sum, rms_norm(sum, w, eps)};
}

// x [T, H, D] (any strides with a unit last stride), cos/sin [T, 1, D/2] -> new [T, H, D].
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1,
              "rotary: x must be float32 [T, H, D] with a unit last stride");
  const int64_t t = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  auto c = cos.reshape({t, half}).contiguous(), s = sin.reshape({t, half}).contiguous();
  auto out = torch::empty({t, heads, dim}, x.options());
  const float *xp = x.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  at::parallel_for(0, t, 32, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const float *ci = cp + i * half, *si = sp + i * half;
      for (int64_t hh = 0; hh < heads; ++hh) {
        const float* x1 = xp + i * st + hh * sh;
        const float* x2 = x1 + half;
        float* o = op + (i * heads + hh) * dim;
#pragma omp simd
        for (int64_t j = 0; j < half; ++j) {
          const float a = x1[j] * ci[j], b = x2[j] * si[j];
          const float e = x2[j] * ci[j], f = x1[j] * si[j];
          o[j] = a - b;
          o[half + j] = e + f;
        }
      }
    }
  });
  return out;
}

namespace {

// The caches hold float32 or float16 (kv_cache_dtype): the same type for K and V, 4 dims.
void check_cache(const torch::Tensor& kc, const torch::Tensor& vc) {
  for (const auto* t : {&kc, &vc}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 4 &&
                    (t->scalar_type() == torch::kFloat32 || t->scalar_type() == torch::kHalf),
                "cpu_ops: the KV caches must be contiguous float32 or float16 CPU tensors with 4 dims");
  }
  TORCH_CHECK(kc.scalar_type() == vc.scalar_type() && kc.sizes() == vc.sizes(),
              "cpu_ops: the key and value caches differ in dtype or shape");
}

// A row of n floats into a cache row of T: float16 rounds to nearest even, as torch's .to() does.
inline void put_row(const float* src, float* dst, int64_t n) { std::copy_n(src, n, dst); }
inline void put_row(const float* src, at::Half* dst, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] = at::Half(src[j]);
}

template <typename T>
void store_rows(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& kc, torch::Tensor& vc,
                const int64_t* sl, int64_t t, int64_t heads, int64_t dim, int64_t total) {
  T *kp = kc.data_ptr<T>(), *vp = vc.data_ptr<T>();
  const float *ks = k.data_ptr<float>(), *vs = v.data_ptr<float>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(sl[i] >= 0 && sl[i] < total, "store_kv: slot ", sl[i], " outside the cache");
    for (int64_t hh = 0; hh < heads; ++hh) {
      put_row(ks + i * k.stride(0) + hh * k.stride(1), kp + (sl[i] * heads + hh) * dim, dim);
      put_row(vs + i * v.stride(0) + hh * v.stride(1), vp + (sl[i] * heads + hh) * dim, dim);
    }
  }
}

}  // namespace

// k/v [T, Hkv, D] float32 (unit last stride) into the caches [blocks, block_size, Hkv, D] at flat slots.
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor kc, torch::Tensor vc, torch::Tensor slots) {
  check_cache(kc, vc);
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous(), "store_kv: slots must be int64");
  const int64_t t = k.size(0), heads = kc.size(2), dim = kc.size(3);
  const int64_t total = kc.size(0) * kc.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (const auto* src_dst : {&k, &v}) {
    const torch::Tensor& src = *src_dst;
    TORCH_CHECK(src.dim() == 3 && src.size(0) == t && src.size(1) == heads && src.size(2) == dim &&
                    src.stride(2) == 1 && src.scalar_type() == torch::kFloat32,
                "store_kv: k and v must be float32 [T, Hkv, D]");
  }
  if (kc.scalar_type() == torch::kHalf) {
    store_rows<at::Half>(k, v, kc, vc, sl, t, heads, dim, total);
  } else {
    store_rows<float>(k, v, kc, vc, sl, t, heads, dim, total);
  }
}

namespace {

// e^x for x <= 0 (softmax after subtracting the maximum), to about 2 ulp: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n through the exponent bits. Plain C++ so that
// GCC vectorizes the loops that call it; every path computes it the same way.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, x));
  float p = 1.f / 720.f;
  p = std::fma(p, r, 1.f / 120.f);
  p = std::fma(p, r, 1.f / 24.f);
  p = std::fma(p, r, 1.f / 6.f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.f);
  p = std::fma(p, r, 1.f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

#if SLUICE_V16
// exp_nonpositive on 16 lanes, with the same operations (so the same bits).
inline v16 v_exp_nonpositive(v16 x) {
  const v16 v = v_max(x, v_set1(-87.f));
  const v16 k = v_round(v_mul(v, v_set1(1.44269504088896341f)));
  const v16 r = v_fmadd(k, v_set1(-0.693145751953125f), v_fmadd(k, v_set1(-1.428606765330187e-06f), v));
  const float coef[7] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
  v16 p = v_set1(coef[0]);
  for (int c = 1; c < 7; ++c) p = v_fmadd(p, r, v_set1(coef[c]));
  return v_mul(p, v_pow2(k));
}
#endif

// x[i] = e^(x[i] - shift) for x[i] <= shift: exp_nonpositive, 16 lanes at a time with the same
// operations (so the same bits), then the scalar function for the tail.
void exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
#if SLUICE_V16
  const v16 sh = v_set1(shift);
  for (; i + 16 <= n; i += 16) v_store(x + i, v_exp_nonpositive(v_sub(v_load(x + i), sh)));
#endif
  for (; i < n; ++i) x[i] = exp_nonpositive(x[i] - shift);
}

// silu(g) * u with e^x only ever taken of x <= 0: silu(g) = g * e^min(g, 0) / (1 + e^-|g|), which
// is g / (1 + e^-g) for g >= 0 and g e^g / (e^g + 1) below. The vector lanes and the scalar tail
// do the same operations.
inline float silu_times(float g, float u) {
  const float a = exp_nonpositive(std::min(g, 0.f)), b = exp_nonpositive(std::min(g, -g));
  return g * a / (1.f + b) * u;
}

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up", 2);
  const int64_t t = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({t, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const float* g = gp + i * 2 * inter;
      const float* u = g + inter;
      float* o = op + i * inter;
      int64_t j = 0;
#if SLUICE_V16
      const v16 zero = v_zero(), one = v_set1(1.f);
      for (; j + 16 <= inter; j += 16) {
        const v16 gv = v_load(g + j);
        const v16 a = v_exp_nonpositive(v_min(gv, zero)), b = v_exp_nonpositive(v_min(gv, v_sub(zero, gv)));
        v_store(o + j, v_mul(v_div(v_mul(gv, a), v_add(one, b)), v_load(u + j)));
      }
#endif
      for (; j < inter; ++j) o[j] = silu_times(g[j], u[j]);
    }
  });
  return out;
}

namespace {

// Where a row's tokens are: through its sequence's block table, except that from `tail_start` on
// (a draft-tree row: its ancestors and itself, wherever the step wrote them) token t is at the
// flat slot tail[t - tail_start]. Tokens are visited in the same order either way, so a tree row
// computes exactly what the same tokens in a plain sequence would.
struct RowKeys {
  const int32_t* table;
  const int64_t* tail = nullptr;
  int64_t tail_start = std::numeric_limits<int64_t>::max();
};

// Calls fn(t, pointer to token t's row for this KV head) for t = t0 .. t1 - 1, walking the
// sequence's blocks in order (one table lookup per block), then its tail slots.
template <typename T, typename Fn>
inline void each_token(const T* cache, const RowKeys& keys, int64_t block_size, int64_t row,
                       int64_t offset, int64_t t0, int64_t t1, Fn&& fn) {
  const int64_t mid = std::min(t1, std::max(t0, keys.tail_start));
  for (int64_t t = t0; t < mid;) {
    const int64_t blk = t / block_size, end = std::min(mid, (blk + 1) * block_size);
    const T* p = cache + (static_cast<int64_t>(keys.table[blk]) * block_size + (t - blk * block_size)) * row + offset;
    for (; t < end; ++t, p += row) fn(t, p);   // no division per token
  }
  for (int64_t t = mid; t < t1; ++t) fn(t, cache + keys.tail[t - keys.tail_start] * row + offset);
}

// A row attends over its tokens in chunks of kChunk positions (the last may be shorter): per
// chunk the scores' maximum m, the sum l of e^(score - m) and the unnormalised weighted sum of
// values; then the chunks merge in order. The chunks depend on the row's length alone, so a row's
// bits do not depend on the batch, and chunks of one row can run on different threads (a single
// long sequence keeps both cores streaming its cache). A row of at most kChunk tokens is one chunk:
// its result is acc / l, as before chunking existed.
constexpr int64_t kChunk = 256;

struct Partial {
  float* acc;   // [G, D] unnormalised
  float* m;     // [G]
  float* l;     // [G]
};

// Attention soft-capping (Gemma 2): each score s -> cap * tanh(s / cap), before the softmax; a
// cap of 0 is none.
inline void cap_scores(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  for (int64_t i = 0; i < n; ++i) s[i] = std::tanh(s[i] / cap) * cap;
}

// Per-thread work areas of a chunk kernel: the scores [G, padded length] and each token's element
// offset in the caches (K and V share a layout, so one offset serves both).
struct ChunkScratch {
  std::vector<float> scores;
  std::vector<int64_t> at;
};

// One chunk's kernel (chunk_tiled's specialisations; nullptr: chunk_any).
template <typename T>
using ChunkFn = void (*)(const float*, Partial, int64_t, const T*, const T*, int64_t, int64_t,
                         const RowKeys&, int64_t, int64_t, int64_t, float, float, ChunkScratch&);

#if SLUICE_V16
// Tokens per score tile: the query's products with 16 tokens' keys are summed across their lanes
// together (v_sum16), a few shuffles per token instead of a whole horizontal sum each.
constexpr int64_t kTileTokens = 16;

// Lane i of the result is the sum of v[i]'s 16 lanes. Every v[i] passes the same tree of adds
// (pairs of elements, then of 4-lane groups, then of halves), whatever the other 15 hold, so a
// token's score does not depend on its neighbours in the tile.
#if defined(__AVX512F__)
inline v16 v_sum16(const v16* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i)   // per 128-bit block: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // per block L: the block's sums of v[4j .. 4j + 3]
    const __m512d a = _mm512_castps_pd(w[2 * j]), b = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Blocks (0 + 1, 2 + 3) of two vectors side by side, then the two halves: block j = x[j]'s total.
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, 0x88), _mm512_shuffle_f32x4(y0, y1, 0xDD));
}
#else
// Eight of them, each first as its two halves' sum: lane i = the sum of s[i]'s 8 lanes.
inline __m256 sum8(const __m256* s) {
  const __m256 t0 = _mm256_hadd_ps(s[0], s[1]), t1 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 t2 = _mm256_hadd_ps(s[4], s[5]), t3 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
inline v16 v_sum16(const v16* v) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {sum8(s), sum8(s + 8)};
}
#endif

// The weighted sum of values for GS query heads at once, acc [gs, 16 CH] = sum over the tokens
// in order of p[g][t] v_t: their GS x CH accumulators stay in registers while each value row is
// read once. Called with the run-time gs <= GS; the fewer-head versions are its tail.
template <int CH, int GS, typename T>
void weigh_values(int64_t gs, const float* p, int64_t stride, const T* vc, const int64_t* at, int64_t len,
                  float* acc_out) {
  if constexpr (GS > 1) {
    if (gs < GS) return weigh_values<CH, GS - 1, T>(gs, p, stride, vc, at, len, acc_out);
  }
  v16 acc[GS][CH];
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < CH; ++c) acc[g][c] = v_zero();
  for (int64_t t = 0; t < len; ++t) {
    const T* vt = vc + at[t];
    v16 vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = v_load(vt + 16 * c);
    for (int g = 0; g < GS; ++g) {
      const v16 w = v_set1(p[g * stride + t]);
      for (int c = 0; c < CH; ++c) acc[g][c] = v_fmadd(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GS; ++g)
    for (int c = 0; c < CH; ++c) v_store(acc_out + g * 16 * CH + 16 * c, acc[g][c]);
}

// One chunk for G query heads per KV head (any G) and a head size of 16 * CH: the scores in tiles
// of 16 tokens, each tile's keys read from memory once and then, from the L1 cache, by every head
// (v_sum16 per head and tile); each head's softmax pieces; then the values weighed for as many
// heads at once as keep their accumulators in registers (weigh_values). The per-row arithmetic is
// fixed by (G, CH) and the row's length: every row of that length takes this same path. Cache
// elements are read as float32 (v_load): float16 widens exactly (vcvtph2ps), so a float16 cache
// gives the results of a float32 cache holding the same values, bit for bit.
template <int CH, typename T>
void chunk_tiled(const float* q, Partial part, int64_t group, const T* kc, const T* vc, int64_t kv_heads,
                 int64_t kvh, const RowKeys& keys, int64_t block_size, int64_t t0, int64_t t1, float scale,
                 float softcap, ChunkScratch& scratch) {
  constexpr int64_t dim = 16 * CH;
  constexpr int GS = CH >= 16 ? 1 : 16 / CH;
  const int64_t len = t1 - t0, padded = (len + kTileTokens - 1) / kTileTokens * kTileTokens;
  scratch.scores.resize(static_cast<size_t>(group * padded));
  scratch.at.resize(static_cast<size_t>(len));
  float* sc = scratch.scores.data();
  int64_t* at = scratch.at.data();
  each_token(kc, keys, block_size, kv_heads * dim, kvh * dim, t0, t1, [&](int64_t t, const T* kt) { at[t - t0] = kt - kc; });
  const v16 sv = v_set1(scale);
  for (int64_t t = 0; t < len; t += kTileTokens) {
    const int64_t n = std::min(kTileTokens, len - t);
    for (int64_t g = 0; g < group; ++g) {
      v16 qv[CH];
      for (int c = 0; c < CH; ++c) qv[c] = v_load(q + g * dim + 16 * c);
      v16 prod[kTileTokens];
      for (int64_t i = 0; i < kTileTokens; ++i) {
        if (i >= n) { prod[i] = v_zero(); continue; }
        const T* kt = kc + at[t + i];
        v16 a = v_mul(qv[0], v_load(kt));
        for (int c = 1; c < CH; ++c) a = v_fmadd(qv[c], v_load(kt + 16 * c), a);
        prod[i] = a;
      }
      v_store(sc + g * padded + t, v_mul(v_sum16(prod), sv));
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = sc + g * padded;
    cap_scores(sg, len, softcap);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
    exp_shifted(sg, len, mx);
    // 16 running sums, then one fixed reduction.
    v16 tot = v_zero();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) tot = v_add(tot, v_load(sg + t));
    float total = v_sum(tot);
    for (; t < len; ++t) total += sg[t];
    part.m[g] = mx;
    part.l[g] = total;
  }
  for (int64_t g = 0; g < group; g += GS)
    weigh_values<CH, GS, T>(std::min<int64_t>(GS, group - g), sc + g * padded, padded, vc, at, len, part.acc + g * dim);
}

// The tiled kernel for head size 16 * CH (32 .. 128, and 256), or nullptr (then chunk_any's general loops).
template <typename T>
ChunkFn<T> pick_chunk(int64_t dim) {
  switch (dim) {
    case 32: return chunk_tiled<2, T>;
    case 48: return chunk_tiled<3, T>;
    case 64: return chunk_tiled<4, T>;
    case 80: return chunk_tiled<5, T>;
    case 96: return chunk_tiled<6, T>;
    case 112: return chunk_tiled<7, T>;
    case 128: return chunk_tiled<8, T>;
    case 256: return chunk_tiled<16, T>;
    default: return nullptr;
  }
}
#endif

// One chunk, one KV head, any shape: the group of query heads that share the KV head score the
// tokens t0 .. t1 - 1, then the softmax's pieces and the weighted sum of values, each over the
// tokens in order.
// A cache row as float32: the row itself, or its float16 values widened into buf.
inline const float* as_float(const float* row, int64_t, float*) { return row; }
inline const float* as_float(const at::Half* row, int64_t n, float* buf) {
  for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(row[j]);
  return buf;
}

template <typename T>
void chunk_any(const float* q, Partial part, int64_t group, int64_t dim, const T* kc,
               const T* vc, int64_t kv_heads, int64_t kvh, const RowKeys& keys,
               int64_t block_size, int64_t t0, int64_t t1, float scale, float softcap, ChunkScratch& scratch) {
  const int64_t len = t1 - t0;
  std::vector<float>& scores = scratch.scores;
  scores.resize(static_cast<size_t>(group * len));
  std::vector<float> buf(static_cast<size_t>(dim));
  const int64_t row = kv_heads * dim;                    // elements from one token to the next
  each_token(kc, keys, block_size, row, kvh * dim, t0, t1, [&](int64_t t, const T* k16) {
    const float* kt = as_float(k16, dim, buf.data());
    for (int64_t g = 0; g < group; ++g) scores[g * len + (t - t0)] = dot(q + g * dim, kt, dim) * scale;
  });
  cap_scores(scores.data(), group * len, softcap);
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * len;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
    exp_shifted(sg, len, mx);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += sg[t];
    part.m[g] = mx;
    part.l[g] = total;
    std::fill_n(part.acc + g * dim, dim, 0.f);
  }
  // The weighted sum of values: one running sum per output element, over the tokens in order.
  each_token(vc, keys, block_size, row, kvh * dim, t0, t1, [&](int64_t t, const T* v16) {
    const float* vt = as_float(v16, dim, buf.data());
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + (t - t0)];
      float* og = part.acc + g * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) og[j] = std::fma(p, vt[j], og[j]);
    }
  });
}

// out [G, D] from a row's chunks, merged in order: one chunk is acc / l; several are rescaled to
// their common maximum first.
void merge_chunks(const Partial* parts, int64_t n, int64_t group, int64_t dim, float* out) {
  for (int64_t g = 0; g < group; ++g) {
    float* og = out + g * dim;
    if (n == 1) {
      const float inv = 1.f / parts[0].l[g];
      const float* a = parts[0].acc + g * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) og[j] = a[j] * inv;
      continue;
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, parts[c].m[g]);
    float total = 0.f;
    std::fill_n(og, dim, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float w = exp_nonpositive(parts[c].m[g] - mx);
      total = std::fma(w, parts[c].l[g], total);
      const float* a = parts[c].acc + g * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) og[j] = std::fma(w, a[j], og[j]);
    }
    const float inv = 1.f / total;
#pragma omp simd
    for (int64_t j = 0; j < dim; ++j) og[j] *= inv;
  }
}

// One chunk [t0, t1) of one row for the G query heads of KV head kvh, finished into out [G, D]
// when it is the row's only chunk: the tiled kernel where the head size has one, else chunk_any.
template <typename T>
void attend_one_chunk(ChunkFn<T> tiled, const float* q, const Partial& part, int64_t group, int64_t dim,
                      const T* kc, const T* vc, int64_t kv_heads, int64_t kvh, const RowKeys& keys,
                      int64_t block_size, int64_t t0, int64_t t1, float scale, float softcap,
                      ChunkScratch& scratch) {
  if (tiled != nullptr) {
    tiled(q, part, group, kc, vc, kv_heads, kvh, keys, block_size, t0, t1, scale, softcap, scratch);
  } else {
    chunk_any(q, part, group, dim, kc, vc, kv_heads, kvh, keys, block_size, t0, t1, scale, softcap, scratch);
  }
}

}  // namespace

// q [B, Hq, D] (heads of one KV head adjacent), caches [blocks, bs, Hkv, D], block_tables
// [B, max_blocks] int32, seq_lens [B] int32 -> [B, Hq, D]. Row b attends over the first
// seq_lens[b] tokens of the sequence block_tables[b] describes: a decode row is its sequence's
// last token, and a prefill or verification row is one row per token with its own length.
// Work is split into (row, chunk, KV head) items over the threads.
// Draft-tree rows (optional): tail_start [B] int32 and tail_slots [B, W] int64; row b reads its
// tokens from tail_start[b] on at the slots tail_slots[b, :] (RowKeys). A row without a tail has
// tail_start[b] >= seq_lens[b].
// A sliding window (window > 0; 0: none) limits row b to its last `window` tokens, positions
// seq_lens[b] - window .. seq_lens[b] - 1: the chunks start there, and no earlier block-table
// entry is read (the KV manager may have freed those blocks).
// softcap > 0: each score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kc, torch::Tensor vc,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           std::optional<torch::Tensor> tail_start, std::optional<torch::Tensor> tail_slots,
                           int64_t window, double softcap) {
  TORCH_CHECK(softcap >= 0, "paged_decode: softcap must be >= 0 (0: none), got ", softcap);
  check_cache(kc, vc);
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32, "paged_decode: q must be float32 [B, Hq, D]");
  auto qc = q.contiguous();
  auto bt = block_tables.to(torch::kInt32).contiguous();
  auto sl = seq_lens.to(torch::kInt32).contiguous();
  const int64_t batch = qc.size(0), heads = qc.size(1), dim = qc.size(2);
  const int64_t block_size = kc.size(1), kv_heads = kc.size(2);
  TORCH_CHECK(kc.size(3) == dim && heads % kv_heads == 0, "paged_decode: head shapes do not match the cache");
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == batch && sl.numel() == batch, "paged_decode: one table and length per row");
  const int64_t group = heads / kv_heads, width = bt.size(1);
  const int32_t* lens = sl.data_ptr<int32_t>();
  TORCH_CHECK(window >= 0, "paged_decode: window must be >= 0 (0: none), got ", window);
  // Row b's first token.
  auto row_start = [&](int64_t b) -> int64_t { return window > 0 ? std::max<int64_t>(0, lens[b] - window) : 0; };
  TORCH_CHECK(tail_start.has_value() == tail_slots.has_value(), "paged_decode: tail_start and tail_slots go together");
  torch::Tensor ts, tt;
  if (tail_start.has_value()) {
    ts = tail_start->to(torch::kInt64).contiguous();
    tt = tail_slots->to(torch::kInt64).contiguous();
    TORCH_CHECK(ts.numel() == batch && tt.dim() == 2 && tt.size(0) == batch, "paged_decode: one tail per row");
    const int64_t* start = ts.data_ptr<int64_t>();
    const int64_t cache_slots = kc.size(0) * block_size;
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK(start[b] >= 0 && (start[b] >= lens[b] || lens[b] - start[b] <= tt.size(1)),
                  "paged_decode: row ", b, "'s tail does not fit tail_slots");
      for (int64_t t = start[b]; t < lens[b]; ++t) {
        const int64_t slot_id = tt.data_ptr<int64_t>()[b * tt.size(1) + t - start[b]];
        TORCH_CHECK(slot_id >= 0 && slot_id < cache_slots, "paged_decode: tail slot ", slot_id, " is outside the cache");
      }
    }
  }
  auto row_keys = [&](int64_t b) {
    RowKeys keys{bt.data_ptr<int32_t>() + b * width};
    if (ts.defined()) {
      keys.tail_start = ts.data_ptr<int64_t>()[b];
      keys.tail = tt.data_ptr<int64_t>() + b * tt.size(1);
    }
    return keys;
  };
  // Each row's first chunk, over (row, chunk): a row's chunks are consecutive. Rows of more than
  // one chunk keep their partial results in a workspace (its slots: `slot`), merged afterwards;
  // a one-chunk row is finished where it is computed.
  std::vector<int64_t> first(static_cast<size_t>(batch + 1), 0), slot;
  int64_t split = 0;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= width * block_size, "paged_decode: seq_len ", lens[b],
                " does not fit the block table");
    const int64_t n = (lens[b] - row_start(b) + kChunk - 1) / kChunk;
    first[b + 1] = first[b] + n;
    for (int64_t c = 0; c < n; ++c) slot.push_back(n > 1 ? split++ : -1);
  }
  const int64_t chunks = first[batch], per_part = group * (dim + 2);
  auto out = torch::empty({batch, heads, dim}, qc.options());
  // Kept across calls (a long prefill's partials are tens of MB: fresh pages on every layer
  // would cost more than the attention).
  static thread_local std::vector<float> workspace;
  workspace.resize(static_cast<size_t>(split * kv_heads * per_part));
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* wp = workspace.data();
  auto part_in = [&](float* base) { return Partial{base, base + group * dim, base + group * dim + group}; };
  std::vector<int64_t> row_of(static_cast<size_t>(chunks));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = first[b]; c < first[b + 1]; ++c) row_of[c] = b;
  // The chunks, for a cache of element type T (float or at::Half).
  auto attend = [&](const auto* kp, const auto* vp) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(kp)>>;
#if SLUICE_V16
    const ChunkFn<T> tiled = pick_chunk<T>(dim);
#else
    const ChunkFn<T> tiled = nullptr;
#endif
    at::parallel_for(0, chunks * kv_heads, 1, [&](int64_t i0, int64_t i1) {
      ChunkScratch scratch;
      std::vector<float> local(static_cast<size_t>(per_part));
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t c = i / kv_heads, kvh = i % kv_heads, b = row_of[c];
        const int64_t t0 = row_start(b) + (c - first[b]) * kChunk, t1 = std::min<int64_t>(lens[b], t0 + kChunk);
        const float* qh = qp + (b * heads + kvh * group) * dim;
        const Partial part = part_in(slot[c] < 0 ? local.data() : wp + (slot[c] * kv_heads + kvh) * per_part);
        attend_one_chunk<T>(tiled, qh, part, group, dim, kp, vp, kv_heads, kvh, row_keys(b), block_size, t0, t1,
                            static_cast<float>(scale), static_cast<float>(softcap), scratch);
        if (slot[c] < 0) merge_chunks(&part, 1, group, dim, op + (b * heads + kvh * group) * dim);
      }
    });
  };
  if (kc.scalar_type() == torch::kHalf) {
    attend(kc.data_ptr<at::Half>(), vc.data_ptr<at::Half>());
  } else {
    attend(kc.data_ptr<float>(), vc.data_ptr<float>());
  }
  if (split == 0) return out;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<Partial> parts;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kv_heads, kvh = i % kv_heads;
      if (slot[first[b]] < 0) continue;   // one chunk: already written
      parts.clear();
      for (int64_t c = first[b]; c < first[b + 1]; ++c) parts.push_back(part_in(wp + (slot[c] * kv_heads + kvh) * per_part));
      merge_chunks(parts.data(), static_cast<int64_t>(parts.size()), group, dim,
                   op + (b * heads + kvh * group) * dim);
    }
  });
  return out;
}

// ---- what the layer stacks (cpu_stack.cpp) compose besides the ops above ------------------------
// The row count a oneDNN-packed product runs at: models/cpu_linear.py's row_bucket, the same buckets
// (4 below 4 rows, where oneDNN streams a weight more slowly; exact up to 16 rows; then four per
// doubling), so that a step meets only the primitives the engine's warm-up compiled
// (tests/unit/test_cpu_ops.py holds the two to each other).
int64_t row_bucket(int64_t rows) {
  if (rows < 4) return 4;
  if (rows <= 16) return rows;
  const int64_t bits = 64 - __builtin_clzll(static_cast<unsigned long long>(rows - 1));   // (rows - 1).bit_length()
  const int64_t step = int64_t{1} << (bits - 3);
  return (rows + step - 1) / step * step;
}

// y = x @ W^T (+ bias) for a float32 W that mkldnn::_reorder_linear_weight packed (models/cpu_linear.py's
// packed_linear: the same operator, the bias passed to it, the same zero-padded rows).
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const int64_t rows = x.size(0), padded = row_bucket(rows);
  const torch::Tensor in = padded == rows ? x : at::constant_pad_nd(x, {0, 0, 0, padded - rows});
  torch::jit::Stack stack{in, packed, bias.numel() ? c10::IValue(bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  torch::Tensor out = stack.back().toTensor();
  return padded == rows ? out : out.narrow(0, 0, rows);
}

// Rows of qk [T, Hq + Hkv, D] float32 (the query heads, those of one KV head adjacent, then the
// key heads) attend over dense per-sequence caches [capacity, Hkv, D] float32: sequence i owns
// rows[i] consecutive rows, and its r-th row attends over the cache's first before[i] + r + 1
// entries (causal, after what the cache already held). Each row is computed as paged_decode
// computes a one-chunk row, the cache read as a single block; a work item per (sequence, KV head).
torch::Tensor dense_causal_attention(const torch::Tensor& qk, int64_t heads, const std::vector<torch::Tensor>& key_caches,
                                     const std::vector<torch::Tensor>& value_caches, const std::vector<int64_t>& before,
                                     const std::vector<int64_t>& rows, double scale) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == torch::kFloat32 && qk.is_contiguous(),
              "dense_causal_attention: qk must be contiguous float32 [T, Hq + Hkv, D]");
  const int64_t n = static_cast<int64_t>(key_caches.size()), t = qk.size(0), dim = qk.size(2);
  const int64_t kv_heads = qk.size(1) - heads, group = heads / kv_heads, qk_row = qk.size(1) * dim;
  std::vector<int64_t> first(static_cast<size_t>(n + 1), 0);
  for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + rows[i];
  TORCH_CHECK(first[n] == t, "dense_causal_attention: the row counts add up to ", first[n], ", qk has ", t);
  const float* qkp = qk.data_ptr<float>();
  torch::Tensor attn = torch::empty({t, heads, dim}, qk.options());
  float* ap = attn.data_ptr<float>();
#if SLUICE_V16
  const ChunkFn<float> tiled = pick_chunk<float>(dim);
#else
  const ChunkFn<float> tiled = nullptr;
#endif
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t w0, int64_t w1) {
    ChunkScratch scratch;
    std::vector<float> local(static_cast<size_t>(group * (dim + 2)));
    const Partial part{local.data(), local.data() + group * dim, local.data() + group * dim + group};
    const int32_t block = 0;
    const RowKeys keys{&block};
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t i = w / kv_heads, kvh = w % kv_heads, cap = key_caches[i].size(0);
      const float *kc = key_caches[i].data_ptr<float>(), *vc = value_caches[i].data_ptr<float>();
      for (int64_t r = 0; r < rows[i]; ++r) {
        const int64_t len = before[i] + r + 1, row = first[i] + r;
        const float* q = qkp + row * qk_row + kvh * group * dim;
        attend_one_chunk<float>(tiled, q, part, group, dim, kc, vc, kv_heads, kvh, keys, cap, 0, len,
                                static_cast<float>(scale), 0.f, scratch);
        merge_chunks(&part, 1, group, dim, ap + (row * heads + kvh * group) * dim);
      }
    }
  });
  return attn;
}

// Copies slot src[i] to slot dst[i], in order, in every cache [blocks, block_size, ...] (a draft
// tree's accepted nodes to where a chain's would be, in every layer's K and V: one call instead
// of an indexed copy per tensor).
void move_slots(std::vector<torch::Tensor> caches, torch::Tensor src, torch::Tensor dst) {
  TORCH_CHECK(src.scalar_type() == torch::kInt64 && dst.scalar_type() == torch::kInt64 && src.numel() == dst.numel(),
              "move_slots: src and dst must be int64 of the same length");
  auto sc = src.contiguous(), dc = dst.contiguous();
  const int64_t *sp = sc.data_ptr<int64_t>(), *dp = dc.data_ptr<int64_t>(), n = sc.numel();
  for (auto& c : caches) {
    TORCH_CHECK(c.device().is_cpu() && c.is_contiguous() && c.dim() >= 2, "move_slots: caches must be contiguous CPU tensors");
    const int64_t slots = c.size(0) * c.size(1), bytes = c.numel() / slots * c.element_size();
    auto* base = static_cast<char*>(c.data_ptr());
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(sp[i] >= 0 && sp[i] < slots && dp[i] >= 0 && dp[i] < slots, "move_slots: slot outside the cache");
      std::memmove(base + dp[i] * bytes, base + sp[i] * bytes, static_cast<size_t>(bytes));
    }
  }
}

// Per row of x [R, N] float32, the index of its first maximum, or of its first NaN where it has
// one: torch.argmax's answer (which finds it several times more slowly on CPU rows of a
// vocabulary: 130 against ~15 us for 5 rows of 49k). Greedy sampling and verification read it.
torch::Tensor argmax_rows(torch::Tensor x) {
  check_f32(x, "x", 2);
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(n >= 1, "argmax_rows: rows must not be empty");
  auto out = torch::empty({rows}, x.options().dtype(torch::kInt64));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * n;
      float mx = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t j = 0;
#if SLUICE_V16
      v16 acc = v_set1(mx);
      uint32_t nans = 0;
      for (; j + 16 <= n; j += 16) {
        const v16 v = v_load(row + j);
        nans |= v_nan_mask(v);
        acc = v_max(v, acc);     // a NaN lane of v keeps acc's
      }
      float lanes[16];
      v_store(lanes, acc);
      for (float l : lanes) mx = std::max(mx, l);
      nan = nans != 0;
#endif
      for (; j < n; ++j) {
        if (row[j] != row[j]) nan = true;
        else mx = std::max(mx, row[j]);
      }
      int64_t at = 0;
      if (nan) {
        while (row[at] == row[at]) ++at;
      } else {
        j = 0;
#if SLUICE_V16
        const v16 m = v_set1(mx);
        for (; j + 16 <= n; j += 16) {
          const uint32_t eq = v_eq_mask(v_load(row + j), m);
          if (eq) break;
        }
#endif
        while (row[j] != mx) ++j;
        at = j;
      }
      op[r] = at;
    }
  });
  return out;
}

// Per row of logits [R, N] float32: its k largest (the earlier index first among equals) and their
// softmax probabilities over the row -> (probabilities [R, k], indices [R, k] int64), largest
// first. A draft tree's children from the draft vocabulary's logits, without a [R, N] softmax.
std::vector<torch::Tensor> top_probs(torch::Tensor logits, int64_t k) {
  check_f32(logits, "logits", 2);
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= n, "top_probs: k must be in [1, ", n, "], got ", k);
  auto probs = torch::empty({rows, k}, logits.options());
  auto idx = torch::empty({rows, k}, logits.options().dtype(torch::kInt64));
  const float* lp = logits.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = lp + r * n;
    std::vector<float> best(static_cast<size_t>(k), -std::numeric_limits<float>::infinity());
    std::vector<int64_t> at(static_cast<size_t>(k), -1);
    float mx = -std::numeric_limits<float>::infinity();
    auto offer = [&](int64_t j) {   // x[j] into the sorted k best, after its equals
      const float v = x[j];
      mx = std::max(mx, v);
      if (!(v > best[k - 1]) && at[k - 1] >= 0) return;
      int64_t pos = k - 1;
      while (pos > 0 && (v > best[pos - 1] || at[pos - 1] < 0)) {
        best[pos] = best[pos - 1];
        at[pos] = at[pos - 1];
        --pos;
      }
      best[pos] = v;
      at[pos] = j;
    };
    int64_t j0 = 0;
#if SLUICE_V16
    // Once the k best are filled, a block of 16 with nothing above the k-th is skipped whole
    // (its maximum still counts).
    v16 vmax = v_set1(mx);
    for (; j0 < std::min<int64_t>(k, n); ++j0) offer(j0);
    for (; j0 + 16 <= n; j0 += 16) {
      const v16 v = v_load(x + j0);
      vmax = v_max(v, vmax);
      uint32_t above = v_gt_mask(v, v_set1(best[k - 1]));
      while (above) {
        offer(j0 + __builtin_ctz(above));
        above &= above - 1;
      }
    }
    float lanes[16];
    v_store(lanes, vmax);
    for (float l : lanes) mx = std::max(mx, l);
#endif
    for (; j0 < n; ++j0) offer(j0);
    float total = 0.f;
    int64_t j = 0;
#if SLUICE_V16
    v16 acc = v_zero();
    const v16 m = v_set1(mx);
    for (; j + 16 <= n; j += 16) acc = v_add(acc, v_exp_nonpositive(v_sub(v_load(x + j), m)));
    total = v_sum(acc);
#endif
    for (; j < n; ++j) total += exp_nonpositive(x[j] - mx);
    for (int64_t c = 0; c < k; ++c) {
      pp[r * k + c] = exp_nonpositive(best[c] - mx) / total;
      ip[r * k + c] = at[c];
    }
  }
  return {probs, idx};
}

bool set_huge_page_allocations(int64_t min_bytes);   // cpu_pages.cpp
int64_t huge_page_bytes();
void set_huge_page_arena(int64_t address, int64_t length);
int64_t close_huge_page_arena();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // The GIL is let go while the product runs (the LM head: ~2 ms a step), so the server's other
  // threads (gRPC, asyncio) are not held up by it.
  mod.def("blockq_linear", &blockq_linear, "y = x @ W^T for a block-quantized W (cpu_blockq.cpp)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("blockq_rows", &blockq_rows, "rows of a block-quantized W, dequantized (cpu_blockq.cpp)");
  mod.def("blockq_isa", &blockq_isa, "the block product's integer path: avx512vnni, avx2 or portable");
  mod.def("blockq_pack_gguf", &blockq_pack_gguf, "GGUF Q4_0 / Q4_1 / Q8_0 parts -> (packed, d, m) (cpu_blockq.cpp)");
  mod.def("kquant_linear", &kquant_linear, "y = x @ W^T for a K-quant / 5-bit block W (cpu_kquant.cpp)",
          pybind11::call_guard<pybind11::gil_scoped_release>());
  mod.def("kquant_rows", &kquant_rows, "rows of a K-quant / 5-bit block W, dequantized (cpu_kquant.cpp)");
  mod.def("kquant_chunk_bytes", &kquant_chunk_bytes, "bytes per (tile, super-block) chunk of a format");
  mod.def("kquant_pack_gguf", &kquant_pack_gguf, "a GGUF tensor's K-quant / 5-bit blocks -> its packed layout (cpu_kquant.cpp)");
  mod.def("kquant_pack_gguf_parts", &kquant_pack_gguf_parts,
          "GGUF tensors' blocks in one K-quant / 5-bit type, stacked by rows -> one packed layout (cpu_kquant.cpp)");
  mod.def("kquant_pack", &kquant_pack, "a K-quant / 5-bit weight's parts -> its packed layout (cpu_kquant.cpp)");
  mod.def("kquant_isa", &kquant_isa, "the K-quant product's integer path: avx2 or portable");
  mod.def("rms_norm", &rms_norm);
  mod.def("add_rms_norm", &add_rms_norm);
  mod.def("rotary", &rotary);
  mod.def("silu_mul", &silu_mul);
  mod.def("store_kv", &store_kv);
  mod.def("paged_decode", &paged_decode, pybind11::arg("q"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
          pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
          pybind11::arg("tail_start") = pybind11::none(), pybind11::arg("tail_slots") = pybind11::none(),
          pybind11::arg("window") = 0, pybind11::arg("softcap") = 0.0);
  mod.def("move_slots", &move_slots, "copy slot src[i] to dst[i], in order, in every cache");
  mod.def("argmax_rows", &argmax_rows, "each row's first maximum (or first NaN), as torch.argmax");
  mod.def("top_probs", &top_probs, "each row's k largest logits' softmax probabilities and indices");
  mod.def("row_bucket", &row_bucket, "the row count a oneDNN-packed projection of this many rows runs at");
  mod.def("set_huge_page_allocations", &set_huge_page_allocations,
          "torch's CPU allocations of at least min_bytes on huge pages; 0: back to the previous allocator (cpu_pages.cpp)");
  mod.def("huge_page_bytes", &huge_page_bytes, "bytes the huge-page allocator has mapped in this process");
  mod.def("set_huge_page_arena", &set_huge_page_arena,
          "large allocations from this faulted-in mapping, which the library then owns (cpu_pages.cpp)");
  mod.def("close_huge_page_arena", &close_huge_page_arena,
          "unmap what the open arena has left; returns the bytes taken from it");
  bind_layer_stacks(mod);   // cpu_stack.cpp
}
