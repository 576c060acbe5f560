/* fuel's native step list: a compiled program's steps run in one call (fuel.runtime.native_steps).

   A decode step of a small model is hundreds of short kernels; dispatched one by one from
   Python, the dispatch (argument checks, output allocation, the ctypes call) cost more than
   the kernels. Here the program is laid out once: every value has a fixed address (an arena
   the Python side allocates, the weights, the fed tensors), every view is an offset, and each
   step is a record naming a kernel of this library and its operands. fuel_run_steps walks the
   records: the kernels are the very functions the one-call-per-node path calls (gemv.c,
   rows.c), plus the few element-wise ones below, so the arithmetic is the same.

   An operand is (slot, byte offset): `table[slot] + offset`. Slots are the fed tensors (their
   addresses change per run, the caller fills them), the weights and constants, and the arena.
   A fused step (STEP_FUSED, built by native_steps.fuse) runs up to four products of one
   activation in one parallel region, then the records after it as its epilogue.
   Returns 0, or 1 + the index of the first step that refused its operands (a KV slot or a
   block outside the cache, an index outside a gather's source): the steps before it ran; the
   caller runs the program again step by step, which raises the precise error. */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum {
    STEP_MATMUL = 1, STEP_MATMUL_Q8 = 2, STEP_DEQUANTIZE = 3, STEP_ROPE = 4, STEP_ARGMAX = 5,
    STEP_KV_WRITE = 6, STEP_PAGED_ATTN = 7, STEP_RESIDUAL_RMS_NORM = 8, STEP_RMS_NORM = 9,
    STEP_SILU_MUL = 10, STEP_ADD = 11, STEP_GATHER = 12, STEP_FUSED = 13, STEP_CAST = 14,
    STEP_COPY = 15,
};

enum { FUSED_MAX = 4 };  /* products a fused step shares one activation read among */

typedef struct {
    int64_t kind;
    int64_t slot[9];
    int64_t offset[9];
    int64_t n[14];
    float f[2];
} fuel_step;

int fuel_matmul(int fmt, const float *x, const uint8_t *w, float *out, int64_t M, int64_t N,
                int64_t K, int64_t row_bytes, int threads);
int fuel_matmul_q8(int fmt, const float *x, const uint8_t *w, float *out, int64_t M, int64_t N,
                   int64_t K, int64_t row_bytes, int threads);
int fuel_dequantize(int fmt, const uint8_t *w, float *dst, int64_t N, int64_t K, int64_t row_bytes,
                    int threads);
void fuel_rope(const float *x, int64_t xr, int64_t xh, const float *cos_, const float *sin_,
               float *out, int64_t R, int64_t H, int64_t D);
void fuel_argmax(const float *x, int64_t R, int64_t V, int64_t *out);
int fuel_kv_write_rows(void *cache, int64_t slot_count, int64_t row_bytes, const void *rows,
                       const int64_t *slots, int64_t n);
int fuel_paged_attn_kv(const float *q, const void *kc, const void *vc, const void *table,
                       const void *lens, float *out, int64_t B, int64_t Hq, int64_t L, int64_t D,
                       int64_t blocks, int64_t bs, int64_t Hkv, int64_t W, int index_bytes,
                       float scale, float softcap, int kv_fmt);
void fuel_paged_attn_prefetch(const void *kc, const void *vc, const void *table, const void *lens,
                              int64_t B, int64_t Hq, int64_t L, int64_t D, int64_t blocks,
                              int64_t bs, int64_t Hkv, int64_t W, int index_bytes, int kv_fmt,
                              int me, int teams);
int fuel_cast_half(const float *x, uint16_t *out, int64_t n, int fmt);
void fuel_residual_rms_norm(const float *x, const float *residual, const float *gain, float *out,
                            int64_t R, int64_t H, float eps);
int fuel_matmul_prepare(int fmt, const float *x, int64_t M, int64_t K, float **xs_out);
void fuel_matmul_rows(int fmt, const float *x, const uint8_t *w, float *out, const float *xs,
                      int64_t M, int64_t N, int64_t K, int64_t row_bytes, int64_t n0, int64_t n1);
int64_t fuel_matmul_tile(void);
void fuel_prefetch(const void *p, int64_t bytes);
int omp_get_thread_num(void);
int omp_get_max_threads(void);
void omp_set_num_threads(int);
void *fuel_q8_prepare(int fmt, const float *x, int64_t M, int64_t K);
void fuel_q8_release(void *rows);
void fuel_matmul_q8_rows(int fmt, const uint8_t *w, float *out, const void *rows, int64_t M,
                         int64_t N, int64_t row_bytes, int64_t n0, int64_t n1);

/* rms_norm of R rows of H: x * rsqrt(mean(x*x) + eps) (* gain when given), f32 sums. */
void fuel_rms_norm(const float *x, const float *gain, float *out, int64_t R, int64_t H, float eps) {
    for (int64_t i = 0; i < R; i++) {
        const float *xi = x + i * H;
        float *o = out + i * H, squares = 0.0f;
        #pragma omp simd reduction(+:squares)
        for (int64_t j = 0; j < H; j++) squares += xi[j] * xi[j];
        const float scale = 1.0f / sqrtf(squares / (float)H + eps);
        if (gain) for (int64_t j = 0; j < H; j++) o[j] = xi[j] * scale * gain[j];
        else for (int64_t j = 0; j < H; j++) o[j] = xi[j] * scale;
    }
}

/* silu(gate) * up, n elements (gemv.c: its exponentials eight at a time). */
void fuel_silu_mul(const float *gate, const float *up, float *out, int64_t n);

static inline int64_t index_at(const void *p, int64_t i, int64_t bytes) {
    /* 8: int64; 4: 32-bit, read unsigned (as paged attention reads its table): a negative
       int32 is then past any source and refused like one */
    return bytes == 8 ? ((const int64_t *)p)[i] : (int64_t)((const uint32_t *)p)[i];
}

#define P(k) ((void *)((char *)table[s->slot[k]] + s->offset[k]))

/* One record (every kind but STEP_FUSED): 0, or nonzero when it refused its operands. */
static int run_one(const fuel_step *s, void *const *table, int threads) {
    const int64_t *n = s->n;
    int status = 0;
    switch (s->kind) {
    case STEP_MATMUL:
        status = fuel_matmul((int)n[0], P(0), P(1), P(2), n[1], n[2], n[3], n[4], threads);
        break;
    case STEP_MATMUL_Q8:
        status = fuel_matmul_q8((int)n[0], P(0), P(1), P(2), n[1], n[2], n[3], n[4], threads);
        break;
    case STEP_DEQUANTIZE:
        status = fuel_dequantize((int)n[0], P(0), P(1), n[1], n[2], n[3], 1);
        break;
    case STEP_ROPE:  /* n[3]: x's row stride in elements where its rows are apart (0: H * D) */
        fuel_rope(P(0), n[3] ? n[3] : n[1] * n[2], n[2], P(1), P(2), P(3), n[0], n[1], n[2]);
        break;
    case STEP_ARGMAX:
        fuel_argmax(P(0), n[0], n[1], P(1));
        break;
    case STEP_KV_WRITE:  /* n[3]: the rows' stride in bytes where they are apart (0: n[1]) */
        if (!n[3] || n[3] == n[1]) {
            status = fuel_kv_write_rows(P(0), n[0], n[1], P(1), P(2), n[2]);
        } else {
            const char *rows = P(1);
            const int64_t *slots = P(2);
            for (int64_t i = 0; i < n[2] && !status; i++)
                status = fuel_kv_write_rows(P(0), n[0], n[1], rows + i * n[3], slots + i, 1);
        }
        break;
    case STEP_PAGED_ATTN:
        status = fuel_paged_attn_kv(P(0), P(1), P(2), P(3), P(4), P(5), n[0], n[1], n[2], n[3],
                                    n[4], n[5], n[6], n[7], (int)n[8], s->f[0], s->f[1],
                                    (int)n[9]);
        break;
    case STEP_RESIDUAL_RMS_NORM:
        fuel_residual_rms_norm(P(0), P(1), P(2), P(3), n[0], n[1], s->f[0]);
        break;
    case STEP_RMS_NORM:
        fuel_rms_norm(P(0), s->slot[1] < 0 ? NULL : P(1), P(2), n[0], n[1], s->f[0]);
        break;
    case STEP_SILU_MUL:  /* n[1] > 0: n[1] rows of n[2], gate and up rows n[3] and n[4] elements
                            apart (two column ranges of one product), out contiguous */
        if (!n[1]) {
            fuel_silu_mul(P(0), P(1), P(2), n[0]);
        } else {
            const float *gate = P(0), *up = P(1);
            float *o = P(2);
            for (int64_t r = 0; r < n[1]; r++)
                fuel_silu_mul(gate + r * n[3], up + r * n[4], o + r * n[2], n[2]);
        }
        break;
    case STEP_CAST:  /* f32 -> bf16 / f16 (n[1]: the format code), n[0] elements; n[2] > 0:
                        n[2] rows of n[3], the source's n[4] elements apart */
        if (!n[2]) {
            status = fuel_cast_half(P(0), P(1), n[0], (int)n[1]);
        } else {
            const float *x = P(0);
            uint16_t *o = P(1);
            for (int64_t r = 0; r < n[2] && !status; r++)
                status = fuel_cast_half(x + r * n[4], o + r * n[3], n[3], (int)n[1]);
        }
        break;
    case STEP_ADD: {
        const float *a = P(0), *b = P(1);
        float *o = P(2);
        for (int64_t j = 0; j < n[0]; j++) o[j] = a[j] + b[j];
        break;
    }
    case STEP_GATHER: {  /* rows of n[1] bytes, n[0] indices into n[2] source rows */
        const char *src = P(0);
        const void *index = P(1);
        char *out = P(2);
        for (int64_t j = 0; j < n[0]; j++) {
            const int64_t row = index_at(index, j, n[3]);
            if (row < 0 || row >= n[2]) return 1;
            memcpy(out + j * n[1], src + row * n[1], (size_t)n[1]);
        }
        break;
    }
    case STEP_COPY: {  /* a strided view made contiguous: runs of n[9] bytes at src + a n[5] +
                          b n[6] + c n[7] + d n[8] (byte strides), for a < n[1], b < n[2],
                          c < n[3], d < n[4], written one after another */
        const char *src = P(0);
        char *o = P(1);
        const size_t run = (size_t)n[9];
        for (int64_t a = 0; a < n[1]; a++)
            for (int64_t b = 0; b < n[2]; b++)
                for (int64_t c = 0; c < n[3]; c++)
                    for (int64_t d = 0; d < n[4]; d++, o += run)
                        memcpy(o, src + a * n[5] + b * n[6] + c * n[7] + d * n[8], run);
        break;
    }
    default:
        status = -1;
    }
    return status;
}

/* How much of a new run of weight rows a thread asks for before its first row: the start of
   its share, a product its share crosses into, a tile taken from another share's back. The
   kernels prefetch STREAM_AHEAD (gemv.c) past the row they multiply, so nothing asked for a
   run's first bytes, and a product of a few hundred KiB is several runs a thread (q, k and v).
   Interleaved A/B of a SmolLM2 Q4_1 decode step at a fixed context (20-30 rounds, host load
   varying between runs): 32 KiB 0.91-0.98x of none, 64 KiB 0.89-0.99x, 128 KiB 0.83-1.00x,
   256 KiB 1.07x; f32 and bf16 steps (16 KiB) 0.98-1.01x. */
#define RUN_AHEAD 32768

/* Its rows asked for early by the threads that will read them (gemv.c says why). */
static void prefetch_attention(const fuel_step *s, void *const *table, int me, int teams) {
    const int64_t *n = s->n;
    fuel_paged_attn_prefetch(P(1), P(2), P(3), P(4), n[0], n[1], n[2], n[3], n[4], n[5], n[6],
                             n[7], (int)n[8], (int)n[9], me, teams);
}

/* A fused step: up to FUSED_MAX products of one activation x[M, K] by weights of one format
   (slot 0: x; slots 1..4 the weights, 5..8 the outputs; n: fmt, 8-bit activations, M, K, count,
   N[4], row_bytes[4], epilogue length), their tiles shared out in ONE parallel region (the
   activations rounded or summed once), then the epilogue: the n[13] records that follow it,
   row-wise kernels reading what the products wrote while it is in cache (a GEMM with an
   epilogue, as CUTLASS composes one). Each output row is computed exactly as the unfused
   fuel_matmul / fuel_matmul_q8 computes it (the same tiles of TILE rows, the same row kernel),
   so the results are the unfused records' bit for bit. */
static int run_fused(const fuel_step *s, void *const *table, int threads) {
    const int64_t *n = s->n;
    const int fmt = (int)n[0], q8 = (int)n[1];
    const int64_t M = n[2], K = n[3], count = n[4];
    if (count < 1 || count > FUSED_MAX) return -1;
    const float *x = P(0);
    void *rows = NULL;
    float *xs = NULL;
    if (q8) {
        if (!(rows = fuel_q8_prepare(fmt, x, M, K))) return -1;
    } else if (fuel_matmul_prepare(fmt, x, M, K, &xs)) {
        return -1;
    }
    const int64_t tile = fuel_matmul_tile();
    int64_t first[FUSED_MAX + 1], work = 0;
    first[0] = 0;
    for (int64_t j = 0; j < count; j++) {
        first[j + 1] = first[j] + (n[5 + j] + tile - 1) / tile;
        work += n[5 + j] * K;
    }
    const int64_t tiles = first[count];
    const int parallel = threads > 1 && work >= 65536;
    const fuel_step *attention = NULL;  /* a decode attention in the epilogue: its rows, early */
    for (int64_t e = 1; e <= n[13] && !attention; e++)
        if (s[e].kind == STEP_PAGED_ATTN) attention = s + e;
#define FUSED_TILE(t) do {                                                                      \
        int64_t j = 0;                                                                          \
        while ((t) >= first[j + 1]) j++;                                                        \
        const int64_t N = n[5 + j], n0 = ((t) - first[j]) * tile, n1 = n0 + tile < N ? n0 + tile : N; \
        const uint8_t *w = (const uint8_t *)table[s->slot[1 + j]] + s->offset[1 + j];         \
        if ((t) != run_last + 1 || j != run_product) {  /* a new run of rows (RUN_AHEAD) */     \
            int64_t span = (N - n0) * n[9 + j];                                                 \
            fuel_prefetch(w + n0 * n[9 + j], span < RUN_AHEAD ? span : RUN_AHEAD);             \
        }                                                                                       \
        run_last = (t);                                                                         \
        run_product = j;                                                                        \
        float *out = (float *)((char *)table[s->slot[5 + j]] + s->offset[5 + j]);              \
        if (q8) fuel_matmul_q8_rows(fmt, w, out, rows, M, N, n[9 + j], n0, n1);                \
        else fuel_matmul_rows(fmt, x, w, out, xs, M, N, K, n[9 + j], n0, n1);                  \
    } while (0)
    if (!parallel) {
        int64_t run_last = -2, run_product = -1;
        if (attention) prefetch_attention(attention, table, 0, 1);
        for (int64_t t = 0; t < tiles; t++) FUSED_TILE(t);
    } else {
        /* Each thread owns one contiguous share of the tiles (a static schedule: one stream
           of weights a thread, which the prefetchers follow) and claims it from the front; a
           thread done with its own share takes the tiles left in the others' from their back.
           On this project's shared 2-core VM one core is often slowed for a while by the host,
           and a static split then waits for it at every product (measured: 10-25 us of a
           45-60 us gate/up product a thread apart). Interleaved A/B of a SmolLM2 decode step at
           a fixed context, 24 rounds: Q4_1 4.4-5.5 ms -> 0.90-1.01x, f32 0.94-0.98x, bf16
           0.98x. A chunked dynamic schedule (tiles dealt out in turn) was slower: it breaks
           each thread's stream. A tile is computed the same by whichever thread, so results do
           not depend on who took it. claims[i]: share i's next front tile (low 32 bits) and
           its end (high 32 bits), moved by compare-and-swap. */
        enum { TEAMS_MAX = 64 };
        const int teams = threads < TEAMS_MAX ? threads : TEAMS_MAX;
        /* one cache line a share: an owner's claims do not pull its neighbour's line away */
        struct { _Alignas(64) _Atomic uint64_t word; } claims[TEAMS_MAX];
        for (int i = 0; i < teams; i++) {
            const int64_t q = tiles / teams, r = tiles % teams;
            const uint64_t lo = (uint64_t)(i * q + (i < r ? i : r));
            const uint64_t hi = lo + (uint64_t)q + (i < r ? 1 : 0);
            atomic_init(&claims[i].word, lo | (hi << 32));
        }
        #pragma omp parallel num_threads(teams)
        {
            const int me = omp_get_thread_num();
            int64_t run_last = -2, run_product = -1;
            if (attention) prefetch_attention(attention, table, me, teams);
            /* every share, own first (a runtime that gave fewer threads leaves some unowned:
               they are taken from the back) */
            for (int k = 0; k < teams; k++) {
                _Atomic uint64_t *claim = &claims[(me + k) % teams].word;
                for (;;) {
                    uint64_t v = atomic_load_explicit(claim, memory_order_relaxed);
                    const uint64_t front = v & 0xffffffffu, end = v >> 32;
                    if (front >= end) break;
                    const int64_t t = (int64_t)(k == 0 ? front : end - 1);
                    const uint64_t next = k == 0 ? (front + 1) | (end << 32) : front | ((end - 1) << 32);
                    if (atomic_compare_exchange_weak_explicit(claim, &v, next, memory_order_relaxed,
                                                              memory_order_relaxed))
                        FUSED_TILE(t);
                }
            }
        }
    }
#undef FUSED_TILE
    fuel_q8_release(rows);
    free(xs);
    for (int64_t e = 1; e <= n[13]; e++)
        if (run_one(s + e, table, threads) != 0) return 1;
    return 0;
}

static int run_steps(const fuel_step *steps, int64_t count, void *const *table, int threads) {
    for (int64_t i = 0; i < count; i++) {
        const fuel_step *s = steps + i;
        if (s->kind == STEP_FUSED) {
            if (run_fused(s, table, threads) != 0) return (int)(i + 1);
            i += s->n[13];
        } else if (run_one(s, table, threads) != 0) {
            return (int)(i + 1);
        }
    }
    return 0;
}

/* The steps on `threads` threads: the kernels given a count take it, and for the call the
   calling thread's default team size is that count too, so the ones that size their region by
   the pool (attention over its units) take it as well (fuel.kernels.threads.StepThreads runs a
   step list on one thread while the pool stalls; one region on the whole pool would stall it
   again). */
int fuel_run_steps(const fuel_step *steps, int64_t count, void *const *table, int threads) {
    const int pool = omp_get_max_threads(), team = threads > 0 ? threads : 1;
    if (team != pool) omp_set_num_threads(team);
    const int status = run_steps(steps, count, table, team);
    if (team != pool) omp_set_num_threads(pool);
    return status;
}
