/* fuel's native CPU matmul kernels: out[m, n] = sum_k x[m, k] * W[n, k], W stored packed.

   Built once per machine by fuel.kernels.native (the system C compiler, -O3 -march=native),
   linked against the very OpenMP runtime torch loaded, so a parallel loop here runs on torch's
   intra-op pool: one pool for the whole step (fuel.kernels.threads).

   Weights (rows of N output features, K inputs each):
   - dense: f32, f16 (IEEE half) or bf16, row-major [N, K] (torch's nn.Linear layout);
   - per-channel int8 (fuel's int8_channel rows): each row its K int8 weights, then its f32
     scale, w = q * scale (a compressed-tensors int8 checkpoint's weight and weight_scale);
   - GGUF blocks of 32 weights, each row a run of K/32 blocks (llama.cpp's layout, read as is):
       q4_0: f16 d, 16 bytes of nibbles          w = d * (q - 8)
       q4_1: f16 d, f16 m, 16 bytes of nibbles   w = d * q + m
       q5_0: f16 d, u32 high bits, 16 nibbles    w = d * (q - 16)
       q5_1: f16 d, f16 m, u32 high bits, nibbles w = d * q + m
       q8_0: f16 d, 32 int8                      w = d * q
     nibble j (0..15) of a block is its byte j's low half, element 16 + j the high half; the
     fifth bit of element j is bit j of the u32.
   - q4_1x8: q4_1's blocks regrouped within each row (fuel's own layout, the same bytes moved;
     fuel_regroup converts): every group of eight blocks is 160 bytes, the eight f16 d first,
     then the eight f16 m, then the eight blocks' 16 quant bytes one after another; the scales
     sit in the lane order a horizontal-add tree leaves eight block sums in (x8_lane: blocks 0,
     2, 4, 6, 1, 3, 5, 7). A row's last B % 8 blocks (t of them) are d[t], m[t], then their
     quants, in block order. Why: the 8-bit-activation kernel then reads two blocks' quants with
     one load, eight blocks' scales with one conversion, and scales eight block sums with one
     multiply-add (q8x8_dot_rows); the row and its bytes are q4_1's, so a row is exactly as
     large and dequantizes to the same values.
   - q8_0x8: q8_0's blocks regrouped the same way: a group of eight is 272 bytes, the eight f16 d
     (block order: the reduction below leaves q8_0's eight sums in it), then the eight blocks'
     32 int8 one after another; a short last group d[t] then its quants (q8x8_0_dot_rows).
   - GGUF K-quant super-blocks of 256 weights, eight sub-blocks of 32 (llama.cpp's block_q4_K,
     block_q5_K, block_q6_K, read as is):
       q4_k (144 bytes): f16 d, f16 dmin, scales[12], qs[128]
       q5_k (176 bytes): f16 d, f16 dmin, scales[12], qh[32], qs[128]
            sub-block j has a 6-bit scale sc_j and 6-bit min m_j packed in scales[12] (j < 4:
            the low 6 bits of bytes j and j + 4; j >= 4: byte j + 4's low (scale) and high (min)
            nibbles, topped by the 2 high bits of bytes j - 4 and j); w = d*sc_j * q - dmin*m_j.
            Sub-blocks 2i and 2i+1 are the low and high nibbles of qs[32i .. 32i+31]; q5_k's
            fifth bit of element l of sub-block j is bit j of qh[l].
       q6_k (210 bytes): ql[128], qh[64], int8 scales[16], f16 d (at the end); w = d*sc_g * (q - 32)
            with one scale per 16 weights. Each half h (128 weights) reads ql[64h ..], qh[32h ..]:
            element 32s + l (s = 0..3, l = 0..31) has low nibble ql[64h + 32(s&1) + l] >> 4(s>>1)
            and high two bits (qh[32h + l] >> 2s) & 3.

   Where the CPU has AVX-512 (the build is -march=native), a 32-element block's dot product runs
   16 lanes wide (half the instructions of the AVX2 path); the AVX2 and portable paths are built
   and checked by the tests on such a machine too.

   fuel_matmul keeps activations f32 (no 8-bit rounding of x; fuel_matmul_q8, further down, is
   the one kernel that rounds them, for decode rows): each block's dot product is computed in f32
   from the dequantized-in-register weights, so a result equals the dequantize-then-matmul
   recipe within the rounding of a reordered f32 sum. For formats with an offset (m, or the -8
   and -16 of the symmetric ones) the offset times the block's activation sum is added once per
   block, with the per-32 sums computed once per activation row. The K-quants (AVX2) instead
   decode each 32-weight sub-block to exactly the reference's f32 weights in register and use
   them for up to four activation rows at once (dot_kquant_rows); their portable fallback takes
   the activation-sum route (q6_k's -32 applied to the quants: its scales cover 16 weights).

   fuel_matmul streams each weight row once for all M activation rows (decode: M is a few rows);
   fuel_dequantize writes f32 rows for a GEMM library to multiply when M is large (prefill);
   fuel_gemm_dense multiplies a prompt chunk by a dense f32/f16/bf16 matrix as it is held (16-bit
   weights widened in registers, register-tiled); fuel_matmul_q8 streams the 32-weight block
   formats against activations rounded to 8 bits per block, with integer dot products (its own
   section below states the rounding and the SIMD). Further down: rope, the KV cache writes,
   paged attention for decode rows (fuel_paged_attn_kv) and for a prompt chunk (the flash
   attention fuel_prefill_attn_kv), silu_mul, argmax and the half-precision casts. */
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
/* F(fmt, r, ...) with r the constant 1, 2, 3 or 4 equal to R: an always-inline row kernel is
   specialised for each row count (its loops over the rows unrolled). */
#define WITH_ROWS(R, F, fmt, ...) do {                                                    \
        if ((R) == 1) F(fmt, 1, __VA_ARGS__);                                             \
        else if ((R) == 2) F(fmt, 2, __VA_ARGS__);                                        \
        else if ((R) == 3) F(fmt, 3, __VA_ARGS__);                                        \
        else F(fmt, 4, __VA_ARGS__);                                                      \
    } while (0)
/* The statements (the macro's last arguments) once per tile of TILE weight rows [n0, n1) of N, the tiles split statically over
   `threads` threads of torch's OpenMP pool (serial below 64 Ki weights: a region costs more). */
#define FOR_TILES(N, K, threads, ...) do {                                                 \
        const int64_t tiles_ = ((N) + TILE - 1) / TILE;                                   \
        const int parallel_ = (threads) > 1 && (N) * (K) >= 65536;                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads) if (parallel_)")  \
        for (int64_t t_ = 0; t_ < tiles_; t_++) {                                         \
            const int64_t n0 = t_ * TILE, n1 = n0 + TILE < (N) ? n0 + TILE : (N);         \
            __VA_ARGS__                                                                   \
        }                                                                                 \
    } while (0)

enum { F32 = 0, F16 = 1, BF16 = 2, I8C = 3, Q4_0 = 10, Q4_1 = 11, Q5_0 = 12, Q5_1 = 13, Q8_0 = 14,
       Q4_K = 15, Q5_K = 16, Q6_K = 17, Q4_1X8 = 18, Q8_0X8 = 19 };

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: normalise */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    float f; memcpy(&f, &bits, 4); return f;
#endif
}

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16; float f; memcpy(&f, &bits, 4); return f;
}

static inline uint16_t rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Dense rows (one element a weight, no blocks): f32, f16, bf16, and I8C, per-channel int8: a
   row's K int8 weights, then its f32 scale (w = q * scale). I8C rows are multiplied as integers
   widened to f32 and the row's sum scaled once (sum(q x) * scale: within the recipe's f32
   reassociation bound, as a block format's d applied to its block sum is). */
INLINE int dense_width(int fmt) { return fmt == F32 ? 4 : fmt == I8C ? 1 : 2; }
INLINE int dense_format(int fmt) { return fmt == F32 || fmt == F16 || fmt == BF16 || fmt == I8C; }
static inline float row_scale(const uint8_t *row, int64_t K) { float s; memcpy(&s, row + K, 4); return s; }
INLINE float dense_weight(int fmt, const uint8_t *p, int64_t j) {
    if (fmt == F32) { float v; memcpy(&v, p + 4 * j, 4); return v; }
    if (fmt == I8C) return (float)((const int8_t *)p)[j];
    return fmt == F16 ? half_to_float(rd16(p + 2 * j)) : bf16_to_float(rd16(p + 2 * j));
}

INLINE int block_bytes(int fmt) {
    switch (fmt) {
    case Q4_0: return 18; case Q4_1: case Q4_1X8: return 20; case Q5_0: return 22; case Q5_1: return 24;
    case Q8_0: case Q8_0X8: return 34; case Q4_K: return 144; case Q5_K: return 176; case Q6_K: return 210;
    default: return 0;
    }
}

/* Weights per block: 256 for the K-quant super-blocks, 32 for the other block formats. */
INLINE int block_elems(int fmt) { return fmt == Q4_K || fmt == Q5_K || fmt == Q6_K ? 256 : 32; }

/* The regrouped layouts (see the top): each one's file layout, the lane of block k (0..7) of a
   q4_1x8 group, and one row moved between the file's order and the regrouped one (to_x8: into
   the regrouped layout, else back), B blocks. */
INLINE int x8_source(int fmt) { return fmt == Q4_1X8 ? Q4_1 : fmt == Q8_0X8 ? Q8_0 : -1; }
INLINE int x8_lane(int k) { return k / 2 + 4 * (k % 2); }
INLINE void x8_row_of(const int offset, const uint8_t *src, uint8_t *dst, int64_t B, int to_x8) {
    /* offset 1: q4_1 (d, m, 16 quant bytes); 0: q8_0 (d, 32 int8). A constant where it is
       inlined, so every copy below is a fixed-size move, not a memcpy call (the calls made a
       regrouped row's dequantization 3x the file layout's) */
    const int bb = offset ? 20 : 34, scales = offset ? 4 : 2, quants = bb - scales;
    for (int64_t g = 0; g < B; g += 8) {
        const int n = B - g < 8 ? (int)(B - g) : 8;
        uint8_t *grouped = (uint8_t *)(to_x8 ? dst : src) + g * bb;
        uint8_t *file = (uint8_t *)(to_x8 ? src : dst) + g * bb;
        for (int k = 0; k < n; k++) {
            const int at = n == 8 && offset ? x8_lane(k) : k;  /* q8_0 and short groups: block order */
            uint8_t *d = grouped + 2 * at, *m = grouped + 2 * n + 2 * at, *q = grouped + scales * n + quants * k;
            uint8_t *b = file + bb * k;
            if (to_x8) { memcpy(d, b, 2); if (offset) memcpy(m, b + 2, 2); memcpy(q, b + scales, (size_t)quants); }
            else { memcpy(b, d, 2); if (offset) memcpy(b + 2, m, 2); memcpy(b + scales, q, (size_t)quants); }
        }
    }
}
static __attribute__((unused)) void x8_row(int fmt, const uint8_t *src, uint8_t *dst, int64_t B, int to_x8) {
    if (fmt == Q4_1X8) x8_row_of(1, src, dst, B, to_x8);
    else x8_row_of(0, src, dst, B, to_x8);
}

/* The 32 quants of a block as small integers q (before scale/offset), and the block's scale d
   and offset m such that w = d * q + m. */
INLINE void block_ints(int fmt, const uint8_t *b, int32_t q[32], float *d, float *m) {
    *d = half_to_float(rd16(b));
    switch (fmt) {
    case Q4_0: { const uint8_t *qs = b + 2; *m = -8.0f * *d;
        for (int j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[16 + j] = qs[j] >> 4; } break; }
    case Q4_1: { const uint8_t *qs = b + 4; *m = half_to_float(rd16(b + 2));
        for (int j = 0; j < 16; j++) { q[j] = qs[j] & 15; q[16 + j] = qs[j] >> 4; } break; }
    case Q5_0: { uint32_t qh = rd32(b + 2); const uint8_t *qs = b + 6; *m = -16.0f * *d;
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
            q[16 + j] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        } break; }
    case Q5_1: { uint32_t qh = rd32(b + 4); const uint8_t *qs = b + 8; *m = half_to_float(rd16(b + 2));
        for (int j = 0; j < 16; j++) {
            q[j] = (qs[j] & 15) | (((qh >> j) & 1) << 4);
            q[16 + j] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        } break; }
    default: { const int8_t *qs = (const int8_t *)(b + 2); *m = 0.0f;
        for (int j = 0; j < 32; j++) q[j] = qs[j];
        break; }
    }
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
static inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
static inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* A block's 32 quants as two 16-byte halves (elements 0-15, 16-31), before d and m. */
INLINE void block_halves(int fmt, const uint8_t *b, __m128i *lo, __m128i *hi) {
    if (fmt == Q8_0) {
        *lo = _mm_loadu_si128((const __m128i *)(b + 2));
        *hi = _mm_loadu_si128((const __m128i *)(b + 18));
        return;
    }
    const int off = fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 8;
    const __m128i nib = _mm_set1_epi8(15);
    __m128i v = _mm_loadu_si128((const __m128i *)(b + off));
    *lo = _mm_and_si128(v, nib);
    *hi = _mm_and_si128(_mm_srli_epi16(v, 4), nib);
    if (fmt == Q5_0 || fmt == Q5_1) {
        uint32_t qh = rd32(b + (fmt == Q5_0 ? 2 : 4));
        const __m128i shuf = _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m128i bits = _mm_set_epi8((char)128, 64, 32, 16, 8, 4, 2, 1, (char)128, 64, 32, 16, 8, 4, 2, 1);
        __m128i l = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(qh & 0xffff)), shuf);
        __m128i h = _mm_shuffle_epi8(_mm_cvtsi32_si128((int)(qh >> 16)), shuf);
        *lo = _mm_or_si128(*lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(l, bits), bits), _mm_set1_epi8(16)));
        *hi = _mm_or_si128(*hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, bits), bits), _mm_set1_epi8(16)));
    }
}

/* A half's 16 quants as two f32 vectors (int8 for Q8_0, unsigned otherwise). */
INLINE void half_to_ps(int fmt, __m128i v, __m256 *a, __m256 *c) {
    *a = fmt == Q8_0 ? i8x8_to_ps(v) : u8x8_to_ps(v);
    *c = fmt == Q8_0 ? i8x8_to_ps(_mm_srli_si128(v, 8)) : u8x8_to_ps(_mm_srli_si128(v, 8));
}

/* The 32 quants of a block as four f32 vectors (before d and m). */
INLINE void block_unpack(int fmt, const uint8_t *b, __m256 q[4]) {
    __m128i lo, hi;
    block_halves(fmt, b, &lo, &hi);
    half_to_ps(fmt, lo, &q[0], &q[1]);
    half_to_ps(fmt, hi, &q[2], &q[3]);
}

/* sum_j q_j * x_j over one block (the integer part, before d), 8 lanes wide. */
INLINE __m256 block_dot(int fmt, const uint8_t *b, const float *x) {
    __m256 q[4];
    block_unpack(fmt, b, q);
    __m256 s = _mm256_mul_ps(q[0], _mm256_loadu_ps(x));
    s = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), s);
    s = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), s);
    return _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), s);
}
#endif


#define TILE 16  /* weight rows per scheduling unit */

/* How far ahead of the row it multiplies a kernel streaming packed weights asks for them
   (software prefetch into L1). A thread's share of a product is one contiguous run of rows, so
   the address STREAM_AHEAD bytes on is the weight it reads a few microseconds later. Measured
   on a SmolLM2 Q4_1 decode step (2 threads, weights from memory): 1 KiB ahead streamed
   ~17-23 GB/s, 4 KiB ahead ~30-35 GB/s, the step 4.9-6.2 -> 3.1-3.7 ms. Later, when the host's
   memory answered more slowly, 4 KiB was too short: interleaved A/B of the same step at a
   fixed context (20-24 rounds, every round faster): 6, 8 or 10 KiB 0.63-0.68x of 4 KiB's time,
   12 KiB 0.66x, 16 KiB 0.69x, 24 KiB 0.72x; a second, L2-only hint (T1/T2) at 16-32 KiB on top
   of 4 KiB 0.76-0.80x. The dense kernels (their own PREFETCH_ROWS distance) did not move with
   it. 8 KiB: the middle of the flat stretch. */
#ifndef STREAM_AHEAD
#define STREAM_AHEAD 8192
#endif

/* Every line of [p, p + bytes) requested into cache (a hint: no fault, no effect on results). */
static inline void prefetch_span(const void *p, int64_t bytes) {
#ifdef __AVX2__
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)p + o, _MM_HINT_T0);
#else
    (void)p; (void)bytes;
#endif
}

#if !defined(FUEL_PART) || FUEL_PART == 1  /* the f32-activation matmuls (one parallel build half) */
/* ---- K-quants (q4_k, q5_k, q6_k): 256-weight super-blocks ---------------------------------- */

/* Sub-block j's 6-bit scale and min from a q4_k/q5_k scales[12]. */
INLINE void kq_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) { *sc = s[j] & 63; *mn = s[j + 4] & 63; }
    else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* A super-block's scales: q4_k/q5_k: D[j] = d*sc_j and Mn[j] = -dmin*m_j per 32 weights;
   q6_k: D[g] = d*sc_g per 16 weights, no offset. */
INLINE void kq_scales(int fmt, const uint8_t *b, float D[16], float Mn[8]) {
#ifdef __AVX2__
    /* Eight lanes at once (the scalar decode below cost a third of a super-block's dot). */
    if (fmt == Q6_K) {
        const __m256 d = _mm256_set1_ps(half_to_float(rd16(b + 208)));
        _mm256_storeu_ps(D, _mm256_mul_ps(d, i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(b + 192)))));
        _mm256_storeu_ps(D + 8, _mm256_mul_ps(d, i8x8_to_ps(_mm_loadl_epi64((const __m128i *)(b + 200)))));
        return;
    }
    /* scales[12] as three u32 a, c, e: sc0..3 = a & 63, m0..3 = c & 63 (per byte); sc4..7 = e's
       low nibbles topped by a's bits 6-7, m4..7 = e's high nibbles topped by c's bits 6-7. */
    const uint32_t a = rd32(b + 4), c = rd32(b + 8), e = rd32(b + 12);
    const uint32_t six = 0x3f3f3f3fu, nib = 0x0f0f0f0fu, top = 0x30303030u;
    const uint64_t sc = (uint64_t)(a & six) | (uint64_t)((e & nib) | ((a >> 2) & top)) << 32;
    const uint64_t mn = (uint64_t)(c & six) | (uint64_t)(((e >> 4) & nib) | ((c >> 2) & top)) << 32;
    _mm256_storeu_ps(D, _mm256_mul_ps(_mm256_set1_ps(half_to_float(rd16(b))),
                                      u8x8_to_ps(_mm_cvtsi64_si128((long long)sc))));
    _mm256_storeu_ps(Mn, _mm256_mul_ps(_mm256_set1_ps(-half_to_float(rd16(b + 2))),
                                       u8x8_to_ps(_mm_cvtsi64_si128((long long)mn))));
    return;
#endif
    if (fmt == Q6_K) {
        const float d = half_to_float(rd16(b + 208));
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int g = 0; g < 16; g++) D[g] = d * (float)sc[g];
        return;
    }
    const float d = half_to_float(rd16(b)), dmin = half_to_float(rd16(b + 2));
    for (int j = 0; j < 8; j++) {
        int sc, mn;
        kq_scale_min(b + 4, j, &sc, &mn);
        D[j] = d * (float)sc;
        Mn[j] = -(dmin * (float)mn);
    }
}

/* The 256 quants of a super-block as integers (q6_k's already less 32), in element order. */
INLINE void kq_ints(int fmt, const uint8_t *b, int32_t q[256]) {
    if (fmt == Q6_K) {
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
            for (int l = 0; l < 32; l++) {
                q[128 * h + l] = ((ql[l] & 15) | ((qh[l] & 3) << 4)) - 32;
                q[128 * h + 32 + l] = ((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
                q[128 * h + 64 + l] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                q[128 * h + 96 + l] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            }
        }
        return;
    }
    const uint8_t *qs = b + (fmt == Q5_K ? 48 : 16), *qh = b + 16;
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * i + l] & 15, hi = qs[32 * i + l] >> 4;
            if (fmt == Q5_K) {
                lo |= ((qh[l] >> (2 * i)) & 1) << 4;
                hi |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
            }
            q[64 * i + l] = lo;
            q[64 * i + 32 + l] = hi;
        }
}

#ifdef __AVX2__
/* The 32 quants of sub-block g (weights 32g .. 32g+31) as bytes: unsigned 0..31 for q4_k/q5_k,
   signed -32..31 for q6_k. `g` is a constant once the callers' loops are unrolled. */
INLINE __m256i kq_group(int fmt, const uint8_t *b, int g) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (fmt == Q6_K) {
        const int h = g >> 2, s = g & 3;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (s & 1)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        __m256i lo = _mm256_and_si256(s >> 1 ? _mm256_srli_epi16(ql, 4) : ql, m4);
        /* bits 2s, 2s+1 of each qh byte to bits 4, 5 (16-bit shifts; the mask drops what crossed
           from the neighbouring byte). */
        __m256i hb = s == 0 ? _mm256_slli_epi16(qh, 4) : s == 1 ? _mm256_slli_epi16(qh, 2)
                   : s == 2 ? qh : _mm256_srli_epi16(qh, 2);
        hb = _mm256_and_si256(hb, _mm256_set1_epi8(0x30));
        return _mm256_sub_epi8(_mm256_or_si256(lo, hb), _mm256_set1_epi8(32));
    }
    const int i = g >> 1;
    __m256i v = _mm256_loadu_si256((const __m256i *)(b + (fmt == Q5_K ? 48 : 16) + 32 * i));
    __m256i q = _mm256_and_si256(g & 1 ? _mm256_srli_epi16(v, 4) : v, m4);
    if (fmt == Q5_K) {  /* bit g of each qh byte to bit 4 */
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
        __m256i hb = g <= 4 ? _mm256_slli_epi16(qh, 4 - g) : _mm256_srli_epi16(qh, g - 4);
        q = _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(16)));
    }
    return q;
}

/* The 32 weights of sub-block g as f32, exactly the reference's values: d*sc*q is exact in f32
   (an f16 times a 6- or 8-bit scale times a 6-bit quant needs at most 24 bits), so the one
   rounding of the fma is the reference's rounding of d*sc*q - dmin*m. */
INLINE void kq_weights(int fmt, const uint8_t *b, int g, const float D[16], const float Mn[8],
                       __m256 w[4]) {
    __m256i q = kq_group(fmt, b, g);
    __m128i h[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int t = 0; t < 2; t++) {
        __m256 d = _mm256_set1_ps(fmt == Q6_K ? D[2 * g + t] : D[g]);
        __m256 m = _mm256_set1_ps(fmt == Q6_K ? 0.0f : Mn[g]);
        __m256 a = fmt == Q6_K ? i8x8_to_ps(h[t]) : u8x8_to_ps(h[t]);
        __m256 c = fmt == Q6_K ? i8x8_to_ps(_mm_srli_si128(h[t], 8)) : u8x8_to_ps(_mm_srli_si128(h[t], 8));
        w[2 * t] = _mm256_fmadd_ps(a, d, m);
        w[2 * t + 1] = _mm256_fmadd_ps(c, d, m);
    }
}

/* One super-block dequantized to 256 f32. */
INLINE void kq_dequant(int fmt, const uint8_t *b, float *dst) {
    float D[16], Mn[8];
    kq_scales(fmt, b, D, Mn);
    #pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        __m256 w[4];
        kq_weights(fmt, b, g, D, Mn, w);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + 32 * g + 8 * i, w[i]);
    }
}

/* R (1..4) outputs of one K-quant row against R activation rows x + r*K (written to
   out[r * N]): each sub-block is decoded to its f32 weights once and used for every row, so R
   rows cost little more than one (re-decoding per row would cost R times). At R = 1 this is as
   fast here as scaling integer dot products and adding the min term by activation sums, and
   nearer the reference (its weights are the reference's, bit for bit). */
INLINE void dot_kquant_rows(int fmt, const int R, const uint8_t *row, const float *x, int64_t K,
                            float *out, int64_t N) {
    const int bb = block_bytes(fmt);
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 256; b++) {
        const uint8_t *p = row + b * bb;
        float D[16], Mn[8];
        kq_scales(fmt, p, D, Mn);
        #pragma GCC unroll 8
        for (int g = 0; g < 8; g++) {
            __m256 w[4];
            kq_weights(fmt, p, g, D, Mn, w);
            const float *xg = x + b * 256 + 32 * g;
            for (int r = 0; r < R; r++) {
                acc[r][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xg + r * K), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xg + r * K + 8), acc[r][1]);
                acc[r][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xg + r * K + 16), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xg + r * K + 24), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) out[r * N] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
}
#else
INLINE void kq_dequant(int fmt, const uint8_t *b, float *dst) {
    float D[16], Mn[8] = {0}; int32_t q[256];
    kq_scales(fmt, b, D, Mn);
    kq_ints(fmt, b, q);
    for (int e = 0; e < 256; e++)
        dst[e] = fmt == Q6_K ? D[e / 16] * (float)q[e] : D[e / 32] * (float)q[e] + Mn[e / 32];
}
#endif

#ifndef __AVX2__
/* One output of a K-quant row (portable build): packed row `row` against activation row x, the
   q4_k/q5_k min term by x's per-32 sums xs. */
INLINE float dot_kquant(int fmt, const uint8_t *row, const float *x, const float *xs, int64_t K) {
    const int bb = block_bytes(fmt);
    float D[16], Mn[8] = {0}, total = 0.0f, bias = 0.0f; int32_t q[256];
    for (int64_t b = 0; b < K / 256; b++) {
        kq_scales(fmt, row + b * bb, D, Mn);
        kq_ints(fmt, row + b * bb, q);
        const float *xb = x + b * 256;
        for (int g = 0; g < 16; g++) {
            float s = 0.0f;
            for (int j = 0; j < 16; j++) s += (float)q[16 * g + j] * xb[16 * g + j];
            total += (fmt == Q6_K ? D[g] : D[g / 2]) * s;
        }
        if (fmt != Q6_K)
            for (int j = 0; j < 8; j++) bias += Mn[j] * xs[b * 8 + j];
    }
    return total + bias;
}
#endif

/* Dequantize one packed row of K weights to f32. */
INLINE void dequant_row(int fmt, const uint8_t *row, int64_t K, float *dst) {
    if (fmt == F32) { memcpy(dst, row, (size_t)K * 4); return; }
    if (fmt == I8C) {  /* f32(q) * scale, one rounding a weight: the reference's values */
        const float scale = row_scale(row, K);
        for (int64_t k = 0; k < K; k++) dst[k] = (float)((const int8_t *)row)[k] * scale;
        return;
    }
    if (fmt == F16 || fmt == BF16) {  /* exact widenings, a vector at a time (F16C / a shift) */
        int64_t k = 0;
#ifdef __AVX512F__
        for (; k + 16 <= K; k += 16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * k));
            _mm512_storeu_ps(dst + k, fmt == F16 ? _mm512_cvtph_ps(h)
                             : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
#elif defined(__AVX2__) && defined(__F16C__)
        for (; k + 8 <= K; k += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * k));
            _mm256_storeu_ps(dst + k, fmt == F16 ? _mm256_cvtph_ps(h)
                             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
        }
#endif
        for (; k < K; k++)
            dst[k] = fmt == F16 ? half_to_float(rd16(row + 2 * k)) : bf16_to_float(rd16(row + 2 * k));
        return;
    }
    int bb = block_bytes(fmt); int32_t q[32]; float d, m;
    if (block_elems(fmt) == 256) {
        for (int64_t b = 0; b < K / 256; b++) kq_dequant(fmt, row + b * bb, dst + b * 256);
        return;
    }
    for (int64_t b = 0; b < K / 32; b++) {
#ifdef __AVX2__
        const uint8_t *p = row + b * bb;
        __m256 v[4];
        block_unpack(fmt, p, v);
        d = half_to_float(rd16(p));
        m = fmt == Q4_1 || fmt == Q5_1 ? half_to_float(rd16(p + 2)) : fmt == Q4_0 ? -8.0f * d : fmt == Q5_0 ? -16.0f * d : 0.0f;
        __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
        for (int i = 0; i < 4; i++) _mm256_storeu_ps(dst + b * 32 + 8 * i, _mm256_fmadd_ps(v[i], dv, mv));
        (void)q;
#else
        block_ints(fmt, row + b * bb, q, &d, &m);
        for (int j = 0; j < 32; j++) dst[b * 32 + j] = d * (float)q[j] + m;
#endif
    }
}

#ifdef __AVX512F__
/* sum_j q_j * x_j over one block, 16 lanes wide (AVX-512: half the instructions of AVX2). */
INLINE __m512 block_dot512(int fmt, const uint8_t *b, const float *x) {
    __m128i lo, hi;
    block_halves(fmt, b, &lo, &hi);
    __m512 a = fmt == Q8_0 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)) : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
    __m512 c = fmt == Q8_0 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)) : _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
    return _mm512_fmadd_ps(c, _mm512_loadu_ps(x + 16), _mm512_mul_ps(a, _mm512_loadu_ps(x)));
}
#endif

/* The offset term's weight for one block: w = d * q + m, so the block adds m * sum(x). */
INLINE float block_offset(int fmt, const uint8_t *p, float d) {
    return fmt == Q4_1 || fmt == Q5_1 ? half_to_float(rd16(p + 2))
         : fmt == Q4_0 ? -8.0f * d : fmt == Q5_0 ? -16.0f * d : 0.0f;
}

/* Two blocks a step into two accumulators, then the remainder, at one vector width (FMADD and
   SET1 its intrinsics, DOT its block dot product); reads and updates b, acc0, acc1, bias. */
#define BLOCK_LOOPS(FMADD, SET1, DOT)                                                         \
    for (; b + 1 < blocks; b += 2) {                                                          \
        const uint8_t *p0 = row + b * bb, *p1 = p0 + bb;                                      \
        const float d0 = half_to_float(rd16(p0)), d1 = half_to_float(rd16(p1));               \
        acc0 = FMADD(SET1(d0), DOT(fmt, p0, x + b * 32), acc0);                               \
        acc1 = FMADD(SET1(d1), DOT(fmt, p1, x + b * 32 + 32), acc1);                          \
        bias += block_offset(fmt, p0, d0) * xs[b] + block_offset(fmt, p1, d1) * xs[b + 1];    \
    }                                                                                         \
    for (; b < blocks; b++) {                                                                 \
        const uint8_t *p0 = row + b * bb;                                                     \
        const float d0 = half_to_float(rd16(p0));                                             \
        acc0 = FMADD(SET1(d0), DOT(fmt, p0, x + b * 32), acc0);                               \
        bias += block_offset(fmt, p0, d0) * xs[b];                                            \
    }

/* One output: packed row `row` against activation row x (with its per-block sums xs). */
INLINE float dot_quant(int fmt, const uint8_t *row, const float *x, const float *xs, int64_t K) {
    const int bb = block_bytes(fmt);
    const int64_t blocks = K / 32;
    float bias = 0.0f;
#if defined(__AVX512F__)
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    int64_t b = 0;
    if (fmt == Q4_1 || fmt == Q5_1) {
        /* Scales and offsets of four blocks at once: one f16 -> f32 conversion each. */
        __m128 biasv = _mm_setzero_ps();
        for (; b + 3 < blocks; b += 4) {
            const uint8_t *p = row + b * bb;
            __m128i dm = _mm_set_epi32((int)rd32(p + 3 * bb), (int)rd32(p + 2 * bb), (int)rd32(p + bb), (int)rd32(p));
            __m256 both = _mm256_cvtph_ps(dm);  /* d0 m0 d1 m1 d2 m2 d3 m3 */
            float f[8];
            _mm256_storeu_ps(f, both);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(f[0]), block_dot512(fmt, p, x + b * 32), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(f[2]), block_dot512(fmt, p + bb, x + b * 32 + 32), acc1);
            acc0 = _mm512_fmadd_ps(_mm512_set1_ps(f[4]), block_dot512(fmt, p + 2 * bb, x + b * 32 + 64), acc0);
            acc1 = _mm512_fmadd_ps(_mm512_set1_ps(f[6]), block_dot512(fmt, p + 3 * bb, x + b * 32 + 96), acc1);
            biasv = _mm_fmadd_ps(_mm_set_ps(f[7], f[5], f[3], f[1]), _mm_loadu_ps(xs + b), biasv);
        }
        biasv = _mm_add_ps(biasv, _mm_movehl_ps(biasv, biasv));
        biasv = _mm_add_ss(biasv, _mm_movehdup_ps(biasv));
        bias += _mm_cvtss_f32(biasv);
    }
    BLOCK_LOOPS(_mm512_fmadd_ps, _mm512_set1_ps, block_dot512)
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1)) + bias;
#elif defined(__AVX2__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t b = 0;
    BLOCK_LOOPS(_mm256_fmadd_ps, _mm256_set1_ps, block_dot)
    return hsum(_mm256_add_ps(acc0, acc1)) + bias;
#else
    int32_t q[32]; float d, m, total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        block_ints(fmt, row + b * bb, q, &d, &m);
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += (float)q[j] * x[b * 32 + j];
        total += d * s;
        bias += m * xs[b];
    }
    return total + bias;
#endif
}

#ifdef __AVX2__
/* Eight weights k..k+7 of a dense row as f32. */
INLINE __m256 load8(int fmt, const uint8_t *p, int64_t k) {
    if (fmt == F32) return _mm256_loadu_ps((const float *)p + k);
#ifdef __F16C__
    if (fmt == F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + k)));
#endif
    if (fmt == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k))), 16));
    if (fmt == I8C) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + k))));
    float t[8];
    for (int j = 0; j < 8; j++) t[j] = half_to_float(rd16(p + 2 * (k + j)));
    return _mm256_loadu_ps(t);
}
#endif

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif
#ifdef __AVX512F__
/* Sixteen weights k..k+15 of a 16-bit dense row as f32 (f16: F16C's 512-bit form; bf16: widen
   and shift): the conversion, not the memory, bounds a 256-bit loop over half rows (measured:
   bf16 at 14-16 GB/s against f32's 23-27). */
INLINE __m512 load16(int fmt, const uint8_t *p, int64_t k) {
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + k));
    if (fmt == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

/* Per-channel int8 rows (I8C: K int8 weights, then the row's f32 scale), f32 accumulation; the
   float formats stream one row at a time (dense_row, below). Four rows at once share x's loads. */
INLINE void dot_i8c4(const uint8_t *w, int64_t row_bytes, int64_t rows, const float *x, int64_t K,
                     float *out) {
#ifdef __AVX2__
    __m256 a[4], b[4];
    for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
    int64_t k = 0;
    if (rows >= 4) {
        const uint8_t *p0 = w, *p1 = w + row_bytes, *p2 = w + 2 * row_bytes, *p3 = w + 3 * row_bytes;
        const int64_t ahead = PREFETCH_ROWS * row_bytes;
        for (; k + 16 <= K; k += 16) {
            if ((k & 63) == 0) {  /* one line a row: 64 int8 weights */
                _mm_prefetch((const char *)p0 + ahead + k, _MM_HINT_T0);
                _mm_prefetch((const char *)p1 + ahead + k, _MM_HINT_T0);
                _mm_prefetch((const char *)p2 + ahead + k, _MM_HINT_T0);
                _mm_prefetch((const char *)p3 + ahead + k, _MM_HINT_T0);
            }
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            a[0] = _mm256_fmadd_ps(load8(I8C, p0, k), x0, a[0]); b[0] = _mm256_fmadd_ps(load8(I8C, p0, k + 8), x1, b[0]);
            a[1] = _mm256_fmadd_ps(load8(I8C, p1, k), x0, a[1]); b[1] = _mm256_fmadd_ps(load8(I8C, p1, k + 8), x1, b[1]);
            a[2] = _mm256_fmadd_ps(load8(I8C, p2, k), x0, a[2]); b[2] = _mm256_fmadd_ps(load8(I8C, p2, k + 8), x1, b[2]);
            a[3] = _mm256_fmadd_ps(load8(I8C, p3, k), x0, a[3]); b[3] = _mm256_fmadd_ps(load8(I8C, p3, k + 8), x1, b[3]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        __m256 xv = _mm256_loadu_ps(x + k);
        for (int r = 0; r < 4 && r < rows; r++) a[r] = _mm256_fmadd_ps(load8(I8C, w + r * row_bytes, k), xv, a[r]);
    }
    for (int r = 0; r < 4; r++) a[r] = _mm256_add_ps(a[r], b[r]);
    for (int r = 0; r < 4 && r < rows; r++) {
        float s = hsum(a[r]);
        const uint8_t *p = w + r * row_bytes;
        for (int64_t j = k; j < K; j++) s += dense_weight(I8C, p, j) * x[j];
        out[r] = s * row_scale(p, K);
    }
#else
    for (int r = 0; r < rows && r < 4; r++) {
        const uint8_t *p = w + r * row_bytes; float s = 0.0f;
        for (int64_t j = 0; j < K; j++) s += dense_weight(I8C, p, j) * x[j];
        out[r] = s * row_scale(p, K);
    }
#endif
}


/* How far ahead in a thread's stream of dense weight rows dense_row asks for them (software
   prefetch into L1, one request a 64-byte line). */
#ifndef DENSE_AHEAD
#define DENSE_AHEAD 16384
#endif

/* The widest vector this build has, for the dense kernels (dense_row, and the prompt-chunk GEMM
   further down): 16 lanes of AVX-512 or 8 of AVX2 (with F16C). A build with neither has no
   GEMM_VECTOR: its dense rows run the portable loop, and it has no prompt-chunk GEMM. */
#ifdef __AVX512F__
typedef __m512 gemm_vec;  /* one vector of K-lanes: 16 (AVX-512) or 8 (AVX2) */
#define GEMM_LANES 16
#define gemm_zero _mm512_setzero_ps
#define gemm_load _mm512_loadu_ps
#define gemm_fmadd _mm512_fmadd_ps
#define gemm_add _mm512_add_ps
/* Sixteen weights k..k+15 of an f32, f16 or bf16 row as f32. */
INLINE __m512 gemm_weights(int fmt, const uint8_t *row, int64_t k) {
    return fmt == F32 ? _mm512_loadu_ps((const float *)row + k) : load16(fmt, row, k);
}
INLINE __m256 fold256(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* The four sums of a, b, c and d's lanes, in that order (one transposing tree: a third of the
   instructions of four separate reductions). */
INLINE __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(fold256(a), fold256(b)),
                                       _mm256_hadd_ps(fold256(c), fold256(d)));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
/* s[j] = the lane sum of acc[j], j < rn. */
INLINE void gemm_sums(const __m512 *acc, const int rn, float *s) {
    int j = 0;
    for (; j + 4 <= rn; j += 4) _mm_storeu_ps(s + j, reduce4(acc[j], acc[j + 1], acc[j + 2], acc[j + 3]));
    for (; j < rn; j++) s[j] = _mm512_reduce_add_ps(acc[j]);
}
#define GEMM_VECTOR 1
#elif defined(__AVX2__) && defined(__F16C__)
typedef __m256 gemm_vec;
#define GEMM_LANES 8
#define gemm_zero _mm256_setzero_ps
#define gemm_load _mm256_loadu_ps
#define gemm_fmadd _mm256_fmadd_ps
#define gemm_add _mm256_add_ps
INLINE __m256 gemm_weights(int fmt, const uint8_t *row, int64_t k) { return load8(fmt, row, k); }
INLINE void gemm_sums(const __m256 *acc, const int rn, float *s) {
    for (int j = 0; j < rn; j++) s[j] = hsum(acc[j]);
}
#define GEMM_VECTOR 1
#endif

/* One dense weight row (f32, f16 or bf16) against each of M activation rows: out[m * N] =
   row . x[m]. The row is read front to back once (from memory for the first activation row,
   from L1 for the others), so a thread's share of a product is one sequential stream, which
   the hardware prefetchers follow, where four rows at once (as dot_i8c4 reads) were four streams a
   row apart. Four independent accumulators of the widest vector hide the FMA latency.
   Measured on SmolLM2's decode products (121 calls, 538 MB f32 / 269 MB bf16, 2 threads,
   interleaved rounds, /work/scratch/gv): f32 0.80-0.89x of the four-row kernel's time, bf16 0.92x;
   16 KiB ahead was at least as fast as 4, 8 or 32 KiB, or none. */
INLINE void dense_row(const int fmt, const uint8_t *row, const float *x, int64_t M, int64_t K,
                      float *out, int64_t N) {
    const int64_t width = dense_width(fmt);
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        int64_t k = 0;
        float s = 0.0f;
#ifdef GEMM_VECTOR
        enum { L = GEMM_LANES };
        gemm_vec a0 = gemm_zero(), a1 = a0, a2 = a0, a3 = a0;
        for (; k + 4 * L <= K; k += 4 * L) {
            if (m == 0)
                for (int64_t line = 0; line < 4 * L * width; line += 64)
                    _mm_prefetch((const char *)row + DENSE_AHEAD + width * k + line, _MM_HINT_T0);
            a0 = gemm_fmadd(gemm_weights(fmt, row, k), gemm_load(xr + k), a0);
            a1 = gemm_fmadd(gemm_weights(fmt, row, k + L), gemm_load(xr + k + L), a1);
            a2 = gemm_fmadd(gemm_weights(fmt, row, k + 2 * L), gemm_load(xr + k + 2 * L), a2);
            a3 = gemm_fmadd(gemm_weights(fmt, row, k + 3 * L), gemm_load(xr + k + 3 * L), a3);
        }
        for (; k + L <= K; k += L) a0 = gemm_fmadd(gemm_weights(fmt, row, k), gemm_load(xr + k), a0);
        a0 = gemm_add(gemm_add(a0, a1), gemm_add(a2, a3));
        gemm_sums(&a0, 1, &s);
#endif
        for (; k < K; k++) s += dense_weight(fmt, row, k) * xr[k];
        out[m * N] = s;
    }
}

/* Every output of weight rows [n0, n1) for all M activation rows; `fmt` is a constant at each
   call site (fuel_matmul's switch), so each format gets its own specialised loop. */
INLINE void tile_rows(const int fmt, const float *x, const uint8_t *w, float *out, const float *xs,
                      int64_t M, int64_t N, int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
    if (fmt == F32 || fmt == F16 || fmt == BF16) {
        for (int64_t n = n0; n < n1; n++) dense_row(fmt, w + n * row_bytes, x, M, K, out + n, N);
        return;
    }
    for (int64_t m = 0; m < M; m++) {
        const float *xr = x + m * K;
        if (block_elems(fmt) == 256 && block_bytes(fmt) > 0) {
#ifdef __AVX2__
            /* rows m .. m+R-1 in one pass over the weight rows; the loop's m advances by R */
            const int R = M - m < 4 ? (int)(M - m) : 4;
            for (int64_t n = n0; n < n1; n++) {
                const uint8_t *wr = w + n * row_bytes;
                float *o = out + m * N + n;
                if (m == 0) prefetch_span(wr + STREAM_AHEAD, row_bytes);
                WITH_ROWS(R, dot_kquant_rows, fmt, wr, xr, K, o, N);
            }
            m += R - 1;
#else
            for (int64_t n = n0; n < n1; n++)
                out[m * N + n] = dot_kquant(fmt, w + n * row_bytes, xr, xs + m * (K / 32), K);
#endif
        } else if (block_bytes(fmt) > 0) {
            for (int64_t n = n0; n < n1; n++) {
                if (m == 0) prefetch_span(w + n * row_bytes + STREAM_AHEAD, row_bytes);
                out[m * N + n] = dot_quant(fmt, w + n * row_bytes, xr, xs + m * (K / 32), K);
            }
        } else {  /* I8C */
            for (int64_t n = n0; n < n1; n += 4)
                dot_i8c4(w + n * row_bytes, row_bytes, n1 - n, xr, K, out + m * N + n);
        }
    }
}

/* out[M, N] = x[M, K] @ W[N, K]^T for weights in format `fmt`, on `threads` threads of the
   OpenMP runtime torch uses. Returns 0, or -1 for a format or width it cannot run. */
/* What fuel_matmul computes before its rows: 0 and *xs the per-32 activation sums where the
   format reads them (NULL where it needs none: free() it either way), or -1 for a format or
   width it cannot run (or no memory). */
int fuel_matmul_prepare(int fmt, const float *x, int64_t M, int64_t K, float **xs_out) {
    const int quant = block_bytes(fmt) > 0;
    *xs_out = NULL;
    if (quant && K % block_elems(fmt)) return -1;
    if (!quant && !dense_format(fmt)) return -1;
#ifdef __AVX2__
    const int sums = quant && block_elems(fmt) == 32;  /* the K-quants decode weights instead */
#else
    const int sums = quant;
#endif
    if (sums) {  /* per-32 activation sums, once per row */
        float *xs = (float *)malloc(sizeof(float) * (size_t)(M * (K / 32) + 1));
        if (!xs) return -1;
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < K / 32; b++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += x[m * K + b * 32 + j];
                xs[m * (K / 32) + b] = s;
            }
        *xs_out = xs;
    }
    return 0;
}

/* Weight rows [n0, n1) of fuel_matmul's product, serial, with fuel_matmul_prepare's sums: the
   unit the fused steps (steps.c) share out inside their own parallel region. */
void fuel_matmul_rows(int fmt, const float *x, const uint8_t *w, float *out, const float *xs,
                      int64_t M, int64_t N, int64_t K, int64_t row_bytes, int64_t n0, int64_t n1) {
    switch (fmt) {
    case F32: tile_rows(F32, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case F16: tile_rows(F16, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case BF16: tile_rows(BF16, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case I8C: tile_rows(I8C, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q4_0: tile_rows(Q4_0, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q4_1: tile_rows(Q4_1, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q5_0: tile_rows(Q5_0, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q5_1: tile_rows(Q5_1, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q4_K: tile_rows(Q4_K, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q5_K: tile_rows(Q5_K, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q6_K: tile_rows(Q6_K, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    case Q4_1X8: case Q8_0X8: {  /* f32 activations: a few rows at a time back in the file's
                       order (the f32 oracle and FUEL_Q8_ACTIVATIONS=0; decode reads q8x8_dot_rows) */
        enum { PART = 4 };
        uint8_t *rows = (uint8_t *)malloc((size_t)(PART * row_bytes));
        if (!rows) {  /* no memory for four rows: NaN, never a silently wrong number */
            for (int64_t m = 0; m < M; m++) for (int64_t n = n0; n < n1; n++) out[m * N + n] = NAN;
            break;
        }
        for (int64_t a = n0; a < n1; a += PART) {
            const int64_t b = a + PART < n1 ? a + PART : n1;
            for (int64_t n = a; n < b; n++) x8_row(fmt, w + n * row_bytes, rows + (n - a) * row_bytes, K / 32, 0);
            if (fmt == Q4_1X8) tile_rows(Q4_1, x, rows, out + a, xs, M, N, K, row_bytes, 0, b - a);
            else tile_rows(Q8_0, x, rows, out + a, xs, M, N, K, row_bytes, 0, b - a);
        }
        free(rows);
        break;
    }
    default: tile_rows(Q8_0, x, w, out, xs, M, N, K, row_bytes, n0, n1); break;
    }
}

/* Packed rows between a regrouped format (fmt: q4_1x8, q8_0x8) and its file's order (to_x8 1:
   into fmt; 0: back): N rows of K weights, K / 32 blocks each, src and dst apart. Returns 0, or
   -1 for another format or a K that splits a block. */
int fuel_regroup(int fmt, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K, int to_x8) {
    if (x8_source(fmt) < 0 || K % 32 || K <= 0) return -1;
    const int64_t rb = K / 32 * block_bytes(fmt);
    #pragma omp parallel for schedule(static) if (N * rb >= (1 << 20))
    for (int64_t n = 0; n < N; n++) x8_row(fmt, src + n * rb, dst + n * rb, K / 32, to_x8);
    return 0;
}

/* Weight rows a scheduling unit (the tiles every product here is split into). */
int64_t fuel_matmul_tile(void) { return TILE; }

/* prefetch_span for the step list (steps.c): the first bytes of a new run of weight rows. */
void fuel_prefetch(const void *p, int64_t bytes) { prefetch_span(p, bytes); }

/* Dense GEMM for prompt chunks: out[M, N] = x[M, K] @ W[N, K]^T, W f32, f16 or bf16 as it is
   held (16-bit weights widened in registers: no f32 copy of the matrix is written and read back),
   f32 accumulation. Register tiles of GEMM_TM activation rows by GEMM_TN weight rows, each output
   a 16-lane (AVX2: 8-lane) sum along K folded at the end (the weight rows of a tile stay in L1 while every
   activation row of a block passes them); activation rows in blocks of GEMM_MB (they stay in
   L2), the weight tiles of each block shared out over the threads (the same share each block,
   so a thread's weights stay in its own cache). */
#define GEMM_M 4  /* the largest tile's rows and weight rows (the accumulator arrays' bounds) */
#define GEMM_N 6

#ifdef GEMM_VECTOR
/* One rm x rn tile (rm <= GEMM_M, rn <= GEMM_N, constants at each call site). */
INLINE void gemm_tile(const int fmt, const int rm, const int rn, const float *x, int64_t K,
                      const uint8_t *w, int64_t row_bytes, float *out, int64_t N) {
    gemm_vec acc[GEMM_M][GEMM_N];
    for (int i = 0; i < rm; i++)
        for (int j = 0; j < rn; j++) acc[i][j] = gemm_zero();
    int64_t k = 0;
    for (; k + GEMM_LANES <= K; k += GEMM_LANES) {
        gemm_vec a[GEMM_M];
        for (int i = 0; i < rm; i++) a[i] = gemm_load(x + i * K + k);
        for (int j = 0; j < rn; j++) {
            const gemm_vec b = gemm_weights(fmt, w + j * row_bytes, k);
            for (int i = 0; i < rm; i++) acc[i][j] = gemm_fmadd(a[i], b, acc[i][j]);
        }
    }
    for (int i = 0; i < rm; i++) {
        float s[GEMM_N];
        gemm_sums(acc[i], rn, s);
        for (int j = 0; j < rn; j++) {  /* the columns past the last whole vector */
            for (int64_t t = k; t < K; t++) s[j] += x[i * K + t] * dense_weight(fmt, w + j * row_bytes, t);
            out[i * N + j] = s[j];
        }
    }
}

#if defined(__AVX512F__)
#define GEMM_TM 4  /* the full tile: 24 accumulators of 32 registers (measured 1.25x faster */
#define GEMM_TN 6  /* than 6 x 4 here: fewer passes over the activations outweigh the conversions) */
#else
#define GEMM_TM 3  /* AVX2: 12 accumulators of 16 registers */
#define GEMM_TN 4
#endif
#define GEMM_MB (16 * GEMM_TM)  /* activation rows a block: 64 (AVX-512) or 48 (measured: 32, 64
   and 128 alike at 256 rows here) */
/* Activation rows [m0, m1) against weight rows [n0, n0 + rn), rn <= GEMM_TN. */
INLINE void gemm_rows(const int fmt, const int rn, const float *x, int64_t m0, int64_t m1, int64_t K,
                      const uint8_t *w, int64_t row_bytes, float *out, int64_t N) {
    int64_t m = m0;
    for (; m + GEMM_TM <= m1; m += GEMM_TM) gemm_tile(fmt, GEMM_TM, rn, x + m * K, K, w, row_bytes, out + m * N, N);
    switch (m1 - m) {  /* the rows left: fewer than GEMM_TM */
    case 3: gemm_tile(fmt, 3, rn, x + m * K, K, w, row_bytes, out + m * N, N); break;
    case 2: gemm_tile(fmt, 2, rn, x + m * K, K, w, row_bytes, out + m * N, N); break;
    case 1: gemm_tile(fmt, 1, rn, x + m * K, K, w, row_bytes, out + m * N, N); break;
    default: break;
    }
}

INLINE void gemm_block(const int fmt, const float *x, int64_t m0, int64_t m1, int64_t K, const uint8_t *w,
                       int64_t row_bytes, float *out, int64_t N, int64_t t) {
    const int64_t n = t * GEMM_TN, rest = N - n;
    const uint8_t *wt = w + n * row_bytes;
    float *o = out + n;
    if (rest >= GEMM_TN) { gemm_rows(fmt, GEMM_TN, x, m0, m1, K, wt, row_bytes, o, N); return; }
    switch (rest) {
#if GEMM_TN > 5
    case 5: gemm_rows(fmt, 5, x, m0, m1, K, wt, row_bytes, o, N); break;
    case 4: gemm_rows(fmt, 4, x, m0, m1, K, wt, row_bytes, o, N); break;
#endif
    case 3: gemm_rows(fmt, 3, x, m0, m1, K, wt, row_bytes, o, N); break;
    case 2: gemm_rows(fmt, 2, x, m0, m1, K, wt, row_bytes, o, N); break;
    default: gemm_rows(fmt, 1, x, m0, m1, K, wt, row_bytes, o, N); break;
    }
}

#define GEMM_LOOP(FMT)                                                                        \
    _Pragma("omp parallel num_threads(threads) if (parallel)")                                \
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_MB) {                                             \
        const int64_t m1 = m0 + GEMM_MB < M ? m0 + GEMM_MB : M;                               \
        _Pragma("omp for schedule(static) nowait")                                            \
        for (int64_t t = 0; t < tiles; t++) gemm_block(FMT, x, m0, m1, K, w, row_bytes, out, N, t); \
    }
#endif

/* 0, or -1 where this build has no vector GEMM for `fmt` (f32/f16/bf16 only; AVX-512, or AVX2
   with F16C): the caller then dequantizes and calls torch's GEMM. */
int fuel_gemm_dense(int fmt, const float *x, const uint8_t *w, float *out, int64_t M, int64_t N,
                    int64_t K, int64_t row_bytes, int threads) {
#ifdef GEMM_VECTOR
    if (fmt != F32 && fmt != F16 && fmt != BF16) return -1;
    const int64_t tiles = (N + GEMM_TN - 1) / GEMM_TN;
    const int parallel = threads > 1 && M * N * K >= (1 << 20);
    if (fmt == F16) { GEMM_LOOP(F16) }
    else if (fmt == BF16) { GEMM_LOOP(BF16) }
    else { GEMM_LOOP(F32) }
    return 0;
#else
    (void)fmt; (void)x; (void)w; (void)out; (void)M; (void)N; (void)K; (void)row_bytes; (void)threads;
    return -1;
#endif
}

int fuel_matmul(int fmt, const float *x, const uint8_t *w, float *out, int64_t M, int64_t N,
                int64_t K, int64_t row_bytes, int threads) {
    float *xs = NULL;
    if (fuel_matmul_prepare(fmt, x, M, K, &xs)) return -1;
    FOR_TILES(N, K, threads, { fuel_matmul_rows(fmt, x, w, out, xs, M, N, K, row_bytes, n0, n1); });
    free(xs);
    return 0;
}

#endif
#if !defined(FUEL_PART) || FUEL_PART == 2  /* 8-bit activations (the other half) */
/* ---- 8-bit activations: integer dot products on the packed quants (decode rows) ------------

   fuel_matmul_q8 multiplies the 32-weight block formats (q4_0, q4_1, q5_0, q5_1, q8_0) with
   activations rounded to 8 bits, llama.cpp's technique (its q8_0/q8_1 activation blocks); this
   code is fuel's own. Each activation row is quantized once per call, per 32-element block b:
       amax = max |x_j|, d_b = amax / 127 (f32), q_j = round_half_even(x_j * (127 / amax)),
   so q_j is in [-127, 127] (all 0 for an all-zero block; a block holding a NaN or an infinity
   gets d_b = NaN, so that row's outputs are NaN, never a silently finite number). The block's
   integer sum S_b = sum_j q_j is kept too. Then for weight block (d_w, m_w, quants u_j):
       q4_0 / q5_0: w = d_w (u - 8) / d_w (u - 16):  out += d_w d_b (sum u_j q_j - 8 S_b) (- 16 S_b)
       q4_1 / q5_1: w = d_w u + m_w:                 out += d_w d_b sum u_j q_j + m_w d_b S_b
       q8_0:        w = d_w u (u signed):           out += d_w d_b sum u_j q_j
   The integer part of every block is exact (int32, |sum| < 2^20), converted to f32 exactly and
   scaled. So the result differs from x @ dequant(W).T by the activation rounding,
   |x_j - d_b q_j| <= d_b / 2 (times 1 + 2^-20 for the f32 rounding of d_b and 127/amax), and the
   f32 rounding of the per-block scaling and of the sum over blocks: fuel.jit.native_synth states
   the bound the JIT verifies.

   SIMD, by what the build targets:
   - AVX-512 VNNI + VBMI (Q8_512): a group of four blocks a step. For the nibble formats one
     vpermt2b gathers the four blocks' 16 quant bytes into one register, whose low and high
     nibbles are the bytes [b0 0-15, b1 0-15, b2 0-15, b3 0-15] and [b0 16-31, ... b3 16-31];
     the activation bytes of a group are stored in that order (Q8_QUAD), so two chained vpdpbusd
     (unsigned weight bytes times signed activation bytes, four products a 32-bit lane) leave
     block i's dot in lanes 4i..4i+3, scaled by d_w d_b from one permute. A second vpermt2b
     gathers the four [d_w m_w] (and q5's high bits, applied as byte masks). q8_0's 32 bytes are
     contiguous: two blocks a register, natural order. The last group of a row may be partial:
     masked loads read only its blocks, the activations beyond K are zeros.
   - AVX2 (with AVX-VNNI or AVX-512VL VNNI without VBMI: 256-bit vpdpbusd; AVX2 alone: vpmaddubsw
     + vpmaddwd): the nibble formats a pair of blocks a step, in the same Q8_QUAD activation
     order: the two blocks' 16 quant bytes side by side in one register, so one mask gives both
     blocks' low nibbles [b0 0-15 | b1 0-15] and one shift and mask their high nibbles, against
     the group's activation bytes 32 j and 64 + 32 j (pair j); block i's dot lands in four 32-bit
     lanes. q8_0 one block a step, natural order. No saturation without VNNI: |u| <= 31 (two
     products a 16-bit lane, their sum over the two halves four: 4 * 31 * 127 < 2^15), and q8_0
     multiplies |w| <= 128 by the sign-moved activation, 2 * 128 * 127 < 2^15.
   - the regrouped q4_1x8 and q8_0x8 (see the top) on every AVX2 build, the AVX-512 ones too:
     q8x8_dot_rows and q8x8_0_dot_rows, eight blocks a group, 256-bit (vpdpbusd where VNNI is).
     They were measured on AVX2 alone (Zen 3); on the AVX-512 VBMI machines the file layouts'
     512-bit four-block kernel above has not been compared with them.
   - portable C otherwise (a regrouped row moved back into the file's order first).
   The VNNI paths read q8_0's signed weights as unsigned (w + 128, an xor) and take 128 S_b back;
   the symmetric offsets (8, 16, 128) are folded into the 32-bit accumulators' start values,
   integers (-(o / lanes) S_b a lane), so they stay exact. */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define Q8_512 1
#endif
#ifdef Q8_512
/* vpermt2b byte indices into a group's first 128 bytes (four blocks from its start), per
   format Q4_0, Q4_1, Q5_0, Q5_1: QS gathers the four blocks' 16 quant bytes; HD their f16 d and
   the two bytes after it (q4_1/q5_1: m) in bytes 0-15, and q5's qh low halves (bytes 16-23) and
   high halves (24-31). Generated from the block layouts above (bb*b + offset + j). */
static const uint8_t Q8_QS_IDX[4][64] __attribute__((aligned(64))) = {
    {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71},
    {4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79},
    {6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 83, 84, 85, 86, 87},
    {8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 56, 57, 58, 59, 60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 80, 81, 82, 83, 84, 85, 86, 87, 88, 89, 90, 91, 92, 93, 94, 95}
};
static const uint8_t Q8_HD_IDX[4][64] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 18, 19, 20, 21, 36, 37, 38, 39, 54, 55, 56, 57, 0, 1, 18, 19, 36, 37, 54, 55, 2, 3, 20, 21, 38, 39, 56, 57, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 20, 21, 22, 23, 40, 41, 42, 43, 60, 61, 62, 63, 0, 1, 20, 21, 40, 41, 60, 61, 2, 3, 22, 23, 42, 43, 62, 63, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 22, 23, 24, 25, 44, 45, 46, 47, 66, 67, 68, 69, 2, 3, 24, 25, 46, 47, 68, 69, 4, 5, 26, 27, 48, 49, 70, 71, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    {0, 1, 2, 3, 24, 25, 26, 27, 48, 49, 50, 51, 72, 73, 74, 75, 4, 5, 28, 29, 52, 53, 76, 77, 6, 7, 30, 31, 54, 55, 78, 79, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
};
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define Q8_VNNI 1
#define DPBUSD256(c, u, x) _mm256_dpbusd_epi32(c, u, x)
#elif defined(__AVXVNNI__)
#define Q8_VNNI 1
#define DPBUSD256(c, u, x) _mm256_dpbusd_avx_epi32(c, u, x)
#endif

/* The offset o taken back as o * S_b in the integer part (q8_0's 128 only where its weights are
   read as unsigned bytes: the VNNI paths). */
INLINE int q8_offset(int fmt) {
#ifdef Q8_VNNI
    if (fmt == Q8_0 || fmt == Q8_0X8) return 128;
#endif
    return fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : 0;
}

/* Whether a group's activation bytes are stored in the four-block nibble order (see above). */
INLINE int q8_quad(int fmt) {
#ifdef __AVX2__
    return fmt != Q8_0 && fmt != Q8_0X8;
#else
    (void)fmt; return 0;
#endif
}

/* One activation block to int8 (natural order), its scale and integer sum. */
static void q8_quantize_block(const float *x, int8_t q[32], float *d, int32_t *sum) {
    float amax = 0.0f;
    int bad = 0;
    for (int j = 0; j < 32; j++) {
        const float a = fabsf(x[j]);
        if (!(a <= 3.40282347e38f)) bad = 1;  /* NaN or infinity */
        else if (a > amax) amax = a;
    }
    if (bad) {
        memset(q, 0, 32); *d = NAN; *sum = 0;
        return;
    }
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    int32_t s = 0;
#ifdef __AVX2__
    const __m256 idv = _mm256_set1_ps(id);
    int32_t t[32];
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), idv),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_storeu_si256((__m256i *)(t + 8 * i), _mm256_cvtps_epi32(v));
    }
    for (int j = 0; j < 32; j++) { q[j] = (int8_t)t[j]; s += t[j]; }
#else
    for (int j = 0; j < 32; j++) {
        const int v = (int)nearbyintf(x[j] * id);  /* the default rounding mode: half to even */
        q[j] = (int8_t)v; s += v;
    }
#endif
    *d = amax / 127.0f;
    *sum = s;
}

/* Quantized activation rows as the kernels read them, G = ceil(K/128) groups of four blocks a
   row (the last padded with zero blocks):
   q[r*G*128 ..]: the int8 values (a group in Q8_QUAD order where q8_quad(fmt));
   d, s [r*B + b]: block scale and integer sum;
   dm [r*G*8 ..]: per group [d0 d0 d1 d1 d2 d2 d3 d3] (against the group's [d_w m_w] pairs);
   sm: [0 S0 0 S1 0 S2 0 S3] as f32 (the m_w term);
   c [r*G*32 ..]: the 32-bit lanes' start values, in the lane order of the step reading them:
   natural order 8 lanes a block (-(o/8) S_b each), Q8_QUAD 4 lanes a block (-(o/4) S_b);
   d8, s8 [r*G8*8 + x8_lane(b % 8)]: d_b and d_b S_b per group of eight blocks (G8 = ceil(B/8)),
   in q4_1x8's lane order (zeros past B), against its eight d_w and eight m_w. */
typedef struct {
    int8_t *q; float *d; int32_t *s; float *dm; float *sm; int32_t *c; float *d8; float *s8;
    int64_t K, B, G, G8;
    void *mem;
} Q8Rows;

static int q8_prepare(int fmt, const float *x, int64_t M, int64_t K, Q8Rows *a) {
    const int64_t B = K / 32, G = (B + 3) / 4, G8 = (B + 7) / 8;
    const size_t bytes = sizeof(int32_t) * (size_t)(M * G * 32) + sizeof(float) * (size_t)(M * G * 16)
                       + sizeof(float) * (size_t)(M * G8 * 16)
                       + sizeof(float) * (size_t)(M * B) * 2 + (size_t)(M * G * 128) + 64;
    uint8_t *mem = (uint8_t *)aligned_alloc(64, (bytes + 63) & ~(size_t)63);
    if (!mem) return -1;
    memset(mem, 0, bytes);
    a->mem = mem; a->K = K; a->B = B; a->G = G; a->G8 = G8;
    a->c = (int32_t *)mem;
    a->dm = (float *)(a->c + M * G * 32);
    a->sm = a->dm + M * G * 8;
    a->d8 = a->sm + M * G * 8;
    a->s8 = a->d8 + M * G8 * 8;
    a->q = (int8_t *)(a->s8 + M * G8 * 8);
    a->d = (float *)(a->q + M * G * 128);
    a->s = (int32_t *)(a->d + M * B);
    const int o = q8_offset(fmt), quad = q8_quad(fmt);
    for (int64_t r = 0; r < M; r++) {
        int8_t *qr = a->q + r * G * 128;
        float *dr = a->d + r * B, *dm = a->dm + r * G * 8, *sm = a->sm + r * G * 8;
        int32_t *sr = a->s + r * B, *cr = a->c + r * G * 32;
        for (int64_t b = 0; b < B; b++) {
            int8_t t[32];
            q8_quantize_block(x + r * K + b * 32, t, dr + b, sr + b);
            dm[2 * b] = dm[2 * b + 1] = dr[b];
            sm[2 * b + 1] = (float)sr[b];
            if (fmt == Q4_1X8) {  /* q8x8_dot_rows' eight scales a group, in its lane order */
                a->d8[r * G8 * 8 + (b / 8) * 8 + x8_lane((int)(b % 8))] = dr[b];
                a->s8[r * G8 * 8 + (b / 8) * 8 + x8_lane((int)(b % 8))] = dr[b] * (float)sr[b];
            }
            if (quad) {
                const int64_t g = b / 4, i = b % 4;
                memcpy(qr + g * 128 + 16 * i, t, 16);
                memcpy(qr + g * 128 + 64 + 16 * i, t + 16, 16);
                for (int l = 0; l < 4; l++) cr[g * 32 + 4 * i + l] = -(o / 4) * sr[b];
            } else {
                memcpy(qr + b * 32, t, 32);
                for (int l = 0; l < 8; l++) cr[b * 8 + l] = -(o / 8) * sr[b];
            }
        }
    }
    return 0;
}

#ifdef __AVX2__
/* A q8_0 block's integer dot (its signed weight bytes u against activation bytes xq): eight
   32-bit lane sums. The VNNI paths read the weights as unsigned (w + 128, an xor) and take
   128 S_b back through the lanes' start values c; AVX2 alone moves the signs to the
   activations. (The nibble formats go a pair of blocks a step: q8_pair_bytes, q8_pair_dot.) */
INLINE __m256i q8_0_block_dot(__m256i u, const int8_t *xq, const int32_t *c) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xq);
#ifdef Q8_VNNI
    return DPBUSD256(_mm256_loadu_si256((const __m256i *)c), _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)), x);
#else
    (void)c;
    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
#endif
}

/* [d_w m_w] of n (1..4) consecutive blocks as f32 [d0 m0 d1 m1 d2 m2 d3 m3], zeros past n (for
   the formats without m_w the odd lanes are bytes of the block, never used). */
INLINE __m256 q8_group_scales(const uint8_t *p, int bb, int n) {
    __m128i v[4];  /* four 32-bit loads, three unpacks (scalar shifts and ors took eight ops) */
    for (int i = 0; i < 4; i++) v[i] = i < n ? _mm_cvtsi32_si128((int)rd32(p + i * bb)) : _mm_setzero_si128();
    const __m128i all = _mm_unpacklo_epi64(_mm_unpacklo_epi32(v[0], v[1]), _mm_unpacklo_epi32(v[2], v[3]));
    return _mm256_cvtph_ps(all);
}

#ifdef Q8_512
/* A nibble format's group of n (1..4) blocks at p: the quant bytes' low (*lo) and high (*hi)
   halves in Q8_QUAD order and the blocks' [d_w m_w] as f32 (zeros past n). */
INLINE void q8_quad_bytes(int fmt, const uint8_t *p, int n, __m512i *lo, __m512i *hi, __m256 *dw) {
    const int t = fmt == Q4_0 ? 0 : fmt == Q4_1 ? 1 : fmt == Q5_0 ? 2 : 3;
    const int span = block_bytes(fmt) * n;
    const __m512i a = span >= 64 ? _mm512_loadu_si512(p)
                                 : _mm512_maskz_loadu_epi8(((__mmask64)1 << span) - 1, p);
    const __m512i b = span > 64 ? _mm512_maskz_loadu_epi8(((__mmask64)1 << (span - 64)) - 1, p + 64)
                                : _mm512_setzero_si512();
    const __m512i v = _mm512_permutex2var_epi8(a, _mm512_load_si512(Q8_QS_IDX[t]), b);
    const __m512i h = _mm512_permutex2var_epi8(a, _mm512_load_si512(Q8_HD_IDX[t]), b);
    const __m512i m4 = _mm512_set1_epi8(15);
    *lo = _mm512_and_si512(v, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    *dw = _mm256_cvtph_ps(_mm512_castsi512_si128(h));
    if (fmt == Q5_0 || fmt == Q5_1) {  /* each group byte's fifth bit, as a byte mask */
        const __m128i qh = _mm512_extracti32x4_epi32(h, 1);
        const __m512i sixteen = _mm512_set1_epi8(16);
        *lo = _mm512_mask_add_epi8(*lo, (__mmask64)_mm_cvtsi128_si64(qh), *lo, sixteen);
        *hi = _mm512_mask_add_epi8(*hi, (__mmask64)_mm_extract_epi64(qh, 1), *hi, sixteen);
    }
}

/* q8_0's group of n (1..4) blocks at p: blocks 0-1 and 2-3 as unsigned bytes (w + 128; zero
   bytes past n meet zero activations) and the [d_w .] scales. */
INLINE void q8_0_pairs(const uint8_t *p, int n, __m512i *u01, __m512i *u23, __m256 *dw) {
    __m256i w[4];
    for (int i = 0; i < 4; i++)
        w[i] = i < n ? _mm256_loadu_si256((const __m256i *)(p + 34 * i + 2)) : _mm256_setzero_si256();
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    *u01 = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w[0]), w[1], 1), flip);
    *u23 = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w[2]), w[3], 1), flip);
    *dw = q8_group_scales(p, 34, n);
}

/* A nibble format's group (quants lo/hi, [d_w m_w] dw) against one activation row's group
   (bytes x0/x1, lane start values c0, scales dm and sums sm): the block dots scaled into acc,
   the q4_1/q5_1 offset term into bias. */
INLINE void q8_nib_group(int fmt, __m512i lo, __m512i hi, __m256 dw, __m512i x0, __m512i x1,
                         __m512i c0, __m256 dm, __m256 sm, __m512 *acc, __m256 *bias) {
    const __m256 s = _mm256_mul_ps(dw, dm);
    const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c0, lo, x0), hi, x1);
    const __m512i iq = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(iq, _mm512_castps256_ps512(s)), *acc);
    if (fmt == Q4_1 || fmt == Q5_1) *bias = _mm256_fmadd_ps(s, sm, *bias);
}

/* One group of n blocks for R rows (see q8_dot_rows). */
INLINE void q8_group512(int fmt, const int R, const uint8_t *p, int n, const Q8Rows *a, int64_t r0,
                        int64_t g, const int slot, __m512 acc[4][2], __m256 bias[4]) {
    const int offset = fmt == Q4_1 || fmt == Q5_1;
    __m512i lo, hi;
    __m256 dw;
    prefetch_span(p + STREAM_AHEAD, 4 * block_bytes(fmt));  /* the weight stream, ahead */
    if (fmt == Q8_0) q8_0_pairs(p, n, &lo, &hi, &dw);
    else q8_quad_bytes(fmt, p, n, &lo, &hi, &dw);
    for (int r = 0; r < R; r++) {
        const int64_t at = (r0 + r) * a->G + g;
        const int8_t *xq = a->q + at * 128;
        const int32_t *c = a->c + at * 32;
        const __m256 dm = _mm256_load_ps(a->dm + at * 8);
        if (fmt != Q8_0) {
            const __m512i c0 = q8_offset(fmt) ? _mm512_load_si512(c) : _mm512_setzero_si512();
            q8_nib_group(fmt, lo, hi, dw, _mm512_load_si512(xq), _mm512_load_si512(xq + 64), c0, dm,
                         offset ? _mm256_load_ps(a->sm + at * 8) : _mm256_setzero_ps(),
                         &acc[r][slot], &bias[r]);
            continue;
        }
        const __m512 s512 = _mm512_castps256_ps512(_mm256_mul_ps(dw, dm));
        const __m512i d01 = _mm512_dpbusd_epi32(_mm512_load_si512(c), lo, _mm512_load_si512(xq));
        const __m512i d23 = _mm512_dpbusd_epi32(_mm512_load_si512(c + 16), hi, _mm512_load_si512(xq + 64));
        const __m512i i01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
        acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d01), _mm512_permutexvar_ps(i01, s512), acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d23),
                                    _mm512_permutexvar_ps(_mm512_add_epi32(i01, _mm512_set1_epi32(4)), s512), acc[r][1]);
    }
}
#endif

/* A nibble format's blocks i and i + 1 at b, b + bb (the second only where `both`; zero bytes
   otherwise) as the Q8_QUAD order of that pair: *lo = [block i elements 0-15 | block i+1 elements
   0-15], *hi = the same for elements 16-31, unsigned 0..31. A pair's 16 quant bytes each, side
   by side in one register, give both blocks' low nibbles with one mask and their high nibbles
   with one shift and mask (a block alone in a register took a shift, an insert and a mask). */
INLINE void q8_pair_bytes(int fmt, const uint8_t *b, const int both, __m256i *lo, __m256i *hi) {
    const int bb = block_bytes(fmt), off = fmt == Q4_0 ? 2 : fmt == Q4_1 ? 4 : fmt == Q5_0 ? 6 : 8;
    const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + off));
    const __m128i q1 = both ? _mm_loadu_si128((const __m128i *)(b + bb + off)) : _mm_setzero_si128();
    const __m256i v = _mm256_set_m128i(q1, q0), m4 = _mm256_set1_epi8(15);
    *lo = _mm256_and_si256(v, m4);
    *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (fmt == Q5_0 || fmt == Q5_1) {  /* bit j of qh is element j's fifth bit */
        const int at = fmt == Q5_0 ? 2 : 4;
        const uint32_t h0 = rd32(b + at), h1 = both ? rd32(b + bb + at) : 0;
        const uint32_t hl = (h0 & 0xffffu) | (h1 << 16), hh = (h0 >> 16) | (h1 & 0xffff0000u);
        const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
        const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ULL), sixteen = _mm256_set1_epi8(16);
        const __m256i l = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)hl), spread), bits);
        const __m256i h = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)hh), spread), bits);
        *lo = _mm256_or_si256(*lo, _mm256_and_si256(_mm256_cmpeq_epi8(l, bits), sixteen));
        *hi = _mm256_or_si256(*hi, _mm256_and_si256(_mm256_cmpeq_epi8(h, bits), sixteen));
    }
}

/* A pair's integer dots (lo/hi against the pair's activation bytes xlo/xhi, start values c0):
   block i in lanes 0-3, block i+1 in lanes 4-7, eight products a lane, exact (|lane| <= 8 * 31 *
   127; the 16-bit sums before the widening hold at most 4 * 31 * 127). */
INLINE __m256i q8_pair_dot(__m256i lo, __m256i hi, __m256i xlo, __m256i xhi, __m256i c0) {
#ifdef Q8_VNNI
    return DPBUSD256(DPBUSD256(c0, lo, xlo), hi, xhi);
#else
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xlo), _mm256_maddubs_epi16(hi, xhi));
    return _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), c0);
#endif
}

/* One group of n blocks for R rows. The nibble formats a pair of blocks a 256-bit step, the
   activations in Q8_QUAD order (pair j's bytes at 32 j and 64 + 32 j of the group); q8_0 one block
   a step, natural order. */
INLINE void q8_group256(int fmt, const int R, const uint8_t *p, int n, const Q8Rows *a, int64_t r0,
                        int64_t g, __m256 acc[4][2], __m256 bias[4]) {
    const int bb = block_bytes(fmt), offset = fmt == Q4_1 || fmt == Q5_1;
    const __m256 dw = q8_group_scales(p, bb, n);
    if (fmt != Q8_0) {
        __m256i lo[2], hi[2];
        q8_pair_bytes(fmt, p, n > 1, &lo[0], &hi[0]);
        if (n > 2) q8_pair_bytes(fmt, p + 2 * bb, n > 3, &lo[1], &hi[1]);
        for (int r = 0; r < R; r++) {
            const int64_t at = (r0 + r) * a->G + g;
            const __m256 s = _mm256_mul_ps(dw, _mm256_load_ps(a->dm + at * 8));
            const int8_t *xq = a->q + at * 128;
            const int32_t *c = a->c + at * 32;
            for (int j = 0; j < (n + 1) / 2; j++) {
                const __m256i c0 = q8_offset(fmt) ? _mm256_load_si256((const __m256i *)(c + 8 * j))
                                                  : _mm256_setzero_si256();
                const __m256i dot = q8_pair_dot(lo[j], hi[j], _mm256_load_si256((const __m256i *)(xq + 32 * j)),
                                                _mm256_load_si256((const __m256i *)(xq + 64 + 32 * j)), c0);
                const __m256 sj = _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(4 * j, 4 * j, 4 * j, 4 * j,
                                                                                4 * j + 2, 4 * j + 2, 4 * j + 2, 4 * j + 2));
                acc[r][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sj, acc[r][j]);
            }
            if (offset) bias[r] = _mm256_fmadd_ps(s, _mm256_load_ps(a->sm + at * 8), bias[r]);
        }
        return;
    }
    __m256i u[4];
    for (int i = 0; i < n; i++) u[i] = _mm256_loadu_si256((const __m256i *)(p + i * bb + 2));
    for (int r = 0; r < R; r++) {
        const int64_t at = (r0 + r) * a->G + g;
        const __m256 s = _mm256_mul_ps(dw, _mm256_load_ps(a->dm + at * 8));
        const int8_t *xq = a->q + at * 128;
        const int32_t *c = a->c + at * 32;
        for (int i = 0; i < n; i++) {
            const __m256 si = _mm256_permutevar8x32_ps(s, _mm256_set1_epi32(2 * i));
            acc[r][i & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q8_0_block_dot(u[i], xq + 32 * i, c + 8 * i)),
                                            si, acc[r][i & 1]);
        }
    }
}

/* q4_1x8's short last group of t (1..7) blocks: pshufb indices that move its t f16 scales (in
   block order) into the eight lanes' order, zeros in the lanes past t. */
static const int8_t X8_TAIL[8][16] __attribute__((aligned(16))) = {
    {-128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, -128, -128, -128, -128, -128, -128, 2, 3, -128, -128, -128, -128, -128, -128},
    {0, 1, 4, 5, -128, -128, -128, -128, 2, 3, -128, -128, -128, -128, -128, -128},
    {0, 1, 4, 5, -128, -128, -128, -128, 2, 3, 6, 7, -128, -128, -128, -128},
    {0, 1, 4, 5, 8, 9, -128, -128, 2, 3, 6, 7, -128, -128, -128, -128},
    {0, 1, 4, 5, 8, 9, -128, -128, 2, 3, 6, 7, 10, 11, -128, -128},
    {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, -128, -128}
};

/* A q4_1x8 group of t blocks' 8-bit dots: pair j (blocks 2j, 2j + 1: 32 quant bytes from `q`,
   block 2j + 1 absent where 2j + 1 == t) against the group's activations (pair j's bytes at
   x + 128 (j / 2) + 32 (j % 2) and 64 bytes on: two Q8_QUAD groups), the eight block sums in
   x8_lane order after three horizontal adds. */
INLINE __m256i x8_sums(const uint8_t *q, const int t, const int8_t *x) {
    __m256i d[4];
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        if (2 * j >= t) { d[j] = _mm256_setzero_si256(); continue; }
        const __m256i v = 2 * j + 1 < t ? _mm256_loadu_si256((const __m256i *)(q + 32 * j))
                                        : _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(q + 32 * j)));
        const __m256i w = 2 * j + 1 < t ? v : _mm256_inserti128_si256(v, _mm_setzero_si128(), 1);
        const int8_t *xj = x + 128 * (j / 2) + 32 * (j % 2);
        d[j] = q8_pair_dot(_mm256_and_si256(w, m4), _mm256_and_si256(_mm256_srli_epi16(w, 4), m4),
                           _mm256_load_si256((const __m256i *)xj), _mm256_load_si256((const __m256i *)(xj + 64)),
                           _mm256_setzero_si256());
    }
    return _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
}

/* How far ahead of the group it multiplies q8x8_dot_rows asks for weights (software prefetch
   into L1, three lines a 160-byte group). Unlike the q4_1 kernel (whose heavier arithmetic hid
   nothing more with it), this one streams faster with it: SmolLM2's 120 decode q4_1 products
   regrouped, 2 threads, from memory, 30 interleaved passes: none 4.72 ms, 2 KiB 4.00 ms, 4 KiB
   4.00 ms (the q4_1 kernel: 4.78 ms; with 2-8 KiB ahead 4.14-4.23 against 4.10). q8_0x8's LM
   head likewise (49152x576): none 1.78 ms, 2 KiB 1.50 ms, 4 KiB 1.42 ms (q8_0: 1.79 ms). */
#ifndef X8_AHEAD
#define X8_AHEAD 4096
#endif

/* One q4_1x8 group of n (1..8) blocks at o for R rows (see q8x8_dot_rows). */
INLINE void x8_1_group(const int n, const int R, const uint8_t *o, const Q8Rows *a, int64_t r0,
                       int64_t g, __m256 acc[4], __m256 bias[4]) {
    __m256 dw, mw;
    if (n == 8) {
        _mm_prefetch((const char *)o + X8_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)o + X8_AHEAD + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)o + X8_AHEAD + 128, _MM_HINT_T0);
        dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
        mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + 16)));
    } else {  /* 20 n >= 16 + 2 n bytes: both loads stay inside the row */
        const __m128i lanes = _mm_load_si128((const __m128i *)X8_TAIL[n]);
        dw = _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)o), lanes));
        mw = _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(o + 2 * n)), lanes));
    }
    for (int r = 0; r < R; r++) {
        const int64_t at = (r0 + r) * a->G8 + g;
        const __m256i sums = x8_sums(o + 4 * n, n, a->q + ((r0 + r) * a->G + 2 * g) * 128);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_load_ps(a->d8 + at * 8)), acc[r]);
        bias[r] = _mm256_fmadd_ps(mw, _mm256_load_ps(a->s8 + at * 8), bias[r]);
    }
}

/* R (1..4) outputs of one q4_1x8 weight row against quantized activation rows r0 .. r0+R-1
   (out[r * N]): per group of eight blocks, four 32-byte quant loads shared by the R rows, the
   eight d_w and m_w converted once, eight block sums scaled by one multiply-add and the m_w term
   by another. The same integer dots as the q4_1 kernel; only the f32 order of the sums differs. */
INLINE void q8x8_dot_rows(int fmt, const int R, const uint8_t *row, const Q8Rows *a, int64_t r0,
                          float *out, int64_t N) {
    (void)fmt;  /* Q4_1X8 (WITH_ROWS passes it) */
    const int64_t B = a->B, full = B / 8;
    __m256 acc[4], bias[4];
    for (int r = 0; r < R; r++) acc[r] = bias[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; g++) x8_1_group(8, R, row + g * 8 * 20, a, r0, g, acc, bias);
    switch (B % 8) {  /* a short last group, its block count a constant in each case */
    case 1: x8_1_group(1, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    case 2: x8_1_group(2, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    case 3: x8_1_group(3, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    case 4: x8_1_group(4, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    case 5: x8_1_group(5, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    case 6: x8_1_group(6, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    case 7: x8_1_group(7, R, row + full * 8 * 20, a, r0, full, acc, bias); break;
    }
    for (int r = 0; r < R; r++) out[r * N] = hsum(_mm256_add_ps(acc[r], bias[r]));
}

/* q8_0x8's short last group of t (1..7) blocks: pshufb indices keeping its t f16 scales, zeros
   in the lanes past t. */
static const int8_t X8_NATURAL[8][16] __attribute__((aligned(16))) = {
    {-128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, 2, 3, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, 2, 3, 4, 5, -128, -128, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, 2, 3, 4, 5, 6, 7, -128, -128, -128, -128, -128, -128, -128, -128},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, -128, -128, -128, -128, -128, -128},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, -128, -128, -128, -128},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, -128, -128}
};

/* One q8_0x8 group of n (1..8) blocks at o (their d's, then their quants) for R rows: the eight
   blocks' sums in block order, scaled into acc (the activation scales of the n blocks only: the
   floats after a row's last block are another array's). */
INLINE void x8_0_group(const int n, const int R, const uint8_t *o, const Q8Rows *a, int64_t r0,
                       int64_t b0, __m256 acc[4]) {
    __m256 dw;
    if (n == 8) {
        for (int l = 0; l < 5; l++) _mm_prefetch((const char *)o + X8_AHEAD + 64 * l, _MM_HINT_T0);
        dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)o));
    } else {  /* 34 n >= 16 bytes: the load stays inside the row */
        dw = _mm256_cvtph_ps(_mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)o),
                                              _mm_load_si128((const __m128i *)X8_NATURAL[n])));
    }
    __m256i u[8];
    for (int k = 0; k < 8; k++)
        u[k] = k < n ? _mm256_loadu_si256((const __m256i *)(o + 2 * n + 32 * k)) : _mm256_setzero_si256();
    for (int r = 0; r < R; r++) {
        const int8_t *xq = a->q + (r0 + r) * a->G * 128 + b0 * 32;
        const int32_t *c = a->c + (r0 + r) * a->G * 32 + b0 * 8;
        __m256i s[8];
        for (int k = 0; k < 8; k++) s[k] = k < n ? q8_0_block_dot(u[k], xq + 32 * k, c + 8 * k) : _mm256_setzero_si256();
        const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
        const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(s[4], s[5]), _mm256_hadd_epi32(s[6], s[7]));
        const __m256i sums = _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                                              _mm256_permute2x128_si256(h0, h1, 0x31));
        const float *d = a->d + (r0 + r) * a->B + b0;
        const __m256 da = n == 8 ? _mm256_loadu_ps(d)
            : _mm256_maskload_ps(d, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, da), acc[r]);
    }
}

/* R (1..4) outputs of one q8_0x8 weight row against quantized activation rows r0 .. r0+R-1
   (natural order; out[r * N]): per group of eight blocks, eight 32-byte quant loads shared by the
   R rows and the eight d_w converted once; each block's eight 32-bit lane sums (q8_0_block_dot)
   reduced to one by a horizontal-add tree that leaves the eight blocks' sums in block order,
   scaled by one multiply-add (x8_0_group). */
INLINE void q8x8_0_dot_rows(int fmt, const int R, const uint8_t *row, const Q8Rows *a, int64_t r0,
                            float *out, int64_t N) {
    (void)fmt;  /* Q8_0X8 (WITH_ROWS passes it) */
    const int64_t B = a->B, full = B / 8;
    __m256 acc[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; g++) x8_0_group(8, R, row + g * 8 * 34, a, r0, 8 * g, acc);
    switch (B % 8) {  /* a short last group, its block count a constant in each case */
    case 1: x8_0_group(1, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    case 2: x8_0_group(2, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    case 3: x8_0_group(3, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    case 4: x8_0_group(4, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    case 5: x8_0_group(5, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    case 6: x8_0_group(6, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    case 7: x8_0_group(7, R, row + full * 8 * 34, a, r0, 8 * full, acc); break;
    }
    for (int r = 0; r < R; r++) out[r * N] = hsum(acc[r]);
}

/* R (1..4) outputs of one weight row against quantized activation rows r0 .. r0+R-1 (written
   to out[r * N]). */
INLINE void q8_dot_rows(int fmt, const int R, const uint8_t *row, const Q8Rows *a, int64_t r0,
                        float *out, int64_t N) {
    const int bb = block_bytes(fmt);
    const int64_t B = a->B, full = B / 4;
    __m256 bias[4];
    for (int r = 0; r < R; r++) bias[r] = _mm256_setzero_ps();
#ifdef Q8_512
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 1 < full; g += 2) {  /* two accumulators a row: consecutive groups overlap */
        q8_group512(fmt, R, row + g * 4 * bb, 4, a, r0, g, 0, acc, bias);
        q8_group512(fmt, R, row + (g + 1) * 4 * bb, 4, a, r0, g + 1, 1, acc, bias);
    }
    if (g < full) q8_group512(fmt, R, row + g * 4 * bb, 4, a, r0, g, 0, acc, bias);
    switch (B % 4) {  /* a partial last group, its block count a constant in each case */
    case 1: q8_group512(fmt, R, row + full * 4 * bb, 1, a, r0, full, 1, acc, bias); break;
    case 2: q8_group512(fmt, R, row + full * 4 * bb, 2, a, r0, full, 1, acc, bias); break;
    case 3: q8_group512(fmt, R, row + full * 4 * bb, 3, a, r0, full, 1, acc, bias); break;
    }
    for (int r = 0; r < R; r++) {
        const __m512 t = _mm512_add_ps(acc[r][0], acc[r][1]);
        const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t),
                                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
        out[r * N] = hsum(_mm256_add_ps(h, bias[r]));
    }
#else
    __m256 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < full; g++) q8_group256(fmt, R, row + g * 4 * bb, 4, a, r0, g, acc, bias);
    switch (B % 4) {
    case 1: q8_group256(fmt, R, row + full * 4 * bb, 1, a, r0, full, acc, bias); break;
    case 2: q8_group256(fmt, R, row + full * 4 * bb, 2, a, r0, full, acc, bias); break;
    case 3: q8_group256(fmt, R, row + full * 4 * bb, 3, a, r0, full, acc, bias); break;
    }
    for (int r = 0; r < R; r++)
        out[r * N] = hsum(_mm256_add_ps(_mm256_add_ps(acc[r][0], acc[r][1]), bias[r]));
#endif
}
#else
/* Portable: one output from the natural-order quants. */
static float q8_dot_portable(int fmt, const uint8_t *row, const Q8Rows *a, int64_t r) {
    const int bb = block_bytes(fmt), o = q8_offset(fmt);
    float total = 0.0f, bias = 0.0f;
    for (int64_t b = 0; b < a->B; b++) {
        int32_t q[32]; float d, m;
        block_ints(fmt, row + b * bb, q, &d, &m);
        const int8_t *xq = a->q + r * a->G * 128 + b * 32;
        const int32_t S = a->s[r * a->B + b];
        const float dx = a->d[r * a->B + b];
        int32_t dot = 0;
        for (int j = 0; j < 32; j++) dot += q[j] * xq[j];
        dot -= o * S;
        total += (d * dx) * (float)dot;
        if (fmt == Q4_1 || fmt == Q5_1) bias += m * (dx * (float)S);
    }
    return total + bias;
}
#endif

#ifdef Q8_512
/* out[i] = the lane sum of acc[i] plus that of bias[i], i < 4: four outputs in one reduction. */
INLINE void q8_store4(const __m512 acc[4], const __m256 bias[4], float *out) {
    __m256 h[4];
    for (int i = 0; i < 4; i++)
        h[i] = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(acc[i]),
                                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1))), bias[i]);
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

/* q8_dot_4w for the nibble formats: each group's activations (bytes, start values, scales)
   loaded once for the four weight rows, not once a row. Measured in L2 (one thread, SmolLM2's
   576-wide q4_1 rows): 11.8-12.1 ns a row against 13.6-14.3 for four q8_group512 calls. */
INLINE void q8_nib_4w(int fmt, const uint8_t *w, int64_t row_bytes, const Q8Rows *a, int64_t r0,
                      float *out) {
    const int bb = block_bytes(fmt), offset = fmt == Q4_1 || fmt == Q5_1;
    const int64_t B = a->B, G = a->G;
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 bias[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < G; g++) {
        const int n = g < B / 4 ? 4 : (int)(B % 4);
        const int64_t at = r0 * G + g;
        const __m512i x0 = _mm512_load_si512(a->q + at * 128), x1 = _mm512_load_si512(a->q + at * 128 + 64);
        const __m512i c0 = q8_offset(fmt) ? _mm512_load_si512(a->c + at * 32) : _mm512_setzero_si512();
        const __m256 dm = _mm256_load_ps(a->dm + at * 8);
        const __m256 sm = offset ? _mm256_load_ps(a->sm + at * 8) : _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            const uint8_t *p = w + i * row_bytes + g * 4 * bb;
            prefetch_span(p + STREAM_AHEAD, 4 * bb);
            __m512i lo, hi; __m256 dw;
            if (n == 4) q8_quad_bytes(fmt, p, 4, &lo, &hi, &dw);
            else if (n == 3) q8_quad_bytes(fmt, p, 3, &lo, &hi, &dw);
            else if (n == 2) q8_quad_bytes(fmt, p, 2, &lo, &hi, &dw);
            else q8_quad_bytes(fmt, p, 1, &lo, &hi, &dw);
            q8_nib_group(fmt, lo, hi, dw, x0, x1, c0, dm, sm, &acc[i], &bias[i]);
        }
    }
    q8_store4(acc, bias, out);
}

/* Four weight rows (w, w + row_bytes, ...) against one activation row: out[0..3]. Four
   independent accumulator chains, and one reduction for the four outputs (a decode row's
   K = 576 is only 4.5 groups, so a per-output reduction would cost a fifth of the work). */
INLINE void q8_dot_4w(int fmt, const uint8_t *w, int64_t row_bytes, const Q8Rows *a, int64_t r0,
                      float *out) {
    if (fmt != Q8_0) { q8_nib_4w(fmt, w, row_bytes, a, r0, out); return; }
    const int bb = block_bytes(fmt);
    const int64_t B = a->B, full = B / 4;
    __m512 acc[4][2];
    __m256 bias[4];
    for (int i = 0; i < 4; i++) { acc[i][0] = acc[i][1] = _mm512_setzero_ps(); bias[i] = _mm256_setzero_ps(); }
    for (int64_t g = 0; g < full; g++)
        for (int i = 0; i < 4; i++)
            q8_group512(fmt, 1, w + i * row_bytes + g * 4 * bb, 4, a, r0, g, 0, &acc[i], &bias[i]);
    for (int i = 0; i < 4; i++)
        switch (B % 4) {
        case 1: q8_group512(fmt, 1, w + i * row_bytes + full * 4 * bb, 1, a, r0, full, 1, &acc[i], &bias[i]); break;
        case 2: q8_group512(fmt, 1, w + i * row_bytes + full * 4 * bb, 2, a, r0, full, 1, &acc[i], &bias[i]); break;
        case 3: q8_group512(fmt, 1, w + i * row_bytes + full * 4 * bb, 3, a, r0, full, 1, &acc[i], &bias[i]); break;
        }
    const __m512 sums[4] = {_mm512_add_ps(acc[0][0], acc[0][1]), _mm512_add_ps(acc[1][0], acc[1][1]),
                            _mm512_add_ps(acc[2][0], acc[2][1]), _mm512_add_ps(acc[3][0], acc[3][1])};
    q8_store4(sums, bias, out);
}
#endif

INLINE void q8_tile(const int fmt, const uint8_t *w, float *out, const Q8Rows *a, int64_t M,
                    int64_t N, int64_t row_bytes, int64_t n0, int64_t n1) {
    if (fmt == Q4_1X8 || fmt == Q8_0X8) {
#ifdef __AVX2__
        for (int64_t m = 0; m < M; m += 4) {
            const int R = M - m < 4 ? (int)(M - m) : 4;
            for (int64_t n = n0; n < n1; n++) {
                if (fmt == Q4_1X8) WITH_ROWS(R, q8x8_dot_rows, Q4_1X8, w + n * row_bytes, a, m, out + m * N + n, N);
                else WITH_ROWS(R, q8x8_0_dot_rows, Q8_0X8, w + n * row_bytes, a, m, out + m * N + n, N);
            }
        }
#else
        uint8_t *file = (uint8_t *)malloc((size_t)row_bytes);
        for (int64_t n = n0; n < n1; n++) {
            if (file) x8_row(fmt, w + n * row_bytes, file, a->B, 0);
            for (int64_t m = 0; m < M; m++)
                out[m * N + n] = file ? q8_dot_portable(x8_source(fmt), file, a, m) : NAN;
        }
        free(file);
#endif
        return;
    }
#ifdef Q8_512
    if (M == 1) {  /* decode: four weight rows at a time */
        int64_t n = n0;
        for (; n + 4 <= n1; n += 4) q8_dot_4w(fmt, w + n * row_bytes, row_bytes, a, 0, out + n);
        for (; n < n1; n++) q8_dot_rows(fmt, 1, w + n * row_bytes, a, 0, out + n, N);
        return;
    }
#endif
#ifdef __AVX2__
    for (int64_t m = 0; m < M; m += 4) {
        const int R = M - m < 4 ? (int)(M - m) : 4;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t *wr = w + n * row_bytes;
            float *o = out + m * N + n;
            WITH_ROWS(R, q8_dot_rows, fmt, wr, a, m, o, N);
        }
    }
#else
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) out[m * N + n] = q8_dot_portable(fmt, w + n * row_bytes, a, m);
#endif
}

/* out[M, N] = q8(x)[M, K] @ W[N, K]^T for the 32-weight block formats (see above). Returns 0, or
   -1 for another format, a K that splits a block, or no memory. */
/* The activation rows fuel_matmul_q8 rounds (its first half), for the fused steps: NULL for a
   format or width it cannot run (or no memory); fuel_q8_release frees them. */
void *fuel_q8_prepare(int fmt, const float *x, int64_t M, int64_t K) {
    if (fmt != Q4_0 && fmt != Q4_1 && fmt != Q5_0 && fmt != Q5_1 && fmt != Q8_0 && x8_source(fmt) < 0) return NULL;
    if (K % 32 || K <= 0) return NULL;
    Q8Rows *a = (Q8Rows *)malloc(sizeof(Q8Rows));
    if (!a) return NULL;
    if (q8_prepare(fmt, x, M, K, a)) { free(a); return NULL; }
    return a;
}

void fuel_q8_release(void *rows) {
    if (rows) { free(((Q8Rows *)rows)->mem); free(rows); }
}

/* Weight rows [n0, n1) of fuel_matmul_q8's product (its second half), serial. */
void fuel_matmul_q8_rows(int fmt, const uint8_t *w, float *out, const void *rows, int64_t M,
                         int64_t N, int64_t row_bytes, int64_t n0, int64_t n1) {
    const Q8Rows *a = (const Q8Rows *)rows;
    switch (fmt) {
    case Q4_0: q8_tile(Q4_0, w, out, a, M, N, row_bytes, n0, n1); break;
    case Q4_1: q8_tile(Q4_1, w, out, a, M, N, row_bytes, n0, n1); break;
    case Q5_0: q8_tile(Q5_0, w, out, a, M, N, row_bytes, n0, n1); break;
    case Q5_1: q8_tile(Q5_1, w, out, a, M, N, row_bytes, n0, n1); break;
    case Q4_1X8: q8_tile(Q4_1X8, w, out, a, M, N, row_bytes, n0, n1); break;
    case Q8_0X8: q8_tile(Q8_0X8, w, out, a, M, N, row_bytes, n0, n1); break;
    default: q8_tile(Q8_0, w, out, a, M, N, row_bytes, n0, n1); break;
    }
}

int fuel_matmul_q8(int fmt, const float *x, const uint8_t *w, float *out, int64_t M, int64_t N,
                   int64_t K, int64_t row_bytes, int threads) {
    if (fmt != Q4_0 && fmt != Q4_1 && fmt != Q5_0 && fmt != Q5_1 && fmt != Q8_0 && x8_source(fmt) < 0) return -1;
    if (K % 32 || K <= 0) return -1;
    Q8Rows a;
    if (q8_prepare(fmt, x, M, K, &a)) return -1;
    FOR_TILES(N, K, threads, { fuel_matmul_q8_rows(fmt, w, out, &a, M, N, row_bytes, n0, n1); });
    free(a.mem);
    return 0;
}

/* The activation rounding fuel_matmul_q8 applies, in natural order, for tests and bounds:
   q[M, K] int8, d[M, K/32] f32 (d = NaN for a block with a non-finite value). */
int fuel_quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *d) {
    if (K % 32) return -1;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < K / 32; b++) {
            int32_t s;
            q8_quantize_block(x + r * K + b * 32, q + r * K + b * 32, d + r * (K / 32) + b, &s);
        }
    return 0;
}

/* The runtime's own view of its pool, for tests: how many threads a parallel region gets. */
#endif
#if !defined(FUEL_PART) || FUEL_PART == 1
int fuel_pool_threads(int threads) {
    int got = 1;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp single
        {
#ifdef _OPENMP
            extern int omp_get_num_threads(void);
            got = omp_get_num_threads();
#endif
        }
    }
    return got;
}

/* dst[N, K] f32 = the dequantized rows of W (for large-M products handed to a GEMM library). */
int fuel_dequantize(int fmt, const uint8_t *w, float *dst, int64_t N, int64_t K, int64_t row_bytes,
                    int threads) {
    if (block_bytes(fmt) > 0 ? K % block_elems(fmt) != 0 : !dense_format(fmt)) return -1;
    const int parallel = threads > 1 && N * K >= 65536;
    switch (fmt) {
#define DEQ(F) case F: { _Pragma("omp parallel for schedule(static) num_threads(threads) if (parallel)") \
        for (int64_t n = 0; n < N; n++) dequant_row(F, w + n * row_bytes, K, dst + n * K); break; }
    DEQ(F32) DEQ(F16) DEQ(BF16) DEQ(I8C) DEQ(Q4_0) DEQ(Q4_1) DEQ(Q5_0) DEQ(Q5_1) DEQ(Q8_0)
    DEQ(Q4_K) DEQ(Q5_K) DEQ(Q6_K)
#undef DEQ
    case Q4_1X8: case Q8_0X8: {  /* each row back in the file's order, then the file format's */
        int failed = 0;
        _Pragma("omp parallel num_threads(threads) if (parallel)")
        {
            uint8_t *file = (uint8_t *)malloc((size_t)row_bytes);
            if (!file) {
                _Pragma("omp atomic write")
                failed = 1;
            }
            _Pragma("omp for schedule(static)")
            for (int64_t n = 0; n < N; n++) {
                if (!file) continue;
                x8_row(fmt, w + n * row_bytes, file, K / 32, 0);
                if (fmt == Q4_1X8) dequant_row(Q4_1, file, K, dst + n * K);
                else dequant_row(Q8_0, file, K, dst + n * K);
            }
            free(file);
        }
        if (failed) return -1;
        break;
    }
    default: return -1;
    }
    return 0;
}

/* Rotary embedding, rotate-half form, f32: out[r, h, :] = x*cos + rotate_half(x)*sin with
   rotate_half(x) = (-x[D/2:], x[:D/2]); x rows r (stride xr) of H heads (stride xh), each D
   contiguous; cos/sin one contiguous D-row per r (shared by the heads). out is contiguous. */
void fuel_rope(const float *x, int64_t xr, int64_t xh, const float *cos_, const float *sin_,
               float *out, int64_t R, int64_t H, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < R; r++) {
        const float *c = cos_ + r * D, *s = sin_ + r * D;
        for (int64_t h = 0; h < H; h++) {
            const float *v = x + r * xr + h * xh;
            float *o = out + (r * H + h) * D;
            for (int64_t j = 0; j < half; j++) o[j] = v[j] * c[j] - v[j + half] * s[j];
            for (int64_t j = 0; j < half; j++) o[j + half] = v[j + half] * c[j + half] + v[j] * s[j + half];
        }
    }
}

/* Row-wise argmax of f32 x[R, V] (contiguous), torch's semantics: the first maximal index, and
   a NaN counts as the maximum (its first index wins). Two vector passes over the row (it stays
   in cache): the maximum and whether any NaN, then the first index holding it. */
void fuel_argmax(const float *x, int64_t R, int64_t V, int64_t *out) {
    for (int64_t r = 0; r < R; r++) {
        const float *row = x + r * V;
        float best = row[0];
        int nan = 0;
        int64_t i = 0;
#ifdef __AVX2__
        __m256 m = _mm256_set1_ps(row[0]), bad = _mm256_setzero_ps();
        for (; i + 8 <= V; i += 8) {
            __m256 v = _mm256_loadu_ps(row + i);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            m = _mm256_max_ps(m, v);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int j = 0; j < 8; j++) if (lanes[j] > best) best = lanes[j];
        nan = _mm256_movemask_ps(bad) != 0;
#endif
        for (; i < V; i++) {
            if (isnan(row[i])) nan = 1;
            else if (row[i] > best) best = row[i];
        }
        int64_t at = 0;
        if (nan) { while (!isnan(row[at])) at++; }
        else if (!isnan(best)) { while (row[at] != best) at++; }
        out[r] = at;
    }
}

/* Paged KV cache write: row i of `rows` (row_bytes contiguous bytes: f32, bf16 or f16 elements,
   the cache's own) into slot slots[i] of the cache (slot_count slots of row_bytes). Returns -1,
   writing nothing, when a slot is out of range (the caller raises, as index_copy_ does). */
int fuel_kv_write_rows(void *cache, int64_t slot_count, int64_t row_bytes, const void *rows,
                       const int64_t *slots, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= slot_count) return -1;
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)cache + slots[i] * row_bytes, (const char *)rows + i * row_bytes,
               (size_t)row_bytes);
    return 0;
}

int fuel_kv_write(float *cache, int64_t slot_count, int64_t row_elems, const float *rows,
                  const int64_t *slots, int64_t n) {
    return fuel_kv_write_rows(cache, slot_count, row_elems * 4, rows, slots, n);
}

/* f32 -> bf16 (fmt BF16) or IEEE half (fmt F16), n elements, rounded to nearest even as torch's
   Tensor.to rounds (a NaN stays a quiet NaN, the sign kept; bf16 overflow rounds to infinity,
   f16 beyond its range is infinity): a half-precision KV cache's rows as they are written. */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline uint16_t float_to_half(float f) {
#ifdef __F16C__
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u; memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);   /* rounds past 65504: infinity */
    if (a < 0x38800000u) {                                     /* below 2^-14: subnormal or 0 */
        if (a < 0x33000000u) return (uint16_t)sign;            /* below half the least: 0 */
        const uint32_t e = a >> 23, m = (a & 0x7fffff) | 0x800000, shift = 126 - e;
        uint32_t h = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rest > halfway || (rest == halfway && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = ((a >> 13) - (112u << 10));
    const uint32_t rest = a & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
#endif
}

int fuel_cast_half(const float *x, uint16_t *out, int64_t n, int fmt) {
    if (fmt == BF16) { for (int64_t i = 0; i < n; i++) out[i] = float_to_bf16(x[i]); return 0; }
    if (fmt == F16) { for (int64_t i = 0; i < n; i++) out[i] = float_to_half(x[i]); return 0; }
    return -1;
}

/* Paged attention for decode rows, f32: q [B, Hq, L, D], caches [blocks, bs, Hkv, D], block
   table [B, W] and context lengths [B] of `index_bytes` (4: u32/i32, 8: i64). Query i of
   sequence b sits at position len - L + i and sees positions up to it (at most W * bs); a
   query that sees nothing is NaN. Each kv head's query group is served from one pass over its
   cached rows (GQA). Softcap 0 means none. Returns -1 (nothing written) when a block it would
   read is outside the cache. Serial: a decode step has a few (sequence, kv head) tasks of microseconds. */
static inline int64_t idx_at(const void *p, int64_t i, int index_bytes) {
    return index_bytes == 8 ? ((const int64_t *)p)[i] : (int64_t)((const uint32_t *)p)[i];
}

#ifdef __AVX2__
/* exp of eight floats: 2^n * exp(r), n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts,
   |r| <= ln 2 / 2), exp(r) by its Taylor polynomial to r^6 (truncation < 1.3e-7 relative,
   about one ulp), 2^n built in the exponent bits. x is clamped to [-87.3, 88.7] (the normal
   range: below it the result is ~1e-38 where expf gives a denormal or 0, nothing a softmax
   total of at least 1 can see); a NaN stays NaN. VECTOR_EXP writes it at one vector width: T the
   vector type, I its integer type, P the intrinsics' prefix, W their width in bits, ROUND(v) to
   the nearest integer, NAN_PASS(result, x) x where x is NaN. */
#define VECTOR_EXP(NAME, T, I, P, W, ROUND, NAN_PASS)                                              \
    static inline T NAME(T x) {                                                                    \
        const T clamped = P##_min_ps(P##_max_ps(x, P##_set1_ps(-87.3365f)), P##_set1_ps(88.7228f)); \
        const T n = ROUND(P##_mul_ps(clamped, P##_set1_ps(1.44269504f)));                          \
        T r = P##_fnmadd_ps(n, P##_set1_ps(0.693359375f), clamped);                                \
        r = P##_fnmadd_ps(n, P##_set1_ps(-2.12194440e-4f), r);                                     \
        T p = P##_set1_ps(1.0f / 720.0f);                                                          \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 120.0f));                                       \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 24.0f));                                         \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f / 6.0f));                                          \
        p = P##_fmadd_ps(p, r, P##_set1_ps(0.5f));                                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                 \
        p = P##_fmadd_ps(p, r, P##_set1_ps(1.0f));                                                 \
        const I bits = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23); \
        return NAN_PASS(P##_mul_ps(p, P##_castsi##W##_ps(bits)), x);                               \
    }
#define ROUND8(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define NAN_PASS8(result, x) _mm256_blendv_ps(result, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q))
VECTOR_EXP(exp8, __m256, __m256i, _mm256, 256, ROUND8, NAN_PASS8)
#endif

/* silu(gate) * up, n elements: gate / (1 + exp(-gate)) * up, the exponentials eight at a time
   (exp8: a SmolLM2 decode step's 1536 took 9.5 us with a scalar expf, most of it the calls).
   A gate below -87.3 gives exp8's clamped ~1e38 in the denominator: a result of ~1e-36 where
   the exact one is smaller still (both zero to any tolerance); a NaN gate stays NaN. */
void fuel_silu_mul(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
#ifdef __AVX2__
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(zero, g));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                                _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* Row `row` (D elements) of a cache of element format kv_fmt (F32, F16, BF16) as f32: the row
   itself for f32, else widened into `buffer`. */
static inline const float *cache_row(int kv_fmt, const void *cache, int64_t row, int64_t D,
                                     float *buffer) {
    if (kv_fmt == F32) return (const float *)cache + row * D;
    const uint16_t *h = (const uint16_t *)cache + row * D;
    int64_t d = 0;
#ifdef __AVX2__  /* exact widenings, 8 at a time */
    for (; d + 8 <= D; d += 8) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(h + d));
#ifdef __F16C__
        if (kv_fmt == F16) { _mm256_storeu_ps(buffer + d, _mm256_cvtph_ps(v)); continue; }
#else
        if (kv_fmt == F16) break;
#endif
        _mm256_storeu_ps(buffer + d, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
    }
#endif
    if (kv_fmt == BF16) for (; d < D; d++) buffer[d] = bf16_to_float(h[d]);
    else for (; d < D; d++) buffer[d] = half_to_float(h[d]);
    return buffer;
}

int fuel_paged_attn_kv(const float *q, const void *kc, const void *vc, const void *table,
                       const void *lens, float *out, int64_t B, int64_t Hq, int64_t L, int64_t D,
                       int64_t blocks, int64_t bs, int64_t Hkv, int64_t W, int index_bytes,
                       float scale, float softcap, int kv_fmt);

/* Cache rows are read from memory, not cache: a decode step streams megabytes of weights
   between two layers' attention, so each layer's K and V rows are gone from every cache level
   by the time it runs, and a row-by-row walk waits a memory latency per row (SmolLM2 at 80
   positions, bf16 cache: 13 us warm against ~40-55 us cold). The key pass therefore prefetches
   the key and the value row ATTN_PREFETCH positions ahead (the value pass then finds its rows
   in cache), and a unit starts by prefetching its first ATTN_PREFETCH positions. */
#define ATTN_PREFETCH 8

/* The cache row (in rows of D elements) of position t of sequence b, kv head kv. */
static inline int64_t cache_row_at(const void *table, int64_t b, int64_t W, int64_t t, int64_t bs,
                                   int64_t Hkv, int64_t kv, int index_bytes) {
    return (idx_at(table, b * W + t / bs, index_bytes) * bs + t % bs) * Hkv + kv;
}

static inline void prefetch_row(const void *cache, int64_t row, int64_t row_bytes) {
    prefetch_span((const char *)cache + row * row_bytes, row_bytes);
}

#define ATTN_PARALLEL_WORK (1 << 15)  /* positions read x query heads x head dim: 32 Ki MACs.
   In a step the pool's other thread spins idle through the serial epilogue, so a region costs
   a microsecond or two, and the rows come from memory: SmolLM2's decode row at ~100 positions
   (three units) went 19-20 -> 14-16 us a call in the step. */

#ifdef __AVX2__
/* An f32 cache's decode unit, D a multiple of 64 (attn_fast): scores of eight positions of one
   query head at a time (eight dot products with their own accumulators, the query's vectors
   loaded once for the eight, the eight sums left in order by a horizontal-add tree), and the
   weighted values 64 elements of a head at a time in registers across all positions. The
   one-position-at-a-time loop (a dot's single FMA chain and horizontal sum per position and
   head, the value sums stored and reloaded per position) took ~7 us a unit at 100 positions
   (perf: its value loads and adds hottest). Same products, sums in another f32 order. */
INLINE void attn_scores8(const float *query, const float *const key[8], int64_t D, float scale,
                         float *scores) {
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(query + d);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(key[j] + d), acc[j]);
    }
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm256_storeu_ps(scores, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
}

/* out[0 .. D) = sum_t weights[t] * value(t), 64 elements at a time, in registers. */
INLINE void attn_values64(const float *weights, const float *const *rows, int64_t visible,
                          int64_t D, float *out) {
    for (int64_t c = 0; c < D; c += 64) {
        __m256 acc[8];
        for (int k = 0; k < 8; k++) acc[k] = _mm256_setzero_ps();
        for (int64_t t = 0; t < visible; t++) {
            const __m256 w = _mm256_broadcast_ss(weights + t);
            const float *v = rows[t] + c;
            for (int k = 0; k < 8; k++) acc[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * k), acc[k]);
        }
        for (int k = 0; k < 8; k++) _mm256_storeu_ps(out + c + 8 * k, acc[k]);
    }
}
#endif

/* The decode attention's split over the pool: whether its units get a parallel region (the
   positions the queries will read, not the table's capacity, against ATTN_PARALLEL_WORK), and
   thread `me`'s share of `teams`: contiguous, the first units % teams one unit longer. The
   attention (fuel_paged_attn_kv) and its early row requests (fuel_paged_attn_prefetch) both
   take it from here, so a thread asks for exactly the rows it will read. */
static int attn_parallel(const void *lens, int64_t B, int64_t Hq, int64_t L, int64_t D,
                         int64_t Hkv, int64_t capacity, int index_bytes) {
    int64_t seen_total = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t seen = idx_at(lens, b, index_bytes);
        seen_total += seen > capacity ? capacity : seen;
    }
    return B * Hkv * L > 1 && seen_total * Hq * D * L >= ATTN_PARALLEL_WORK;
}

INLINE void attn_share(int64_t units, int me, int teams, int64_t *u0, int64_t *u1) {
    const int64_t q = units / teams, r = units % teams;
    *u0 = me * q + (me < r ? me : r);
    *u1 = *u0 + q + (me < r ? 1 : 0);
}

int fuel_paged_attn(const float *q, const float *kc, const float *vc, const void *table,
                    const void *lens, float *out, int64_t B, int64_t Hq, int64_t L, int64_t D,
                    int64_t blocks, int64_t bs, int64_t Hkv, int64_t W, int index_bytes,
                    float scale, float softcap) {
    return fuel_paged_attn_kv(q, kc, vc, table, lens, out, B, Hq, L, D, blocks, bs, Hkv, W,
                              index_bytes, scale, softcap, F32);
}

/* As fuel_paged_attn, over caches of element format kv_fmt (F32, F16 or BF16): each key and
   value row widened to f32 as it is read (a half-precision cache is never converted whole). */
int fuel_paged_attn_kv(const float *q, const void *kc, const void *vc, const void *table,
                       const void *lens, float *out, int64_t B, int64_t Hq, int64_t L, int64_t D,
                       int64_t blocks, int64_t bs, int64_t Hkv, int64_t W, int index_bytes,
                       float scale, float softcap, int kv_fmt) {
    if (kv_fmt != F32 && kv_fmt != F16 && kv_fmt != BF16) return -1;
    const int64_t group = Hq / Hkv, capacity = W * bs;
    for (int64_t b = 0; b < B; b++) {  /* every block a query will read must be in the cache */
        int64_t seen = idx_at(lens, b, index_bytes);
        seen = seen > capacity ? capacity : seen;
        for (int64_t j = 0; j * bs < seen; j++) {
            const int64_t blk = idx_at(table, b * W + j, index_bytes);
            if (blk < 0 || blk >= blocks) return -1;
        }
    }
    /* One unit is a (sequence, kv head, query row): its group's scores, softmax and values.
       Units are shared out over torch's pool when there is enough work (the positions the
       queries read, not the table's capacity: Llama-3.1-8B at 2048 positions took 4.7 ms
       serial; see ATTN_PARALLEL_WORK); a decode row of a few dozen positions stays serial.
       Each unit is computed exactly as serially, so the result does not depend on the
       threads. */
    extern int omp_get_max_threads(void);
    extern int omp_get_thread_num(void);
    extern int omp_get_num_threads(void);
    const int64_t units = B * Hkv * L;
    const int parallel = attn_parallel(lens, B, Hq, L, D, Hkv, capacity, index_bytes);
    const int teams = parallel ? omp_get_max_threads() : 1;
    const size_t per = (size_t)(capacity * group + 1) + (size_t)(group * D + 1) + (size_t)(D + 1);
#ifdef __AVX2__
    const int fast = kv_fmt == F32 && D % 64 == 0;  /* attn_scores8, attn_values64 */
#else
    const int fast = 0;
#endif
    float *scratch = (float *)malloc(sizeof(float) * per * (size_t)(teams > 0 ? teams : 1));
    const float **rows_at = fast ? (const float **)malloc(sizeof(float *) * (size_t)(2 * capacity + 16)
                                                          * (size_t)(teams > 0 ? teams : 1)) : NULL;
    if (!scratch || (fast && !rows_at)) { free(scratch); free(rows_at); return -1; }
    #pragma omp parallel num_threads(teams) if (parallel)
    {
    const int me = parallel ? omp_get_thread_num() : 0;
    int64_t u0 = 0, u1 = units;
    if (parallel) attn_share(units, me, omp_get_num_threads(), &u0, &u1);
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / (Hkv * L), kv = (u / L) % Hkv, i = u % L;
        float *scores = scratch + per * (size_t)(me < teams ? me : 0);
        float *acc = scores + capacity * group + 1, *widened = acc + group * D + 1;
        const int64_t context = idx_at(lens, b, index_bytes);
        int64_t visible = context - L + i + 1;
        if (visible > capacity) visible = capacity;
        if (visible <= 0) {
            for (int64_t g = 0; g < group; g++)
                for (int64_t d = 0; d < D; d++) out[((b * Hq + kv * group + g) * L + i) * D + d] = NAN;
            continue;
        }
        const int64_t row_bytes = D * (kv_fmt == F32 ? 4 : 2);
        /* the first ATTN_PREFETCH positions up front, then each one ATTN_PREFETCH ahead */
        for (int64_t t = 0; t < visible && t < ATTN_PREFETCH; t++) {
            const int64_t row = cache_row_at(table, b, W, t, bs, Hkv, kv, index_bytes);
            prefetch_row(kc, row, row_bytes);
            prefetch_row(vc, row, row_bytes);
        }
        const float **keys = fast ? rows_at + (size_t)(2 * capacity + 16) * (size_t)(me < teams ? me : 0) : NULL;
        const float **values = fast ? keys + capacity + 8 : NULL;
        int64_t done = 0;  /* positions scored by the fast path */
#ifdef __AVX2__
        if (fast) {
            for (int64_t t = 0; t < visible; t++) {
                const int64_t row = cache_row_at(table, b, W, t, bs, Hkv, kv, index_bytes);
                keys[t] = (const float *)kc + row * D;
                values[t] = (const float *)vc + row * D;
            }
            for (; done + 8 <= visible; done += 8) {
                for (int j = 0; j < 8 && done + ATTN_PREFETCH + j < visible; j++) {
                    prefetch_span(keys[done + ATTN_PREFETCH + j], row_bytes);
                    prefetch_span(values[done + ATTN_PREFETCH + j], row_bytes);
                }
                for (int64_t g = 0; g < group; g++)
                    attn_scores8(q + ((b * Hq + kv * group + g) * L + i) * D, keys + done, D, scale,
                                 scores + g * capacity + done);
            }
            if (softcap > 0.0f)
                for (int64_t g = 0; g < group; g++)
                    for (int64_t t = 0; t < done; t++)
                        scores[g * capacity + t] = tanhf(scores[g * capacity + t] / softcap) * softcap;
        }
#endif
        for (int64_t t = done; t < visible; t++) {
            if (t + ATTN_PREFETCH < visible) {
                const int64_t row = cache_row_at(table, b, W, t + ATTN_PREFETCH, bs, Hkv, kv, index_bytes);
                prefetch_row(kc, row, row_bytes);
                prefetch_row(vc, row, row_bytes);
            }
            const float *key = cache_row(kv_fmt, kc, cache_row_at(table, b, W, t, bs, Hkv, kv, index_bytes),
                                         D, widened);
            for (int64_t g = 0; g < group; g++) {
                const float *query = q + ((b * Hq + kv * group + g) * L + i) * D;
                float dot = 0.0f;
                /* vectorised (a reordered f32 sum, within the JIT's tolerance) */
                #pragma omp simd reduction(+:dot)
                for (int64_t d = 0; d < D; d++) dot += query[d] * key[d];
                float s = dot * scale;
                if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
                scores[g * capacity + t] = s;
            }
        }
        for (int64_t g = 0; g < group; g++) {
            float *row = scores + g * capacity, top = -INFINITY, total = 0.0f;
            for (int64_t t = 0; t < visible; t++) if (row[t] > top) top = row[t];
            int64_t t = 0;
#ifdef __AVX2__  /* the exponentials eight at a time (a scalar expf was most of a long row) */
            const __m256 shift = _mm256_set1_ps(top);
            __m256 sums = _mm256_setzero_ps();
            for (; t + 8 <= visible; t += 8) {
                const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + t), shift));
                _mm256_storeu_ps(row + t, e);
                sums = _mm256_add_ps(sums, e);
            }
            total = hsum(sums);
#endif
            for (; t < visible; t++) { row[t] = expf(row[t] - top); total += row[t]; }
            const float inv = 1.0f / total;
            for (int64_t t = 0; t < visible; t++) row[t] *= inv;
        }
#ifdef __AVX2__
        if (fast) {
            for (int64_t g = 0; g < group; g++)
                attn_values64(scores + g * capacity, values, visible, D,
                              out + ((b * Hq + kv * group + g) * L + i) * D);
            continue;
        }
#endif
        for (int64_t e = 0; e < group * D; e++) acc[e] = 0.0f;
        for (int64_t t = 0; t < visible; t++) {
            const float *value = cache_row(kv_fmt, vc, cache_row_at(table, b, W, t, bs, Hkv, kv, index_bytes),
                                           D, widened);
            for (int64_t g = 0; g < group; g++) {
                const float w = scores[g * capacity + t];
                float *a = acc + g * D;
                for (int64_t d = 0; d < D; d++) a[d] += w * value[d];
            }
        }
        for (int64_t g = 0; g < group; g++)
            memcpy(out + ((b * Hq + kv * group + g) * L + i) * D, acc + g * D, sizeof(float) * (size_t)D);
    }
    }
    free(scratch);
    free(rows_at);
    return 0;
}

/* The KV cache rows thread `me` of `teams` will read in fuel_paged_attn_kv with these operands
   (its share of the units: attn_share), asked for into L2; every row to thread 0 where the
   attention runs serially. The step list (steps.c) calls it at the start of the fused product
   step whose epilogue holds the attention: a decode step streams megabytes of weights between
   two layers' attention, so every cached row is gone from every cache level by then, and the
   attention waited a memory latency per few rows (SmolLM2 at ~100 positions: ~15-25 us of a
   ~20-30 us call); asked for here, the rows come in while the products stream (the same bytes,
   earlier). A hint: it loads no cache row and writes nothing, and stops at a block outside the
   cache (the attention refuses it). */
void fuel_paged_attn_prefetch(const void *kc, const void *vc, const void *table, const void *lens,
                              int64_t B, int64_t Hq, int64_t L, int64_t D, int64_t blocks,
                              int64_t bs, int64_t Hkv, int64_t W, int index_bytes, int kv_fmt,
                              int me, int teams) {
    if ((kv_fmt != F32 && kv_fmt != F16 && kv_fmt != BF16) || Hkv <= 0 || bs <= 0 || teams < 1) return;
    const int64_t capacity = W * bs, units = B * Hkv * L, row_bytes = D * (kv_fmt == F32 ? 4 : 2);
    int64_t u0 = 0, u1 = units;
    if (attn_parallel(lens, B, Hq, L, D, Hkv, capacity, index_bytes)) attn_share(units, me, teams, &u0, &u1);
    else if (me != 0) return;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t b = u / (Hkv * L), kv = (u / L) % Hkv, i = u % L;
        int64_t visible = idx_at(lens, b, index_bytes) - L + i + 1;
        if (visible > capacity) visible = capacity;
        for (int64_t t = 0; t < visible; t++) {
            const int64_t blk = idx_at(table, b * W + t / bs, index_bytes);
            if (blk < 0 || blk >= blocks) break;
            const int64_t row = cache_row_at(table, b, W, t, bs, Hkv, kv, index_bytes);
            for (int64_t o = 0; o < row_bytes; o += 64) {
                __builtin_prefetch((const char *)kc + row * row_bytes + o, 0, 2);
                __builtin_prefetch((const char *)vc + row * row_bytes + o, 0, 2);
            }
        }
    }
}


/* Prompt-chunk attention (many query rows a sequence): the paged-attention recipe's semantics
   (query i of L sees positions up to len - L + i, capped at the table's capacity; a query that
   sees nothing is NaN), computed as flash attention over blocks of PA_KB keys: each (sequence,
   kv head)'s cache rows are gathered once, widened to f32, keys transposed ([D][positions]) so
   a block's scores are broadcast-FMAs of query elements against 16 keys a vector, and values
   row-major for the weighted sum; every block of PA_R query rows of one head keeps its running
   maximum, total and output in registers (online softmax), skipping the keys no row of it
   sees. AVX-512 and head dims of 64 or 128 only (-1 otherwise: the caller's SDPA stands). */
#ifdef __AVX512F__
#define PA_KB 64
#define PA_ROWS(DV) ((DV) == 4 ? 4 : 2)  /* query rows a block: their outputs stay in registers */

/* exp of sixteen floats: exp8 at AVX-512 width. */
#define ROUND16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define NAN_PASS16(result, x) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), result, x)
VECTOR_EXP(exp16, __m512, __m512i, _mm512, 512, ROUND16, NAN_PASS16)

/* R query rows (row stride qs elements) of one head, rows' last visible positions `last` (all
   >= 0), over the gathered keys kt [D][cap] and values v [cap][D]; DV = D / 16; output rows
   contiguous. */
INLINE void prefill_rows(const int R, const int DV, const float *q, int64_t qs, int64_t D,
                         const float *kt, int64_t cap, const float *v, const int64_t *last,
                         float scale, float *out) {
    __m512 o[4][8];
    float m[4], l[4], p[4][PA_KB] __attribute__((aligned(64)));
    int64_t end = 0;
    for (int r = 0; r < R; r++) {
        m[r] = -INFINITY; l[r] = 0.0f;
        for (int c = 0; c < DV; c++) o[r][c] = _mm512_setzero_ps();
        if (last[r] + 1 > end) end = last[r] + 1;
    }
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k0 = 0; k0 < end; k0 += PA_KB) {
        __m512 s[4][PA_KB / 16];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < PA_KB / 16; c++) s[r][c] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d++) {
            const float *kr = kt + d * cap + k0;
            __m512 k[PA_KB / 16];
            for (int c = 0; c < PA_KB / 16; c++) k[c] = _mm512_loadu_ps(kr + 16 * c);
            for (int r = 0; r < R; r++) {
                const __m512 qb = _mm512_set1_ps(q[r * qs + d]);
                for (int c = 0; c < PA_KB / 16; c++) s[r][c] = _mm512_fmadd_ps(qb, k[c], s[r][c]);
            }
        }
        for (int r = 0; r < R; r++) {
            __mmask16 seen[PA_KB / 16];
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int c = 0; c < PA_KB / 16; c++) {
                const __m512i at = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(k0 + 16 * c)));
                seen[c] = _mm512_cmple_epi32_mask(at, _mm512_set1_epi32((int)last[r]));
                s[r][c] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), seen[c], s[r][c], _mm512_set1_ps(scale));
                top = _mm512_max_ps(top, s[r][c]);
            }
            const float block_top = _mm512_reduce_max_ps(top);
            if (block_top == -INFINITY) {  /* this row sees none of these keys */
                for (int c = 0; c < PA_KB / 16; c++) _mm512_store_ps(p[r] + 16 * c, _mm512_setzero_ps());
                continue;
            }
            const float now = block_top > m[r] ? block_top : m[r];
            const float keep = m[r] == -INFINITY ? 0.0f : expf(m[r] - now);
            __m512 total = _mm512_setzero_ps();
            for (int c = 0; c < PA_KB / 16; c++) {
                const __m512 e = _mm512_maskz_mov_ps(seen[c], exp16(_mm512_sub_ps(s[r][c], _mm512_set1_ps(now))));
                _mm512_store_ps(p[r] + 16 * c, e);
                total = _mm512_add_ps(total, e);
            }
            l[r] = l[r] * keep + _mm512_reduce_add_ps(total);
            m[r] = now;
            const __m512 kv = _mm512_set1_ps(keep);
            for (int c = 0; c < DV; c++) o[r][c] = _mm512_mul_ps(o[r][c], kv);
        }
        const int64_t stop = end - k0 < PA_KB ? end - k0 : PA_KB;
        for (int64_t t = 0; t < stop; t++) {
            const float *vr = v + (k0 + t) * D;
            __m512 vv[8];
            for (int c = 0; c < DV; c++) vv[c] = _mm512_loadu_ps(vr + 16 * c);
            for (int r = 0; r < R; r++) {
                const __m512 pb = _mm512_set1_ps(p[r][t]);
                for (int c = 0; c < DV; c++) o[r][c] = _mm512_fmadd_ps(pb, vv[c], o[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int c = 0; c < DV; c++) _mm512_storeu_ps(out + r * D + 16 * c, _mm512_mul_ps(o[r][c], inv));
    }
}

/* The query rows [i0, i0 + n) of one head: blocks of R rows (R = 4 for D = 64, 2 for 128). */
INLINE void prefill_block(const int DV, const float *q, int64_t qs, int64_t D, const float *kt,
                          int64_t cap, const float *v, const int64_t *last, int64_t n, float scale,
                          float *out) {
    int any_blind = 0;
    for (int64_t r = 0; r < n; r++) any_blind |= last[r] < 0;
    const int R = PA_ROWS(DV);
    if (!any_blind && n == R) {
        if (R == 4) prefill_rows(4, 4, q, qs, D, kt, cap, v, last, scale, out);
        else prefill_rows(2, 8, q, qs, D, kt, cap, v, last, scale, out);
        return;
    }
    for (int64_t r = 0; r < n; r++) {  /* a short block, or rows that see nothing (NaN) */
        if (last[r] < 0) { for (int64_t d = 0; d < D; d++) out[r * D + d] = NAN; continue; }
        if (DV == 4) prefill_rows(1, 4, q + r * qs, qs, D, kt, cap, v, last + r, scale, out + r * D);
        else prefill_rows(1, 8, q + r * qs, qs, D, kt, cap, v, last + r, scale, out + r * D);
    }
}
#endif

int fuel_prefill_attn_kv(const float *q, const void *kc, const void *vc, const void *table,
                         const void *lens, float *out, int64_t B, int64_t Hq, int64_t L, int64_t D,
                         int64_t blocks, int64_t bs, int64_t Hkv, int64_t W, int index_bytes,
                         float scale, int kv_fmt, int64_t qs_b, int64_t qs_h, int64_t qs_l) {
#ifdef __AVX512F__
    if ((kv_fmt != F32 && kv_fmt != F16 && kv_fmt != BF16) || (D != 64 && D != 128)
        || Hkv <= 0 || Hq % Hkv) return -1;
    const int64_t group = Hq / Hkv, capacity = W * bs, DV = D / 16, R = PA_ROWS(DV);
    int64_t cap = 0;  /* positions gathered a (sequence, kv head), rounded up to a key block */
    for (int64_t b = 0; b < B; b++) {  /* every block a query will read must be in the cache */
        int64_t seen = idx_at(lens, b, index_bytes);
        seen = seen > capacity ? capacity : seen < 0 ? 0 : seen;
        for (int64_t j = 0; j * bs < seen; j++) {
            const int64_t blk = idx_at(table, b * W + j, index_bytes);
            if (blk < 0 || blk >= blocks) return -2;
        }
        if (seen > cap) cap = seen;
    }
    cap = (cap + PA_KB - 1) / PA_KB * PA_KB;
    if (cap == 0) cap = PA_KB;
    const int64_t kstride = cap + 16;  /* floats a transposed key row (see the gather) */
    const size_t per = (size_t)((kstride + cap) * D);
    float *gathered = (float *)calloc((size_t)(B * Hkv) * per + 16, sizeof(float));
    if (!gathered) return -1;
    const int64_t pairs = B * Hkv;
    const int parallel = L * Hq > 1;
    #pragma omp parallel if (parallel)
    {
        float widened[128], tile[16 * 128];
        #pragma omp for schedule(static)
        for (int64_t u = 0; u < pairs; u++) {  /* gather: keys transposed, values as rows */
            const int64_t b = u / Hkv, kv = u % Hkv;
            int64_t seen = idx_at(lens, b, index_bytes);
            seen = seen > capacity ? capacity : seen;
            float *kt = gathered + (size_t)u * per, *v = kt + kstride * D;
            /* keys transposed 16 positions at a time: each d's 16 values one cache line (a
               position at a time wrote D lines a key, 4 KiB apart at 1024 positions: the same
               L1 set, 1.3x slower than SDPA there); the row stride is padded off 4 KiB too */
            for (int64_t t0 = 0; t0 < seen; t0 += 16) {
                const int64_t n = seen - t0 < 16 ? seen - t0 : 16;
                for (int64_t j = 0; j < n; j++) {
                    const int64_t row = cache_row_at(table, b, W, t0 + j, bs, Hkv, kv, index_bytes);
                    memcpy(tile + j * D, cache_row(kv_fmt, kc, row, D, widened), sizeof(float) * (size_t)D);
                    memcpy(v + (t0 + j) * D, cache_row(kv_fmt, vc, row, D, widened), sizeof(float) * (size_t)D);
                }
                for (int64_t d = 0; d < D; d++)
                    for (int64_t j = 0; j < n; j++) kt[d * kstride + t0 + j] = tile[j * D + d];
            }
        }
        const int64_t chunks = (L + R - 1) / R, units = B * Hq * chunks;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; u++) {  /* the later row blocks first: the most keys */
            const int64_t w = units - 1 - u;
            const int64_t b = w / (Hq * chunks), h = (w / chunks) % Hq, i0 = (w % chunks) * R;
            const int64_t n = L - i0 < R ? L - i0 : R;
            const int64_t context = idx_at(lens, b, index_bytes);
            int64_t last[4];
            for (int64_t r = 0; r < n; r++) {
                int64_t visible = context - L + i0 + r + 1;
                if (visible > capacity) visible = capacity;
                last[r] = visible - 1;
            }
            const float *kt = gathered + (size_t)(b * Hkv + h / group) * per;
            /* q may be a strided view (heads and rows permuted out of a projection: its
               elements D-contiguous); the output is contiguous [B, Hq, L, D] */
            const float *qr = q + b * qs_b + h * qs_h + i0 * qs_l;
            const size_t at = (size_t)(((b * Hq + h) * L + i0) * D);
            if (DV == 4) prefill_block(4, qr, qs_l, D, kt, kstride, kt + kstride * D, last, n, scale, out + at);
            else prefill_block(8, qr, qs_l, D, kt, kstride, kt + kstride * D, last, n, scale, out + at);
        }
    }
    free(gathered);
    return 0;
#else
    (void)q; (void)kc; (void)vc; (void)table; (void)lens; (void)out; (void)B; (void)Hq; (void)L;
    (void)D; (void)blocks; (void)bs; (void)Hkv; (void)W; (void)index_bytes; (void)scale; (void)kv_fmt;
    (void)qs_b; (void)qs_h; (void)qs_l;
    return -1;
#endif
}

#endif
