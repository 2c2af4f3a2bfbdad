// Quantized linears for the CPU: y[M, N] = x[M, K] . W[N, K]^T with W kept in groups of 16 or 32 weights along K as
// integers and a scale (and an offset) per group, w = d * q + m, as a GGUF's Q4_0, Q4_1, Q4_K, Q5_x, Q6_K, Q8_0
// blocks hold them, multiplied by the float32 activations as they are: per group, s = sum over k (in order) of
// q[k] * x[k], then y += d * s + m * sum(x over the group), fused multiply-adds in float32. This is the dequantized
// weights' product up to the order of the float32 sums, with no rounding of the activations. The reference
// (kernels/quant.py, qlinear_ref) computes the same numbers in torch.
//
// Every output row is computed by the same instructions in the same order whatever the number of rows M and
// wherever the row sits among them: a verify over a draft tree gives each row exactly what a one-row step gives.
//
// The weights are repacked at load (kernels/quant.py, pack) into records, one per (tile of 16 outputs, group):
//   qs   the 16 outputs' integers, 16 bytes per k (8-bit: signed bytes) or per two k (4-bit: the low nibble k, the
//        high one k + 1), byte l being output l's
//   d    16 scales (float16 or float32)
//   m    16 offsets (affine formats only), same type
// so that one 512-bit register holds one k's weights of 16 outputs. Records are read in order: one stream per
// thread, the tiles split between threads.
//
// bfloat16 weights (kind BF16: a bfloat16 checkpoint, or --dtype bfloat16 on a CPU) have no groups and no scales: a
// tile's record is its 16 outputs' weights for every k in order, two k per 64 bytes (one cache line): in each
// 128-bit quarter q, 4 words of k (outputs 4q..4q+3), then the same 4 outputs' words of k + 1. Interleaving a
// quarter's low (high) words with zeros makes them the upper halves of 4 floats: the float32 weights of k (k + 1),
// exactly, in two instructions for the two k. They multiply the float32 activations as they are:
// acc = fma(w[k], x[k], acc) for k in order. Half float32's bytes; the float32 product of the same weights up to the
// order of the sums.
//
// int8 activations (the flag ACT8 on a kind of integers, as llama.cpp runs a GGUF's blocks): each row's activations are
// rounded per group to int8 with a scale, xs = max|x| / 127, xq = rint(x * (127 / max|x|)), and the integers multiply
// the integers exactly (AVX-512 VNNI: 64 byte products per instruction against 16 float32 ones; AVX2: VPMADDUBSW's 32
// into int16 pairs, VPMADDWD's into int32); then per group acc =
// fma(d * xs, s, acc) with s = sum of q[k] * xq[k] (an exact integer) and, for affine formats, acc = fma(m, xs *
// sum(xq), acc). The product is then the dequantized weights' with the rounded activations, each group's exactly, up to
// the float32 accumulation over groups; a row still does not depend on the others. Their records are those above with
// each 64-byte line of integers in VNNI order (kernels/quant.py, act8_records): byte 4 l + i holds what byte 16 i + l
// holds above, so that each 32-bit lane is four bytes of one output (4-bit: eight k's, as nibbles), and the activations
// are stored in the matching k order (act8_rows). With float_only set, such records are put back in the order above
// for the float32 path (a copy per call: for checks).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && !defined(CLOVER_GENERIC)
#include <immintrin.h>
#define CLOVER_AVX512 1
#else
#define CLOVER_AVX512 0
#endif
#if CLOVER_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define CLOVER_VNNI 1
#else
#define CLOVER_VNNI 0
#endif
// AVX2 (with FMA and F16C) where there is no AVX-512: each 16-output tile as two 8-lane halves, the same operations in
// the same order per output, so the same bits as the other paths (int8 products: VPMADDUBSW and VPMADDWD, exact)
#if !CLOVER_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(CLOVER_GENERIC)
#include <immintrin.h>
#define CLOVER_AVX2 1
#else
#define CLOVER_AVX2 0
#endif

namespace {

constexpr int LANES = 16;  // outputs per tile

constexpr int64_t BF16 = 16;  // the kind of bfloat16 weights (kernels/quant.py BF16)
constexpr int64_t ACT8 = 32;  // flag on a kind of integers: int8 activations (kernels/quant.py ACT8)

// While set, ACT8 kinds multiply the float32 activations as they are (kernels/quant.py float_activations): the checks
// that compare clover's step with a reference of other arithmetic run so, in the same programs.
std::atomic<bool> float_only{false};

// kind: bits (4 or 8) | group (16 or 32) | affine | float32 scales, in one integer (kernels/quant.py kind_code); or
// BF16: records of 32 k's bfloat16 weights (no scales)
struct Kind {
  int bits, group;
  bool affine, f32;
  explicit Kind(int64_t code)
      : bits(code == BF16 ? 16 : code & 1 ? 8 : 4), group(code == BF16 ? 32 : code & 2 ? 16 : 32),
        affine(code != BF16 && (code & 4)), f32(code != BF16 && (code & 8)) {}
  int qbytes() const { return LANES * group * bits / 8; }  // a record's integers (or bfloat16 words)
  int record() const { return qbytes() + (bits == 16 ? 0 : (affine ? 2 : 1) * LANES * (f32 ? 4 : 2)); }
};

inline float half_to_float(uint16_t h) {
  uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff, f;
  if (exp == 0) {
    if (man == 0) {
      f = sign << 31;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) { man <<= 1; exp--; }
      man &= 0x3ff;
      f = (sign << 31) | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    f = (sign << 31) | 0x7f800000 | (man << 13);
  } else {
    f = (sign << 31) | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

// Output l's integer for k from its byte (4-bit: nibbles of k and k + 1 in one byte; 8-bit: signed).
template <int BITS>
inline int q_of(uint8_t byte, int k) {
  if (BITS == 4) return k % 2 ? byte >> 4 : byte & 0x0f;
  return (int8_t)byte;
}

// That byte's place in a group's record: 16 bytes (one per output) per k, or per pair of k (4-bit).
template <int BITS>
inline int q_byte(int k, int l) {
  return BITS == 4 ? 16 * (k / 2) + l : 16 * k + l;
}

// Output l's integer for k in a group's record at p.
template <int BITS>
inline int q_at(const uint8_t* p, int k, int l) {
  return q_of<BITS>(p[q_byte<BITS>(k, l)], k);
}

// The same integer in a record of ACT8 kinds, whose lines hold byte 16 i + l at 4 l + i.
template <int BITS>
inline int q_at_act8(const uint8_t* p, int k, int l) {
  const int b = q_byte<BITS>(k, l);
  return q_of<BITS>(p[64 * (b / 64) + 4 * l + (b % 64) / 16], k);
}

// Output l's scale (or offset) in a record's 16 float16 or float32 values at p.
template <bool F32>
inline float scale_at(const uint8_t* p, int l) {
  float v;
  if (F32) {
    std::memcpy(&v, p + 4 * l, 4);
  } else {
    uint16_t h;
    std::memcpy(&h, p + 2 * l, 2);
    v = half_to_float(h);
  }
  return v;
}

#if CLOVER_AVX512
// The 16 scales (or offsets) at p, as float32.
template <bool F32>
inline __m512 scales16(const uint8_t* p) {
  return F32 ? _mm512_loadu_ps((const float*)p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// The running totals of T tiles for R rows into y (the last tile's outputs past N left out).
template <int R, int T>
inline void store_tiles(float (*acc)[R][LANES], float* y, int64_t N, int64_t n0) {
  for (int t = 0; t < T; t++) {
    const int64_t first = n0 + t * LANES;
    const int64_t valid = N - first < LANES ? N - first : LANES;
    if (valid <= 0) break;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N + first, mask, _mm512_load_ps(acc[t][r]));
  }
}
#endif

#if CLOVER_AVX2
// Half h (outputs 8 h .. 8 h + 7) of the 16 scales (or offsets) at p, as float32.
template <bool F32>
inline __m256 scales8(const uint8_t* p, int h) {
  return F32 ? _mm256_loadu_ps((const float*)p + 8 * h) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p + h));
}

// The running totals of T tiles for R rows into y (the last tile's outputs past N left out).
template <int R, int T>
inline void copy_tiles(float (*acc)[R][LANES], float* y, int64_t N, int64_t n0) {
  for (int t = 0; t < T; t++) {
    const int64_t first = n0 + t * LANES;
    const int64_t valid = N - first < LANES ? N - first : LANES;
    if (valid <= 0) break;
    for (int r = 0; r < R; r++) std::memcpy(y + r * N + first, acc[t][r], valid * sizeof(float));
  }
}
#endif

// Part g of `parts` of the len bytes at pf asked of the memory ahead of their use (the next block's weights: see
// run_tasks), a few lines per group, so that the requests spread over the call. No effect on any result.
inline void prefetch_part(const uint8_t* pf, int64_t len, int64_t g, int64_t parts) {
  if (len <= 0) return;
  const int64_t chunk = ((len + parts - 1) / parts + 63) & ~int64_t(63);
  const int64_t lo = g * chunk, hi = lo + chunk < len ? lo + chunk : len;
  for (int64_t o = lo; o < hi; o += 64) __builtin_prefetch(pf + o, 0, 3);
}

// T tiles (consecutive, 16 outputs each) for R rows of x, group by group: s = sum over the group's k, in order, of
// q[k] * x[k]; acc = d * s + acc; acc = m * sx + acc (sx: the sum of x over the group, in order; affine formats).
// T > 1 only gives the core independent sums to overlap; a row's arithmetic is the same for any R and T.
template <int BITS, int GROUP, bool AFFINE, bool F32, int R, int T>
void tiles_rows(const uint8_t* rec, int64_t tile_bytes, int64_t groups, const float* x, const float* sx, int64_t K,
                float* y, int64_t N, int64_t n0, const uint8_t* pf, int64_t pf_len) {
  constexpr int QB = LANES * GROUP * BITS / 8;
  constexpr int SB = LANES * (F32 ? 4 : 2);
  constexpr int REC = QB + (AFFINE ? 2 : 1) * SB;
#if CLOVER_AVX512
  // the group's sums s in registers; the running totals in memory (L1), updated once per group
  alignas(64) float acc[T][R][LANES];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++) _mm512_store_ps(acc[t][r], _mm512_setzero_ps());
  const __m512i low = _mm512_set1_epi32(0x0f);
  for (int64_t g = 0; g < groups; g++) {
    prefetch_part(pf, pf_len, g, groups);
    __m512 s[T][R];
    for (int t = 0; t < T; t++)
      for (int r = 0; r < R; r++) s[t][r] = _mm512_setzero_ps();
    const float* xg = x + g * GROUP;
    if (BITS == 4) {
      for (int j = 0; j < GROUP / 2; j++) {
        __m512 q0[T], q1[T];
        for (int t = 0; t < T; t++) {
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(rec + t * tile_bytes + g * REC + 16 * j)));
          q0[t] = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
          q1[t] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
        }
        for (int r = 0; r < R; r++) {
          const __m512 x0 = _mm512_set1_ps(xg[r * K + 2 * j]), x1 = _mm512_set1_ps(xg[r * K + 2 * j + 1]);
          for (int t = 0; t < T; t++) {
            s[t][r] = _mm512_fmadd_ps(q0[t], x0, s[t][r]);
            s[t][r] = _mm512_fmadd_ps(q1[t], x1, s[t][r]);
          }
        }
      }
    } else {
      for (int k = 0; k < GROUP; k++) {
        __m512 q[T];
        for (int t = 0; t < T; t++)
          q[t] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(rec + t * tile_bytes + g * REC + 16 * k))));
        for (int r = 0; r < R; r++) {
          const __m512 xk = _mm512_set1_ps(xg[r * K + k]);
          for (int t = 0; t < T; t++) s[t][r] = _mm512_fmadd_ps(q[t], xk, s[t][r]);
        }
      }
    }
    for (int t = 0; t < T; t++) {
      const uint8_t* p = rec + t * tile_bytes + g * REC + QB;
      const __m512 d = scales16<F32>(p);
      const __m512 m = AFFINE ? scales16<F32>(p + SB) : _mm512_setzero_ps();
      for (int r = 0; r < R; r++) {
        __m512 a = _mm512_fmadd_ps(d, s[t][r], _mm512_load_ps(acc[t][r]));
        if (AFFINE) a = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * groups + g]), a);
        _mm512_store_ps(acc[t][r], a);
      }
    }
  }
  store_tiles<R, T>(acc, y, N, n0);
#elif CLOVER_AVX2
  alignas(32) float acc[T][R][LANES];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++) _mm256_store_ps(acc[t][r] + 8 * h, _mm256_setzero_ps());
  const __m256i low = _mm256_set1_epi32(0x0f);
  for (int64_t g = 0; g < groups; g++) {
    prefetch_part(pf, pf_len, g, groups);
    __m256 s[T][R][2];
    for (int t = 0; t < T; t++)
      for (int r = 0; r < R; r++) s[t][r][0] = s[t][r][1] = _mm256_setzero_ps();
    const float* xg = x + g * GROUP;
    if (BITS == 4) {
      for (int j = 0; j < GROUP / 2; j++)
        for (int t = 0; t < T; t++) {
          const uint8_t* p = rec + t * tile_bytes + g * REC + 16 * j;
          __m256 q0[2], q1[2];
          for (int h = 0; h < 2; h++) {
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h)));
            q0[h] = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
            q1[h] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          }
          for (int r = 0; r < R; r++) {
            const __m256 x0 = _mm256_broadcast_ss(xg + r * K + 2 * j), x1 = _mm256_broadcast_ss(xg + r * K + 2 * j + 1);
            for (int h = 0; h < 2; h++) {
              s[t][r][h] = _mm256_fmadd_ps(q0[h], x0, s[t][r][h]);
              s[t][r][h] = _mm256_fmadd_ps(q1[h], x1, s[t][r][h]);
            }
          }
        }
    } else {
      for (int k = 0; k < GROUP; k++)
        for (int t = 0; t < T; t++) {
          const uint8_t* p = rec + t * tile_bytes + g * REC + 16 * k;
          __m256 q[2];
          for (int h = 0; h < 2; h++)
            q[h] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8 * h))));
          for (int r = 0; r < R; r++) {
            const __m256 xk = _mm256_broadcast_ss(xg + r * K + k);
            for (int h = 0; h < 2; h++) s[t][r][h] = _mm256_fmadd_ps(q[h], xk, s[t][r][h]);
          }
        }
    }
    for (int t = 0; t < T; t++) {
      const uint8_t* p = rec + t * tile_bytes + g * REC + QB;
      for (int h = 0; h < 2; h++) {
        const __m256 d = scales8<F32>(p, h);
        const __m256 m = AFFINE ? scales8<F32>(p + SB, h) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
          __m256 a = _mm256_fmadd_ps(d, s[t][r][h], _mm256_load_ps(acc[t][r] + 8 * h));
          if (AFFINE) a = _mm256_fmadd_ps(m, _mm256_broadcast_ss(sx + r * groups + g), a);
          _mm256_store_ps(acc[t][r] + 8 * h, a);
        }
      }
    }
  }
  copy_tiles<R, T>(acc, y, N, n0);
#else
  for (int t = 0; t < T; t++) {
    float acc[R][LANES];
    for (int r = 0; r < R; r++)
      for (int l = 0; l < LANES; l++) acc[r][l] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
      const uint8_t* p = rec + t * tile_bytes + g * REC;
      const float* xg = x + g * GROUP;
      for (int l = 0; l < LANES; l++) {
        const float d = scale_at<F32>(p + QB, l), m = AFFINE ? scale_at<F32>(p + QB + SB, l) : 0.0f;
        for (int r = 0; r < R; r++) {
          float s = 0.0f;
          for (int k = 0; k < GROUP; k++) s = std::fma((float)q_at<BITS>(p, k, l), xg[r * K + k], s);
          acc[r][l] = std::fma(d, s, acc[r][l]);
          if (AFFINE) acc[r][l] = std::fma(m, sx[r * groups + g], acc[r][l]);
        }
      }
    }
    for (int r = 0; r < R; r++)
      for (int64_t l = 0; l < LANES && n0 + t * LANES + l < N; l++) y[r * N + n0 + t * LANES + l] = acc[r][l];
  }
#endif
}

// T tiles of bfloat16 weights for R rows of x: acc = fma(w[k], x[k], acc), k in order (see the top of the file).
template <int R, int T>
void bf16_tiles_rows(const uint8_t* rec, int64_t tile_bytes, const float* x, int64_t K, float* y, int64_t N,
                     int64_t n0, const uint8_t* pf, int64_t pf_len) {
#if CLOVER_AVX512
  __m512 acc[T][R];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++) acc[t][r] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 2) {
    if (k % 32 == 0) prefetch_part(pf, pf_len, k / 32, (K + 31) / 32);
    __m512 w0[T], w1[T];
    for (int t = 0; t < T; t++) {
      const __m512i v = _mm512_loadu_si512((const void*)(rec + t * tile_bytes + 2 * LANES * k));
      w0[t] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
      w1[t] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
    }
    for (int r = 0; r < R; r++) {
      const __m512 x0 = _mm512_set1_ps(x[r * K + k]), x1 = _mm512_set1_ps(x[r * K + k + 1]);
      for (int t = 0; t < T; t++) acc[t][r] = _mm512_fmadd_ps(w0[t], x0, acc[t][r]);
      for (int t = 0; t < T; t++) acc[t][r] = _mm512_fmadd_ps(w1[t], x1, acc[t][r]);
    }
  }
  for (int t = 0; t < T; t++) {
    const int64_t first = n0 + t * LANES;
    const int64_t valid = N - first < LANES ? N - first : LANES;
    if (valid <= 0) break;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + r * N + first, mask, acc[t][r]);
  }
#elif CLOVER_AVX2
  // a 32-byte half of a k-pair's line holds quarters 2 h and 2 h + 1: outputs 8 h .. 8 h + 7 of k (low words of each
  // 128-bit lane) and of k + 1 (high words)
  alignas(32) float acc[T][R][LANES];
  __m256 a[T][R][2];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++) a[t][r][0] = a[t][r][1] = _mm256_setzero_ps();
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 2) {
    if (k % 32 == 0) prefetch_part(pf, pf_len, k / 32, (K + 31) / 32);
    for (int t = 0; t < T; t++)
      for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(rec + t * tile_bytes + 2 * LANES * k + 32 * h));
        const __m256 w0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
        const __m256 w1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
        for (int r = 0; r < R; r++) {
          a[t][r][h] = _mm256_fmadd_ps(w0, _mm256_broadcast_ss(x + r * K + k), a[t][r][h]);
          a[t][r][h] = _mm256_fmadd_ps(w1, _mm256_broadcast_ss(x + r * K + k + 1), a[t][r][h]);
        }
      }
  }
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++) _mm256_store_ps(acc[t][r] + 8 * h, a[t][r][h]);
  copy_tiles<R, T>(acc, y, N, n0);
#else
  for (int t = 0; t < T; t++)
    for (int64_t l = 0; l < LANES && n0 + t * LANES + l < N; l++)
      for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t k = 0; k < K; k++) {
          // the word of output l = 4q + i at k: quarter q of k's line, after the 4 words of k - 1 when k is odd
          const int64_t word = LANES * (k & ~int64_t(1)) + 8 * (l / 4) + 4 * (k & 1) + l % 4;
          uint16_t h;
          std::memcpy(&h, rec + t * tile_bytes + 2 * word, 2);
          const uint32_t bits = (uint32_t)h << 16;
          float w;
          std::memcpy(&w, &bits, 4);
          acc = std::fma(w, x[r * K + k], acc);
        }
        y[r * N + n0 + t * LANES + l] = acc;
      }
#endif
}

// Where k of a group sits in a row's int8 activations (act8_rows): 4-bit records hold k and k + 1 in one byte's two
// nibbles, so each 8 k's are stored as the even ones then the odd ones; 8-bit records in k order.
template <int BITS>
inline int act8_slot(int k) {
  return BITS == 4 ? (k & ~7) + 4 * (k & 1) + ((k & 7) >> 1) : k;
}

// Each row's activations per group rounded to int8: xs = max|x| / 127, xq = rint(x * (127 / max|x|)) (0 for a group
// of zeros), stored in act8_slot order (for 8-bit records as xq + 128: VNNI multiplies unsigned bytes by signed ones,
// the weights being the signed ones); and sq = xs * (sum of xq over the group), the rounded activations' sum.
template <int BITS, int GROUP>
void act8_rows(const float* x, int64_t M, int64_t K, uint8_t* xq, float* xs, float* sq) {
  const int64_t groups = K / GROUP;
  for (int64_t r = 0; r < M; r++)
    for (int64_t g = 0; g < groups; g++) {
      const float* xg = x + r * K + g * GROUP;
      uint8_t* out = xq + r * K + g * GROUP;
#if CLOVER_AVX512
      __m512 v[GROUP / 16], top = _mm512_setzero_ps();
      for (int i = 0; i < GROUP / 16; i++) {
        v[i] = _mm512_loadu_ps(xg + 16 * i);
        top = _mm512_max_ps(top, _mm512_abs_ps(v[i]));
      }
      const float amax = _mm512_reduce_max_ps(top);
#else
      float amax = 0.0f;
      for (int k = 0; k < GROUP; k++) amax = std::fmax(amax, std::fabs(xg[k]));
#endif
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      const float scale = amax / 127.0f;
      int32_t total = 0;
#if CLOVER_AVX512
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      __m512i sum = _mm512_setzero_si512();
      for (int i = 0; i < GROUP / 16; i++) {  // rounded to nearest even, as nearbyint
        const __m512i q = _mm512_min_epi32(hi, _mm512_max_epi32(lo, _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inv)))));
        sum = _mm512_add_epi32(sum, q);
        __m128i b = _mm512_cvtepi32_epi8(q);
        if (BITS == 4) b = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15));
        else b = _mm_xor_si128(b, _mm_set1_epi8((char)0x80));
        _mm_storeu_si128((__m128i*)(out + 16 * i), b);
      }
      total = _mm512_reduce_add_epi32(sum);
#else
      for (int k = 0; k < GROUP; k++) {
        const int q = (int)std::fmin(127.0f, std::fmax(-127.0f, std::nearbyint(xg[k] * inv)));
        total += q;
        out[act8_slot<BITS>(k)] = (uint8_t)(BITS == 4 ? (int8_t)q : q + 128);
      }
#endif
      xs[r * groups + g] = scale;
      sq[r * groups + g] = scale * (float)total;
    }
}

// T tiles for R rows of int8 activations: per group s = sum of q[k] * xq[k] (int32, exact), then
// acc = fma(d * xs, s, acc) and, affine, acc = fma(m, sq, acc) (sq: xs * the sum of xq over the group).
template <int BITS, int GROUP, bool AFFINE, bool F32, int R, int T>
void act8_tiles_rows(const uint8_t* rec, int64_t tile_bytes, int64_t groups, const uint8_t* xq, const float* xs,
                     const float* sq, int64_t K, float* y, int64_t N, int64_t n0, const uint8_t* pf, int64_t pf_len) {
  constexpr int QB = LANES * GROUP * BITS / 8;
  constexpr int SB = LANES * (F32 ? 4 : 2);
  constexpr int REC = QB + (AFFINE ? 2 : 1) * SB;
#if CLOVER_VNNI
  alignas(64) float acc[T][R][LANES];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++) _mm512_store_ps(acc[t][r], _mm512_setzero_ps());
  const __m512i low = _mm512_set1_epi8(0x0f), ones = _mm512_set1_epi8(1);
  constexpr int LINES = QB / 64;  // 4-bit: 8 k's per line (two nibbles of 4 pairs); 8-bit: 4 k's
  for (int64_t g = 0; g < groups; g++) {
    prefetch_part(pf, pf_len, g, groups);
    __m512i s[T][R], qsum[T];
    for (int t = 0; t < T; t++) {
      qsum[t] = _mm512_setzero_si512();
      for (int r = 0; r < R; r++) s[t][r] = _mm512_setzero_si512();
    }
    const uint8_t* xg = xq + g * GROUP;
    // unrolled whole, so that the R x T sums stay in registers (rolled, GCC moved them between registers and the
    // stack every line: 8 rows' linears 1.3x slower on a Zen 5)
#pragma GCC unroll 8
    for (int c = 0; c < LINES; c++) {
      __m512i w0[T], w1[T];
      for (int t = 0; t < T; t++) {
        // VNNI order: lane l holds output l's four bytes
        const __m512i v = _mm512_loadu_si512((const void*)(rec + t * tile_bytes + g * REC + 64 * c));
        if (BITS == 4) {
          w0[t] = _mm512_and_si512(v, low);                         // k = 8c, 8c + 2, 8c + 4, 8c + 6
          w1[t] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);   // k = 8c + 1, ... 8c + 7
        } else {
          w0[t] = v;                                                // k = 4c ... 4c + 3, signed
          qsum[t] = _mm512_dpbusd_epi32(qsum[t], ones, v);              // their sum, for the + 128 of the activations
        }
      }
      for (int r = 0; r < R; r++) {
        if (BITS == 4) {
          int32_t e, o;
          std::memcpy(&e, xg + r * K + 8 * c, 4);
          std::memcpy(&o, xg + r * K + 8 * c + 4, 4);
          const __m512i x0 = _mm512_set1_epi32(e), x1 = _mm512_set1_epi32(o);
          for (int t = 0; t < T; t++) {
            s[t][r] = _mm512_dpbusd_epi32(s[t][r], w0[t], x0);
            s[t][r] = _mm512_dpbusd_epi32(s[t][r], w1[t], x1);
          }
        } else {
          int32_t e;
          std::memcpy(&e, xg + r * K + 4 * c, 4);
          const __m512i x0 = _mm512_set1_epi32(e);
          for (int t = 0; t < T; t++) s[t][r] = _mm512_dpbusd_epi32(s[t][r], x0, w0[t]);
        }
      }
    }
    for (int t = 0; t < T; t++) {
      const uint8_t* p = rec + t * tile_bytes + g * REC + QB;
      const __m512 d = scales16<F32>(p);
      const __m512 m = AFFINE ? scales16<F32>(p + SB) : _mm512_setzero_ps();
      const __m512i shift = _mm512_slli_epi32(qsum[t], 7);
      for (int r = 0; r < R; r++) {
        const __m512i si = BITS == 4 ? s[t][r] : _mm512_sub_epi32(s[t][r], shift);
        const __m512 dx = _mm512_mul_ps(d, _mm512_set1_ps(xs[r * groups + g]));
        __m512 a = _mm512_fmadd_ps(dx, _mm512_cvtepi32_ps(si), _mm512_load_ps(acc[t][r]));
        if (AFFINE) a = _mm512_fmadd_ps(m, _mm512_set1_ps(sq[r * groups + g]), a);
        _mm512_store_ps(acc[t][r], a);
      }
    }
  }
  store_tiles<R, T>(acc, y, N, n0);
#elif CLOVER_AVX2
  // the same sums of four byte products per 32-bit lane, by VPMADDUBSW (pairs to int16: no pair can saturate, 4-bit
  // 15 x 127 x 2, 8-bit 128 x 127 x 2 with the sign moved onto the activations) and VPMADDWD; 8-bit records' products
  // taken with the activations' own signs (xq + 128 back to xq), so no correction for the 128
  alignas(32) float acc[T][R][LANES];
  for (int t = 0; t < T; t++)
    for (int r = 0; r < R; r++)
      for (int h = 0; h < 2; h++) _mm256_store_ps(acc[t][r] + 8 * h, _mm256_setzero_ps());
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8((char)0x80);
  constexpr int LINES = QB / 64;
  static_assert(BITS == 8 || LINES <= 4, "4-bit pair sums must fit int16");
  for (int64_t g = 0; g < groups; g++) {
    prefetch_part(pf, pf_len, g, groups);
    __m256i s[T][R][2];
    for (int t = 0; t < T; t++)
      for (int r = 0; r < R; r++) s[t][r][0] = s[t][r][1] = _mm256_setzero_si256();
    const uint8_t* xg = xq + g * GROUP;
    for (int c = 0; c < LINES; c++)
      for (int t = 0; t < T; t++)
        for (int h = 0; h < 2; h++) {  // lanes 8 h .. 8 h + 7: outputs 8 h ..
          const __m256i v = _mm256_loadu_si256((const __m256i*)(rec + t * tile_bytes + g * REC + 64 * c + 32 * h));
          if (BITS == 4) {
            const __m256i w0 = _mm256_and_si256(v, low), w1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int r = 0; r < R; r++) {
              int32_t e, o;
              std::memcpy(&e, xg + r * K + 8 * c, 4);
              std::memcpy(&o, xg + r * K + 8 * c + 4, 4);
              const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(w0, _mm256_set1_epi32(e)),
                                                     _mm256_maddubs_epi16(w1, _mm256_set1_epi32(o)));
              s[t][r][h] = _mm256_add_epi16(s[t][r][h], pairs);  // int16 until the group's end: |sum| <= 30480
            }
          } else {
            const __m256i w = _mm256_abs_epi8(v);
            for (int r = 0; r < R; r++) {
              int32_t e;
              std::memcpy(&e, xg + r * K + 4 * c, 4);
              const __m256i xs8 = _mm256_xor_si256(_mm256_set1_epi32(e), flip);
              const __m256i pairs = _mm256_maddubs_epi16(w, _mm256_sign_epi8(xs8, v));
              s[t][r][h] = _mm256_add_epi32(s[t][r][h], _mm256_madd_epi16(pairs, ones));
            }
          }
        }
    if (BITS == 4)  // the int16 pair sums (at most 4 lines x 2 x 15 x 127 x 2 each) to int32 lanes
      for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++)
          for (int h = 0; h < 2; h++) s[t][r][h] = _mm256_madd_epi16(s[t][r][h], ones);
    for (int t = 0; t < T; t++) {
      const uint8_t* p = rec + t * tile_bytes + g * REC + QB;
      for (int h = 0; h < 2; h++) {
        const __m256 d = scales8<F32>(p, h);
        const __m256 m = AFFINE ? scales8<F32>(p + SB, h) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
          const __m256 dx = _mm256_mul_ps(d, _mm256_broadcast_ss(xs + r * groups + g));
          __m256 a = _mm256_fmadd_ps(dx, _mm256_cvtepi32_ps(s[t][r][h]), _mm256_load_ps(acc[t][r] + 8 * h));
          if (AFFINE) a = _mm256_fmadd_ps(m, _mm256_broadcast_ss(sq + r * groups + g), a);
          _mm256_store_ps(acc[t][r] + 8 * h, a);
        }
      }
    }
  }
  copy_tiles<R, T>(acc, y, N, n0);
#else
  for (int t = 0; t < T; t++)
    for (int l = 0; l < LANES; l++) {
      if (n0 + t * LANES + l >= N) break;
      for (int r = 0; r < R; r++) {
        float acc = 0.0f;
        for (int64_t g = 0; g < groups; g++) {
          const uint8_t* p = rec + t * tile_bytes + g * REC;
          const uint8_t* xg = xq + r * K + g * GROUP;
          int32_t s = 0;
          for (int k = 0; k < GROUP; k++) {
            const int a = BITS == 4 ? (int)(int8_t)xg[act8_slot<BITS>(k)] : (int)xg[k] - 128;
            s += q_at_act8<BITS>(p, k, l) * a;
          }
          const float d = scale_at<F32>(p + QB, l), m = AFFINE ? scale_at<F32>(p + QB + SB, l) : 0.0f;
          const float dx = d * xs[r * groups + g];
          acc = std::fma(dx, (float)s, acc);
          if (AFFINE) acc = std::fma(m, sq[r * groups + g], acc);
        }
        y[r * N + n0 + t * LANES + l] = acc;
      }
    }
#endif
}

// The tiles split evenly between threads (one contiguous range each); a thread's tiles go in blocks of 2, each block
// for all rows, as many at a time as the table below gives for the rows left. While a block runs, each call asks the
// memory for a part of the next block's bytes: its pass's share (rows r .. r + R - 1 of M: the fraction r / M ..
// (r + R) / M), and of that its tiles' share of the block, so that the passes cover the next block once whatever their
// tiles per call. With several passes over the rows, a block's weights come from the cache after the first and the
// memory would otherwise wait; with one, the requests run a block ahead of the hardware's. All of SmolLM2's linears for a step, against blocks of 8 (1 row) or 4 without the requests, on a Zen 5:
// 1 row 0.95x the time, 2 rows 0.69x, 4 rows 0.58x, 8 rows 0.61x, 16 rows 0.71x, 32 rows 0.79x (the AVX2 path built
// there: 1-2 rows 0.61-0.66x, 4-16 rows 0.94-0.99x); docs/BENCHMARKS.md, 2026-12-07 (16:17-19:17 UTC).
// op.template tiles<R, T>(r, t, pf, len) computes T tiles from tile t for R rows from row r, asking for the len bytes
// at pf as it goes.
// (rows, tiles) per call, by rows left: 8 or more, 4, 2, 1 (AVX2: 16 registers of 8 lanes, so at most 4 (row, tile)
// pairs' sums in registers). The int8-activation kernel on AVX-512 takes 4 rows x 2 tiles from 4 rows up (ACT8_RT):
// 8 of its int32 sums and 8 float32 totals fit in registers together (8 x 2 left the totals in memory; all of
// SmolLM2's linears at 12-32 rows 0.80-0.93x the time, 1-8 rows the same; docs/BENCHMARKS.md, 2026-12-07).
#if CLOVER_AVX2
constexpr int RT[4][2] = {{4, 1}, {4, 1}, {2, 2}, {1, 2}};
constexpr auto& ACT8_RT = RT;
#else
constexpr int RT[4][2] = {{8, 2}, {4, 2}, {2, 2}, {1, 2}};
constexpr int ACT8_RT[4][2] = {{4, 2}, {4, 2}, {2, 2}, {1, 2}};
#endif

// op.rt: its (rows, tiles) table (RT or ACT8_RT)
template <class Op>
void run_tasks(int64_t M, int64_t tiles, const Op& op) {
  constexpr auto& RT = Op::rt;
  constexpr int64_t BLOCK = 2;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t b = t0; b < t1; b += BLOCK) {
      const int64_t t_end = b + BLOCK < t1 ? b + BLOCK : t1;
      const int64_t next_end = t_end + BLOCK < t1 ? t_end + BLOCK : t1;
      for (int64_t r = 0; r < M;) {
        const int64_t left = M - r;
        int64_t t = b;
        // the next block's bytes (those that exist): rows r .. r + rr - 1's share of them, and of that the part of a
        // call over tiles t .. t + tt - 1 of this block's t_end - b (the same whatever the passes' tiles per call)
        auto ahead_of = [&](int64_t rr, int64_t tt, int64_t& len) -> const uint8_t* {
          len = 0;
          if (t_end >= next_end) return nullptr;
          const int64_t bytes = (next_end - t_end) * op.tile_bytes, lo = bytes * r / M, hi = bytes * (r + rr) / M;
          const int64_t nb = t_end - b, a = lo + (hi - lo) * (t - b) / nb, z = lo + (hi - lo) * (t - b + tt) / nb;
          len = z - a;
          return op.packed + t_end * op.tile_bytes + a;
        };
#define CLOVER_RT(RR, TT)                                                  \
  for (; t + TT <= t_end; t += TT) {                                       \
    int64_t len;                                                           \
    const uint8_t* pf = ahead_of(RR, TT, len);                             \
    op.template tiles<RR, TT>(r, t, pf, len);                              \
  }                                                                        \
  for (; t < t_end; t++) {                                                 \
    int64_t len;                                                           \
    const uint8_t* pf = ahead_of(RR, 1, len);                              \
    op.template tiles<RR, 1>(r, t, pf, len);                               \
  }                                                                        \
  r += RR;
        if (left >= RT[0][0]) {
          CLOVER_RT(RT[0][0], RT[0][1])
        } else if (left >= RT[1][0]) {
          CLOVER_RT(RT[1][0], RT[1][1])
        } else if (left >= RT[2][0]) {
          CLOVER_RT(RT[2][0], RT[2][1])
        } else {
          CLOVER_RT(RT[3][0], RT[3][1])
        }
#undef CLOVER_RT
      }
    }
  });
}

template <int BITS, int GROUP, bool AFFINE, bool F32>
struct GroupedTiles {
  static constexpr auto& rt = RT;
  const uint8_t* packed;
  int64_t tile_bytes, groups;
  const float *x, *sums;
  int64_t K;
  float* y;
  int64_t N;
  template <int R, int T>
  void tiles(int64_t r, int64_t t, const uint8_t* pf, int64_t pf_len) const {
    tiles_rows<BITS, GROUP, AFFINE, F32, R, T>(packed + t * tile_bytes, tile_bytes, groups, x + r * K,
                                               sums + r * groups, K, y + r * N, N, t * LANES, pf, pf_len);
  }
};

template <int BITS, int GROUP, bool AFFINE, bool F32>
struct Act8Tiles {
  static constexpr auto& rt = ACT8_RT;
  const uint8_t* packed;
  int64_t tile_bytes, groups;
  const uint8_t* xq;
  const float *xs, *sums;
  int64_t K;
  float* y;
  int64_t N;
  template <int R, int T>
  void tiles(int64_t r, int64_t t, const uint8_t* pf, int64_t pf_len) const {
    act8_tiles_rows<BITS, GROUP, AFFINE, F32, R, T>(packed + t * tile_bytes, tile_bytes, groups, xq + r * K,
                                                    xs + r * groups, sums + r * groups, K, y + r * N, N, t * LANES,
                                                    pf, pf_len);
  }
};

struct Bf16Tiles {
  static constexpr auto& rt = RT;
  const uint8_t* packed;
  int64_t tile_bytes;
  const float* x;
  int64_t K;
  float* y;
  int64_t N;
  template <int R, int T>
  void tiles(int64_t r, int64_t t, const uint8_t* pf, int64_t pf_len) const {
    bf16_tiles_rows<R, T>(packed + t * tile_bytes, tile_bytes, x + r * K, K, y + r * N, N, t * LANES, pf, pf_len);
  }
};

template <int BITS, int GROUP, bool AFFINE, bool F32>
void run(const uint8_t* packed, int64_t M, int64_t N, int64_t K, const float* x, float* y, bool act8) {
  constexpr int REC = LANES * GROUP * BITS / 8 + (AFFINE ? 2 : 1) * LANES * (F32 ? 4 : 2);
  const int64_t groups = K / GROUP, tiles = (N + LANES - 1) / LANES, tile_bytes = groups * REC;
  // each row's sum over each group (in order), for the offsets' term
  if (act8) {
    // kept by the calling thread from call to call (grown, never shrunk; nothing in them is kept): a step makes over a
    // hundred calls
    static thread_local std::vector<uint8_t> xq;
    static thread_local std::vector<float> xs, sq;
    if (xq.size() < (size_t)(M * K)) xq.resize(M * K);
    if (xs.size() < (size_t)(M * groups)) {
      xs.resize(M * groups);
      sq.resize(M * groups);
    }
    act8_rows<BITS, GROUP>(x, M, K, xq.data(), xs.data(), sq.data());
    run_tasks(M, tiles, Act8Tiles<BITS, GROUP, AFFINE, F32>{packed, tile_bytes, groups, xq.data(), xs.data(),
                                                          sq.data(), K, y, N});
    return;
  }
  std::vector<float> sums(AFFINE ? M * groups : 0);
  for (int64_t r = 0; AFFINE && r < M; r++)
    for (int64_t g = 0; g < groups; g++) {
      float s = 0.0f;
      for (int k = 0; k < GROUP; k++) s += x[r * K + g * GROUP + k];
      sums[r * groups + g] = s;
    }
  run_tasks(M, tiles, GroupedTiles<BITS, GROUP, AFFINE, F32>{packed, tile_bytes, groups, x, sums.data(), K, y, N});
}

void run_bf16(const uint8_t* packed, int64_t M, int64_t N, int64_t K, const float* x, float* y) {
  const int64_t tiles = (N + LANES - 1) / LANES;
  run_tasks(M, tiles, Bf16Tiles{packed, 2 * LANES * K, x, K, y, N});
}

// ACT8 records (lines in VNNI order: byte 4 l + i from 16 i + l) back in the plain order, a copy.
at::Tensor plain_order(const at::Tensor& packed, const Kind& k) {
  at::Tensor out = packed.clone();
  const int64_t rec = k.record(), qb = k.qbytes();
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < packed.numel() / rec; r++)
    for (int64_t line = 0; line < qb; line += 64)
      for (int l = 0; l < LANES; l++)
        for (int i = 0; i < 4; i++) dst[r * rec + line + 16 * i + l] = src[r * rec + line + 4 * l + i];
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t in_features,
                  int64_t kind) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "clover_quant::linear runs on the CPU");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed weights must be contiguous uint8");
  TORCH_CHECK(kind == BF16 || (kind >= 0 && (kind & ~(ACT8 | 15)) == 0), "unknown packed weight kind ", kind);
  const bool act8 = (kind & ACT8) && !float_only.load(std::memory_order_relaxed);
  const Kind k(kind & ~ACT8);
  TORCH_CHECK(x.size(-1) <= in_features && in_features % k.group == 0, "input features do not fit the packed weights");
  const int64_t tiles = (out_features + LANES - 1) / LANES, groups = in_features / k.group;
  TORCH_CHECK(packed.numel() == tiles * groups * k.record(), "packed weights of the wrong size");
  auto sizes = x.sizes().vec();
  at::Tensor x2 = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  if (x2.size(1) < in_features) x2 = at::constant_pad_nd(x2, {0, in_features - x2.size(1)});
  x2 = x2.contiguous();
  const int64_t M = x2.size(0);
  sizes.back() = out_features;
  at::Tensor y = at::empty({M, out_features}, x2.options());
  if (M > 0) {
    // float32 activations on VNNI-ordered records (checks): those records in the plain order, a copy
    const at::Tensor records = (kind & ACT8) && !act8 ? plain_order(packed, k) : packed;
    const uint8_t* p = records.data_ptr<uint8_t>();
    const float* xp = x2.data_ptr<float>();
    float* out = y.data_ptr<float>();
    const int64_t N = out_features, K = in_features;
#define CLOVER_KIND(code, B, G, A, F) \
  case code:                          \
    run<B, G, A, F>(p, M, N, K, xp, out, act8); \
    break;
    switch (kind & ~ACT8) {
      CLOVER_KIND(0, 4, 32, false, false) CLOVER_KIND(1, 8, 32, false, false) CLOVER_KIND(2, 4, 16, false, false)
      CLOVER_KIND(3, 8, 16, false, false) CLOVER_KIND(4, 4, 32, true, false) CLOVER_KIND(5, 8, 32, true, false)
      CLOVER_KIND(6, 4, 16, true, false) CLOVER_KIND(7, 8, 16, true, false) CLOVER_KIND(8, 4, 32, false, true)
      CLOVER_KIND(9, 8, 32, false, true) CLOVER_KIND(10, 4, 16, false, true) CLOVER_KIND(11, 8, 16, false, true)
      CLOVER_KIND(12, 4, 32, true, true) CLOVER_KIND(13, 8, 32, true, true) CLOVER_KIND(14, 4, 16, true, true)
      CLOVER_KIND(15, 8, 16, true, true)
      case BF16:
        run_bf16(p, M, N, K, xp, out);
        break;
      default: TORCH_CHECK(false, "unknown packed weight kind ", kind);
    }
#undef CLOVER_KIND
  }
  y = y.reshape(sizes);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY(clover_quant, m) {
  m.def("linear(Tensor x, Tensor packed, int out_features, int in_features, int kind) -> Tensor");
}

TORCH_LIBRARY_IMPL(clover_quant, CPU, m) { m.impl("linear", &linear); }

extern "C" int clover_quant_avx512() { return CLOVER_AVX512; }

extern "C" int clover_quant_vnni() { return CLOVER_VNNI; }

extern "C" int clover_quant_avx2() { return CLOVER_AVX2; }

// Whether int8 activations have a SIMD path (AVX-512 VNNI or AVX2), else portable C++ only.
extern "C" int clover_quant_int8() { return CLOVER_VNNI || CLOVER_AVX2; }

extern "C" int clover_quant_float_activations(int on) { return float_only.exchange(on != 0) ? 1 : 0; }
