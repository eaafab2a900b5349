/* CPU kernels of the quantized GGUF path; blockspec/kernels/native.py compiles this file at first
   use and calls it through ctypes (no torch headers: it builds in a few seconds).

   Each kernel computes every row of its output by the same sequence of float operations however
   many rows it is given, so a verify row equals the same row decoded alone (DFlash == plain
   decoding). Tensors are contiguous float32 (int64 for indices) unless said otherwise. Sums run
   over LANES partial sums combined in one fixed order (`lane_sum`'s, on every path);
   that order, not the math, is where they differ from torch's reductions.

   Weights are GGUF blocks of 32 along a row: w = scale * q + shift with q the block's 4-bit codes
   (0 .. 15; byte j of a block holds weight j in its low nibble and weight j + 16 in its high one,
   GGUF's own layout), or its int8 values (Q8_0: shift 0), scale and shift fp16 as in the file (the
   bytes read per token are the file's). The kernel rebuilds each w exactly as dequantizing the
   file does (scale * q is exact in fp32, then + shift rounds once), so a row is the dequantized
   weight's dot product, summed in another order. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
/* AVX2 + FMA machines (most desktop and many server CPUs have no AVX-512) run the same 16 lanes as
   two 8-lane registers: the same float operations lane for lane, and lane_sum's order, so their
   results are the portable path's bit for bit, at vector speed. */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define BLOCKSPEC_AVX2 1
#endif

#define GROUP 32
#define LANES 16
#define MAX_BLOCKS 1024    /* blocks a row (K ≤ 32768; native.py keeps wider rows off this kernel) */
#if defined(BLOCKSPEC_AVX2)
#define TILE_M 4          /* rows of x per pass over the weights (8 rows' accumulators would spill) */
#else
#define TILE_M 8          /* rows of x per pass over the weights (a verify block of 8: one pass) */
#endif

static inline float lane_sum(const float acc[LANES]) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

#if defined(__AVX2__)
/* lane_sum of lanes lo (0-7) and hi (8-15), in its order. */
static inline float lane_sum2(__m256 lo, __m256 hi) {
    __m256 s8 = _mm256_add_ps(lo, hi);                                               /* i + (i + 8) */
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1)); /* i + (i + 4) */
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                  /* (0 + 2), (1 + 3) */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

#if defined(__AVX512F__)
/* lane_sum of a 16-lane register, in its order. */
static inline float sum16(__m512 v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), hi);                            /* i + (i + 8) */
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));     /* i + (i + 4) */
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));                                   /* (0 + 2), (1 + 3) */
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

/* dot(a, b) over n values (n a multiple of LANES): LANES partial sums (lane i mod 16), then lane_sum's
   order on every path. */
static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return sum16(acc);
#elif defined(BLOCKSPEC_AVX2)
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    return lane_sum2(lo, hi);
#else
    float acc[LANES] = {0};
    for (int64_t i = 0; i < n; i += LANES)
        for (int l = 0; l < LANES; l++) acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    return lane_sum(acc);
#endif
}

/* o[0 .. n) += p · v (n a multiple of LANES). */
static inline void axpy(float p, const float *v, float *o, int64_t n) {
#if defined(__AVX512F__)
    const __m512 pp = _mm512_set1_ps(p);
    for (int64_t i = 0; i < n; i += LANES) _mm512_storeu_ps(o + i, _mm512_fmadd_ps(pp, _mm512_loadu_ps(v + i), _mm512_loadu_ps(o + i)));
#elif defined(BLOCKSPEC_AVX2)
    const __m256 pp = _mm256_set1_ps(p);
    for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
#else
    for (int64_t i = 0; i < n; i++) o[i] = fmaf(p, v[i], o[i]);
#endif
}

/* ---- weight-only quantized linear ---------------------------------------------------------- */

#if !defined(__F16C__)
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023, bits;
    if (exponent == 31) {
        bits = sign | 0x7F800000 | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {                                   /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 1024)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 1023) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

/* n fp16 values → fp32 (exact). */
static inline void halves_to_floats(const uint16_t *h, int64_t n, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#endif
#if defined(__F16C__)
    for (; i < n; i++) out[i] = _cvtsh_ss(h[i]);
#else
    for (; i < n; i++) out[i] = half_to_float(h[i]);
#endif
}

/* One block's 32 weights as two 16-lane halves (weights 0-15, 16-31). */
#if defined(__AVX512F__)
typedef __m512 half_t;
static inline void unpack_q4(const uint8_t *codes, float scale, float shift, half_t *lo, half_t *hi) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    __m512 d = _mm512_set1_ps(scale), m = _mm512_set1_ps(shift);
    *lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15))), d, m);
    *hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), d, m);
}
static inline void unpack_q8(const int8_t *values, float scale, half_t *lo, half_t *hi) {
    __m512 d = _mm512_set1_ps(scale);
    *lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)values))), d);
    *hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(values + 16)))), d);
}
static inline half_t zero_half() { return _mm512_setzero_ps(); }
static inline half_t fma_half(half_t a, half_t b, half_t c) { return _mm512_fmadd_ps(a, b, c); }
static inline half_t load_half(const float *p) { return _mm512_loadu_ps(p); }
static inline float half_sum(half_t v) { return sum16(v); }
#elif defined(BLOCKSPEC_AVX2)
struct half_t { __m256 lo, hi; };        /* lanes 0-7, 8-15 */
static inline __m256 widen8(__m128i bytes8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8)); }
static inline void unpack_q4(const uint8_t *codes, float scale, float shift, half_t *lo, half_t *hi) {
    const __m256 d = _mm256_set1_ps(scale), m = _mm256_set1_ps(shift);
    const __m128i bytes = _mm_loadu_si128((const __m128i *)codes), nibble = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    lo->lo = _mm256_fmadd_ps(widen8(low), d, m);
    lo->hi = _mm256_fmadd_ps(widen8(_mm_srli_si128(low, 8)), d, m);
    hi->lo = _mm256_fmadd_ps(widen8(high), d, m);
    hi->hi = _mm256_fmadd_ps(widen8(_mm_srli_si128(high, 8)), d, m);
}
static inline void unpack_q8(const int8_t *values, float scale, half_t *lo, half_t *hi) {
    const __m256 d = _mm256_set1_ps(scale);
    const __m128i a = _mm_loadu_si128((const __m128i *)values), b = _mm_loadu_si128((const __m128i *)(values + 16));
    lo->lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a)), d);
    lo->hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8))), d);
    hi->lo = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d);
    hi->hi = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8))), d);
}
static inline half_t zero_half() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline half_t fma_half(half_t a, half_t b, half_t c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline half_t load_half(const float *p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline float half_sum(half_t v) { return lane_sum2(v.lo, v.hi); }
#else
struct half_t { float v[LANES]; };
static inline void unpack_q4(const uint8_t *codes, float scale, float shift, half_t *lo, half_t *hi) {
    for (int l = 0; l < LANES; l++) {
        lo->v[l] = fmaf((float)(codes[l] & 15), scale, shift);
        hi->v[l] = fmaf((float)(codes[l] >> 4), scale, shift);
    }
}
static inline void unpack_q8(const int8_t *values, float scale, half_t *lo, half_t *hi) {
    for (int l = 0; l < LANES; l++) {
        lo->v[l] = (float)values[l] * scale;
        hi->v[l] = (float)values[l + LANES] * scale;
    }
}
static inline half_t zero_half() { half_t z; memset(&z, 0, sizeof z); return z; }
static inline half_t fma_half(half_t a, half_t b, half_t c) {
    for (int l = 0; l < LANES; l++) c.v[l] = fmaf(a.v[l], b.v[l], c.v[l]);
    return c;
}
static inline half_t load_half(const float *p) { half_t h; memcpy(h.v, p, sizeof h.v); return h; }
static inline float half_sum(half_t v) { return lane_sum(v.v); }
#endif

/* y[m0 .. m0 + MT, n0 .. n0 + NT] (BITS 4: codes [N, K / 2]; 8: int8 values [N, K]): each block's
   weights are rebuilt once and applied to all MT rows. */
template <int BITS, int NT, int MT>
static void tile(const float *x, int64_t k, const void *weights, const uint16_t *scales, const uint16_t *shifts,
                 const float *bias, int64_t n0, int64_t m0, int64_t ldy, float *y) {
    const int64_t nb = k / GROUP;
    float scale[NT][MAX_BLOCKS], shift[NT][BITS == 4 ? MAX_BLOCKS : 1];
    for (int i = 0; i < NT; i++) {
        halves_to_floats(scales + (n0 + i) * nb, nb, scale[i]);
        if (BITS == 4) halves_to_floats(shifts + (n0 + i) * nb, nb, shift[i]);
    }
    half_t acc[NT][MT];
#pragma GCC unroll 8
    for (int i = 0; i < NT; i++)
#pragma GCC unroll 8
        for (int r = 0; r < MT; r++) acc[i][r] = zero_half();
    for (int64_t b = 0; b < nb; b++) {
        half_t xlo[MT], xhi[MT];
#pragma GCC unroll 8
        for (int r = 0; r < MT; r++) {
            xlo[r] = load_half(x + (m0 + r) * k + b * GROUP);
            xhi[r] = load_half(x + (m0 + r) * k + b * GROUP + LANES);
        }
#pragma GCC unroll 8
        for (int i = 0; i < NT; i++) {
            const int64_t row = n0 + i;
            half_t lo, hi;
            /* the next tile's block: more rows stream at once than the hardware prefetcher follows
               (a hint past the last row is harmless) */
            __builtin_prefetch((const uint8_t *)weights + (row + NT) * (k * BITS / 8) + b * (GROUP * BITS / 8), 0, 3);
            if (BITS == 4)
                unpack_q4((const uint8_t *)weights + row * (k / 2) + b * (GROUP / 2), scale[i][b], shift[i][b], &lo, &hi);
            else
                unpack_q8((const int8_t *)weights + row * k + b * GROUP, scale[i][b], &lo, &hi);
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                acc[i][r] = fma_half(xlo[r], lo, acc[i][r]);
                acc[i][r] = fma_half(xhi[r], hi, acc[i][r]);
            }
        }
    }
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++)
            y[(m0 + r) * ldy + n0 + i] = half_sum(acc[i][r]) + (bias != nullptr ? bias[n0 + i] : 0.0f);
}

/* Rows m0 .. m0 + MT of y: tiles of NT output columns (4, or 2 where 8 rows' accumulators would
   not fit the registers), then single columns. */
template <int BITS, int MT>
static void rows_of(const float *x, int64_t k, const void *weights, const uint16_t *scale, const uint16_t *shift,
                    const float *bias, int64_t n, int64_t m0, float *y) {
#if defined(BLOCKSPEC_AVX2)
    constexpr int NT = MT > 2 ? 1 : (MT > 1 ? 2 : 4);     /* 16 ymm: NT · MT accumulators of two */
#else
    constexpr int NT = MT > 4 ? 2 : 4;
#endif
    int64_t n0 = 0;
    for (; n0 + NT <= n; n0 += NT) tile<BITS, NT, MT>(x, k, weights, scale, shift, bias, n0, m0, n, y);
    for (; n0 < n; n0++) tile<BITS, 1, MT>(x, k, weights, scale, shift, bias, n0, m0, n, y);
}

template <int BITS>
static void linear(const float *x, int64_t m, int64_t k, const void *weights, const uint16_t *scale, const uint16_t *shift,
                   const float *bias, int64_t n, float *y) {
    int64_t m0 = 0;
    for (; m0 + TILE_M <= m; m0 += TILE_M) rows_of<BITS, TILE_M>(x, k, weights, scale, shift, bias, n, m0, y);
    switch (m - m0) {
        case 7: rows_of<BITS, 7>(x, k, weights, scale, shift, bias, n, m0, y); break;
        case 6: rows_of<BITS, 6>(x, k, weights, scale, shift, bias, n, m0, y); break;
        case 5: rows_of<BITS, 5>(x, k, weights, scale, shift, bias, n, m0, y); break;
        case 4: rows_of<BITS, 4>(x, k, weights, scale, shift, bias, n, m0, y); break;
        case 3: rows_of<BITS, 3>(x, k, weights, scale, shift, bias, n, m0, y); break;
        case 2: rows_of<BITS, 2>(x, k, weights, scale, shift, bias, n, m0, y); break;
        case 1: rows_of<BITS, 1>(x, k, weights, scale, shift, bias, n, m0, y); break;
        default: break;
    }
}

/* y [M, N] = x [M, K] · Wᵀ (+ bias [N], or NULL); scale [N, K / 32] fp16; bits 4 (shift [N, K / 32]
   fp16) or 8 (shift unused). */
extern "C" void quant_linear(const float *x, int64_t m, int64_t k, const void *weights, int bits, const uint16_t *scale,
                             const uint16_t *shift, const float *bias, int64_t n, float *y) {
    if (bits == 4)
        linear<4>(x, m, k, weights, scale, shift, bias, n, y);
    else
        linear<8>(x, m, k, weights, scale, shift, bias, n, y);
}

/* ---- int8 activations (llama.cpp's way) ------------------------------------------------------

   The same blocks, multiplied by activations quantized to int8 per block of 32 (d = max|x| / 127,
   q = x / d rounded to nearest even): each block's products are integers, summed exactly (the CPU's
   int8 dot-product instructions, VNNI where it has them), then scaled by d_w · d_x in fp32; Q4's
   shift multiplies the block's fp32 sum of x (in order). About a third of the fp32 kernel's
   instructions per weight, at the error of rounding x to 8 bits per block (what llama.cpp's CPU
   matmuls do). Every path (VNNI, AVX2, portable) and every batch size gives the same bits: the
   integer sums are exact, and the float operations are lane for lane one fixed sequence: 16
   lanes, block b's 8 partial sums (4 weights each, in order) into lanes 8·(b mod 2) …, then
   lane_sum, then the shift's sum (blocks in order), then the bias. */

/* One x row → per block b: q[32 b …] int8, d[b] = max|x| / 127, sum[b] = Σ x in order. */
static void quantize_row_q8(const float *x, int64_t k, int8_t *q, float *d, float *sum) {
    for (int64_t b = 0; b < k / GROUP; b++) {
        const float *xb = x + b * GROUP;
        float amax = 0.0f, s = 0.0f;
        for (int j = 0; j < GROUP; j++) {
            const float a = fabsf(xb[j]);
            amax = (a > amax || a != a) ? a : amax;        /* a NaN stays: d is NaN, the block's output too */
            s += xb[j];
        }
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < GROUP; j++) {
            const float v = nearbyintf(xb[j] * inv);       /* ±inf where amax is tiny: clamped; NaN: 0 */
            q[b * GROUP + j] = v == v ? (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v)) : 0;
        }
        d[b] = amax / 127.0f;
        sum[b] = s;
    }
}

/* AVX-512 as the q8 helpers use it (F + DQ + BW + VL: every AVX-512 server CPU since Skylake-SP). */
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BLOCKSPEC_AVX512 1
#endif
#if defined(BLOCKSPEC_AVX512) && defined(__AVX512VNNI__)
#define BLOCKSPEC_Q8_512 1       /* two blocks an instruction: lanes 0-7 the even block, 8-15 the odd one */
#elif defined(__AVX2__) && defined(__FMA__)
#define BLOCKSPEC_Q8_256 1       /* one block an instruction, into the even or the odd block's 8 lanes */
/* 8 int32 lanes: lane l = Σ_{j < 4} u[4l + j] · s[4l + j] (u unsigned, s signed bytes; exact). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else   /* pairs in int16 (≤ 2 · 128 · 127: no saturation), then pairs of pairs */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

/* n fp16 values → fp32, zero from n to np (a multiple of 16). Read where they lie: a copy first
   would make the conversion's wide load wait on the copy's narrower stores. */
static inline void padded_floats(const uint16_t *h, int64_t n, int64_t np, float *out) {
#if defined(BLOCKSPEC_AVX512)
    for (int64_t i = 0; i < np; i += LANES) {
        const __mmask16 live = n - i >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (n > i ? n - i : 0)) - 1);
        _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, h + i)));
    }
#else
    halves_to_floats(h, n, out);
    for (int64_t i = n; i < np; i++) out[i] = 0.0f;
#endif
}

/* y[m0 .. m0 + MT, n0 .. n0 + NT] from quantized x rows (q [M, K]; d and sum [M, nbp], nbp = the
   blocks a row rounded up to 16, zero past them): each weight block unpacked once for the MT rows. */
template <int BITS, int NT, int MT>
static void tile_q8(const int8_t *q, const float *dx, const float *sx, int64_t k, const void *weights,
                    const uint16_t *scales, const uint16_t *shifts, const float *bias, int64_t n0, int64_t m0,
                    int64_t ldy, float *y) {
    const int64_t nb = k / GROUP, nbp = (nb + LANES - 1) / LANES * LANES, row_bytes = k * BITS / 8;
    /* s = d_w · d_x per block for every (weight row, x row) of the tile; the shift's sums Σ_b m_b ·
       Σx_b, lane b mod 16 then lane_sum (zero past the row's blocks: fmaf adds +0, and no lane is −0) */
    float scale[MAX_BLOCKS + LANES], s[NT][MT][MAX_BLOCKS + LANES], shifted[NT][MT];
    for (int i = 0; i < NT; i++) {
        padded_floats(scales + (n0 + i) * nb, nb, nbp, scale);
        for (int r = 0; r < MT; r++)
            for (int64_t b = 0; b < nbp; b++) s[i][r][b] = scale[b] * dx[(m0 + r) * nbp + b];
        if (BITS == 4) {
            padded_floats(shifts + (n0 + i) * nb, nb, nbp, scale);
            for (int r = 0; r < MT; r++) shifted[i][r] = dot(scale, sx + (m0 + r) * nbp, nbp);
        }
    }
#if defined(BLOCKSPEC_Q8_512)
    __m512 acc[NT][MT];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) acc[i][r] = _mm512_setzero_ps();
    const __m512i pair_index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int64_t b = 0; b < nb; b += 2) {
        const bool whole = b + 1 < nb;                     /* else the last block alone, in lanes 0-7 */
#pragma GCC unroll 8
        for (int i = 0; i < NT; i++) {
            const uint8_t *w = (const uint8_t *)weights + (n0 + i) * row_bytes + b * (GROUP * BITS / 8);
            __builtin_prefetch(w + NT * row_bytes, 0, 3);
            __m512i u;
            __mmask64 negative = 0;
            if (BITS == 4) {
                const __m256i bytes = whole ? _mm256_loadu_si256((const __m256i *)w)
                                            : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)w));
                u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(bytes), _mm256_srli_epi16(bytes, 4), 1),
                                     _mm512_set1_epi8(15));              /* [b low | b+1 low | b high | b+1 high] */
                u = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0)); /* [b: weights 0-31 | b+1: 0-31] */
            } else {
                const __m512i v = whole ? _mm512_loadu_si512(w)
                                        : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)w));
                u = _mm512_abs_epi8(v);                                   /* |w| (−128 → 128 unsigned) */
                negative = _mm512_movepi8_mask(v);
            }
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                const int8_t *qx = q + (m0 + r) * k + b * GROUP;
                __m512i x = whole ? _mm512_loadu_si512(qx) : _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)qx));
                if (BITS == 8) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);   /* x · sign w */
                const __m512 sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x));
                const __m512 sv = _mm512_permutexvar_ps(pair_index, _mm512_castps128_ps512(_mm_castsi128_ps(
                    _mm_loadl_epi64((const __m128i *)&s[i][r][b]))));          /* (s[b] ×8, s[b+1] ×8) */
                acc[i][r] = whole ? _mm512_fmadd_ps(sums, sv, acc[i][r])
                                  : _mm512_mask3_fmadd_ps(sums, sv, acc[i][r], 0x00FF);   /* lanes 0-7 only */
            }
        }
    }
#elif defined(BLOCKSPEC_Q8_256)
    __m256 acc[NT][MT][2];
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) acc[i][r][0] = acc[i][r][1] = _mm256_setzero_ps();
    /* Block b into lanes 8 · HALF … (HALF = b mod 2, a constant, so the accumulators stay in registers). */
    auto block = [&](int64_t b, auto half_constant) __attribute__((always_inline)) {
        constexpr int HALF = decltype(half_constant)::value;
#pragma GCC unroll 8
        for (int i = 0; i < NT; i++) {
            const uint8_t *w = (const uint8_t *)weights + (n0 + i) * row_bytes + b * (GROUP * BITS / 8);
            __builtin_prefetch(w + NT * row_bytes, 0, 3);
            __m256i wv;
            if (BITS == 4) {
                const __m128i bytes = _mm_loadu_si128((const __m128i *)w);
                wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
            } else {
                wv = _mm256_loadu_si256((const __m256i *)w);
            }
#pragma GCC unroll 8
            for (int r = 0; r < MT; r++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(q + (m0 + r) * k + b * GROUP));
                const __m256i sums = BITS == 4 ? dot_u8s8(wv, x)
                                               : dot_u8s8(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv));
                acc[i][r][HALF] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(&s[i][r][b]),
                                                  acc[i][r][HALF]);
            }
        }
    };
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        block(b, std::integral_constant<int, 0>());
        block(b + 1, std::integral_constant<int, 1>());
    }
    if (b < nb) block(b, std::integral_constant<int, 0>());
#else
    float acc[NT][MT][LANES];
    memset(acc, 0, sizeof acc);
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < NT; i++) {
            const uint8_t *w = (const uint8_t *)weights + (n0 + i) * row_bytes + b * (GROUP * BITS / 8);
            for (int r = 0; r < MT; r++) {
                const int8_t *qx = q + (m0 + r) * k + b * GROUP;
                for (int l = 0; l < 8; l++) {
                    int32_t sum = 0;
                    for (int j = 4 * l; j < 4 * l + 4; j++) {
                        const int32_t wj = BITS == 4 ? (j < 16 ? (w[j] & 15) : (w[j - 16] >> 4)) : ((const int8_t *)w)[j];
                        sum += wj * (int32_t)qx[j];
                    }
                    float *lane = &acc[i][r][8 * (b & 1) + l];
                    *lane = fmaf((float)sum, s[i][r][b], *lane);
                }
            }
        }
#endif
    for (int i = 0; i < NT; i++)
        for (int r = 0; r < MT; r++) {
#if defined(BLOCKSPEC_Q8_512)
            const float total = sum16(acc[i][r]) + (BITS == 4 ? shifted[i][r] : 0.0f);
#elif defined(BLOCKSPEC_Q8_256)
            const float total = lane_sum2(acc[i][r][0], acc[i][r][1]) + (BITS == 4 ? shifted[i][r] : 0.0f);
#else
            const float total = lane_sum(acc[i][r]) + (BITS == 4 ? shifted[i][r] : 0.0f);
#endif
            y[(m0 + r) * ldy + n0 + i] = total + (bias != nullptr ? bias[n0 + i] : 0.0f);
        }
}

template <int BITS, int MT>
static void rows_q8(const int8_t *q, const float *dx, const float *sx, int64_t k, const void *weights,
                    const uint16_t *scale, const uint16_t *shift, const float *bias, int64_t n, int64_t m0, float *y) {
    constexpr int NT = MT > 4 ? 1 : (MT > 2 ? 2 : 4);      /* NT · MT accumulators of 16 lanes ≤ 8 */
    int64_t n0 = 0;
    for (; n0 + NT <= n; n0 += NT) tile_q8<BITS, NT, MT>(q, dx, sx, k, weights, scale, shift, bias, n0, m0, n, y);
    for (; n0 < n; n0++) tile_q8<BITS, 1, MT>(q, dx, sx, k, weights, scale, shift, bias, n0, m0, n, y);
}

template <int BITS>
static void linear_q8(const int8_t *q, const float *dx, const float *sx, int64_t m, int64_t k, const void *weights,
                      const uint16_t *scale, const uint16_t *shift, const float *bias, int64_t n, float *y) {
    int64_t m0 = 0;
    for (; m0 + 8 <= m; m0 += 8) rows_q8<BITS, 8>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y);
    switch (m - m0) {
        case 7: rows_q8<BITS, 7>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        case 6: rows_q8<BITS, 6>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        case 5: rows_q8<BITS, 5>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        case 4: rows_q8<BITS, 4>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        case 3: rows_q8<BITS, 3>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        case 2: rows_q8<BITS, 2>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        case 1: rows_q8<BITS, 1>(q, dx, sx, k, weights, scale, shift, bias, n, m0, y); break;
        default: break;
    }
}

/* The scratch quant_linear_q8 needs for M rows of K: q [M, K] int8, then d and sum [M, nbp] fp32
   (nbp: the blocks a row rounded up to 16), in floats. */
static int64_t q8_scratch_floats(int64_t m, int64_t k) {
    const int64_t nbp = (k / GROUP + LANES - 1) / LANES * LANES;
    return (m * k + 3) / 4 + 2 * m * nbp;
}

/* quant_linear_q8 in a caller's scratch (q8_scratch_floats(m, k) floats or more). */
static void linear_q8_in(const float *x, int64_t m, int64_t k, const void *weights, int bits, const uint16_t *scale,
                         const uint16_t *shift, const float *bias, int64_t n, float *y, float *scratch) {
    const int64_t nb = k / GROUP, nbp = (nb + LANES - 1) / LANES * LANES;
    float *dx = scratch, *sx = dx + m * nbp;
    int8_t *q = (int8_t *)(sx + m * nbp);
    for (int64_t r = 0; r < m; r++) {
        quantize_row_q8(x + r * k, k, q + r * k, dx + r * nbp, sx + r * nbp);
        for (int64_t b = nb; b < nbp; b++) dx[r * nbp + b] = sx[r * nbp + b] = 0.0f;   /* the tile's padding */
    }
    if (bits == 4)
        linear_q8<4>(q, dx, sx, m, k, weights, scale, shift, bias, n, y);
    else
        linear_q8<8>(q, dx, sx, m, k, weights, scale, shift, bias, n, y);
}

/* quant_linear with x quantized to int8 per block (above). Returns 0, or −1 when its scratch
   memory could not be had (nothing written). */
extern "C" int quant_linear_q8(const float *x, int64_t m, int64_t k, const void *weights, int bits,
                               const uint16_t *scale, const uint16_t *shift, const float *bias, int64_t n, float *y) {
    float *scratch = (float *)malloc(sizeof(float) * (size_t)q8_scratch_floats(m, k));
    if (scratch == nullptr) return -1;
    linear_q8_in(x, m, k, weights, bits, scale, shift, bias, n, y, scratch);
    free(scratch);
    return 0;
}

/* ---- the layer's other ops ------------------------------------------------------------------ */

/* rows [M, H] of x (+ residual, or NULL) → out = weight · s / rms(s), res_out = s (H a multiple of LANES). */
extern "C" void add_rms_norm(const float *x, const float *residual, const float *weight, float eps, int64_t m,
                             int64_t h, float *out, float *res_out) {
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * h;
        float *s = res_out + r * h;
        for (int64_t i = 0; i < h; i++) s[i] = residual != nullptr ? xr[i] + residual[r * h + i] : xr[i];
        float inv = 1.0f / sqrtf(dot(s, s, h) / (float)h + eps);
        for (int64_t i = 0; i < h; i++) out[r * h + i] = weight[i] * (s[i] * inv);
    }
}

/* In place, one head of D values: RMSNorm by weight (or none), then RoPE over its first rot dims
   (the first half rotated against the second, Hugging Face's rotate_half). */
static inline void norm_rope_head(float *x, int64_t d, const float *norm, float eps, const float *cos,
                                  const float *sin, int64_t rot) {
    if (norm != nullptr) {
        float inv = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
        for (int64_t i = 0; i < d; i++) x[i] = norm[i] * (x[i] * inv);
    }
    int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* qkv [N, (Hq + 2 Hkv) · D] → q_out [N, Hq, D] normed and rotated; k (normed, rotated) and v stored
   in the pools [slots, Hkv, D] at slots [N]. cos, sin [N, rot]; q_norm / k_norm [D] or NULL. */
extern "C" void qk_norm_rope_store(const float *qkv, int64_t n, int64_t hq, int64_t hkv, int64_t d,
                                   const float *q_norm, const float *k_norm, float eps, const float *cos,
                                   const float *sin, int64_t rot, float *k_pool, float *v_pool,
                                   const int64_t *slots, float *q_out) {
    int64_t width = (hq + 2 * hkv) * d;
    for (int64_t t = 0; t < n; t++) {
        const float *row = qkv + t * width;
        const float *c = cos + t * rot, *s = sin + t * rot;
        for (int64_t h = 0; h < hq; h++) {
            float *q = q_out + (t * hq + h) * d;
            memcpy(q, row + h * d, sizeof(float) * d);
            norm_rope_head(q, d, q_norm, eps, c, s, rot);
        }
        for (int64_t h = 0; h < hkv; h++) {
            float *k = k_pool + (slots[t] * hkv + h) * d;
            memcpy(k, row + (hq + h) * d, sizeof(float) * d);
            norm_rope_head(k, d, k_norm, eps, c, s, rot);
            memcpy(v_pool + (slots[t] * hkv + h) * d, row + (hq + hkv + h) * d, sizeof(float) * d);
        }
    }
}

/* e^x for x ≤ 88.7 (below −87.3: about 0): x = n·ln2 + r with |r| ≤ ln2 / 2, e^r by its Taylor
   series to r⁷ / 7! (remainder below 6e−9 of the value, under fp32's own rounding), times 2ⁿ built
   in the exponent bits. Branch-free, so loops over arrays vectorize; torch's exp differs from it
   by an ulp or two. */
static inline float exp_approx(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float round = 12582912.0f;                     /* 1.5 · 2²³: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + round) - round;
    float r = fmaf(n, -0.693145751953125f, x);           /* ln2 in two parts: the first exact in n·it */
    r = fmaf(n, -1.428606765330187e-06f, r);
    float p = 1.0f / 5040;
    p = fmaf(p, r, 1.0f / 720);
    p = fmaf(p, r, 1.0f / 120);
    p = fmaf(p, r, 1.0f / 24);
    p = fmaf(p, r, 1.0f / 6);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    return p * __builtin_bit_cast(float, (uint32_t)((int32_t)n + 127) << 23);
}

static inline int64_t longest(const int64_t *lens, int64_t n) {
    int64_t top = 0;
    for (int64_t i = 0; i < n; i++) top = lens[i] > top ? lens[i] : top;
    return top;
}

/* Causal attention of a target layer over paged pools [slots, Hkv, D]: q [N, Hq, D] → out [N, Hq · D].
   Sequence b's rows are query_start[b] .. query_start[b + 1] − 1; a row at position p sees the
   keys at positions 0 .. min(p + 1, context_lens[b]) − 1, found through block_tables [B, pages].
   Rows past query_start[B] (a bucket's padding) are zero. scratch: 3 · (max(context_lens) + 1)
   floats (the scores, then each key's pool slot). Softmax in fp32: max, e^(s − max), their lane sum. */
extern "C" void paged_attention(const float *q, int64_t n, int64_t hq, int64_t hkv, int64_t d, const float *k_pool,
                                const float *v_pool, const int64_t *block_tables, int64_t pages, int64_t page_size,
                                const int64_t *query_start, const int64_t *context_lens, const int64_t *positions,
                                int64_t num_seqs, float scale, float *scratch, float *out) {
    const int64_t group = hq / hkv, max_keys = longest(context_lens, num_seqs);
    float *scores = scratch;
    int64_t *slots = (int64_t *)(scratch + 2 * ((max_keys + 1) / 2));
    memset(out, 0, sizeof(float) * n * hq * d);
    for (int64_t b = 0; b < num_seqs; b++) {
        const int64_t *table = block_tables + b * pages;
        for (int64_t j = 0; j < context_lens[b]; j++) slots[j] = table[j / page_size] * page_size + j % page_size;
        for (int64_t t = query_start[b]; t < query_start[b + 1]; t++) {
            int64_t keys = positions[t] + 1 < context_lens[b] ? positions[t] + 1 : context_lens[b];
            for (int64_t h = 0; h < hq; h++) {
                const float *qh = q + (t * hq + h) * d;
                const int64_t g = h / group;
                float top = -INFINITY;
                for (int64_t j = 0; j < keys; j++) {
                    scores[j] = dot(qh, k_pool + (slots[j] * hkv + g) * d, d) * scale;
                    top = scores[j] > top ? scores[j] : top;
                }
                float acc[LANES] = {0};
                int64_t j = 0;
                for (; j + LANES <= keys; j += LANES)
                    for (int l = 0; l < LANES; l++) {
                        scores[j + l] = exp_approx(scores[j + l] - top);
                        acc[l] += scores[j + l];
                    }
                for (int l = 0; j < keys; j++, l++) {
                    scores[j] = exp_approx(scores[j] - top);
                    acc[l] += scores[j];
                }
                const float inv = 1.0f / lane_sum(acc);
                float *o = out + (t * hq + h) * d;
                for (j = 0; j < keys; j++) {
                    const float *v = v_pool + (slots[j] * hkv + g) * d;
                    axpy(scores[j] * inv, v, o, d);
                }
            }
        }
    }
}

/* gate_up [M, 2I] (gate | up) → out [M, I] = silu(gate) · up. */
extern "C" void silu_mul(const float *gate_up, int64_t m, int64_t inter, float *out) {
    for (int64_t r = 0; r < m; r++) {
        const float *__restrict g = gate_up + r * 2 * inter, *__restrict u = g + inter;
        float *__restrict o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* ---- a dense target's decoder stack in one call --------------------------------------------- */

struct Weight {                 /* a QuantLinear's buffers */
    const void *values;
    const uint16_t *scale, *shift;       /* fp16; shift NULL for 8 bits */
    const float *bias;                   /* NULL without one */
    int64_t bits, n, k;
    int64_t int8_activations;            /* 1: quant_linear_q8 (kernel "q8"), 0: quant_linear ("native") */
};

struct Layer {
    const float *input_norm, *post_norm, *q_norm, *k_norm;   /* q_norm / k_norm NULL without qk-norm */
    Weight qkv, o, gate_up, down;
    float *k_pool, *v_pool;
};

struct Shape {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
};

struct Batch {                  /* AttentionMetadata's tensors */
    const int64_t *slots, *block_tables, *query_start, *context_lens, *positions;
    int64_t pages, page_size, num_seqs;
    const float *cos, *sin;
    int64_t rot;
};

/* q8: the forward's scratch holds the quantized rows (no allocation per projection). */
static void apply(const Weight *w, const float *x, int64_t m, float *y, float *q8_scratch) {
    if (w->int8_activations)
        linear_q8_in(x, m, w->k, w->values, (int)w->bits, w->scale, w->shift, w->bias, w->n, y, q8_scratch);
    else
        quant_linear(x, m, w->k, w->values, (int)w->bits, w->scale, w->shift, w->bias, w->n, y);
}

/* x [N, hidden]: the embeddings in; the layers as PreNormLayer.forward_residual runs them, op for
   op (these kernels, in that order); capture [num_layers]: c ≥ 0 where column block c of features
   [N, C · hidden] takes the stream after that layer, else −1; out [N, hidden]: the final norm's
   output. Returns 0, or −1 when scratch memory could not be had. */
extern "C" int dense_forward(const Layer *layers, int64_t num_layers, const Shape *s, const Batch *b,
                             const float *x, int64_t n, const int64_t *capture, int64_t num_captured,
                             float *features, const float *final_norm, float *out) {
    const int64_t h = s->hidden, qw = s->heads * s->head_dim, kvw = s->kv_heads * s->head_dim;
    const int64_t widest = std::max(h, std::max(qw, s->intermediate));       /* the projections' widest input */
    const int64_t sizes[] = {n * h, n * h, n * h, n * (qw + 2 * kvw), n * qw, n * qw, n * 2 * s->intermediate,
                             n * s->intermediate, 3 * (longest(b->context_lens, b->num_seqs) + 1),
                             q8_scratch_floats(n, widest)};
    int64_t total = 0;
    for (int64_t size : sizes) total += size;
    float *mem = (float *)malloc(sizeof(float) * (size_t)total);
    if (mem == nullptr) return -1;
    float *stream = mem, *residual = stream + sizes[0], *normed = residual + sizes[1], *qkv = normed + sizes[2];
    float *q = qkv + sizes[3], *attn = q + sizes[4], *gate_up = attn + sizes[5], *act = gate_up + sizes[6];
    float *scratch = act + sizes[7], *q8 = scratch + sizes[8];
    memcpy(stream, x, sizeof(float) * n * h);
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer *l = layers + i;
        add_rms_norm(stream, i == 0 ? nullptr : residual, l->input_norm, s->eps, n, h, normed, residual);
        apply(&l->qkv, normed, n, qkv, q8);
        qk_norm_rope_store(qkv, n, s->heads, s->kv_heads, s->head_dim, l->q_norm, l->k_norm, s->eps, b->cos, b->sin,
                           b->rot, l->k_pool, l->v_pool, b->slots, q);
        paged_attention(q, n, s->heads, s->kv_heads, s->head_dim, l->k_pool, l->v_pool, b->block_tables, b->pages,
                        b->page_size, b->query_start, b->context_lens, b->positions, b->num_seqs, s->scale, scratch,
                        attn);
        apply(&l->o, attn, n, stream, q8);
        add_rms_norm(stream, residual, l->post_norm, s->eps, n, h, normed, residual);
        apply(&l->gate_up, normed, n, gate_up, q8);
        silu_mul(gate_up, n, s->intermediate, act);
        apply(&l->down, act, n, stream, q8);
        if (capture[i] >= 0) {
            for (int64_t t = 0; t < n; t++)
                for (int64_t j = 0; j < h; j++)
                    features[(t * num_captured + capture[i]) * h + j] = stream[t * h + j] + residual[t * h + j];
        }
    }
    add_rms_norm(stream, residual, final_norm, s->eps, n, h, out, residual);
    free(mem);
    return 0;
}
