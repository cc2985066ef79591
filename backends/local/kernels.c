/* Fused elementwise kernels for the packed trainer (backends/local/packed.py), float32, CPU.
 *
 * Built on first use by backends/local/kernels.py (the system C compiler, -O3 -march=x86-64-v3 where the CPU
 * has it, -march=native with RUNNER_KERNELS_NATIVE=1; OpenMP when the compiler has it) and called through
 * ctypes on contiguous float32 tensors. Each kernel does in one pass over
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

/* ---------------------------------------------------------------- tree attention
 * Attention over a packed chunk made of segments. A segment is a run of query rows (a lone sequence, or one node
 * of a prefix tree) that sees every row of its ancestors' segments, in order, then its own rows causally: with m
 * keys in all and n own rows, its query i sees key j when j <= i + m - n. Every tensor is token-major over the
 * chunk's T rows (float32, contiguous), so no segment's rows are copied out or concatenated:
 *   q, o, do, dq (T, H, D); k, v, dk, dv (T, KV, D); lse (T, H), the row logsumexp of scale q.k.
 * seg (nseg x 4, int64): a segment's first row, its row count, and the first and end index of its ancestors in
 * anc (x 2, int64: an ancestor's first row and row count, root first). Query head h reads KV head h / (H / KV).
 *
 *   forward   s = scale q.k, lse = logsumexp_j s, o = sum_j softmax(s)_j v_j      (online, one pass over keys)
 *   backward  p = exp(s - lse) (recomputed, not stored), dv_j = sum_i p_ij do_i, dp_ij = do_i . v_j,
 *             ds_ij = p_ij (dp_ij - do_i . o_i), dq_i = scale sum_j ds_ij k_j, dk_j = scale sum_i ds_ij q_i
 *
 * A task is one segment for one KV head: it gathers the segment's keys and values into its workspace (keys and
 * values transposed, D x mp, so a tile of KT keys is one vector), then takes its query heads' rows in blocks
 * of QB: a tile's scores are QB vectors, the block's output (or dq) rows stay in registers. The forward's tasks
 * are independent, and so are the backward's, which leave each segment's share of dk and dv apart; a second
 * phase adds the shares up in segment order (an ancestor's rows get one from each descendant), so the result
 * does not depend on the thread count. Written with GCC/clang vector types (16 floats; a target without
 * 512-bit vectors splits them). D is a compile-time constant: one function per head size. */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
static inline v16 ld16(const float *p) { v16 v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16 v) { memcpy(p, &v, sizeof v); }
static const i16 LANE = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* exp_le80 on 16 lanes, for x <= 0 (larger x is taken as 0: scores here are at most their row's max) */
static inline v16 exp16(v16 x) {
    x = (v16)(((i16)x & (x < 0.0f)));
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

/* the larger of each lane; a row's largest lane (four shuffle steps) */
static inline v16 vmax16(v16 a, v16 b) { i16 gt = a > b; return (v16)(((i16)a & gt) | ((i16)b & ~gt)); }
#if defined(__clang__)
#define SHUF16(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#else
#define SHUF16(x, ...) __builtin_shuffle(x, (i16){__VA_ARGS__})
#endif
static inline float hmax16(v16 x) {
    x = vmax16(x, SHUF16(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    x = vmax16(x, SHUF16(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    x = vmax16(x, SHUF16(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    x = vmax16(x, SHUF16(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return x[0];
}

#define KT 16
#define QBMAX 4

static inline long round_kt(long m) { return (m + KT - 1) / KT * KT; }

#ifdef _OPENMP
#include <omp.h>
static inline int omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int omp_thread(void) { return 0; }
#endif

/* floats of workspace one thread needs (the caller passes nt of them), for segments of at most mmax keys and
 * nmax rows */
long tree_attn_work(long mmax, long nmax, long D) { return 5 * round_kt(mmax) * D + nmax; }

/* keys a segment sees: its ancestors' rows and its own */
static inline long seg_keys(const int64_t *sg, const int64_t *anc) {
    long m = sg[1];
    for (long a = sg[2]; a < sg[3]; a++) m += anc[2 * a + 1];
    return m;
}

/* Calls body(j, row) for the segment's key rows in order: j counts from 0, row is the chunk row. */
#define FOR_KEYS(sg, anc, j, row, ...)                                                                           \
    {                                                                                                            \
        long j = 0;                                                                                              \
        for (long a_ = (sg)[2]; a_ <= (sg)[3]; a_++) {                                                           \
            long r0_ = a_ < (sg)[3] ? (anc)[2 * a_] : (sg)[0], len_ = a_ < (sg)[3] ? (anc)[2 * a_ + 1] : (sg)[1]; \
            for (long row = r0_; row < r0_ + len_; row++, j++) { __VA_ARGS__ }                                        \
        }                                                                                                        \
    }

/* The segment's keys for KV head kh: kt (and vt) transposed, D x mp, zero past m; kr or vr row-major, m x D. */
static inline void gather(const float *k, const float *v, const int64_t *sg, const int64_t *anc, long KV, long kh,
                          long m, long mp, float *kt, float *vt, float *kr, float *vr, const int D) {
    FOR_KEYS(sg, anc, j, row, {
        const float *ks = k + (row * KV + kh) * D, *vs = v + (row * KV + kh) * D;
        for (int d = 0; d < D; d++) kt[d * mp + j] = ks[d];
        if (vt) for (int d = 0; d < D; d++) vt[d * mp + j] = vs[d];
        if (kr) memcpy(kr + j * D, ks, sizeof(float) * (size_t)D);
        if (vr) memcpy(vr + j * D, vs, sizeof(float) * (size_t)D);
    })
    for (int d = 0; d < D; d++)
        for (long j = m; j < mp; j++) {
            kt[d * mp + j] = 0.0f;
            if (vt) vt[d * mp + j] = 0.0f;
        }
}

/* The rows of one query block: q scaled (qs), do (dor, backward only), and the last key each row sees (-1 for
 * rows past the segment's end, which repeat its last row and are masked out). Returns the largest. */
static inline long load_rows(const float *q, const float *dout, long row0, long n, long i0, long h, long H,
                             float scale, long off, float qs[][128], float dor[][128], long *lim, const int D,
                             const int QB) {
    long jend = -1;
    for (int r = 0; r < QB; r++) {
        long i = i0 + r < n ? i0 + r : n - 1;
        const float *qrow = q + ((row0 + i) * H + h) * D;
        for (int d = 0; d < D; d++) qs[r][d] = qrow[d] * scale;
        if (dor) {
            const float *drow = dout + ((row0 + i) * H + h) * D;
            for (int d = 0; d < D; d++) dor[r][d] = drow[d];
        }
        lim[r] = i0 + r < n ? i0 + r + off : -1;
        jend = lim[r] > jend ? lim[r] : jend;
    }
    return jend;
}

static inline void fwd_task(const float *q, const float *k, const float *v, float *o, float *lse,
                            const int64_t *sg, const int64_t *anc, long H, long KV, long kh, float scale, float *buf,
                            const int D, const int QB) {
    const int DV = D / 16;
    long row0 = sg[0], n = sg[1], m = seg_keys(sg, anc), mp = round_kt(m), off = m - n, g = H / KV;
    float *kt = buf, *vr = kt + mp * D;
    gather(k, v, sg, anc, KV, kh, m, mp, kt, NULL, NULL, vr, D);
    for (long h = kh * g; h < (kh + 1) * g; h++)
        for (long i0 = 0; i0 < n; i0 += QB) {
            float qs[QBMAX][128] __attribute__((aligned(64)));
            float P[QBMAX][KT] __attribute__((aligned(64)));
            float mx[QBMAX];
            long lim[QBMAX];
            v16 acc[QBMAX][8], sum[QBMAX];  /* sum: per lane, added up at the end */
            long jend = load_rows(q, NULL, row0, n, i0, h, H, scale, off, qs, NULL, lim, D, QB);
            for (int r = 0; r < QB; r++) {
                mx[r] = -INFINITY;
                sum[r] = (v16){0};
                for (int e = 0; e < DV; e++) acc[r][e] = (v16){0};
            }
            const v16 ninf = (v16){0} - INFINITY;
            for (long j0 = 0; j0 <= jend; j0 += KT) {
                v16 s[QBMAX] = {{0}}, s2[QBMAX] = {{0}};  /* two chains per row: even and odd d */
                for (int d = 0; d < D; d += 2) {
                    v16 k0 = ld16(kt + d * mp + j0), k1 = ld16(kt + (d + 1) * mp + j0);
                    for (int r = 0; r < QB; r++) { s[r] += qs[r][d] * k0; s2[r] += qs[r][d + 1] * k1; }
                }
                for (int r = 0; r < QB; r++) {
                    if (lim[r] < j0) {  /* sees no key of this tile */
                        st16(P[r], (v16){0});
                        continue;
                    }
                    i16 seen = (LANE + (int)j0) <= (int)lim[r];
                    v16 sr = (v16)(((i16)(s[r] + s2[r]) & seen) | ((i16)ninf & ~seen));
                    float t = hmax16(sr);
                    if (t > mx[r]) {  /* a new row max: rescale what was summed so far */
                        float corr = expf(mx[r] - t);  /* 0 on the first tile (mx = -inf) */
                        sum[r] *= corr;
                        for (int e = 0; e < DV; e++) acc[r][e] *= corr;
                        mx[r] = t;
                    }
                    v16 p = (v16)((i16)exp16(sr - mx[r]) & seen);
                    sum[r] += p;
                    st16(P[r], p);
                }
                long jn = jend + 1 - j0 < KT ? jend + 1 - j0 : KT;
                for (long jj = 0; jj < jn; jj++) {
                    const float *vrow = vr + (j0 + jj) * D;
                    for (int e = 0; e < DV; e++) {
                        v16 vv = ld16(vrow + 16 * e);
                        for (int r = 0; r < QB; r++) acc[r][e] += P[r][jj] * vv;
                    }
                }
            }
            for (int r = 0; r < QB && i0 + r < n; r++) {
                float tot = 0.0f;
                for (int l = 0; l < 16; l++) tot += sum[r][l];
                float *orow = o + ((row0 + i0 + r) * H + h) * D, inv = 1.0f / tot;
                for (int e = 0; e < DV; e++) st16(orow + 16 * e, acc[r][e] * inv);
                lse[(row0 + i0 + r) * H + h] = mx[r] + logf(tot);
            }
        }
}

/* dst[jj] += sum_r w[r][jj] x[r] for the tile's jn key rows (m x D, row-major): dv's and dk's update. Two
 * chains per vector (QB is even), x's rows held in registers across the rows of dst. */
static inline void add_outer(float *dst, const float w[][KT], const float x[][128], long jn, const int D,
                             const int QB) {
    const int DV = D / 16;
    v16 xv[QBMAX][8];
    for (int r = 0; r < QB; r++)
        for (int e = 0; e < DV; e++) xv[r][e] = ld16(x[r] + 16 * e);
    for (long jj = 0; jj < jn; jj++) {
        float *row = dst + jj * D;
        for (int e = 0; e < DV; e++) {
            v16 a = ld16(row + 16 * e), a2 = w[0][jj] * xv[0][e];
            for (int r = 1; r + 1 < QB; r += 2) { a += w[r][jj] * xv[r][e]; a2 += w[r + 1][jj] * xv[r + 1][e]; }
            a += w[QB - 1][jj] * xv[QB - 1][e];
            st16(row + 16 * e, a + a2);
        }
    }
}

/* dkb, dvb (m x D each): this task's share of the dk, dv of the segment's key rows */
static inline void bwd_task(const float *q, const float *k, const float *v, const float *o, const float *dout,
                            const float *lse, float *dq, float *dkb, float *dvb, const int64_t *sg, const int64_t *anc,
                            long H, long KV, long kh, float scale, float *buf, const int D, const int QB) {
    const int DV = D / 16;
    long row0 = sg[0], n = sg[1], m = seg_keys(sg, anc), mp = round_kt(m), off = m - n, g = H / KV;
    float *kt = buf, *vt = kt + mp * D, *kr = vt + mp * D, *di = kr + mp * D;
    gather(k, v, sg, anc, KV, kh, m, mp, kt, vt, kr, NULL, D);
    memset(dkb, 0, sizeof(float) * (size_t)(m * D));
    memset(dvb, 0, sizeof(float) * (size_t)(m * D));
    for (long h = kh * g; h < (kh + 1) * g; h++) {
        for (long i = 0; i < n; i++) {  /* di = do . o per row */
            const float *orow = o + ((row0 + i) * H + h) * D, *drow = dout + ((row0 + i) * H + h) * D;
            v16 a = {0};
            for (int e = 0; e < DV; e++) a += ld16(orow + 16 * e) * ld16(drow + 16 * e);
            float t = 0.0f;
            for (int l = 0; l < 16; l++) t += a[l];
            di[i] = t;
        }
        for (long i0 = 0; i0 < n; i0 += QB) {
            float qs[QBMAX][128] __attribute__((aligned(64))), dor[QBMAX][128] __attribute__((aligned(64)));
            float P[QBMAX][KT] __attribute__((aligned(64))), DS[QBMAX][KT] __attribute__((aligned(64)));
            float lr[QBMAX], dd[QBMAX];
            long lim[QBMAX];
            v16 dqr[QBMAX][8];
            long jend = load_rows(q, dout, row0, n, i0, h, H, scale, off, qs, dor, lim, D, QB);
            for (int r = 0; r < QB; r++) {
                long i = i0 + r < n ? i0 + r : n - 1;
                lr[r] = lse[(row0 + i) * H + h];
                dd[r] = di[i];
                for (int e = 0; e < DV; e++) dqr[r][e] = (v16){0};
            }
            for (long j0 = 0; j0 <= jend; j0 += KT) {
                v16 s[QBMAX] = {{0}}, dp[QBMAX] = {{0}};
                for (int d = 0; d < D; d++) {
                    v16 kk = ld16(kt + d * mp + j0), vv = ld16(vt + d * mp + j0);
                    for (int r = 0; r < QB; r++) { s[r] += qs[r][d] * kk; dp[r] += dor[r][d] * vv; }
                }
                for (int r = 0; r < QB; r++) {
                    i16 seen = (LANE + (int)j0) <= (int)lim[r];
                    v16 p = (v16)((i16)exp16(s[r] - lr[r]) & seen);
                    st16(P[r], p);
                    st16(DS[r], p * (dp[r] - dd[r]));
                }
                long jn = jend + 1 - j0 < KT ? jend + 1 - j0 : KT;
                add_outer(dvb + j0 * D, P, dor, jn, D, QB);  /* dv += P^T do */
                add_outer(dkb + j0 * D, DS, qs, jn, D, QB);  /* dk += DS^T (scale q) */
                for (long jj = 0; jj < jn; jj++) {  /* dq += DS k */
                    const float *krow = kr + (j0 + jj) * D;
                    for (int e = 0; e < DV; e++) {
                        v16 kv = ld16(krow + 16 * e);
                        for (int r = 0; r < QB; r++) dqr[r][e] += DS[r][jj] * kv;
                    }
                }
            }
            for (int r = 0; r < QB && i0 + r < n; r++) {
                float *dqrow = dq + ((row0 + i0 + r) * H + h) * D;
                for (int e = 0; e < DV; e++) st16(dqrow + 16 * e, dqr[r][e] * scale);
            }
        }
    }
}

/* The backward. With part: in two phases. First every (segment, KV head) task, in parallel: its dq rows, and its
 * share of dk, dv for the segment's key rows into part (per segment s, from key offset koff[s]: KV blocks of
 * m_s x D for dk, then for dv). Then per KV head, segments in order, the shares are added into dk and dv (zero on
 * entry): an ancestor's rows get a share from each descendant. Without part (one thread, or part would be too
 * large): threads split the KV heads and each adds a segment's share as soon as it is formed, in the same
 * segment order. Either way every row's sum runs in the same order, so the bits do not depend on the thread
 * count or the form. */
#define TREE_ATTN(D, QB)                                                                                         \
void tree_attn_fwd_##D(const float *q, const float *k, const float *v, float *o, float *lse, const int64_t *seg, \
                       long nseg, const int64_t *anc, long H, long KV, float scale, float *work, long per, int nt) { \
    _Pragma("omp parallel if (nt > 1 && nseg * KV > 1) num_threads(nt)")                                        \
    {                                                                                                            \
        float *buf = work + per * omp_thread();                                                                  \
        _Pragma("omp for schedule(dynamic)")                                                                     \
        for (long t = 0; t < nseg * KV; t++)                                                                     \
            fwd_task(q, k, v, o, lse, seg + 4 * (t / KV), anc, H, KV, t % KV, scale, buf, D, QB);                \
    }                                                                                                            \
}                                                                                                                \
void tree_attn_bwd_##D(const float *q, const float *k, const float *v, const float *o, const float *dout,       \
                       const float *lse, float *dq, float *dk, float *dv, const int64_t *seg, long nseg,         \
                       const int64_t *anc, const int64_t *koff, float *part, long H, long KV, float scale,       \
                       float *work, long per, int nt) {                                                          \
    _Pragma("omp parallel if (nt > 1) num_threads(nt)")                                                          \
    {                                                                                                            \
        float *buf = work + per * omp_thread();                                                                  \
        if (part) {                                                                                              \
            _Pragma("omp for schedule(dynamic)")                                                                 \
            for (long t = 0; t < nseg * KV; t++) {                                                               \
                long s = t / KV, kh = t % KV, m = koff[s + 1] - koff[s];                                         \
                float *dkb = part + (2 * koff[s] * KV + kh * m) * D, *dvb = dkb + KV * m * D;                    \
                bwd_task(q, k, v, o, dout, lse, dq, dkb, dvb, seg + 4 * s, anc, H, KV, kh, scale, buf, D, QB);   \
            }                                                                                                    \
        }                                                                                                        \
        _Pragma("omp for schedule(static)")                                                                      \
        for (long kh = 0; kh < KV; kh++)                                                                         \
            for (long s = 0; s < nseg; s++) {                                                                    \
                long m = koff[s + 1] - koff[s];                                                                  \
                float *dkb = part ? part + (2 * koff[s] * KV + kh * m) * D : buf + per - 2 * m * D;              \
                float *dvb = part ? dkb + KV * m * D : dkb + m * D;                                              \
                if (!part)                                                                                       \
                    bwd_task(q, k, v, o, dout, lse, dq, dkb, dvb, seg + 4 * s, anc, H, KV, kh, scale, buf, D, QB); \
                FOR_KEYS(seg + 4 * s, anc, j, row, {                                                             \
                    float *dkr = dk + (row * KV + kh) * D, *dvr = dv + (row * KV + kh) * D;                      \
                    for (int d = 0; d < D; d++) { dkr[d] += dkb[j * D + d]; dvr[d] += dvb[j * D + d]; }          \
                })                                                                                               \
            }                                                                                                    \
    }                                                                                                            \
}

TREE_ATTN(16, 4)
TREE_ATTN(32, 4)
TREE_ATTN(64, 4)
TREE_ATTN(128, 4)
