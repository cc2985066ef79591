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

/* ---------------------------------------------------------------- attention backward
 * Causal attention's input gradients, for c sequences of n queries against m keys (m >= n: the last n keys are
 * the queries' own, any before them ancestors that every query sees): query i sees key j when j <= i + m - n.
 * The forward ran elsewhere (torch's flash attention) and left its output o and row logsumexp lse, so the
 * probabilities are recomputed here, not stored: p = exp(scale q.k - lse).
 *
 *   dv_j = sum_i p_ij do_i        dp_ij = do_i . v_j        ds_ij = p_ij (dp_ij - do_i . o_i)
 *   dq_i = scale sum_j ds_ij k_j  dk_j = scale sum_i ds_ij q_i
 *
 * Layouts (contiguous float32, token-major as the packed trainer holds them): q, o, do, dq (c*n, H, D); k, v, dk,
 * dv (c*m, KV, D); lse (c, H, n). Query head h reads KV head h / (H / KV) (grouped-query attention).
 *
 * One task per (sequence, KV head): it owns its dk, dv rows and its query heads' dq rows, so tasks never share
 * an output and the result does not depend on the thread count. Within a task, queries go in blocks of QB rows
 * and keys in tiles of KT: a tile's scores are QB x KT registers (keys and values transposed, so KT keys are two
 * vectors), dq's QB rows stay in registers over a row block, dk and dv accumulate in the task's m x D buffers (L2).
 * Written with GCC/clang vector types (16 floats; a target without 512-bit vectors splits them). D is a
 * compile-time constant: one function per head size, torch's backward for the others. */
typedef float v16 __attribute__((vector_size(64)));
static inline v16 ld16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
typedef int32_t i16 __attribute__((vector_size(64)));

/* exp_le80 on 16 lanes, for x <= 0 (larger x is clamped to 0: the scores here are at most their logsumexp) */
static inline v16 exp16(v16 x) {
    x = (v16)(((i16)x & (x < 0.0f)));  /* x > 0 (rounding) -> 0 */
    x = (v16)(((i16)x & (x >= -87.0f)) | ((i16)((v16){0} - 87.0f) & (x < -87.0f)));
    v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v16 p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
    return p * (v16)e;
}

#define KT 16
#define QBMAX 4

/* floats of workspace one thread needs (the caller passes nt of them): kt, vt, dk, dv and the row dots */
long attn_work(long m, long n, long D) { return 4 * ((m + KT - 1) / KT * KT) * D + n; }

#ifdef _OPENMP
#include <omp.h>
static inline int omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int omp_thread(void) { return 0; }
#endif

static inline void attn_bwd_task(const float *q, const float *k, const float *v, const float *o, const float *dout,
                                 const float *lse, float *dq, float *dk, float *dv, long b, long kh, long n, long m,
                                 long H, long KV, float scale, float *buf, const int D, const int QB) {
    const int DV = D / 16;
    long g = H / KV, off = m - n, mp = (m + KT - 1) / KT * KT;
    float *kt = buf, *vt = kt + mp * D, *dkb = vt + mp * D, *dvb = dkb + mp * D, *di = dvb + mp * D;
    memset(buf, 0, sizeof(float) * (size_t)(4 * mp * D));
    for (long j = 0; j < m; j++) {  /* kt, vt: keys and values transposed (D x mp, zero past m) */
        const float *kr = k + ((b * m + j) * KV + kh) * D, *vr = v + ((b * m + j) * KV + kh) * D;
        for (int d = 0; d < D; d++) { kt[d * mp + j] = kr[d]; vt[d * mp + j] = vr[d]; }
    }
    for (long h = kh * g; h < (kh + 1) * g; h++) {
        const float *ls = lse + (b * H + h) * n;
        for (long i = 0; i < n; i++) {
            const float *orow = o + ((b * n + i) * H + h) * D, *dorow = dout + ((b * n + i) * H + h) * D;
            v16 acc = {0};
            for (int e = 0; e < DV; e++) acc += ld16(orow + 16 * e) * ld16(dorow + 16 * e);
            float t = 0.0f;
            for (int l = 0; l < 16; l++) t += acc[l];
            di[i] = t;
        }
        for (long i0 = 0; i0 < n; i0 += QB) {
            float qs[QBMAX][128] __attribute__((aligned(64))), dor[QBMAX][128] __attribute__((aligned(64)));
            float lr[QBMAX], dd[QBMAX];
            long lim[QBMAX], jend = -1;
            v16 dqr[QBMAX][8];
            for (int r = 0; r < QB; r++) {
                long i = i0 + r < n ? i0 + r : n - 1;  /* past the end: the last row again, all masked out */
                const float *qrow = q + ((b * n + i) * H + h) * D, *dorow = dout + ((b * n + i) * H + h) * D;
                for (int d = 0; d < D; d++) { qs[r][d] = qrow[d] * scale; dor[r][d] = dorow[d]; }
                for (int e = 0; e < DV; e++) dqr[r][e] = (v16){0};
                lr[r] = ls[i]; dd[r] = di[i];
                lim[r] = i0 + r < n ? i0 + r + off : -1;  /* the last key row r sees */
                jend = lim[r] > jend ? lim[r] : jend;
            }
            for (long j0 = 0; j0 <= jend; j0 += KT) {
                v16 s[QBMAX][KT / 16] = {{{0}}}, dp[QBMAX][KT / 16] = {{{0}}};
                for (int d = 0; d < D; d++) {
                    const float *kd = kt + d * mp + j0, *vd = vt + d * mp + j0;
                    for (int t = 0; t < KT / 16; t++) {
                        v16 kk = ld16(kd + 16 * t), vv = ld16(vd + 16 * t);
                        for (int r = 0; r < QB; r++) { s[r][t] += qs[r][d] * kk; dp[r][t] += dor[r][d] * vv; }
                    }
                }
                float P[QBMAX][KT] __attribute__((aligned(64))), DS[QBMAX][KT] __attribute__((aligned(64)));
                for (int r = 0; r < QB; r++)
                    for (int t = 0; t < KT / 16; t++) {
                        i16 idx = (i16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + (int)(j0 + 16 * t);
                        i16 seen = idx <= (int)lim[r];  /* all ones where key j0 + 16 t + lane is visible */
                        v16 p = exp16(s[r][t] - lr[r]);
                        p = (v16)((i16)p & seen);
                        st16(P[r] + 16 * t, p);
                        st16(DS[r] + 16 * t, p * (dp[r][t] - dd[r]));
                    }
                long jn = jend + 1 - j0 < KT ? jend + 1 - j0 : KT;
                {  /* dv += P^T do */
                    v16 x[QBMAX][8];
                    for (int r = 0; r < QB; r++) for (int e = 0; e < DV; e++) x[r][e] = ld16(dor[r] + 16 * e);
                    for (long jj = 0; jj < jn; jj++) {
                        float *row = dvb + (j0 + jj) * D;
                        for (int e = 0; e < DV; e++) {
                            v16 a = ld16(row + 16 * e), a2 = P[0][jj] * x[0][e];  /* two chains (QB is even) */
                            for (int r = 1; r + 1 < QB; r += 2) { a += P[r][jj] * x[r][e]; a2 += P[r + 1][jj] * x[r + 1][e]; }
                            a += P[QB - 1][jj] * x[QB - 1][e];
                            st16(row + 16 * e, a + a2);
                        }
                    }
                }
                {  /* dk += DS^T (scale q) */
                    v16 x[QBMAX][8];
                    for (int r = 0; r < QB; r++) for (int e = 0; e < DV; e++) x[r][e] = ld16(qs[r] + 16 * e);
                    for (long jj = 0; jj < jn; jj++) {
                        float *row = dkb + (j0 + jj) * D;
                        for (int e = 0; e < DV; e++) {
                            v16 a = ld16(row + 16 * e), a2 = DS[0][jj] * x[0][e];  /* two chains (QB is even) */
                            for (int r = 1; r + 1 < QB; r += 2) { a += DS[r][jj] * x[r][e]; a2 += DS[r + 1][jj] * x[r + 1][e]; }
                            a += DS[QB - 1][jj] * x[QB - 1][e];
                            st16(row + 16 * e, a + a2);
                        }
                    }
                }
                for (long jj = 0; jj < jn; jj++) {  /* dq += DS k */
                    const float *kr = k + ((b * m + j0 + jj) * KV + kh) * D;
                    for (int e = 0; e < DV; e++) {
                        v16 kv = ld16(kr + 16 * e);
                        for (int r = 0; r < QB; r++) dqr[r][e] += DS[r][jj] * kv;
                    }
                }
            }
            for (int r = 0; r < QB && i0 + r < n; r++) {
                float *dqrow = dq + ((b * n + i0 + r) * H + h) * D;
                for (int e = 0; e < DV; e++) st16(dqrow + 16 * e, dqr[r][e] * scale);
            }
        }
    }
    for (long j = 0; j < m; j++) {
        float *dkr = dk + ((b * m + j) * KV + kh) * D, *dvr = dv + ((b * m + j) * KV + kh) * D;
        memcpy(dkr, dkb + j * D, sizeof(float) * (size_t)D);
        memcpy(dvr, dvb + j * D, sizeof(float) * (size_t)D);
    }
}

#define ATTN_BWD(D, QB)                                                                                          \
void attn_bwd_##D(const float *q, const float *k, const float *v, const float *o, const float *dout,            \
                  const float *lse, float *dq, float *dk, float *dv, long c, long n, long m, long H, long KV,    \
                  float scale, float *work, int nt) {                                                            \
    long per = attn_work(m, n, D);                                                                               \
    _Pragma("omp parallel if (nt > 1 && c * KV > 1) num_threads(nt)")                                            \
    {                                                                                                            \
        float *buf = work + per * omp_thread();                                                                  \
        _Pragma("omp for schedule(dynamic)")                                                                     \
        for (long task = 0; task < c * KV; task++)                                                               \
            attn_bwd_task(q, k, v, o, dout, lse, dq, dk, dv, task / KV, task % KV, n, m, H, KV, scale, buf, D, QB); \
    }                                                                                                            \
}

ATTN_BWD(16, 4)
ATTN_BWD(32, 4)
ATTN_BWD(64, 4)
ATTN_BWD(128, 2)
