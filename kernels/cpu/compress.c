/* dslaunch's 1-bit compression kernels (runtime/optim/compression.py): sign + pack + error feedback
 * in one pass, and the unpacking (times each row's scale, or the mean over the rows) in one pass.
 *
 * Built into the same library as optim.c (build.py, same flags). Rounding is the torch
 * reference's, operation by operation, so the results are bitwise equal:
 *   pack:   bit = x >= 0 (NaN: 0), first element in the high bit;
 *           error = (x + (bit ? -2 scale : 0)) + scale   (the reference: add(x, bit, alpha=-2s) + s);
 *   unpack: out = bit ? scale : -scale; the mean: ((s_0 + s_1) + s_2 ...) / rows, row order.
 * The scale itself (a norm, torch's reduction order) is computed by the caller with torch.
 *
 * Rows: the packed signs of row r start at rows + r * stride (a row of bytes, then whatever the
 * caller keeps behind it: the fp32 scale). The unpacking reads row r's scale from the 4 bytes right
 * behind its signs.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Below this many bytes of signs one thread does it all (a parallel region costs microseconds). */
#define PARALLEL_MIN_BYTES (1 << 14)

static inline int threads_for(int64_t bytes, int threads) {
    return bytes < PARALLEL_MIN_BYTES ? 1 : threads;
}

/* x: nrows * row_bytes * 8 floats; err: same size, overwritten with the compression error. */
void dsl_onebit_pack(const float *restrict x, float *restrict err, uint8_t *restrict rows, int64_t nrows,
                     int64_t row_bytes, int64_t stride, float scale, int threads) {
    const float minus_2s = -2.0f * scale; /* exact: a power-of-two multiple */
    const int nt = threads_for(nrows * row_bytes, threads);
    for (int64_t r = 0; r < nrows; r++) {
        const float *xr = x + 8 * r * row_bytes;
        float *er = err + 8 * r * row_bytes;
        uint8_t *out = rows + r * stride;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t b = 0; b < row_bytes; b++) {
            unsigned v = 0;
            for (int k = 0; k < 8; k++) {
                const float xi = xr[8 * b + k];
                const int bit = xi >= 0.0f;
                v |= (unsigned)bit << (7 - k);
                er[8 * b + k] = (xi + (bit ? minus_2s : 0.0f)) + scale;
            }
            out[b] = (uint8_t)v;
        }
    }
}

static inline float row_scale(const uint8_t *rows, int64_t r, int64_t row_bytes, int64_t stride) {
    float s;
    memcpy(&s, rows + r * stride + row_bytes, sizeof s);
    return s;
}

/* mean == 0: out (nrows * row_bytes * 8 floats) = each row's signs times its scale.
 * mean != 0: out (row_bytes * 8 floats) = the mean over the rows of sign times scale. */
void dsl_onebit_unpack(const uint8_t *restrict rows, int64_t nrows, int64_t row_bytes, int64_t stride,
                       float *restrict out, int mean, int threads) {
    const int nt = threads_for(nrows * row_bytes, threads);
    if (!mean) {
        for (int64_t r = 0; r < nrows; r++) {
            const float s = row_scale(rows, r, row_bytes, stride);
            const uint8_t *in = rows + r * stride;
            float *o = out + 8 * r * row_bytes;
#pragma omp parallel for schedule(static) num_threads(nt)
            for (int64_t b = 0; b < row_bytes; b++)
                for (int k = 0; k < 8; k++)
                    o[8 * b + k] = (in[b] >> (7 - k)) & 1u ? s : -s;
        }
        return;
    }
    /* the mean: row by row into out (each pass a simple loop that vectorises), in row order,
     * starting from 0 as the reference (0 + v: -0.0 becomes +0.0) */
    const float count = (float)nrows;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < 8 * row_bytes; i++)
        out[i] = 0.0f;
    for (int64_t r = 0; r < nrows; r++) {
        const float s = row_scale(rows, r, row_bytes, stride);
        const uint8_t *in = rows + r * stride;
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t b = 0; b < row_bytes; b++)
            for (int k = 0; k < 8; k++)
                out[8 * b + k] += (in[b] >> (7 - k)) & 1u ? s : -s;
    }
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t i = 0; i < 8 * row_bytes; i++)
        out[i] = out[i] / count;
}
