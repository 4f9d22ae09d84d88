/* w8a8.c's GEMM on the AMX tile unit (tdpbssd), for CPUs with AMX-INT8: the same packed weight, rows
 * quantized without the +128, the same output stage (w8a8.h). w8a8.c's comment describes both paths. Built
 * at first use by servelm/kernels. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "w8a8.h"

#ifdef W8A8_AMX
/* A work item: up to 256 rows x up to 8 pairs of blocks (256 outputs). Its rows' tiles for one step (32 rows of K
 * int8: 28 KiB at K = 896) stay in L1 while the item's 8 pairs of weight blocks (in L2) pass over them; each
 * weight block is read from beyond L2 once per 256 rows, each row once per item's outputs. */
#define AMX_BLOCK_ROWS 256
#define AMX_BLOCK_PAIRS 8

/* A tile of sums waiting for scale_out: rows x cols of them, for the outputs from row m, column n0. */
struct pending {
    int32_t (*sums)[64];
    int rows;
    int64_t cols, m, n0;
};

/* Rows r0 to r1 of a pending tile through scale_out. */
static inline void finish_rows(const struct pending *p, int r0, int r1, const struct out_spec *o) {
    scale_out(p->sums + r0, r1 - r0, p->cols, p->m + r0, p->n0, o);
}

/* The int32 sums of 16 or 32 rows (lower: rows 16-31 too) of q (signed bytes, Kp a multiple of 64, in tiles: each
 * 16 rows x 64 of K 1 KiB in a row) x the blocks of 16 outputs at w0 and w1 (w1 NULL: w0's alone), into
 * sums[r][j]. A block's 16 groups of 4 of K in a step of 64 are 1 KiB in a row too. stream: the first rows
 * of a row block, for which the weights come from memory. prev (NULL: none): the previous tile, scaled a few
 * rows a step while the tile unit multiplies, since the vector units would otherwise scale it with the tile
 * unit idle (at K = 896 a tile multiplies in 14 steps, about as long as its 32 x 32 outputs take to scale). */
static void amx_tile(const int8_t *q, int64_t Kp, int lower, const int8_t *w0, const int8_t *w1,
                     int32_t (*sums)[64], int stream, const struct pending *prev, const struct out_spec *o) {
    const int64_t steps = Kp / 64;
    const int rows = prev ? prev->rows : 0, per_step = (int)((rows + steps - 1) / steps);
    int done = 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < Kp; k += 64) {
        if (stream) { /* the weights' first pass, from memory */
            amx_prefetch_ahead(w0 + 16 * k);
            if (w1) amx_prefetch_ahead(w1 + 16 * k);
        }
        _tile_loadd(4, q + 16 * k, 64);
        _tile_loadd(6, w0 + 16 * k, 64);
        _tile_dpbssd(0, 4, 6);
        if (w1) {
            _tile_loadd(7, w1 + 16 * k, 64);
            _tile_dpbssd(1, 4, 7);
        }
        if (lower) {
            _tile_loadd(5, q + 16 * Kp + 16 * k, 64);
            _tile_dpbssd(2, 5, 6);
            if (w1) _tile_dpbssd(3, 5, 7);
        }
        if (done < rows) {
            const int end = done + per_step < rows ? done + per_step : rows;
            finish_rows(prev, done, end, o);
            done = end;
        }
    }
    _tile_stored(0, sums[0], 256);
    _tile_stored(1, sums[0] + 16, 256);
    _tile_stored(2, sums[16], 256);
    _tile_stored(3, sums[16] + 16, 256);
}

void w8a8_amx_gemm(const void *x, int64_t M, int64_t K, const int8_t *packed, struct out_spec o, int nthreads) {
    const int64_t N = o.N;
    const int64_t Np = round_up(N, 16), Kp = round_up(K, K_ALIGN), Mp = round_up(M, AMX_ROWS);
    int8_t *q = aligned_alloc(64, (size_t)(Mp * Kp));
    /* the last step's rows past M multiply zeros: they are spread over its tiles, so those are cleared whole */
    memset(q + M / 16 * 16 * Kp, 0, (size_t)((Mp - M / 16 * 16) * Kp));
    float *row_scales = malloc(sizeof(float) * (size_t)M);
    o.row_scales = row_scales;
    const int64_t pairs = (Np / 16 + 1) / 2, row_blocks = (Mp + AMX_BLOCK_ROWS - 1) / AMX_BLOCK_ROWS;
    /* The pairs split evenly into blocks of up to AMX_BLOCK_PAIRS, as many as a multiple of the threads: a
     * decoding step's one row block is shared out evenly (blocks of 8, 8 and 2 pairs left one of two threads
     * 2 of the 18 pairs at N = 576, at about half the bytes per second of the other shapes). */
    const int64_t pair_blocks = round_up((pairs + AMX_BLOCK_PAIRS - 1) / AMX_BLOCK_PAIRS, nthreads);
    _Pragma("omp parallel num_threads(nthreads)") {
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, o.x_bf16, m, K, Kp, 0, 1024, (uint8_t *)q + m / 16 * 16 * Kp + m % 16 * 64, row_scales + m);
    amx_configure();
    int32_t sums[2][AMX_ROWS][64] __attribute__((aligned(64))); /* a tile's sums, the previous one's */
    struct pending prev = {NULL, 0, 0, 0, 0};
    _Pragma("omp for collapse(2) schedule(static) nowait")
    for (int64_t rb = 0; rb < row_blocks; rb++)
        for (int64_t pb = 0; pb < pair_blocks; pb++) {
            const int64_t m_end = (rb + 1) * AMX_BLOCK_ROWS < M ? (rb + 1) * AMX_BLOCK_ROWS : M;
            const int64_t p_end = (pb + 1) * pairs / pair_blocks;
            for (int64_t m = rb * AMX_BLOCK_ROWS; m < m_end; m += AMX_ROWS)
                for (int64_t p = pb * pairs / pair_blocks; p < p_end; p++) {
                    const int64_t n0 = p * 32;
                    const int8_t *w0 = packed + n0 * Kp, *w1 = n0 + 16 < Np ? w0 + 16 * Kp : NULL;
                    int32_t(*next)[64] = sums[prev.sums == sums[0]];
                    amx_tile(q + m * Kp, Kp, M - m > 16, w0, w1, next, m == rb * AMX_BLOCK_ROWS,
                             prev.sums ? &prev : NULL, &o);
                    prev = (struct pending){next, M - m < AMX_ROWS ? (int)(M - m) : AMX_ROWS, w1 ? 32 : 16, m, n0};
                }
        }
    if (prev.sums) finish_rows(&prev, 0, prev.rows, &o);
    _tile_release();
    }
    free(q);
    free(row_scales);
}
#endif
