/* The sampler's random draw, for CPUs: one token per row of float32 logits
 * from softmax(x / temperature), after top-k, top-p and min-p, as
 * servelm/engine/sampler.py's PyTorch stages and row_blocks.inverse_cdf
 * draw it, without writing a [rows, vocab] distribution (nor sorting a
 * row: a top-p request's topk() over 32 x 49152 logits alone took 6 ms).
 *
 * A row's weights are w = exp((x - largest) / T), its largest token's 1.
 * top-k keeps the logits at least the k-th largest (ties kept); min-p the
 * weights at least min_p; top-p the weights at least v, the largest value
 * whose weights of at least v (among top-k's) sum to top_p times their
 * total (the smallest set of most likely tokens reaching p, ties with its
 * least likely kept). The draw: the first index whose running sum of kept
 * weights exceeds u times their total, found from sums of blocks of
 * DRAW_BLOCK columns, then a running sum inside the block found; a weight
 * of 0 (a banned token, -inf) adds nothing, so it is never the one found.
 * The draw also gives each row's largest logit and logsum, as
 * log_softmax_stats would (the sampler then skips that pass over the row).
 * And a request's top logprobs: each row's k largest logits (top_values).
 * Built at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <float.h>
#include <math.h>

#include "bf16.h"
#include "kernels.h"
#include "vexp.h"

#define DRAW_BLOCK 1024
#define HEAP_ON_STACK 256

/* The largest of x[0..V), NaN if it holds one. */
static float row_largest(const float *x, int64_t V) {
    int64_t i = 0;
    float m = -INFINITY;
#ifdef __AVX512F__
    __m512 vm = _mm512_set1_ps(-INFINITY);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff), inf_bits = _mm512_set1_epi32(0x7f800000);
    __mmask16 nan = 0;
    for (; i + 16 <= V; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), inf_bits);
        vm = _mm512_max_ps(vm, v);
    }
    if (nan) return NAN;
    m = _mm512_reduce_max_ps(vm);
#endif
    for (; i < V; i++) {
        if (f32_is_nan(x[i])) return NAN;
        m = x[i] > m ? x[i] : m;
    }
    return m;
}

/* w[i] = exp((x[i] - m) * scale) for i in [0, n), 0 for an x[i] of -inf, and their sum (w NULL: the sum
 * alone). */
static double weights(const float *x, int64_t n, float m, float scale, float *w) {
    int64_t i = 0;
    double sum = 0.; /* without AVX-512, one add after another: in float32 a row's logsum drifted 1.8e-5 */
#ifdef __AVX512F__
    __m512 vs = _mm512_setzero_ps();
    const __m512 vmax = _mm512_set1_ps(m), vscale = _mm512_set1_ps(scale), floor = _mm512_set1_ps(-200.f);
    for (; i + 16 <= n; i += 16) {
        const __m512 z = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vmax), vscale);
        const __m512 e = exp16(_mm512_max_ps(z, floor)); /* exp16(-inf) is NaN; e^-200 is 0 in float32 */
        if (w) _mm512_storeu_ps(w + i, e);
        vs = _mm512_add_ps(vs, e);
        lanes_into_sum(i, &vs, &sum);
    }
    sum += (double)_mm512_reduce_add_ps(vs);
#endif
    for (; i < n; i++) {
        const float z = (x[i] - m) * scale, e = z > -200.f ? expf(z) : 0.f;
        if (w) w[i] = e;
        sum += e;
    }
    return sum;
}

/* What a row keeps: its logits of at least x_floor whose weights are at least w_floor. */
struct kept {
    float x_floor, w_floor;
};

/* The sum of the kept weights of w[0..n) (a banned token, x of -inf, weighs 0 and adds nothing). */
static double kept_sum(const float *x, const float *w, int64_t n, struct kept keep) {
    int64_t i = 0;
    double sum = 0.;
#ifdef __AVX512F__
    __m512 vs = _mm512_setzero_ps();
    const __m512 xf = _mm512_set1_ps(keep.x_floor), wf = _mm512_set1_ps(keep.w_floor);
    for (; i + 16 <= n; i += 16) {
        const __m512 wv = _mm512_loadu_ps(w + i);
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), xf, _CMP_GE_OQ) &
                            _mm512_cmp_ps_mask(wv, wf, _CMP_GE_OQ);
        vs = _mm512_mask_add_ps(vs, k, vs, wv);
        lanes_into_sum(i, &vs, &sum);
    }
    sum += (double)_mm512_reduce_add_ps(vs);
#endif
    for (; i < n; i++)
        if (x[i] >= keep.x_floor && w[i] >= keep.w_floor) sum += w[i];
    return sum;
}

/* A (value, index) pair of the heaps of the k largest (top-k's floor, top_values), ranked by value, then
 * by the lower index. */
struct ranked {
    float value;
    int64_t at;
};

static int ranks_below(struct ranked a, struct ranked b) { return a.value < b.value || (a.value == b.value && a.at > b.at); }

static void sift_down(struct ranked *heap, int64_t n, int64_t at) {
    for (;;) {
        int64_t least = at, l = 2 * at + 1, r = l + 1;
        if (l < n && ranks_below(heap[l], heap[least])) least = l;
        if (r < n && ranks_below(heap[r], heap[least])) least = r;
        if (least == at) return;
        const struct ranked t = heap[at];
        heap[at] = heap[least];
        heap[least] = t;
        at = least;
    }
}

/* heap[0..k) (0 < k <= V) = the k largest of x[0..V) as a min-heap by rank: the first k heaped, then every
 * later value above the heap's least in its place (16 compared at a time). A later index ranks below an
 * equal value already held, so only a larger value enters. */
static void heap_of_largest(const float *x, int64_t V, int64_t k, struct ranked *heap) {
    for (int64_t j = 0; j < k; j++) heap[j] = (struct ranked){x[j], j};
    for (int64_t j = k / 2 - 1; j >= 0; j--) sift_down(heap, k, j);
    int64_t i = k;
#ifdef __AVX512F__
    for (; i + 16 <= V; i += 16) {
        __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(heap[0].value), _CMP_GT_OQ);
        while (above) {
            const int64_t j = i + __builtin_ctz(above);
            above &= above - 1;
            if (x[j] > heap[0].value) {
                heap[0] = (struct ranked){x[j], j};
                sift_down(heap, k, 0);
            }
        }
    }
#endif
    for (; i < V; i++)
        if (x[i] > heap[0].value) {
            heap[0] = (struct ranked){x[i], i};
            sift_down(heap, k, 0);
        }
}

/* The k-th largest of x[0..V), 0 < k < V. */
static float kth_largest(const float *x, int64_t V, int64_t k) {
    struct ranked on_stack[HEAP_ON_STACK];
    struct ranked *heap = k <= HEAP_ON_STACK ? on_stack : malloc(sizeof(struct ranked) * (size_t)k);
    if (!heap) return -INFINITY; /* out of memory: keep every token rather than fail the batch */
    heap_of_largest(x, V, k, heap);
    const float kth = heap[0].value;
    if (heap != on_stack) free(heap);
    return kth;
}

/* The weights w[0..n) of the logits x[0..n) at least x_floor whose weights are at least ``least`` copied to
 * cand (from its start), and how many. */
static int64_t gather(const float *x, const float *w, int64_t n, float x_floor, float least, float *cand) {
    int64_t i = 0, count = 0;
#ifdef __AVX512F__
    const __m512 xf = _mm512_set1_ps(x_floor), lf = _mm512_set1_ps(least);
    for (; i + 16 <= n; i += 16) {
        const __m512 wv = _mm512_loadu_ps(w + i);
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), xf, _CMP_GE_OQ) &
                            _mm512_cmp_ps_mask(wv, lf, _CMP_GE_OQ);
        _mm512_mask_compressstoreu_ps(cand + count, k, wv);
        count += __builtin_popcount(k);
    }
#endif
    for (; i < n; i++)
        if (x[i] >= x_floor && w[i] >= least) cand[count++] = w[i];
    return count;
}

/* The candidates cand[0..n) whose bits >> shift & mask equal b moved to cand's start; how many. */
static int64_t keep_bucket(float *cand, int64_t n, int shift, uint32_t mask, uint32_t b) {
    int64_t i = 0, left = 0;
#ifdef __AVX512F__
    const __m512i vmask = _mm512_set1_epi32((int)mask), vb = _mm512_set1_epi32((int)b);
    const __m128i vshift = _mm_cvtsi32_si128(shift);
    for (; i + 16 <= n; i += 16) {
        const __m512i bits = _mm512_loadu_si512(cand + i);
        const __mmask16 k = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_srl_epi32(bits, vshift), vmask), vb);
        _mm512_mask_compressstoreu_epi32(cand + left, k, bits); /* left <= i: never ahead of the reads */
        left += __builtin_popcount(k);
    }
#endif
    for (; i < n; i++)
        if (((f32_bits(cand[i]) >> shift) & mask) == b) cand[left++] = cand[i];
    return left;
}

/* buckets[(bits of cand[i] >> shift) & mask] += cand[i] for i < n; buckets zeroed first (span of them). */
static void bucket_sums(const float *cand, int64_t n, int shift, uint32_t mask, double *buckets, int64_t span) {
    memset(buckets, 0, sizeof(double) * (size_t)span);
    for (int64_t i = 0; i < n; i++) buckets[(f32_bits(cand[i]) >> shift) & mask] += cand[i];
}

/* bucket_sums where the candidates' buckets are among few (lo .. span - 1, at most FEW_BUCKETS of them; more
 * go to bucket_sums): a masked vector sum per bucket. A flat row puts most neighbours in the same bucket, where
 * bucket_sums' adds each wait for the one before through memory (2x the whole draw on a flat row). */
#define FEW_BUCKETS 20
static void few_bucket_sums(const float *cand, int64_t n, int shift, uint32_t mask, uint32_t lo, double *buckets,
                            int64_t span) {
    const int few = (int)(span - lo);
    if (few > FEW_BUCKETS) {
        bucket_sums(cand, n, shift, mask, buckets, span);
        return;
    }
    memset(buckets, 0, sizeof(double) * (size_t)span);
    int64_t i = 0;
#ifdef __AVX512F__
    __m512d sums[FEW_BUCKETS];
    for (int j = 0; j < few; j++) sums[j] = _mm512_setzero_pd();
    const __m128i vshift = _mm_cvtsi32_si128(shift);
    const __m512i vmask = _mm512_set1_epi32((int)mask);
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(cand + i);
        const __m512i at = _mm512_and_si512(_mm512_srl_epi32(_mm512_castps_si512(v), vshift), vmask);
        const __m512d low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        const __m512d high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
        for (int j = 0; j < few; j++) {
            const __mmask16 k = _mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32((int)lo + j));
            sums[j] = _mm512_mask_add_pd(sums[j], (__mmask8)k, sums[j], low);
            sums[j] = _mm512_mask_add_pd(sums[j], (__mmask8)(k >> 8), sums[j], high);
        }
    }
    for (int j = 0; j < few; j++) buckets[lo + (uint32_t)j] = _mm512_reduce_add_pd(sums[j]);
#endif
    for (; i < n; i++) buckets[(f32_bits(cand[i]) >> shift) & mask] += cand[i];
}

/* top-p's floor: the largest weight v such that the weights of at least v among cand[0..n) (the positive
 * weights top-k keeps, or those of at least some floor whose sum alone reaches ``mass``; all at least
 * ``least``, at most 1) sum to at least ``mass``. Its bits are found 9 (the exponent: from least's to 1's,
 * 127), 4, 7, then 12 at a time (a non-negative float's bits order as its value): at each level the
 * candidates are summed into buckets by their next bits, the highest bucket at which the mass from the top
 * reaches ``mass`` gives those bits, and only that bucket's candidates stay for the next level. Where
 * rounding leaves the candidates' total short of ``mass``, the lowest bucket is taken: v is then at most
 * every candidate. cand is overwritten. */
static float mass_floor(float *cand, int64_t n, double mass, float least) {
    static const int widths[4] = {9, 4, 7, 12};
    double buckets[1 << 12], above = 0.;
    uint32_t prefix = 0;
    for (int level = 0, shift = 32; level < 4; level++) {
        const uint32_t mask = (1u << widths[level]) - 1, top = level == 0 ? 127 : mask;
        shift -= widths[level];
        few_bucket_sums(cand, n, shift, mask, level == 0 ? f32_bits(least) >> 23 : 0, buckets, (int64_t)top + 1);
        uint32_t b = top;
        for (; b > 0 && above + buckets[b] < mass; b--) above += buckets[b];
        n = keep_bucket(cand, n, shift, mask, b);
        prefix = (prefix << widths[level]) | b;
    }
    float v;
    memcpy(&v, &prefix, sizeof v);
    return v;
}

/* top-p's floor over the weights w of the logits x[0..V) at least x_floor (top-k's), for ``top_p`` of their
 * mass; cand is a workspace of V floats. A real model's nucleus is nearly always among the tokens of at least
 * 2^-8 of the largest's weight, so only they are read again where their mass suffices (else those of at least
 * 2^-16, else all). */
static float top_p_floor(const float *x, const float *w, int64_t V, float x_floor, float top_p, float *cand) {
    const double mass = (double)top_p * kept_sum(x, w, V, (struct kept){x_floor, 0.f});
    for (int e = 8; e <= 24; e += 8) {
        const float least = e < 24 ? ldexpf(1.f, -e) : FLT_MIN; /* FLT_MIN: every positive weight */
        const int64_t n = gather(x, w, V, x_floor, least, cand);
        double sum = 0.;
        for (int64_t i = 0; i < n; i++) sum += cand[i];
        if (sum >= mass || e == 24) {
            const float v = mass_floor(cand, n, mass, least);
            return v > least ? v : least;
        }
    }
    return 0.f; /* not reached */
}

/* In w[0..n) (the weights of x[0..n)), the first kept index at which the running sum of kept weights exceeds
 * target, else (rounding left the sum short) the last kept index; -1 where none is kept. */
static int64_t scan(const float *x, const float *w, int64_t n, struct kept keep, float target) {
    int64_t last = -1;
    float run = 0.f;
    for (int64_t i = 0; i < n; i++)
        if (w[i] > 0.f && x[i] >= keep.x_floor && w[i] >= keep.w_floor) {
            run += w[i];
            last = i;
            if (run > target) break;
        }
    return last;
}

/* Whether a row's top_k (<= 0 or >= V: none), top_p (>= 1: none) or min_p (<= 0: none) drops any token. */
static int truncates(int64_t top_k, float top_p, float min_p, int64_t V) {
    return (top_k > 0 && top_k < V) || top_p < 1.f || min_p > 0.f;
}

/* One row's draw: scale = 1 / temperature, top_k <= 0 or >= V for none, top_p >= 1 for none, min_p <= 0 for
 * none; w is the row's workspace (2 V floats), for a row that truncates. Also the row's largest logit and
 * log(sum of exp(x - largest)), as log_softmax_stats gives them (NaN where the largest is not finite): at
 * temperature 1 the sum of the weights themselves, else one more pass over the row. */
static int64_t draw_row(const float *x, int64_t V, float scale, int64_t top_k, float top_p, float min_p, float u,
                        float *w, float *largest, float *logsum) {
    const float m = row_largest(x, V);
    *largest = m;
    *logsum = NAN;
    if (!f32_is_finite(m)) return -1;
    const int plain = !truncates(top_k, top_p, min_p, V);
    struct kept keep = {-INFINITY, 0.f};
    double raw = -1.; /* the sum of exp(x - m), once known */
    if (!plain) {
        const double sum = weights(x, V, m, scale, w);
        if (scale == 1.f) raw = sum;
        if (top_k > 0 && top_k < V) keep.x_floor = kth_largest(x, V, top_k);
        if (top_p < 1.f) /* over top-k's tokens, before min-p, as the PyTorch stages go */
            keep.w_floor = top_p_floor(x, w, V, keep.x_floor, top_p, w + V);
        if (min_p > keep.w_floor) keep.w_floor = min_p; /* the largest weight is 1 */
    }
    /* A plain row's weights are made a block at a time (no workspace), twice for the block found. */
    float block[DRAW_BLOCK];
    const int64_t nblocks = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
    float block_sums[nblocks], total = 0.f;
    double exact = 0.; /* the blocks' sums before their rounding to float32: the logsum's */
    for (int64_t b = 0; b < nblocks; b++) {
        const int64_t start = b * DRAW_BLOCK, n = V - start < DRAW_BLOCK ? V - start : DRAW_BLOCK;
        const double sum = plain ? weights(x + start, n, m, scale, block) : kept_sum(x + start, w + start, n, keep);
        block_sums[b] = (float)sum;
        total += block_sums[b];
        exact += sum;
    }
    if (plain && scale == 1.f) raw = exact;
    *logsum = (float)log(raw >= 0. ? raw : weights(x, V, m, 1.f, NULL));
    float target = u * total;
    int64_t b = 0;
    for (; b < nblocks - 1 && target >= block_sums[b]; b++) target -= block_sums[b];
    const int64_t start = b * DRAW_BLOCK, n = V - start < DRAW_BLOCK ? V - start : DRAW_BLOCK;
    if (plain) weights(x + start, n, m, scale, block);
    const int64_t found = scan(x + start, plain ? block : w + start, n, keep, target);
    if (found >= 0) return start + found;
    for (int64_t i = 0; i < V; i++) /* nothing kept in the last block (rounding): the largest, always kept */
        if (x[i] == m) return i;
    return -1; /* cannot happen: m is one of x's values */
}

void draw_f32(const float *x, int64_t rows, int64_t V, int64_t stride, const float *scale, const int64_t *top_k,
              const float *top_p, const float *min_p, const float *u, int64_t *token, float *largest, float *logsum,
              int nthreads) {
    int any = 0;
    for (int64_t r = 0; r < rows; r++) any |= truncates(top_k[r], top_p[r], min_p[r], V);
#pragma omp parallel num_threads(nthreads) if (rows * V >= 32768)
    {
        float *w = any ? malloc(2 * sizeof(float) * (size_t)V) : 0;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (truncates(top_k[r], top_p[r], min_p[r], V) && !w) { /* out of memory */
                token[r] = -1;
                largest[r] = logsum[r] = NAN;
                continue;
            }
            token[r] = draw_row(x + r * stride, V, scale[r], top_k[r], top_p[r], min_p[r], u[r], w, largest + r,
                                logsum + r);
        }
        free(w);
    }
}

void top_values_f32(const float *x, int64_t V, int64_t stride, const int64_t *rows, int64_t n, int64_t k,
                    float *values, int64_t *ids, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n * V >= 32768)
    for (int64_t r = 0; r < n; r++) {
        const float *row = x + rows[r] * stride;
        struct ranked on_stack[HEAP_ON_STACK];
        struct ranked *heap = k <= HEAP_ON_STACK ? on_stack : malloc(sizeof(struct ranked) * (size_t)k);
        if (!heap) { /* out of memory: the first k, unranked, rather than fail the batch */
            for (int64_t j = 0; j < k; j++) values[r * k + j] = row[j], ids[r * k + j] = j;
            continue;
        }
        if (k > 0) heap_of_largest(row, V, k, heap);
        for (int64_t left = k; left > 0; left--) { /* the least out first, to the end */
            values[r * k + left - 1] = heap[0].value;
            ids[r * k + left - 1] = heap[0].at;
            heap[0] = heap[left - 1];
            sift_down(heap, left - 1, 0);
        }
        if (heap != on_stack) free(heap);
    }
}
