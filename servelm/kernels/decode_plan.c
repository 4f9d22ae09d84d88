/* Decoding attention's work items (paged_attention.c's and kv_int8.c's kernels), and the merge of a long
 * sequence's parts.
 *
 * An item is one sequence's KV heads h0 .. h0 + heads - 1 (all of them when there are at least as many
 * sequences as threads, one otherwise) over a run of its keys. A sequence of more than PART_KEYS keys splits
 * into parts of PART_KEYS (whole cache blocks), whatever decodes beside it, so that one long sequence keeps
 * every thread busy and its result is the same alone or in a batch (a speculative step's verified rows must
 * come out as plain decoding's): each part sums its rows in float32 under its own softmax, keeping its
 * largest score and its sum, and decode_plan_merge weighs the parts by them (flash-decoding's split of the
 * keys). A shorter sequence's items write their rows straight to the output. Built at first use by
 * servelm/kernels. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"
#include "bf16.h"

#define PART_KEYS 512

struct decode_plan decode_plan(const int64_t *lens, int64_t B, int64_t split, int64_t heads, int64_t rows,
                               int64_t D, int64_t block_size) {
    const int64_t part = (PART_KEYS + block_size - 1) / block_size * block_size;
    struct decode_plan plan = {NULL, 0, 1, rows, D, NULL};
    int parted = 0;
    for (int64_t b = 0; b < B; b++) {
        plan.count += split * ((lens[b] + part - 1) / part);
        parted |= lens[b] > part;
    }
    plan.items = malloc(sizeof(struct decode_item) * (size_t)plan.count);
    int64_t i = 0;
    for (int64_t b = 0; b < B; b++) { /* a sequence's parts side by side: the merge finds them there */
        const int64_t parts = (lens[b] + part - 1) / part;
        for (int64_t s = 0; s < split; s++)
            for (int64_t p = 0; p < parts; p++) {
                const int64_t len = lens[b] - p * part < part ? lens[b] - p * part : part;
                plan.items[i++] = (struct decode_item){b, s * heads, p * part, len, parts};
                plan.longest = len > plan.longest ? len : plan.longest;
            }
    }
    if (parted) plan.partials = malloc(sizeof(float) * (size_t)(plan.count * rows * (D + 2)));
    return plan;
}

void decode_plan_free(struct decode_plan *plan) {
    free(plan->items);
    free(plan->partials);
}

float *decode_part(const struct decode_plan *plan, int64_t i) {
    return plan->items[i].parts > 1 ? plan->partials + i * plan->rows * (plan->D + 2) : NULL;
}

struct prefetch_stream decode_item_stream(const struct decode_plan *plan, int64_t i, const void *cache,
                                          int64_t head_bytes, int64_t heads, int64_t row_bytes,
                                          const int64_t *tables, int64_t max_blocks, int64_t block_size) {
    if (i >= plan->count) return prefetch_stream(cache, tables, block_size, row_bytes, 0, 0);
    const struct decode_item *it = plan->items + i;
    return prefetch_stream((const char *)cache + it->h0 * head_bytes, tables + it->b * max_blocks + it->first / block_size,
                           block_size, row_bytes, heads * head_bytes, it->len);
}

void decode_plan_merge(const struct decode_plan *plan, int64_t H, int64_t G, void *out, int out_bf16) {
    const int64_t rows = plan->rows, D = plan->D, stride = rows * (D + 2);
    _Pragma("omp for schedule(dynamic)") /* within the kernel's parallel region: each sequence's first part */
    for (int64_t i = 0; i < plan->count; i++) {
        const struct decode_item *it = plan->items + i;
        if (it->parts == 1 || it->first != 0) continue;
        const float *first = plan->partials + i * stride;
        for (int64_t r = 0; r < rows; r++) {
            float most = -INFINITY, total = 0.f, acc[D];
            for (int64_t p = 0; p < it->parts; p++) most = fmaxf(most, first[p * stride + rows * D + 2 * r]);
            for (int64_t d = 0; d < D; d++) acc[d] = 0.f;
            for (int64_t p = 0; p < it->parts; p++) { /* part p's rows are normalized by its own sum */
                const float *stats = first + p * stride + rows * D + 2 * r;
                const float weight = stats[1] * expf(stats[0] - most);
                const float *o = first + p * stride + r * D;
                total += weight;
                for (int64_t d = 0; d < D; d++) acc[d] += weight * o[d];
            }
            const int64_t at = (it->b * H + it->h0 * G + r) * D;
            for (int64_t d = 0; d < D; d++) {
                if (out_bf16) ((uint16_t *)out)[at + d] = f32_to_bf16(acc[d] / total);
                else ((float *)out)[at + d] = acc[d] / total;
            }
        }
    }
}
