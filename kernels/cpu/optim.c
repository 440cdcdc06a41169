/* dslaunch's CPU optimizer kernels: Adam/AdamW, Adagrad, Lion and the two passes of the fused
 * offloaded step, over flat contiguous fp32 tensors (gradients also bf16/fp16).
 *
 * Built by build.py (-O3 -march=native -ffp-contract=off -fno-math-errno -fno-trapping-math
 * -fopenmp): the loops are written so that gcc auto-vectorises them (straight-line bodies, type
 * choices hoisted out of the loops by always-inlined helpers taking constant dtypes); a call takes
 * a table of tensors and OpenMP splits their elements, in fixed blocks, among the threads.
 * Rounding follows torch's vectorised CPU kernels step by step: the compiler fuses no multiply-add
 * by itself (-ffp-contract=off), and fmaf stands exactly where torch's kernels round once (lerp,
 * the second moment, L2 decay, Adagrad's sum), so the results equal torch's fused optimizers bit
 * for bit on an AVX2 machine.
 * 16-bit conversions are written with integer and float operations (exact, round to nearest
 * even), so that the fp16 and bf16 variants vectorise as well.
 *
 * Dtype codes: 0 = fp32, 1 = bf16, 2 = fp16 for gradients; for parameter copies 0 = no copy.
 */
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* Elements per OpenMP block (the unit the threads' shares are cut in): 64 KiB of fp32 per tensor. */
#define BLOCK 16384
/* Below this many elements one thread does it all (a parallel region costs microseconds). */
#define PARALLEL_MIN (1 << 16)

enum { F32 = 0, BF16 = 1, F16 = 2 };

ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = { (uint32_t)h << 16 };
    return x.f;
}

/* Round to nearest even, as torch's float -> bfloat16; NaN stays a (quiet) NaN. */
ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } x = { f };
    uint32_t rounded = (x.u + 0x7FFFu + ((x.u >> 16) & 1u)) >> 16;
    return (uint16_t)(f != f ? 0x7FC0u : rounded);
}

/* IEEE half <-> float with integer and float operations only, so that the loops vectorise
 * (gcc 12 has no vector _Float16 without AVX512-FP16). Exact, as a hardware conversion: */

/* half -> float: shift exponent and mantissa into place, then one multiply by 2^112 rebiases the
 * exponent and normalises subnormals exactly; inf/NaN keep an all-ones exponent. */
ALWAYS_INLINE float f16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } x = { (uint32_t)(h & 0x7FFFu) << 13 }, magic = { 0x77800000u }; /* 2^112 */
    float scaled = x.f * magic.f;
    union { float f; uint32_t u; } r = { scaled };
    uint32_t special = x.u | 0x7F800000u;                 /* inf/NaN: max exponent, same payload */
    uint32_t bits = (h & 0x7C00u) == 0x7C00u ? special : r.u;
    union { uint32_t u; float f; } out = { bits | ((uint32_t)(h & 0x8000u) << 16) };
    return out.f;
}

/* float -> half, round to nearest even: subnormal results by an exact float add that lets the
 * FPU round, normal ones by adding the rounding bias to the bits, overflow to inf, NaN quiet. */
ALWAYS_INLINE uint16_t f32_to_f16(float f) {
    union { float f; uint32_t u; } x = { f };
    const uint32_t sign = x.u & 0x80000000u, a = x.u ^ sign;
    union { uint32_t u; float f; } mag = { a }, denorm_magic = { ((127u - 15u) + (23u - 10u) + 1u) << 23 };
    union { float f; uint32_t u; } sub = { mag.f + denorm_magic.f };
    uint32_t sub_bits = sub.u - denorm_magic.u;
    uint32_t norm_bits = (a + ((uint32_t)(15 - 127) << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    uint32_t big = a > 0x7F800000u ? 0x7E00u : 0x7C00u;
    uint32_t bits = a >= ((127u + 16u) << 23) ? big : (a < (113u << 23) ? sub_bits : norm_bits);
    return (uint16_t)(bits | (sign >> 16));
}

ALWAYS_INLINE float load_grad(const void *g, ptrdiff_t i, const int dtype) {
    if (dtype == BF16) return bf16_to_f32(((const uint16_t *)g)[i]);
    if (dtype == F16) return f16_to_f32(((const uint16_t *)g)[i]);
    return ((const float *)g)[i];
}

ALWAYS_INLINE void store_copy(void *out, ptrdiff_t i, float value, const int dtype) {
    if (dtype == BF16) ((uint16_t *)out)[i] = f32_to_bf16(value);
    else if (dtype == F16) ((uint16_t *)out)[i] = f32_to_f16(value);
}

/* torch's vectorised lerp: the form depends on the weight (both ends exact) and it rounds once
 * (a fused multiply-add), so fmaf here; fmaf is exact whatever -ffp-contract says. */
ALWAYS_INLINE float lerp(float self, float end, float weight) {
    return weight < 0.5f ? fmaf(weight, end - self, self) : fmaf(weight - 1.0f, end - self, end);
}

/* ------------------------------------------------------------------ the frame every kernel shares */

/* The tensors of one elementwise kernel call, n elements each: the fp32 parameters, the gradient
 * (dtype gdt), up to two fp32 states (NULL when absent) and the 16-bit copy (dtype odt, 0 = none). */
typedef struct {
    float *p;
    const void *g;
    float *s1, *s2;
    void *out;
    const void *args;      /* the kernel's own arguments (AdamArgs, AdagradArgs, LionArgs) */
    int divides;           /* gradients are divided (grad_div != 1): a loop of its own, since gcc
                              would otherwise divide every element and blend (vdivps is slow) */
} Job;

typedef void (*RangeFn)(const Job *job, ptrdiff_t lo, ptrdiff_t hi);

/* One tensor of a call: the addresses of p, g, s1, s2, out (0 = absent) and its element count,
 * as Python's ctypes writes them. A call takes a table of rows with the same dtypes. */
typedef struct { int64_t p, g, s1, s2, out, n; } Row;

/* One OpenMP frame for all elementwise kernels: the rows' fixed blocks, laid end to end, split
 * in contiguous shares, one per thread. Each thread touches the same elements every step (so
 * first-touch placement stays put), and a list of small tensors is one parallel region and one
 * Python call, not one each. */
static void for_rows(RangeFn fn, const Job *job, const Row *rows, int64_t count, int threads) {
    int64_t blocks = 0, numel = 0;
    for (int64_t r = 0; r < count; r++) {
        blocks += (rows[r].n + BLOCK - 1) / BLOCK;
        numel += rows[r].n;
    }
    #pragma omp parallel num_threads(threads) if (numel >= PARALLEL_MIN)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t end = blocks * (t + 1) / nt;
        int64_t b = blocks * t / nt, r = 0, first = 0;  /* first: the global index of row r's block 0 */
        while (b < end) {
            const int64_t n = rows[r].n, row_blocks = (n + BLOCK - 1) / BLOCK;
            if (b >= first + row_blocks) {
                first += row_blocks, r++;
                continue;
            }
            Job j = *job;
            j.p = (float *)(intptr_t)rows[r].p, j.g = (const void *)(intptr_t)rows[r].g;
            j.s1 = (float *)(intptr_t)rows[r].s1, j.s2 = (float *)(intptr_t)rows[r].s2;
            j.out = (void *)(intptr_t)rows[r].out;
            /* The thread's blocks of this row in one call (elementwise: the same result), so a
             * loop's setup and remainder come once per row, not once per block. */
            const int64_t stop = end < first + row_blocks ? end : first + row_blocks;
            const ptrdiff_t lo = (b - first) * BLOCK, last = (stop - first) * BLOCK, hi = last < n ? last : n;
            fn(&j, lo, hi);
            b = stop;
        }
    }
}

/* A kernel's loop, RANGE(p, g, s1, s2, out, args, lo, hi, gdt, odt, divides) with restrict
 * pointers, instantiated once per (gradient dtype, copy dtype, divides) so that no dtype test or
 * division stays in a loop that does not need it; NAME[gdt * 3 + odt] is the instance. */
#define INSTANCE(RANGE, G, O)                                                                     \
    static void RANGE##_##G##_##O(const Job *j, ptrdiff_t lo, ptrdiff_t hi) {                     \
        if (j->divides) RANGE(j->p, j->g, j->s1, j->s2, j->out, j->args, lo, hi, G, O, 1);        \
        else RANGE(j->p, j->g, j->s1, j->s2, j->out, j->args, lo, hi, G, O, 0);                   \
    }
#define INSTANCES(NAME, RANGE)                                                                    \
    INSTANCE(RANGE, F32, F32) INSTANCE(RANGE, F32, BF16) INSTANCE(RANGE, F32, F16)                \
    INSTANCE(RANGE, BF16, F32) INSTANCE(RANGE, BF16, BF16) INSTANCE(RANGE, BF16, F16)             \
    INSTANCE(RANGE, F16, F32) INSTANCE(RANGE, F16, BF16) INSTANCE(RANGE, F16, F16)                \
    static const RangeFn NAME[9] = {                                                              \
        RANGE##_F32_F32, RANGE##_F32_BF16, RANGE##_F32_F16, RANGE##_BF16_F32, RANGE##_BF16_BF16,  \
        RANGE##_BF16_F16, RANGE##_F16_F32, RANGE##_F16_BF16, RANGE##_F16_F16 };

#define RANGE_PARAMS                                                                              \
    float *restrict p, const void *restrict g, float *restrict s1, float *restrict s2,            \
    void *restrict out, const void *args, ptrdiff_t lo, ptrdiff_t hi, const int gdt, const int odt,      \
    const int divides

/* The gradient as the update sees it: times grad_mul (clip / loss scale), then divided by
 * grad_div (torch's grad_scale: torch divides, and dividing here rounds the same). */
ALWAYS_INLINE float scaled_grad(const void *g, ptrdiff_t i, const int gdt, float grad_mul, float grad_div,
                                const int divides) {
    float grad = load_grad(g, i, gdt);
    if (grad_mul != 1.0f) grad = grad * grad_mul;
    if (divides) grad = grad / grad_div;
    return grad;
}

/* ------------------------------------------------------------------------------------ Adam */

/* Coefficients such as 1 - beta1 come computed in double and rounded once (as torch does):
 * 1.0f - 0.9f is not the float nearest to 0.1. */
typedef struct {
    float beta1, one_m_beta1, beta2, one_m_beta2, eps, weight_decay;
    float lr_wd;           /* lr * weight_decay */
    float decay;           /* 1 - lr * weight_decay */
    float step_size;       /* lr / (1 - beta1^t), or lr without bias correction */
    float bc2_sqrt;        /* sqrt(1 - beta2^t), or 1 */
    float bc2_rsqrt;       /* 1 / sqrt(1 - beta2^t), or 1 */
    float grad_mul, grad_div;
    int l2, decoupled;     /* weight decay added to the gradient (Adam), or to the parameter (AdamW) */
} AdamArgs;

/* s1 = exp_avg, s2 = exp_avg_sq. */
ALWAYS_INLINE void adam_range(RANGE_PARAMS) {
    const AdamArgs a = *(const AdamArgs *)args;
    for (ptrdiff_t i = lo; i < hi; i++) {
        float grad = scaled_grad(g, i, gdt, a.grad_mul, a.grad_div, divides);
        float param = p[i];
        if (a.l2) grad = fmaf(param, a.weight_decay, grad);
        float mi = lerp(s1[i], grad, a.one_m_beta1);
        float vi = fmaf(a.one_m_beta2 * grad, grad, s2[i] * a.beta2);
        float denom = sqrtf(vi) / a.bc2_sqrt + a.eps;
        if (a.decoupled) param = param * a.decay;
        /* The association torch's fused Adam uses: (-step_size * m) / denom. */
        param = param + (-a.step_size * mi) / denom;
        s1[i] = mi;
        s2[i] = vi;
        p[i] = param;
        store_copy(out, i, param, odt);
    }
}
INSTANCES(ADAM, adam_range)

/* DeepSpeed's association (its DeepSpeedCPUAdam's AVX loop): the moments as multiply + fma, the
 * second-moment correction a multiply folded into the eps add, one division, and the weight decay
 * and the step each one fma into the parameter. One division per element instead of two is ~6%
 * of the step (it sits closer to the memory bound); the error against fp64 stays within
 * DeepSpeed's own. */
ALWAYS_INLINE void adam_ds_range(RANGE_PARAMS) {
    const AdamArgs a = *(const AdamArgs *)args;
    /* Unrolled: each iteration reads and writes longer runs of every stream (as DeepSpeed's loop,
     * 8 vectors per stream), 4-5% faster on 20M elements than the plain vectorised loop. */
    #pragma GCC unroll 16
    for (ptrdiff_t i = lo; i < hi; i++) {
        float grad = scaled_grad(g, i, gdt, a.grad_mul, a.grad_div, divides);
        float param = p[i];
        if (a.l2) grad = fmaf(param, a.weight_decay, grad);
        float mi = fmaf(grad, a.one_m_beta1, s1[i] * a.beta1);
        float vi = fmaf(grad * grad, a.one_m_beta2, s2[i] * a.beta2);
        float denom = fmaf(sqrtf(vi), a.bc2_rsqrt, a.eps);
        if (a.decoupled) param = fmaf(param, -a.lr_wd, param);
        param = fmaf(mi / denom, -a.step_size, param);
        s1[i] = mi;
        s2[i] = vi;
        p[i] = param;
        store_copy(out, i, param, odt);
    }
}
INSTANCES(ADAM_DS, adam_ds_range)

/* One Adam/AdamW step of every row (s1 = exp_avg, s2 = exp_avg_sq); out (dtype odt, 0 = none)
 * receives the new params. deepspeed: DeepSpeed's association (adam_ds_range), else torch's. */
void dsl_adam(const Row *rows, int64_t count, int gdt, int odt, float beta1, float one_m_beta1, float beta2,
              float one_m_beta2, float eps, float weight_decay, float lr_wd, float decay, float step_size,
              float bc2_sqrt, float bc2_rsqrt, float grad_mul, float grad_div, int adamw_mode, int deepspeed,
              int threads) {
    const int decays = weight_decay != 0.0f, l2 = decays && !adamw_mode, decoupled = decays && adamw_mode;
    const AdamArgs a = { beta1, one_m_beta1, beta2, one_m_beta2, eps, weight_decay, lr_wd, decay, step_size,
                         bc2_sqrt, bc2_rsqrt, grad_mul, grad_div, l2, decoupled };
    const Job job = { NULL, NULL, NULL, NULL, NULL, &a, grad_div != 1.0f };
    for_rows((deepspeed ? ADAM_DS : ADAM)[gdt * 3 + odt], &job, rows, count, threads);
}

/* --------------------------------------------------------------------------------- Adagrad */

typedef struct { float clr, eps, weight_decay, grad_mul, grad_div; } AdagradArgs;

/* torch's Adagrad: g += wd * p; sum += g^2; p += (-clr * g) / (sqrt(sum) + eps). s1 = sum. */
ALWAYS_INLINE void adagrad_range(RANGE_PARAMS) {
    const AdagradArgs a = *(const AdagradArgs *)args;
    (void)s2;
    for (ptrdiff_t i = lo; i < hi; i++) {
        float grad = scaled_grad(g, i, gdt, a.grad_mul, a.grad_div, divides);
        float param = p[i];
        if (a.weight_decay != 0.0f) grad = fmaf(param, a.weight_decay, grad);
        float s = fmaf(grad, grad, s1[i]);
        s1[i] = s;
        param = param + (-a.clr * grad) / (sqrtf(s) + a.eps);
        p[i] = param;
        store_copy(out, i, param, odt);
    }
}
INSTANCES(ADAGRAD, adagrad_range)

void dsl_adagrad(const Row *rows, int64_t count, int gdt, int odt, float clr, float eps, float weight_decay,
                 float grad_mul, float grad_div, int threads) {
    const AdagradArgs a = { clr, eps, weight_decay, grad_mul, grad_div };
    const Job job = { NULL, NULL, NULL, NULL, NULL, &a, grad_div != 1.0f };
    for_rows(ADAGRAD[gdt * 3 + odt], &job, rows, count, threads);
}

/* ------------------------------------------------------------------------------------ Lion */

/* c = lerp(m, g, 1 - beta1); p = p * decay - lr * sign(c); m = lerp(m, g, 1 - beta2), with
 * decay = 1 - lr * weight_decay (1 - beta and decay computed in double by the caller). s1 = m. */
typedef struct { float lr, one_m_beta1, one_m_beta2, decay, grad_mul; } LionArgs;

ALWAYS_INLINE void lion_range(RANGE_PARAMS) {
    const LionArgs a = *(const LionArgs *)args;
    (void)s2, (void)divides;
    for (ptrdiff_t i = lo; i < hi; i++) {
        float grad = scaled_grad(g, i, gdt, a.grad_mul, 1.0f, 0);
        float mi = s1[i];
        float c = lerp(mi, grad, a.one_m_beta1);
        float sign = (float)(c > 0.0f) - (float)(c < 0.0f);
        float param = p[i];
        if (a.decay != 1.0f) param = param * a.decay;
        param = param - a.lr * sign;
        p[i] = param;
        s1[i] = lerp(mi, grad, a.one_m_beta2);
        store_copy(out, i, param, odt);
    }
}
INSTANCES(LION, lion_range)

void dsl_lion(const Row *rows, int64_t count, int gdt, int odt, float lr, float one_m_beta1,
              float one_m_beta2, float decay, float grad_mul, int threads) {
    const LionArgs a = { lr, one_m_beta1, one_m_beta2, decay, grad_mul };
    const Job job = { NULL, NULL, NULL, NULL, NULL, &a, 0 };
    for_rows(LION[gdt * 3 + odt], &job, rows, count, threads);
}

/* ---------------------------------------------------------------- streaming bandwidth reference */

/* The bound an update kernel is measured against: the same frame, threads and memory traffic
 * (read p, g and the states present, write p and the states in place, write the 16-bit copy),
 * with one add per tensor instead of the optimizer's arithmetic. */
ALWAYS_INLINE void stream_range(RANGE_PARAMS) {
    (void)args, (void)divides;
    for (ptrdiff_t i = lo; i < hi; i++) {
        float x = load_grad(g, i, gdt);
        float param = p[i] + x;
        p[i] = param;
        if (s1) s1[i] = s1[i] + x;
        if (s2) s2[i] = s2[i] + x;
        store_copy(out, i, param, odt);
    }
}
INSTANCES(STREAM, stream_range)

void dsl_stream(const Row *rows, int64_t count, int gdt, int odt, int threads) {
    const Job job = { NULL, NULL, NULL, NULL, NULL, NULL, 0 };
    for_rows(STREAM[gdt * 3 + odt], &job, rows, count, threads);
}

/* ------------------------------------------------------------- pass 1 of the offloaded step */

/* Sum of (grad * grad_mul)^2 in double, or (square = 0, the streaming reference of this pass)
 * the plain sum: the same reads with one add. */
ALWAYS_INLINE double sum_range(const void *restrict g, ptrdiff_t lo, ptrdiff_t hi, float grad_mul,
                               const int gdt, const int square) {
    double s = 0.0;
    #pragma omp simd reduction(+ : s)
    for (ptrdiff_t i = lo; i < hi; i++) {
        double x = (double)(load_grad(g, i, gdt) * grad_mul);
        s += square ? x * x : x;
    }
    return s;
}

/* Instances per (gradient dtype, square), picked before the OpenMP region: a constant passed
 * into the region would reach its outlined body as a runtime value (and one variant would not
 * vectorise). */
typedef double (*SumFn)(const void *g, ptrdiff_t lo, ptrdiff_t hi, float grad_mul);
#define SUM_INSTANCE(G, SQ)                                                                       \
    static double sum_##G##_##SQ(const void *g, ptrdiff_t lo, ptrdiff_t hi, float grad_mul) {     \
        return sum_range(g, lo, hi, grad_mul, G, SQ);                                             \
    }
SUM_INSTANCE(F32, 0) SUM_INSTANCE(BF16, 0) SUM_INSTANCE(F16, 0)
SUM_INSTANCE(F32, 1) SUM_INSTANCE(BF16, 1) SUM_INSTANCE(F16, 1)
static const SumFn SUM[2][3] = { { sum_F32_0, sum_BF16_0, sum_F16_0 }, { sum_F32_1, sum_BF16_1, sum_F16_1 } };

/* The reduction frame: fixed blocks as in for_rows, partial sums added by OpenMP. The reduction
 * order is fixed for a given thread count. */
static double sum_blocks(SumFn fn, const void *g, int64_t n, float grad_mul, int threads) {
    const ptrdiff_t blocks = (n + BLOCK - 1) / BLOCK;
    double total = 0.0;
    #pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_MIN) reduction(+ : total)
    for (ptrdiff_t b = 0; b < blocks; b++) {
        const ptrdiff_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        total += fn(g, lo, hi, grad_mul);
    }
    return total;
}

/* The sum of squares of the unscaled gradients (grad * grad_mul), in double: inf or NaN exactly
 * when a gradient is inf/NaN (a finite fp32 squared stays finite in double), so the overflow
 * check costs nothing beyond the norm. */
double dsl_grad_sumsq(const void *g, int gdt, int64_t n, float grad_mul, int threads) {
    return sum_blocks(SUM[1][gdt], g, n, grad_mul, threads);
}

/* The streaming reference of pass 1: read every gradient once, add them up. */
double dsl_stream_read(const void *g, int gdt, int64_t n, int threads) {
    return sum_blocks(SUM[0][gdt], g, n, 1.0f, threads);
}

/* ------------------------------------------------- the gradient norm folded into its writes */

/* One block of dsl_fold_sumsq: dst = src (mode 1) or dst += src (mode 2), or nothing (mode 0),
 * then the sum of squares of dst's block while it is in cache. */
ALWAYS_INLINE double fold_block(float *restrict dst, const void *restrict src, ptrdiff_t lo, ptrdiff_t hi,
                                const int sdt, const int mode) {
    if (mode == 1)
        for (ptrdiff_t i = lo; i < hi; i++) dst[i] = load_grad(src, i, sdt);
    else if (mode == 2)
        for (ptrdiff_t i = lo; i < hi; i++) dst[i] = dst[i] + load_grad(src, i, sdt);
    return sum_F32_1(dst, lo, hi, 1.0f);
}

typedef double (*FoldFn)(float *dst, const void *src, ptrdiff_t lo, ptrdiff_t hi);
#define FOLD_INSTANCE(G, M)                                                                       \
    static double fold_##G##_##M(float *dst, const void *src, ptrdiff_t lo, ptrdiff_t hi) {      \
        return fold_block(dst, src, lo, hi, G, M);                                                \
    }
FOLD_INSTANCE(F32, 0) FOLD_INSTANCE(F32, 1) FOLD_INSTANCE(BF16, 1) FOLD_INSTANCE(F16, 1)
FOLD_INSTANCE(F32, 2) FOLD_INSTANCE(BF16, 2) FOLD_INSTANCE(F16, 2)
static const FoldFn FOLD[3][3] = { { fold_F32_0, fold_F32_0, fold_F32_0 },
                                   { fold_F32_1, fold_BF16_1, fold_F16_1 },
                                   { fold_F32_2, fold_BF16_2, fold_F16_2 } };

/* Write a gradient into fp32 dst (mode 1: copy src, 2: add src, 0: leave dst) and return the sum of
 * squares of dst's n elements in double. The order is fixed by n alone: each BLOCK's sum in its
 * own partial, the partials added in block order after the parallel region, so the result is the
 * same bits at any thread count and whether the write was fused or not (mode 0 on the written
 * dst). The partials live on the stack up to 256 blocks (4M elements), else one malloc. */
double dsl_fold_sumsq(float *dst, const void *src, int sdt, int64_t n, int mode, int threads) {
    const ptrdiff_t blocks = (n + BLOCK - 1) / BLOCK;
    double stack[256], *partial = blocks <= 256 ? stack : (double *)malloc((size_t)blocks * sizeof(double));
    if (partial == NULL) return NAN;
    const FoldFn fn = FOLD[mode][sdt];
    #pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_MIN)
    for (ptrdiff_t b = 0; b < blocks; b++) {
        const ptrdiff_t lo = b * BLOCK, hi = lo + BLOCK < n ? lo + BLOCK : n;
        partial[b] = fn(dst, src, lo, hi);
    }
    double total = 0.0;
    for (ptrdiff_t b = 0; b < blocks; b++) total += partial[b];
    if (partial != stack) free(partial);
    return total;
}

/* Copy of fp32 params to bf16/fp16 (for a step that was skipped, or an initial copy). */
void dsl_copy_out(const float *restrict p, void *restrict out, int odt, int64_t n, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads) if (n >= PARALLEL_MIN)
    for (ptrdiff_t i = 0; i < n; i++) {
        if (odt == BF16) ((uint16_t *)out)[i] = f32_to_bf16(p[i]);
        else ((uint16_t *)out)[i] = f32_to_f16(p[i]);
    }
}

/* Asks the kernel to back the whole 2 MiB pages inside [addr, addr + bytes) with huge pages, for
 * memory not yet touched (a fresh state tensor): a streaming update over 4 KiB pages spends ~4% of
 * its time on TLB misses per tensor so placed. Returns madvise's result (0, or -1: no THP here). */
int dsl_advise_huge(void *addr, int64_t bytes) {
    const uintptr_t huge = (uintptr_t)2 << 20, start = (uintptr_t)addr, end = start + (uintptr_t)bytes;
    const uintptr_t lo = (start + huge - 1) & ~(huge - 1), hi = end & ~(huge - 1);
    return hi > lo ? madvise((void *)lo, hi - lo, MADV_HUGEPAGE) : 0;
}
