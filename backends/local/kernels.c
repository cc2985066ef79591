/* Fused elementwise kernels for the packed trainer (backends/local/packed.py), float32, CPU.
 *
 * Built on first use by backends/local/kernels.py (the system C compiler, -O3 -march=native, OpenMP when the
 * compiler has it) and called through ctypes on contiguous float32 tensors. Each kernel does in one pass over
 * memory what torch's eager ops do in several: these tensors (tokens x hidden, tokens x intermediate) do not
 * stay in cache, so eager elementwise work is bound by memory traffic, and the fused forms move 2-5x fewer
 * bytes (numbers in bench/README.md).
 *
 * Every kernel works row by row and a row's result does not depend on how rows are split over threads, so
 * results are the same for any thread count. No reassociation flags (-ffast-math) are used: the sums below
 * are written with explicit 16-lane partial sums, which the compiler vectorises as written.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16

/* Parallel over rows only when there is enough work for the threads to pay off. */
#define PAR_ROWS(nt, rows, cols) if ((nt) > 1 && (long)(rows) * (long)(cols) >= 65536) num_threads(nt)

/* sum of a[i] * b[i], 16 partial sums (fixed order: the same bits every call). */
static inline float dot(const float *a, const float *b, long n) {
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) acc[l] += a[j + l] * b[j + l];
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; j < n; j++) s += a[j] * b[j];
    return s;
}

/* ---------------------------------------------------------------- RMSNorm, one row (rms_* and norm_rope_*)
 * y = w * (x * rs) (no weight when w is NULL); returns rs = 1 / sqrt(mean(x^2) + eps). */
static inline float norm_row(const float *x, const float *w, float *y, long n, float eps) {
    float rs = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    if (w)
        for (long j = 0; j < n; j++) y[j] = w[j] * (x[j] * rs);
    else
        for (long j = 0; j < n; j++) y[j] = x[j] * rs;
    return rs;
}

/* dx = rs * (g - xhat * mean(g * xhat)), g = dy * w, xhat = x * rs; plus dres (the gradient that reaches x
 * around the norm, from the residual stream) when given. */
static inline void norm_row_bwd(const float *dy, const float *x, const float *w, float rs, const float *dres,
                                float *dx, long n) {
    float acc[LANES] = {0};
    long j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            float g = w ? dy[j + l] * w[j + l] : dy[j + l];
            acc[l] += g * (x[j + l] * rs);
        }
    float m = 0.0f;
    for (int l = 0; l < LANES; l++) m += acc[l];
    for (; j < n; j++) m += (w ? dy[j] * w[j] : dy[j]) * (x[j] * rs);
    m /= (float)n;
    if (dres) {
        for (j = 0; j < n; j++) {
            float g = w ? dy[j] * w[j] : dy[j];
            dx[j] = (g - (x[j] * rs) * m) * rs + dres[j];
        }
    } else {
        for (j = 0; j < n; j++) {
            float g = w ? dy[j] * w[j] : dy[j];
            dx[j] = (g - (x[j] * rs) * m) * rs;
        }
    }
}

/* ---------------------------------------------------------------- RMSNorm
 * Per row of n: y = norm(x) * w; with r, x <- x + r first (the residual add), written to xo. rstd (rows) is
 * kept for the backward. */
void rms_fwd(const float *x, const float *r, const float *w, float *xo, float *y, float *rstd, long rows, long n,
             float eps, int nt) {
#pragma omp parallel for schedule(static) PAR_ROWS(nt, rows, n)
    for (long t = 0; t < rows; t++) {
        const float *xt = x + t * n;
        if (r) {
            const float *rt = r + t * n;
            float *ot = xo + t * n;
            for (long j = 0; j < n; j++) ot[j] = xt[j] + rt[j];
            xt = ot;
        }
        rstd[t] = norm_row(xt, w, y + t * n, n, eps);
    }
}

/* The backward of rms_fwd (x: its xo), plus dres when given. */
void rms_bwd(const float *dy, const float *x, const float *w, const float *rstd, const float *dres, float *dx,
             long rows, long n, int nt) {
#pragma omp parallel for schedule(static) PAR_ROWS(nt, rows, n)
    for (long t = 0; t < rows; t++)
        norm_row_bwd(dy + t * n, x + t * n, w, rstd[t], dres ? dres + t * n : NULL, dx + t * n, n);
}

/* ---------------------------------------------------------------- per-head RMSNorm (optional) + rotary
 * x: (rows, heads, d); cos/sin: (rows, d). out = rope(norm(x) * w) (norm skipped when w is NULL, then rstd is
 * not written). rope(z)[i] = z[i] cos[i] - z[i+h] sin[i], rope(z)[i+h] = z[i+h] cos[i+h] + z[i] sin[i+h]. */
void norm_rope_fwd(const float *x, const float *w, const float *cs, const float *sn, float *out, float *rstd,
                   long rows, long heads, long d, float eps, int nt) {
    long h = d / 2;
#pragma omp parallel for schedule(static) PAR_ROWS(nt, rows, heads *d)
    for (long t = 0; t < rows; t++) {
        const float *c = cs + t * d, *s = sn + t * d;
        for (long k = 0; k < heads; k++) {
            const float *xt = x + (t * heads + k) * d;
            float *ot = out + (t * heads + k) * d;
            float z[512];
            const float *zz = xt;
            if (w) {
                rstd[t * heads + k] = norm_row(xt, w, z, d, eps);
                zz = z;
            }
            for (long j = 0; j < h; j++) {
                ot[j] = zz[j] * c[j] - zz[j + h] * s[j];
                ot[j + h] = zz[j + h] * c[j + h] + zz[j] * s[j + h];
            }
        }
    }
}

/* The backward of norm_rope_fwd: dz = rope^T(dy), then the norm's backward (when w is given). */
void norm_rope_bwd(const float *dy, const float *x, const float *w, const float *cs, const float *sn,
                   const float *rstd, float *dx, long rows, long heads, long d, int nt) {
    long h = d / 2;
#pragma omp parallel for schedule(static) PAR_ROWS(nt, rows, heads *d)
    for (long t = 0; t < rows; t++) {
        const float *c = cs + t * d, *s = sn + t * d;
        for (long k = 0; k < heads; k++) {
            const float *dyt = dy + (t * heads + k) * d;
            float *dxt = dx + (t * heads + k) * d;
            float dz[512];
            float *zt = w ? dz : dxt;
            for (long j = 0; j < h; j++) {
                zt[j] = dyt[j] * c[j] + dyt[j + h] * s[j + h];
                zt[j + h] = dyt[j + h] * c[j + h] - dyt[j] * s[j];
            }
            if (w) norm_row_bwd(dz, x + (t * heads + k) * d, w, rstd[t * heads + k], NULL, dxt, d);
        }
    }
}

/* ---------------------------------------------------------------- SwiGLU: p = silu(g) * u */

/* exp(x) for x <= 80 (callers clamp), Cephes' expf: range reduction by ln 2 and a degree-6 polynomial,
 * within a few ulp of expf on this range; written without branches or calls so the loops vectorise. */
static inline float exp_le80(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* n = round(x / ln 2) by the 1.5 * 2^23 trick (exact for |n| < 2^22; floorf does not vectorise here) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return p * scale;
}

/* sigmoid(g); g below -80 gives 1/(1+e^80) ~ 1.8e-35 instead of a denormal (silu's value differs by < 1e-33) */
static inline float sigm(float g) {
    float ng = -g;
    return 1.0f / (1.0f + exp_le80(ng < 80.0f ? ng : 80.0f));
}

void swiglu_fwd(const float *g, const float *u, float *p, long n, int nt) {
    long rows = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) PAR_ROWS(nt, rows, 4096)
    for (long b = 0; b < rows; b++) {
        long end = (b + 1) * 4096 < n ? (b + 1) * 4096 : n;
        for (long i = b * 4096; i < end; i++) p[i] = g[i] * sigm(g[i]) * u[i];
    }
}

/* dg = dp * u * s * (1 + g (1 - s)), du = dp * g * s, s = sigmoid(g) */
void swiglu_bwd(const float *dp, const float *g, const float *u, float *dg, float *du, long n, int nt) {
    long rows = (n + 4095) / 4096;
#pragma omp parallel for schedule(static) PAR_ROWS(nt, rows, 4096)
    for (long b = 0; b < rows; b++) {
        long end = (b + 1) * 4096 < n ? (b + 1) * 4096 : n;
        for (long i = b * 4096; i < end; i++) {
            float s = sigm(g[i]);
            float gs = g[i] * s;
            du[i] = dp[i] * gs;
            dg[i] = dp[i] * u[i] * (s + gs * (1.0f - s));
        }
    }
}
