// Attention on the CPU whose every query row is computed the same way whatever else is in the batch: a row's
// output depends only on its query and on the keys and values it may see, taken in buffer order (the committed
// tokens, then its ancestors in the draft tree, then itself). A verify over a tree therefore gives each node, bit
// for bit, what a one-token step gives the same token after the same accepted path; with activations rounded to
// int8 before every product (quant_cpu.cpp's ACT8) the float32 noise of a row-dependent attention (torch's SDPA)
// would otherwise grow into different tokens.
//
// For each batch b, query head h (key/value head h / (Hq / Hkv)) and query row i, over the visible keys j in order:
//   s_j = scale * dot(q, k_j)    dot: 16 lanes, lane l = fma over d = l, l + 16, ... in order, then summed in
//                                halves (lane l + lane l + 8, then + 4, + 2, + 1)
//   s_j = cap * tanh(s_j / cap)  only with a soft cap (cap > 0)
//   p_j = exp(s_j - max s)       exp_nonpositive: a fixed polynomial, elementwise
//   out = acc / total            acc = fma(p_j, v_j, acc) over j in order; total: 16 lanes (lane j % 16, in order),
//                                summed in halves
// The AVX-512 path computes 16 keys' dots at once (for the query heads that share a key/value head together, each
// head's operations unchanged) and the portable C++ one key at a time, with the same operations in the same order;
// neither reorders a sum (built with -ffp-contract=off, no fast-math), so a row's result is the same bits for every
// batch and every place of the row in it.
// Keys and values may be float16 (a float16 KV cache, as llama.cpp keeps by default): each is widened exactly to
// float32 as it is read, and everything after runs as above.
// The reference (kernels/attention.py, attention_ref) is softmax attention in float64.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(CLOVER_GENERIC)
#include <immintrin.h>
#define CLOVER_ATTN_AVX512 1
#else
#define CLOVER_ATTN_AVX512 0
#endif
// AVX2 (with FMA and F16C) where there is no AVX-512: 16 lanes as two halves of 8, the same operations in the same order
#if !CLOVER_ATTN_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CLOVER_GENERIC)
#include <immintrin.h>
#define CLOVER_ATTN_AVX2 1
#else
#define CLOVER_ATTN_AVX2 0
#endif

namespace {

constexpr int LANES = 16;

// exp(x) for x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial
// (Cephes' expf coefficients), times 2^n built in the exponent bits; 0 below -87. Separate multiplies and adds.
inline float exp_nonpositive(float x) {
  const bool under = !(x >= -87.0f);
  x = under ? -87.0f : x;
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * (r * r) + r) + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return under ? 0.0f : p * scale;
}

// A sum of 16 lanes, in halves: lane l + lane l + 8, then + 4, + 2, + 1.
inline float halving(float* lane) {
  for (int half = LANES / 2; half > 0; half /= 2)
    for (int l = 0; l < half; l++) lane[l] = lane[l] + lane[l + half];
  return lane[0];
}

// A cached key or value element as float32: a float16 cache's widen exactly, so both caches run the same arithmetic
// on the numbers they hold.
inline float widen(float x) { return x; }
inline float widen(at::Half x) { return static_cast<float>(x); }

// q . k: lane l = fma over d = l, l + 16, ... in order, then halving.
template <int64_t D, typename KV>
inline float dot(const float* q, const KV* k) {
  float lane[LANES] = {0.0f};
  for (int64_t d = 0; d < D; d += LANES)
    for (int l = 0; l < LANES; l++) lane[l] = std::fma(q[d + l], widen(k[d + l]), lane[l]);
  return halving(lane);
}

#if CLOVER_ATTN_AVX512
// 16 cached elements as float32 (float16: widened exactly by VCVTPH2PS)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

inline __m512 exp16(__m512 x) {
  const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(bits));
}

inline float halving16(__m512 v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// The halving sums of 16 keys' lanes at once, key j's in lane j: the same pairs as halving(), four folds.
inline __m512 halving_16x16(__m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int m = 0; m < 8; m++)  // lane l + l + 8: [key 2m's 8 | key 2m+1's 8]
    s1[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                          _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int p = 0; p < 4; p++)  // + 4: a 128-bit block per key (4p .. 4p + 3)
    s2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0x88),
                          _mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0xDD));
  for (int u = 0; u < 2; u++)  // + 2: block b holds keys 8u + b and 8u + 4 + b, two lanes each
    s3[u] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * u], s2[2 * u + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * u], s2[2 * u + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // + 1: block b holds keys b, b + 4, b + 8, b + 12
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#endif

#if CLOVER_ATTN_AVX2
// 8 cached elements as float32 (float16: widened exactly by VCVTPH2PS)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

// halving() of 16 lanes held as lo (lanes 0..7) and hi (8..15)
inline float halving8(__m256 lo, __m256 hi) {
  const __m256 a = _mm256_add_ps(lo, hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// exp_nonpositive of 8 scores, the same operations
inline __m256 exp8(__m256 x) {
  const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_blendv_ps(_mm256_set1_ps(-87.0f), x, ok);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

// dot() of q (as 2 D / 16 halves) and key k
template <int64_t D, typename KV>
inline float dot8(const __m256* qv, const KV* k) {
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int c = 0; c < D / LANES; c++) {
    lo = _mm256_fmadd_ps(qv[2 * c], load8(k + LANES * c), lo);
    hi = _mm256_fmadd_ps(qv[2 * c + 1], load8(k + LANES * c + 8), hi);
  }
  return halving8(lo, hi);
}
#endif

// One query row of one head: out[D] = softmax(scale * q . k_j) . v_j over the keys keys[0 .. V - 1] in order, k_j at
// kb + keys[j] * ks and v_j at vb + keys[j] * vs. s: scratch. AVX2 and the portable C++ (AVX-512: attend_heads).
template <int64_t D, typename KV>
void attend_row(const float* qrow, const KV* kb, int64_t ks, const KV* vb, int64_t vs, const int64_t* keys, int64_t V,
                float sc, float cap, std::vector<float>& s, float* o) {
  if (V == 0) {
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    return;
  }
  s.resize((V + LANES - 1) / LANES * LANES);
  float top = -INFINITY;
  float total;
#if CLOVER_ATTN_AVX2
  __m256 qv[D / 8];
  for (int c = 0; c < D / 8; c++) qv[c] = _mm256_loadu_ps(qrow + 8 * c);
  for (int64_t j = 0; j < V; j++) {
    float x = sc * dot8<D>(qv, kb + keys[j] * ks);
    if (cap > 0.0f) x = cap * std::tanh(x / cap);
    s[j] = x;
    top = std::fmax(top, x);
  }
  for (int64_t j = V; j < (int64_t)s.size(); j++) s[j] = 0.0f;
  const __m256 t = _mm256_set1_ps(top);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < V; j0 += LANES) {  // lane j % 16 in order; past V, zeros added (exactly nothing)
    __m256 e[2];
    for (int h = 0; h < 2; h++) {
      e[h] = exp8(_mm256_sub_ps(_mm256_loadu_ps(s.data() + j0 + 8 * h), t));
      const int64_t live = V - j0 - 8 * h;
      if (live < 8) {  // lanes past V: 0
        alignas(32) float tmp[8];
        _mm256_store_ps(tmp, e[h]);
        for (int l = live < 0 ? 0 : live; l < 8; l++) tmp[l] = 0.0f;
        e[h] = _mm256_load_ps(tmp);
      }
      _mm256_storeu_ps(s.data() + j0 + 8 * h, e[h]);
    }
    lo = _mm256_add_ps(lo, e[0]);
    hi = _mm256_add_ps(hi, e[1]);
  }
  total = halving8(lo, hi);
  __m256 av[D / 8];
  for (int c = 0; c < D / 8; c++) av[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < V; j++) {
    const KV* vj = vb + keys[j] * vs;
    const __m256 p = _mm256_set1_ps(s[j]);
    for (int c = 0; c < D / 8; c++) av[c] = _mm256_fmadd_ps(p, load8(vj + 8 * c), av[c]);
  }
  const __m256 tv = _mm256_set1_ps(total);
  for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(o + 8 * c, _mm256_div_ps(av[c], tv));
#else
  for (int64_t j = 0; j < V; j++) {
    float x = sc * dot<D>(qrow, kb + keys[j] * ks);
    if (cap > 0.0f) x = cap * std::tanh(x / cap);
    s[j] = x;
    top = std::fmax(top, x);
  }
  float lane[LANES] = {0.0f};
  for (int64_t j = 0; j < V; j++) {
    s[j] = exp_nonpositive(s[j] - top);
    lane[j % LANES] = lane[j % LANES] + s[j];
  }
  total = halving(lane);
  float acc[D];
  for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
  for (int64_t j = 0; j < V; j++) {
    const KV* vj = vb + keys[j] * vs;
    for (int64_t d = 0; d < D; d++) acc[d] = std::fma(s[j], widen(vj[d]), acc[d]);
  }
  for (int64_t d = 0; d < D; d++) o[d] = acc[d] / total;
#endif
}

#if CLOVER_ATTN_AVX512
// attend_row on AVX-512, for G query heads that share one key/value head, the same row and so the same keys: each
// head's arithmetic is attend_row's (the recipe at the top of the file), operation for operation in the same order,
// 16 keys' dots at once (so the same bits for any G); only the loads of the keys and values (and a float16 cache's
// widening) are shared by the G heads, and their G independent sums overlap where one head's chain of multiply-adds
// would wait on itself. q[g]: head g's query, o[g]: its output.
template <int64_t D, typename KV, int G>
void attend_heads(const float* const* q, const KV* kb, int64_t ks, const KV* vb, int64_t vs, const int64_t* keys,
                  int64_t V, float sc, float cap, std::vector<float>& s, float* const* o) {
  constexpr int C = D / LANES;
  if (V == 0) {
    for (int g = 0; g < G; g++)
      for (int64_t d = 0; d < D; d++) o[g][d] = 0.0f;
    return;
  }
  const int64_t S = (V + LANES - 1) / LANES * LANES;  // one head's scores
  s.resize(G * S);
  __m512 qv[G][C];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) qv[g][c] = _mm512_loadu_ps(q[g] + LANES * c);
  __m512 best[G];
  for (int g = 0; g < G; g++) best[g] = _mm512_set1_ps(-INFINITY);
  alignas(64) float lanes[G][LANES][LANES];  // per head, 16 keys' dot lanes
  for (int64_t j0 = 0; j0 < V; j0 += LANES) {
    for (int j = 0; j < LANES; j++) {
      if (j0 + j < V) {
        const KV* kj = kb + keys[j0 + j] * ks;
        __m512 kc[C];
        for (int c = 0; c < C; c++) kc[c] = load16(kj + LANES * c);
        for (int g = 0; g < G; g++) {
          __m512 a = _mm512_setzero_ps();
          for (int c = 0; c < C; c++) a = _mm512_fmadd_ps(qv[g][c], kc[c], a);
          _mm512_store_ps(lanes[g][j], a);
        }
      } else {
        for (int g = 0; g < G; g++) _mm512_store_ps(lanes[g][j], _mm512_setzero_ps());
      }
    }
    const __mmask16 live = V - j0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (V - j0)) - 1);
    for (int g = 0; g < G; g++) {
      __m512 a[LANES];
      for (int j = 0; j < LANES; j++) a[j] = _mm512_load_ps(lanes[g][j]);
      const __m512 x = _mm512_mul_ps(_mm512_set1_ps(sc), halving_16x16(a));
      _mm512_storeu_ps(s.data() + g * S + j0, x);
      if (cap <= 0.0f) best[g] = _mm512_mask_max_ps(best[g], live, best[g], x);
    }
  }
  float total[G];
  for (int g = 0; g < G; g++) {
    float* sg = s.data() + g * S;
    float top = -INFINITY;
    if (cap > 0.0f) {
      for (int64_t j = 0; j < V; j++) {
        sg[j] = cap * std::tanh(sg[j] / cap);
        top = std::fmax(top, sg[j]);
      }
    } else {
      top = _mm512_reduce_max_ps(best[g]);
    }
    __m512 sum = _mm512_setzero_ps();
    const __m512 t = _mm512_set1_ps(top);
    for (int64_t j0 = 0; j0 < V; j0 += LANES) {
      const __mmask16 live = V - j0 >= LANES ? (__mmask16)0xffff : (__mmask16)((1u << (V - j0)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + j0), t)));
      _mm512_storeu_ps(sg + j0, e);
      sum = _mm512_add_ps(sum, e);
    }
    total[g] = halving16(sum);
  }
  __m512 av[G][C];
  for (int g = 0; g < G; g++)
    for (int c = 0; c < C; c++) av[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < V; j++) {
    const KV* vj = vb + keys[j] * vs;
    __m512 vc[C];
    for (int c = 0; c < C; c++) vc[c] = load16(vj + LANES * c);
    for (int g = 0; g < G; g++) {
      const __m512 p = _mm512_set1_ps(s[g * S + j]);
      for (int c = 0; c < C; c++) av[g][c] = _mm512_fmadd_ps(p, vc[c], av[g][c]);
    }
  }
  for (int g = 0; g < G; g++) {
    const __m512 tv = _mm512_set1_ps(total[g]);
    for (int c = 0; c < C; c++) _mm512_storeu_ps(o[g] + LANES * c, _mm512_div_ps(av[g][c], tv));
  }
}
#endif

// D float16 elements widened into float32 (AVX2 and the portable C++: attend's copy before a several-row call).
template <int64_t D>
inline void widen_row(const at::Half* p, float* out) {
#if CLOVER_ATTN_AVX2
  for (int c = 0; c < D / 8; c++) _mm256_storeu_ps(out + 8 * c, load8(p + 8 * c));
#else
  for (int64_t d = 0; d < D; d++) out[d] = widen(p[d]);
#endif
}

// q [B, Hq, n, D] (any strides), k/v [B, Hkv, L, D] of KV (float or at::Half; unit stride in D), visible: for each row
// the indices of the keys it sees, in order (shared by the batch and the heads). out [B, n, Hq, D] contiguous.
// AVX-512: one task per (batch, key/value head, row, chunk of its query heads), the chunk's heads sharing each key's
// and value's loads (and a float16 cache's widening: VCVTPH2PS as they are read). AVX2 and the portable C++: one
// task per (batch, head, row), each widening float16 keys and values as it reads them; float16 with several rows
// there: first every key and value up to the last one a row sees widened once into float32 buffers (the same numbers,
// so the rows then run the same arithmetic and give the same bits as a one-row call), read by the rows and heads that
// share them.
template <int64_t D, typename KV>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::vector<std::vector<int64_t>>& visible,
            double scale, double softcap, at::Tensor& out) {
  if constexpr (std::is_same<KV, at::Half>::value && !CLOVER_ATTN_AVX512) {
    if (q.size(2) > 1) {
      int64_t L = 0;  // the keys some row sees: a static step's buffers may reach far past them
      for (const std::vector<int64_t>& keys : visible)
        if (!keys.empty() && keys.back() + 1 > L) L = keys.back() + 1;
      const int64_t B = k.size(0), Hkv = k.size(1);
      // kept by the calling thread from call to call: a fresh buffer of this size costs its pages' faults each time
      static thread_local std::vector<float> kbuf, vbuf;
      if (kbuf.size() < (size_t)(B * Hkv * L * D)) {  // grown, never shrunk; nothing in them is kept
        kbuf.clear();
        vbuf.clear();
        kbuf.resize(B * Hkv * L * D);
        vbuf.resize(B * Hkv * L * D);
      }
      float* kwp = kbuf.data();
      float* vwp = vbuf.data();
      const at::Tensor kw = at::from_blob(kwp, {B, Hkv, L, D}, q.options());
      const at::Tensor vw = at::from_blob(vwp, {B, Hkv, L, D}, q.options());
      const at::Half* kp = k.data_ptr<at::Half>();
      const at::Half* vp = v.data_ptr<at::Half>();
      const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
      const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
      at::parallel_for(0, B * Hkv * L, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; r++) {
          const int64_t b = r / (Hkv * L), h = (r / L) % Hkv, j = r % L;
          widen_row<D>(kp + b * ks0 + h * ks1 + j * ks2, kwp + r * D);
          widen_row<D>(vp + b * vs0 + h * vs1 + j * vs2, vwp + r * D);
        }
      });
      attend<D, float>(q, kw, vw, visible, scale, softcap, out);
      return;
    }
  }
  const int64_t B = q.size(0), Hq = q.size(1), n = q.size(2), Hkv = k.size(1);
  const int64_t group = Hq / Hkv;
  const float* qp = q.data_ptr<float>();
  const KV* kp = k.data_ptr<KV>();
  const KV* vp = v.data_ptr<KV>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2), qs3 = q.stride(3);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const float sc = (float)scale, cap = (float)softcap;
#if CLOVER_ATTN_AVX512
  // One task per (batch, key/value head, row, chunk of at most GMAX of its query heads): the heads of a chunk share
  // the loads of the keys and values (attend_heads).
  constexpr int GMAX = D / LANES >= 16 ? 1 : D / LANES >= 8 ? 2 : 4;
  const int64_t chunks = (group + GMAX - 1) / GMAX;
  at::parallel_for(0, B * Hkv * n * chunks, 1, [&](int64_t w0, int64_t w1) {
    static thread_local std::vector<float> s;  // scores: kept from call to call (grown, never shrunk)
    alignas(64) float qrows[GMAX][D];
    for (int64_t w = w0; w < w1; w++) {
      const int64_t b = w / (Hkv * n * chunks), hk = (w / (n * chunks)) % Hkv, i = (w / chunks) % n, c = w % chunks;
      // heads h0 .. h1 - 1 of this key/value head's group: the chunks as even as can be
      const int64_t h0 = hk * group + c * group / chunks, h1 = hk * group + (c + 1) * group / chunks;
      const std::vector<int64_t>& keys = visible[i];
      const float* qp_[GMAX];
      float* op_[GMAX];
      for (int64_t h = h0; h < h1; h++) {
        for (int64_t d = 0; d < D; d++) qrows[h - h0][d] = qp[b * qs0 + h * qs1 + i * qs2 + d * qs3];
        qp_[h - h0] = qrows[h - h0];
        op_[h - h0] = op + ((b * n + i) * Hq + h) * D;
      }
      const KV* kh = kp + b * ks0 + hk * ks1;
      const KV* vh = vp + b * vs0 + hk * vs1;
      const int64_t V = (int64_t)keys.size();
      switch (h1 - h0) {
        case 1: attend_heads<D, KV, 1>(qp_, kh, ks2, vh, vs2, keys.data(), V, sc, cap, s, op_); break;
        case 2: attend_heads<D, KV, (GMAX >= 2 ? 2 : 1)>(qp_, kh, ks2, vh, vs2, keys.data(), V, sc, cap, s, op_); break;
        case 3: attend_heads<D, KV, (GMAX >= 3 ? 3 : 1)>(qp_, kh, ks2, vh, vs2, keys.data(), V, sc, cap, s, op_); break;
        default: attend_heads<D, KV, GMAX>(qp_, kh, ks2, vh, vs2, keys.data(), V, sc, cap, s, op_); break;
      }
    }
  });
#else
  at::parallel_for(0, B * Hq * n, 1, [&](int64_t w0, int64_t w1) {
    static thread_local std::vector<float> s;  // scores: kept from call to call (grown, never shrunk)
    alignas(64) float qrow[D];
    for (int64_t w = w0; w < w1; w++) {
      const int64_t b = w / (Hq * n), h = (w / n) % Hq, i = w % n, hk = h / group;
      const std::vector<int64_t>& keys = visible[i];
      for (int64_t d = 0; d < D; d++) qrow[d] = qp[b * qs0 + h * qs1 + i * qs2 + d * qs3];
      attend_row<D, KV>(qrow, kp + b * ks0 + hk * ks1, ks2, vp + b * vs0 + hk * vs1, vs2, keys.data(),
                        (int64_t)keys.size(), sc, cap, s, op + ((b * n + i) * Hq + h) * D);
    }
  });
#endif
}

// The keys each row sees, in order: row i of a bool mask [n, L] (read 8 bytes at a time: long stretches of false
// past the committed tokens), or causal after the L - n committed keys.
std::vector<std::vector<int64_t>> visible_keys(const c10::optional<at::Tensor>& mask, int64_t n, int64_t L) {
  std::vector<std::vector<int64_t>> visible(n);
  if (mask.has_value() && mask->defined()) {
    const at::Tensor m = mask->to(at::kBool).reshape({-1, mask->size(-2), mask->size(-1)})[0].contiguous();
    TORCH_CHECK(m.size(0) == n && m.size(1) == L, "exact_rows: the mask is not [n, L]");
    const uint8_t* mp = (const uint8_t*)m.data_ptr<bool>();
    for (int64_t i = 0; i < n; i++) {
      const uint8_t* row = mp + i * L;
      int64_t count = 0, j = 0;  // first the row's keys counted (bytes of 0 or 1), so that one allocation holds them
      for (; j + 8 <= L; j += 8) {
        uint64_t word;
        std::memcpy(&word, row + j, 8);
        count += __builtin_popcountll(word);
      }
      for (; j < L; j++) count += row[j] != 0;
      visible[i].reserve(count);
      j = 0;
      for (; j + 8 <= L; j += 8) {
        uint64_t word;
        std::memcpy(&word, row + j, 8);
        if (!word) continue;
        for (int e = 0; e < 8; e++)
          if (row[j + e]) visible[i].push_back(j + e);
      }
      for (; j < L; j++)
        if (row[j]) visible[i].push_back(j);
    }
  } else {
    TORCH_CHECK(L >= n, "exact_rows: fewer keys than queries");
    for (int64_t i = 0; i < n; i++) {
      visible[i].reserve(L - n + i + 1);
      for (int64_t j = 0; j <= L - n + i; j++) visible[i].push_back(j);
    }
  }
  return visible;
}

// query [B, Hq, n, D] float32; key, value [B, Hkv, L, D], both float32 or both float16 (a float16 KV cache: half
// the bytes a step reads; each element widened exactly), unit stride along D. mask: bool [B or 1, 1, n, L]
// (true = visible; the same for the whole batch: its first entry is read) or, when undefined, causal after the
// L - n committed keys. Returns [B, n, Hq, D].
at::Tensor exact_rows(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                      const c10::optional<at::Tensor>& mask, double scale, double softcap) {
  const bool half = key.scalar_type() == at::kHalf;
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  query.scalar_type() == at::kFloat && (half || key.scalar_type() == at::kFloat) &&
                  value.scalar_type() == key.scalar_type(),
              "clover_attention::exact_rows: a float32 query, float32 or float16 keys and values, on the CPU");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4, "exact_rows: 4-d query, key and value");
  TORCH_CHECK(key.size(0) == query.size(0) && value.size(0) == query.size(0), "exact_rows: batches do not match");
  TORCH_CHECK(key.size(3) == query.size(3) && value.size(3) == query.size(3) && key.stride(3) == 1 &&
                  value.stride(3) == 1 && key.size(2) == value.size(2) && query.size(1) % key.size(1) == 0,
              "exact_rows: shapes do not fit");
  const int64_t n = query.size(2), L = key.size(2);
  const std::vector<std::vector<int64_t>> visible = visible_keys(mask, n, L);
  at::Tensor out = at::empty({query.size(0), n, query.size(1), query.size(3)}, query.options());
  if (out.numel() == 0) return out;
  switch (query.size(3)) {
#define CLOVER_D(d) \
  case d:           \
    if (half)                                                          \
      attend<d, at::Half>(query, key, value, visible, scale, softcap, out); \
    else                                                               \
      attend<d, float>(query, key, value, visible, scale, softcap, out);   \
    break;
    CLOVER_D(16) CLOVER_D(32) CLOVER_D(48) CLOVER_D(64) CLOVER_D(80) CLOVER_D(96) CLOVER_D(112) CLOVER_D(128)
    CLOVER_D(160) CLOVER_D(192) CLOVER_D(256)
#undef CLOVER_D
    default: TORCH_CHECK(false, "exact_rows: head size ", query.size(3), " (a multiple of 16 up to 256 but 144, 176, 208, 224, 240)");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(clover_attention, m) {
  m.def("exact_rows(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(clover_attention, CPU, m) { m.impl("exact_rows", &exact_rows); }

extern "C" int clover_attention_avx512() { return CLOVER_ATTN_AVX512; }

extern "C" int clover_attention_avx2() { return CLOVER_ATTN_AVX2; }
