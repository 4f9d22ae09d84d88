/* Decoding attention's work items (paged_attention.c's and kv_int8.c's kernels), and the merge of a long
 * sequence's parts.
 *
 * An item is one sequence's KV heads h0 .. h0 + heads - 1 (all of them when there are at least as many
 * sequences as threads, one otherwise) over a run of its keys. A sequence of more than PART_KEYS keys splits
 * into parts of PART_KEYS (whole cache blocks), whatever decodes beside it, so that one long sequence keeps
 * every thread busy and its result is the same alone or in a batch (a speculative step's verified rows must
 * come out as plain decoding's): each part sums its rows in float32 under its own softmax, keeping its
 * largest score and its sum, and the thread that finishes a sequence's last part weighs the parts by them
 * (flash-decoding's split of the keys; no barrier, which on a busy machine waits for every thread to be
 * scheduled again). A shorter sequence's items write their rows straight to the output. Built at first use
 * by servelm/kernels. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "attention.h"
#include "bf16.h"

#define PART_KEYS 512

struct decode_plan decode_plan(const int64_t *lens, int64_t B, int64_t split, int64_t heads, int64_t rows,
                               int64_t D, int64_t block_size) {
    const int64_t part = (PART_KEYS + block_size - 1) / block_size * block_size;
    struct decode_plan plan = {NULL, NULL, 0, 1, rows, D, NULL};
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
                plan.items[i] = (struct decode_item){b, s * heads, p * part, len, parts, i - p};
                i++;
                plan.longest = len > plan.longest ? len : plan.longest;
            }
    }
    if (parted) {
        plan.partials = malloc(sizeof(float) * (size_t)(plan.count * rows * (D + 2)));
        plan.done = calloc((size_t)plan.count, sizeof(int64_t));
    }
    return plan;
}

void decode_plan_free(struct decode_plan *plan) {
    free(plan->items);
    free(plan->partials);
    free(plan->done);
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

/* Sequence group's rows (its parts at items group .. group + parts - 1), the parts weighed by their softmax
 * stats, into out. */
static void merge(const struct decode_plan *plan, int64_t group, int64_t H, int64_t G, void *out, int out_bf16) {
    const int64_t rows = plan->rows, D = plan->D, stride = rows * (D + 2);
    const struct decode_item *it = plan->items + group;
    const float *first = plan->partials + group * stride;
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

void decode_item_done(const struct decode_plan *plan, int64_t i, int64_t H, int64_t G, void *out, int out_bf16) {
    const struct decode_item *it = plan->items + i;
    /* acq_rel: the other parts' sums, written before their threads counted them, are seen here */
    if (it->parts > 1 && __atomic_add_fetch(plan->done + it->group, 1, __ATOMIC_ACQ_REL) == it->parts)
        merge(plan, it->group, H, G, out, out_bf16);
}
