/* fuel's native row-wise kernels (f32): built into the same library as gemv.c, by
   fuel.kernels.native, at -O3 -march=native.

   residual_add_rms_norm over R rows of H elements, the registry's recipe in one pass per row:
       total  = x + residual
       normed = total * rsqrt(mean(total * total) + eps) * gain
   written stacked as out[0] = normed, out[1] = total ([2, R, H], contiguous), the fused op's
   two results. The mean is a sum in f32 divided by H (the recipe's torch.mean reassociates the
   same sum), so the result equals the recipe within f32 reassociation, which the JIT verifies
   at every shape it adopts. The sum of squares runs in eight lanes (an f32 sum with one
   accumulator is a chain of dependent adds the compiler may not reorder: ~1 ns an element,
   80 us for a 128-row prompt chunk), added pairwise at the end; a prompt chunk's rows are shared
   out over torch's pool (a decode row stays serial: a parallel region costs more than it
   saves, fuel.kernels.threads). */
#include <stdint.h>
#include <math.h>

#define LANES 8
#define PARALLEL_ELEMENTS 32768

static void residual_rms_norm_row(const float *xi, const float *ri, const float *gain, float *t,
                                  float *n, int64_t H, float eps) {
    float acc[LANES] = {0.0f};
    int64_t j = 0;
    for (; j + LANES <= H; j += LANES)
        for (int l = 0; l < LANES; l++) {
            const float v = xi[j + l] + ri[j + l];
            t[j + l] = v;
            acc[l] += v * v;
        }
    float tail = 0.0f;
    for (; j < H; j++) {
        const float v = xi[j] + ri[j];
        t[j] = v;
        tail += v * v;
    }
    const float squares = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                          ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
    const float scale = 1.0f / sqrtf(squares / (float)H + eps);
    for (j = 0; j < H; j++) n[j] = t[j] * scale * gain[j];
}

void fuel_residual_rms_norm(const float *x, const float *residual, const float *gain, float *out,
                            int64_t R, int64_t H, float eps) {
    float *normed = out, *total = out + R * H;
#pragma omp parallel for schedule(static) if (R > 1 && R * H >= PARALLEL_ELEMENTS)
    for (int64_t i = 0; i < R; i++)
        residual_rms_norm_row(x + i * H, residual + i * H, gain, total + i * H, normed + i * H, H, eps);
}
