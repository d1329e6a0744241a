/* Fused fp32 CPU kernels for training: RMSNorm and SwiGLU, forward and backward, and the
 * cross-entropy of a chunk of logits with its gradient.
 *
 * Compiled on the user's machine at first use by `difftrain/model/ckernels.py` (cc -O3
 * -march=native) and called through ctypes on contiguous fp32 tensors. Each kernel makes one pass
 * over memory where torch's eager operators make three to six, which is what these elementwise
 * steps cost in a CPU training step: their tensors come from the matrix products just before them
 * and do not fit in the cache, so every pass is a trip to DRAM.
 *
 * Work is split over `threads` OpenMP threads by rows. Reductions across rows (RMSNorm's weight
 * gradient) are summed in fixed blocks of rows, in block order, so the result does not depend on
 * the number of threads. exp is computed here (Cody-Waite reduction and the Cephes polynomial,
 * within 2 ulp of expf), in plain C that the compiler vectorises.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define API __attribute__((visibility("default")))

/* ---- threads ------------------------------------------------------------------------------ */

typedef void (*range_fn)(const void *args, int64_t begin, int64_t end);

/* fn over [0, n) in `threads` contiguous pieces, each a multiple of `grain` (the last excepted).
   OpenMP, so that the pieces run on torch's own worker threads: the process has one libgomp
   (torch's, which this library binds to when torch has loaded it), and threads of another pool
   would compete with torch's, which spin for a while after each of its parallel regions. */
static void parallel(range_fn fn, const void *args, int64_t n, int64_t grain, int threads) {
    if (grain < 1) grain = 1;
    int64_t units = (n + grain - 1) / grain;
    if (threads > units) threads = (int)units;
#ifdef _OPENMP
    if (threads > 1) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; t++) {
            int64_t b = units * t / threads * grain, e = units * (t + 1) / threads * grain;
            fn(args, b, e < n ? e : n);
        }
        return;
    }
#endif
    fn(args, 0, n);
}

/* ---- exp and sigmoid ------------------------------------------------------------------------ */

static inline float as_float(int32_t i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

/* e^x for x <= 0 (all callers): Cody-Waite reduction x = k·ln2 + r, |r| <= ln2/2, the Cephes
   degree-6 polynomial for e^r, and 2^k from exponent bits in two halves, so that results below
   the smallest normal float come out subnormal, as expf's do; below -104 (e^x under half the
   smallest subnormal, −inf included) it is 0. */
static inline float exp_nonpos(float x) {
    const float x0 = x;
    x = x < -104.0f ? -104.0f : x;
    float kf = x * 1.44269504088896341f;
    kf = (kf + 12582912.0f) - 12582912.0f; /* round to nearest */
    float r = x - kf * 0.693359375f;
    r = r - kf * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t k = (int32_t)kf, k1 = k >> 1, k2 = k - k1;
    y = y * as_float((k1 + 127) << 23) * as_float((k2 + 127) << 23);
    return x0 < -104.0f ? 0.0f : y;
}

/* σ(x) = 1/(1 + e^-x), from e^-|x| so that nothing overflows */
static inline float sigmoid(float x) {
    float e = exp_nonpos(x < 0.0f ? x : -x);
    float s = 1.0f / (1.0f + e);
    return x < 0.0f ? e * s : s;
}

/* ---- SwiGLU: h = silu(g) ⊙ u --------------------------------------------------------------- */

typedef struct {
    const float *g, *u, *gh;
    float *h, *gg, *gu;
} swiglu_args;

static void swiglu_fwd_range(const void *p, int64_t b, int64_t e) {
    const swiglu_args *a = p;
    const float *restrict g = a->g, *restrict u = a->u;
    float *restrict h = a->h;
    for (int64_t i = b; i < e; i++) {
        float x = g[i];
        h[i] = x * sigmoid(x) * u[i];
    }
}

/* ∂u = ∂h ⊙ silu(g);  ∂g = ∂h ⊙ u ⊙ σ(g)(1 + g(1 − σ(g))) */
static void swiglu_bwd_range(const void *p, int64_t b, int64_t e) {
    const swiglu_args *a = p;
    const float *restrict g = a->g, *restrict u = a->u, *restrict gh = a->gh;
    float *restrict gg = a->gg, *restrict gu = a->gu;
    for (int64_t i = b; i < e; i++) {
        float x = g[i], s = sigmoid(x), d = gh[i];
        gu[i] = d * (x * s);
        gg[i] = d * u[i] * (s * (1.0f + x * (1.0f - s)));
    }
}

API void difftrain_swiglu_fwd(const float *g, const float *u, float *h, int64_t n, int threads) {
    swiglu_args a = {g, u, NULL, h, NULL, NULL};
    parallel(swiglu_fwd_range, &a, n, 16384, threads);
}

API void difftrain_swiglu_bwd(const float *gh, const float *g, const float *u, float *gg, float *gu, int64_t n,
                              int threads) {
    swiglu_args a = {g, u, gh, NULL, gg, gu};
    parallel(swiglu_bwd_range, &a, n, 16384, threads);
}

/* ---- RMSNorm: y = w ⊙ x·r, r = 1/√(mean(x²) + ε) per row of D -------------------------------- */

typedef struct {
    const float *x, *w, *g, *r_in;
    float *y, *r, *gx, *partial;
    int64_t d, block;
    float eps;
} rms_args;

/* eight running sums of a row, as a vectorised loop keeps them, added pairwise */
static inline float sum8(const float acc[8]) {
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

static inline float row_rstd(const float *restrict x, int64_t d, float eps) {
    float acc[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= d; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += x[j + k] * x[j + k];
    for (; j < d; j++) acc[0] += x[j] * x[j];
    float v = sum8(acc) / (float)d + eps;
    /* 1/√v in float as torch.rsqrt computes it */
    return 1.0f / __builtin_sqrtf(v);
}

static void rms_fwd_range(const void *p, int64_t b, int64_t e) {
    const rms_args *a = p;
    const int64_t d = a->d;
    const float *restrict w = a->w;
    for (int64_t i = b; i < e; i++) {
        const float *restrict x = a->x + i * d;
        float *restrict y = a->y + i * d;
        float r = row_rstd(x, d, a->eps);
        a->r[i] = r;
        for (int64_t j = 0; j < d; j++) y[j] = (x[j] * r) * w[j];
    }
}

/* per row: x̂ = x·r, c = mean(g⊙w ⊙ x̂), ∂x = r·(g⊙w − x̂·c); ∂w accumulates g ⊙ x̂ over the rows of
   each block of `block` rows into partial[block index] */
static void rms_bwd_range(const void *p, int64_t b, int64_t e) {
    const rms_args *a = p;
    const int64_t d = a->d;
    const float *restrict w = a->w;
    for (int64_t blk = b / a->block; blk * a->block < e; blk++) {
        float *restrict gw = a->partial ? a->partial + blk * d : NULL;
        if (gw) memset(gw, 0, (size_t)d * sizeof(float));
        int64_t i1 = (blk + 1) * a->block < e ? (blk + 1) * a->block : e;
        for (int64_t i = blk * a->block; i < i1; i++) {
            const float *restrict x = a->x + i * d, *restrict g = a->g + i * d;
            const float r = a->r_in[i];
            float acc[8] = {0};
            int64_t j = 0;
            for (; j + 8 <= d; j += 8)
                for (int k = 0; k < 8; k++) acc[k] += g[j + k] * w[j + k] * (x[j + k] * r);
            for (; j < d; j++) acc[0] += g[j] * w[j] * (x[j] * r);
            float c = sum8(acc) / (float)d;
            if (a->gx) {
                float *restrict gx = a->gx + i * d;
                for (j = 0; j < d; j++) gx[j] = r * (g[j] * w[j] - (x[j] * r) * c);
            }
            if (gw)
                for (j = 0; j < d; j++) gw[j] += g[j] * (x[j] * r);
        }
    }
}

API void difftrain_rmsnorm_fwd(const float *x, const float *w, float *y, float *r, int64_t rows, int64_t d, float eps,
                               int threads) {
    rms_args a = {x, w, NULL, NULL, y, r, NULL, NULL, d, 1, eps};
    parallel(rms_fwd_range, &a, rows, 1, threads);
}

/* gx may be NULL (no input gradient), gw may be NULL (no weight gradient). Returns 0, or -1 when
   the memory for the partial weight gradients cannot be had. */
API int difftrain_rmsnorm_bwd(const float *g, const float *x, const float *w, const float *r, float *gx, float *gw,
                              int64_t rows, int64_t d, int threads) {
    /* blocks of rows fixed by the shape alone: at most 256 partial sums, at least 16 rows each */
    int64_t block = (rows + 255) / 256;
    if (block < 16) block = 16;
    int64_t blocks = (rows + block - 1) / block;
    float *partial = NULL;
    if (gw) {
        partial = malloc((size_t)(blocks > 0 ? blocks : 1) * (size_t)d * sizeof(float));
        if (!partial) return -1;
    }
    rms_args a = {x, w, g, r, NULL, NULL, gx, partial, d, block, 0.0f};
    parallel(rms_bwd_range, &a, rows, block, threads);
    if (gw) {
        memset(gw, 0, (size_t)d * sizeof(float));
        for (int64_t blk = 0; blk < blocks; blk++)
            for (int64_t j = 0; j < d; j++) gw[j] += partial[blk * d + j];
        free(partial);
    }
    return 0;
}

/* ---- cross-entropy rows: loss and ∂loss/∂logits, in place over the logits ----------------------- */

typedef struct {
    float *z, *loss;
    const int64_t *target;
    int64_t v, ignore;
    int grad;
    int bad; /* set when a target is outside [0, v) and not the ignore index */
} xent_args;

static void xent_range(const void *p, int64_t b, int64_t e) {
    xent_args *a = (xent_args *)p;
    const int64_t v = a->v;
    for (int64_t i = b; i < e; i++) {
        float *restrict z = a->z + i * v;
        const int64_t t = a->target[i];
        if (t == a->ignore || t < 0 || t >= v) {
            if (t != a->ignore) __atomic_store_n(&a->bad, 1, __ATOMIC_RELAXED);
            a->loss[i] = 0.0f;
            if (a->grad) memset(z, 0, (size_t)v * sizeof(float));
            continue;
        }
        float mx[16];
        for (int k = 0; k < 16; k++) mx[k] = z[0];
        int64_t j0 = 0;
        for (; j0 + 16 <= v; j0 += 16) /* sixteen running maxima, as a vector register keeps them */
            for (int k = 0; k < 16; k++) mx[k] = z[j0 + k] > mx[k] ? z[j0 + k] : mx[k];
        for (; j0 < v; j0++) mx[0] = z[j0] > mx[0] ? z[j0] : mx[0];
        float m = mx[0];
        for (int k = 1; k < 16; k++) m = mx[k] > m ? mx[k] : m;
        const float zt = z[t];
        float acc[16] = {0};
        int64_t j = 0;
        if (a->grad) { /* e^(z − m) written in place, then scaled: one exp per logit */
            for (; j + 16 <= v; j += 16)
                for (int k = 0; k < 16; k++) acc[k] += (z[j + k] = exp_nonpos(z[j + k] - m));
            for (; j < v; j++) acc[0] += (z[j] = exp_nonpos(z[j] - m));
        } else {
            for (; j + 16 <= v; j += 16)
                for (int k = 0; k < 16; k++) acc[k] += exp_nonpos(z[j + k] - m);
            for (; j < v; j++) acc[0] += exp_nonpos(z[j] - m);
        }
        for (int k = 8; k > 0; k /= 2)
            for (int q = 0; q < k; q++) acc[q] += acc[q + k];
        const float s = acc[0];
        a->loss[i] = logf(s) - (zt - m); /* −log softmax(z)[t]; zt − m is exact */
        if (a->grad) {
            const float inv = 1.0f / s;
            for (j = 0; j < v; j++) z[j] *= inv;
            z[t] -= 1.0f;
        }
    }
}

/* z: rows × v logits; target: one per row (ignore: no loss, no gradient). loss gets each row's
   −log softmax(z)[target]; with grad, z becomes ∂(Σ loss)/∂z = softmax(z) − onehot(target) (0 on
   ignored rows). Returns 0, or -1 if a target is outside [0, v) (its row counts as ignored). */
API int difftrain_xent(float *z, const int64_t *target, float *loss, int64_t rows, int64_t v, int64_t ignore,
                       int grad, int threads) {
    xent_args a = {z, loss, target, v, ignore, grad, 0};
    parallel(xent_range, &a, rows, 1, threads);
    return a.bad ? -1 : 0;
}
