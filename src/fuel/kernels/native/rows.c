/* fuel's native row-wise kernels (f32): built into the same library as gemv.c, by
   fuel.kernels.native, at -O3 -march=native.

   residual_add_rms_norm over R rows of H elements, the registry's recipe in one pass per row:
       total  = x + residual
       normed = total * rsqrt(mean(total * total) + eps) * gain
   written stacked as out[0] = normed, out[1] = total ([2, R, H], contiguous), the fused op's
   two results. The mean is a sum in f32 divided by H (the recipe's torch.mean reassociates the
   same sum), so the result equals the recipe within f32 reassociation, which the JIT verifies
   at every shape it adopts. Serial: a row of a few thousand elements is microseconds, and a
   parallel region costs more than it saves (fuel.kernels.threads). */
#include <stdint.h>
#include <math.h>

void fuel_residual_rms_norm(const float *x, const float *residual, const float *gain, float *out,
                            int64_t R, int64_t H, float eps) {
    float *normed = out, *total = out + R * H;
    for (int64_t i = 0; i < R; i++) {
        const float *xi = x + i * H, *ri = residual + i * H;
        float *t = total + i * H, *n = normed + i * H;
        float squares = 0.0f;
        for (int64_t j = 0; j < H; j++) {
            const float v = xi[j] + ri[j];
            t[j] = v;
            squares += v * v;
        }
        const float scale = 1.0f / sqrtf(squares / (float)H + eps);
        for (int64_t j = 0; j < H; j++) n[j] = t[j] * scale * gain[j];
    }
}
