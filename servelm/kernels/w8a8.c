/* int8 x int8 GEMM for W8A8 linear layers (servelm/models/w8a8.py), for
 * AVX512-VNNI CPUs: out = x W^T (+ bias) with W int8 [N, K] times one float32
 * scale per output row, and x quantized per row on the fly (symmetric, one
 * scale per row). vpdpbusd multiplies 64 pairs of bytes and adds them into 16
 * int32 sums in one instruction: twice the multiply-adds per instruction of
 * vdpbf16ps, so a compute-bound GEMM (prefill, large batches) can run up to
 * twice bfloat16's rate.
 *
 * vpdpbusd takes unsigned bytes on one side: each activation q in [-127, 127]
 * is stored as q + 128, and the extra 128 * sum_k w[n][k] of each output is
 * subtracted once at the end (its "compensation", computed when the weight is
 * packed).
 *
 * The packed weight (w8a8_pack): N rounded up to 16 (Np), K to 4 (Kp), zeros
 * in the padding; element (n, k) at ((n / 16) * (Kp / 4) + k / 4) * 64 +
 * (n % 16) * 4 + k % 4, so that 16 outputs x 4 of K are one vector; then Np
 * int32 compensations, and N and K as int32. A tile of up to TILE_ROWS rows x TILE_BLOCKS blocks of
 * 16 outputs keeps its sums in registers, each row's 4 bytes broadcast
 * against each block's vector; threads split the outputs into panels of
 * up to TILE_BLOCKS blocks, evenly (a panel's weights stay in the core's L2
 * while every row passes over them, and they prefetch the next panel's, or the next call's first).
 * Elsewhere w8a8_supported() is 0 and callers keep PyTorch's path. Built at first use by servelm/kernels.
 *
 * On CPUs with AMX-INT8 (Intel Sapphire Rapids and later) the same packed
 * weight feeds the tile unit instead: a B tile is 16 rows of 64 bytes, each
 * row one group of 4 of K for 16 outputs, which is exactly 16 consecutive
 * vectors of the layout above (K is padded to 64 for it). tdpbssd multiplies
 * signed bytes on both sides, so the rows are quantized without the +128 and
 * need no compensation; one instruction does 16 x 16 x 64 multiply-adds, 16
 * times vpdpbusd's work. Each step of 64 of K loads 2 tiles of 16 rows and 2
 * tiles of 16 outputs and multiplies them into 4 tiles of sums (32 rows x 32
 * outputs), which then go through the same scaling as the VNNI tile's.
 * Linux hands out the tile registers only on request (amx.h), once per
 * process; where that fails, or after w8a8_use_amx(0), the VNNI path runs,
 * with sums identical to the last bit. The AMX path is in w8a8_amx.c, what
 * both share (a row's quantization, the output stage) in w8a8.h.
 *
 * A gated MLP's gate/up weight can be packed with its rows in pairs of
 * 16-row blocks (gate, then up): both paths then write silu(gate) * up of
 * each pair (silu = 1), never the [M, N] product itself. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "kernels.h"
#include "w8a8.h"

#define TILE_ROWS 6   /* 6 rows x 4 blocks of sums, 4 of weights, 1 broadcast: 29 of the 32 registers */
#define TILE_BLOCKS 4 /* 64 outputs per panel */
#define CHUNK_ROWS 48 /* rows per work item: items split the rows too when there are few panels */

/* The tile's loops run a constant number of times once inlined: unrolled, its sums stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

int w8a8_supported(void) {
#ifdef W8A8_VNNI
    return 1;
#else
    return 0;
#endif
}

int64_t w8a8_packed_bytes(int64_t N, int64_t K) {
    return round_up(N, 16) * round_up(K, K_ALIGN) + 4 * round_up(N, 16) + 2 * 4;
}

/* The packed weight ends with its N and K as int32, since the padded size alone no longer tells K apart. */
int w8a8_packed_matches(const int8_t *packed, int64_t bytes, int64_t N, int64_t K) {
    int32_t shape[2];
    if (bytes != w8a8_packed_bytes(N, K)) return 0;
    memcpy(shape, packed + bytes - sizeof shape, sizeof shape);
    return shape[0] == N && shape[1] == K;
}

#ifdef W8A8_AMX
static int amx_enabled = 1;

static int amx_active(void) { return amx_enabled && amx_granted(); }
#endif

int w8a8_use_amx(int want) {
#ifdef W8A8_AMX
    if (want >= 0) amx_enabled = want;
    return amx_active();
#else
    (void)want;
    return 0;
#endif
}

void w8a8_pack(const int8_t *w, int64_t N, int64_t K, int8_t *packed, int nthreads) {
    const int64_t Np = round_up(N, 16), Kp = round_up(K, K_ALIGN);
    int32_t *comp = (int32_t *)(packed + Np * Kp);
    const int32_t shape[2] = {(int32_t)N, (int32_t)K};
    memcpy(comp + Np, shape, sizeof shape);
    _Pragma("omp parallel for schedule(static) num_threads(nthreads)")
    for (int64_t block = 0; block < Np / 16; block++) {
        int8_t *dst = packed + block * 16 * Kp;
        memset(dst, 0, (size_t)(16 * Kp));
        for (int64_t j = 0; j < 16; j++) {
            const int64_t n = block * 16 + j;
            int32_t sum = 0;
            for (int64_t k = 0; n < N && k < K; k++) {
                dst[(k / 4) * 64 + j * 4 + k % 4] = w[n * K + k];
                sum += w[n * K + k];
            }
            comp[n] = 128 * sum;
        }
    }
}

#ifdef W8A8_VNNI
/* One step of 4 of K: each row's 4 bytes broadcast against each block's vector, summed into acc. */
static inline __attribute__((always_inline)) void tile_step(const uint8_t *q, int64_t Kp, const int8_t *w,
                                                           int64_t k4, __m512i *acc, int ROWS, int BLOCKS) {
    __m512i wv[TILE_BLOCKS];
    UNROLL for (int b = 0; b < BLOCKS; b++) wv[b] = _mm512_loadu_si512(w + b * 16 * Kp + k4 * 64);
    UNROLL for (int r = 0; r < ROWS; r++) {
        int32_t four;
        memcpy(&four, q + r * Kp + 4 * k4, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
        UNROLL for (int b = 0; b < BLOCKS; b++)
            acc[r * BLOCKS + b] = _mm512_dpbusd_epi32(acc[r * BLOCKS + b], xv, wv[b]);
    }
}

/* The int32 sums of ROWS rows of q x BLOCKS blocks of 16 outputs, into sums[r][16 * b + j], prefetching the
 * pf_bytes at pf into L2 meanwhile, pf_lines lines a step of K. Each (ROWS, BLOCKS) is its own small function
 * (tile_R_B below), so that its 24 sums get registers of their own. */
static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t Kp, const int8_t *w,
                                                      int32_t (*sums)[64], const char *pf, int64_t pf_bytes,
                                                      int64_t pf_lines, int ROWS, int BLOCKS) {
    __m512i acc[TILE_ROWS * TILE_BLOCKS];
    UNROLL for (int i = 0; i < ROWS * BLOCKS; i++) acc[i] = _mm512_setzero_si512();
    const int64_t steps = Kp / 4, lines = (pf_bytes + 63) / 64;
    int64_t k4 = 0;
    for (; k4 < steps && k4 * pf_lines < lines; k4++) { /* the steps that prefetch, then the rest without */
        for (int64_t line = k4 * pf_lines; line < (k4 + 1) * pf_lines && line < lines; line++)
            _mm_prefetch(pf + line * 64, _MM_HINT_T1);
        tile_step(q, Kp, w, k4, acc, ROWS, BLOCKS);
    }
    for (; k4 < steps; k4++) tile_step(q, Kp, w, k4, acc, ROWS, BLOCKS);
    UNROLL for (int r = 0; r < ROWS; r++)
        UNROLL for (int b = 0; b < BLOCKS; b++) _mm512_storeu_si512(sums[r] + 16 * b, acc[r * BLOCKS + b]);
}

typedef void (*tile_fn)(const uint8_t *, int64_t, const int8_t *, int32_t (*)[64], const char *, int64_t, int64_t);
#define TILE_FN(R, B)                                                                                            \
    static __attribute__((noinline)) void tile_##R##_##B(const uint8_t *q, int64_t Kp, const int8_t *w,        \
                                                         int32_t (*sums)[64], const char *pf, int64_t bytes,     \
                                                         int64_t lines) {                                        \
        tile(q, Kp, w, sums, pf, bytes, lines, R, B);                                                            \
    }
#define TILE_FNS(R) TILE_FN(R, 1) TILE_FN(R, 2) TILE_FN(R, 3) TILE_FN(R, 4)
TILE_FNS(1) TILE_FNS(2) TILE_FNS(3) TILE_FNS(4) TILE_FNS(5) TILE_FNS(6)
#define TILE_ROW(R) {tile_##R##_1, tile_##R##_2, tile_##R##_3, tile_##R##_4}
static const tile_fn TILES[TILE_ROWS][TILE_BLOCKS] = {TILE_ROW(1), TILE_ROW(2), TILE_ROW(3),
                                                      TILE_ROW(4), TILE_ROW(5), TILE_ROW(6)};
#endif

/* The first 16-output block of panel p: the units (blocks, or gate/up pairs of them) split evenly over the
 * panels. Panel p is blocks panel_block(p) .. panel_block(p + 1) - 1. */
static inline int64_t panel_block(int64_t p, int64_t units, int64_t panels, int64_t unit) {
    return p * units / panels * unit;
}

/* How a call splits an N x K weight into panels: its output blocks (in gate/up pairs for silu) evenly into
 * panels of up to TILE_BLOCKS; with one chunk of rows (decoding) as many panels as a multiple of the threads,
 * so that each gets the same share (9 panels of 4 at N = 576 went 5 and 4 to two threads). */
struct split {
    int64_t Np, Kp, unit, units, panels;
};

static struct split split_weight(int64_t N, int64_t K, int silu, int64_t chunks, int nthreads) {
    struct split s = {round_up(N, 16), round_up(K, K_ALIGN), silu ? 2 : 1, 0, 0};
    s.units = s.Np / 16 / s.unit;
    s.panels = (s.Np / 16 + TILE_BLOCKS - 1) / TILE_BLOCKS;
    if (chunks == 1) s.panels = round_up(s.panels, nthreads);
    return s;
}

/* Panel p's weights: where they start and, in *bytes, how many. */
static const char *panel_weights(const int8_t *packed, const struct split *s, int64_t p, int64_t *bytes) {
    const int64_t b0 = panel_block(p, s->units, s->panels, s->unit);
    *bytes = p < s->panels ? (panel_block(p + 1, s->units, s->panels, s->unit) - b0) * 16 * s->Kp : 0;
    return (const char *)(packed + b0 * 16 * s->Kp);
}

/* The first of the panels that thread t of n works on under the static schedule of one chunk of rows. */
static inline int64_t first_panel(int64_t panels, int64_t t, int64_t n) {
    return t * (panels / n) + (t < panels % n ? t : panels % n);
}

void w8a8_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *packed, const float *scales,
               const void *bias, int64_t N, int flags, void *out, int nthreads, const struct w8a8_next *next) {
#ifdef W8A8_VNNI
    struct out_spec o = {NULL, scales, NULL, bias, x_bf16, !!(flags & W8A8_SILU_MUL), !!(flags & W8A8_F32_OUT), N, out};
#ifdef W8A8_AMX
    if (M >= AMX_MIN_ROWS && amx_active()) {
        w8a8_amx_gemm(x, M, K, packed, o, nthreads);
        return;
    }
#endif
    const int64_t chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
    const struct split s = split_weight(N, K, o.silu, chunks, nthreads);
    const int64_t Np = s.Np, Kp = s.Kp, panels = s.panels;
    o.comp = (const int32_t *)(packed + Np * Kp);
    uint8_t *q = aligned_alloc(64, (size_t)round_up(M * Kp, 64));
    float *row_scales = malloc(sizeof(float) * (size_t)M);
    o.row_scales = row_scales;
    /* One parallel region for both loops: on a busy machine each region's start waits until every thread
     * is scheduled again, which can cost more than the GEMM itself. */
    _Pragma("omp parallel num_threads(nthreads)") {
    /* With one chunk of rows (decoding) each thread's panels are a run of them: its first on its way to L2
     * while the rows round (the call before may have asked for it already); while its last multiplies, this
     * thread's first of the next call (next: decode_step.c's next GEMM on the same rows, split as that call
     * will split it), or nothing. Per decoding step of 32 rows (SmolLM2, w8a8), the forward 1.1-2.0% faster
     * against none, steps alternating in one process (docs/BENCHMARKS.md). */
    const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t mine = first_panel(panels, t, n), last = first_panel(panels, t + 1, n) - 1;
    int64_t after_bytes = 0;
    const char *after = NULL; /* what this thread's last panel prefetches */
    if (chunks == 1 && next) {
        const struct split later = split_weight(next->N, next->K, !!(next->flags & W8A8_SILU_MUL), 1, nthreads);
        after = panel_weights(next->packed, &later, first_panel(later.panels, t, n), &after_bytes);
    }
    if (chunks == 1 && mine < panels) {
        int64_t bytes;
        const char *w = panel_weights(packed, &s, mine, &bytes);
        for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(w + line, _MM_HINT_T1);
    }
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++) quantize_row(x, x_bf16, m, K, Kp, 128, 64, q + m * Kp, row_scales + m);
    _Pragma("omp for collapse(2) schedule(static) nowait") /* the region's end waits */
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t bytes, pf_bytes = 0;
            const int8_t *w = (const int8_t *)panel_weights(packed, &s, p, &bytes);
            const int64_t blocks = bytes / 16 / Kp, n0 = panel_block(p, s.units, panels, s.unit) * 16;
            const int64_t m0 = c * CHUNK_ROWS, rows = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
            if (blocks == 0) continue; /* more panels than blocks */
            /* Decoding (one chunk of rows) streams the weights from memory once a call: while a panel's tiles
             * multiply, each prefetches an even share of this thread's next panel's weights into L2 (or,
             * after its last, the next call's first), a line or more a step of K. Against none, 32 rows from
             * memory ran 1.1-1.4x (`bench/w8a8_gemm.py --copies 24`, Zen 5); all of it in the first tile
             * gained nothing. */
            const char *pf_at = NULL;
            if (chunks == 1 && p < last) pf_at = panel_weights(packed, &s, p + 1, &pf_bytes);
            if (chunks == 1 && p == last) pf_at = after, pf_bytes = after_bytes;
            const int64_t tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
            const int64_t share = round_up((pf_bytes + tiles - 1) / tiles, 64);
            const int64_t lines = (share / 64 + Kp / 4 - 1) / (Kp / 4); /* a step of K */
            int32_t sums[TILE_ROWS][64] __attribute__((aligned(64)));
            for (int64_t m = m0, i = 0; m < m0 + rows; m += TILE_ROWS, i++) {
                const int r = M - m < TILE_ROWS ? (int)(M - m) : TILE_ROWS;
                const int64_t left = pf_bytes - i * share;
                const char *pf = left > 0 ? pf_at + i * share : NULL;
                TILES[r - 1][blocks - 1](q + m * Kp, Kp, w, sums, pf, left < share ? left : share, lines);
                scale_out(sums, r, 16 * blocks, m, n0, &o);
            }
        }
    }
    free(q);
    free(row_scales);
#endif
}
