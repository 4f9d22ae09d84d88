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
 * TILE_BLOCKS blocks (a panel's weights stay in the core's L2 while every
 * row passes over them). Elsewhere w8a8_supported() is 0 and callers keep
 * PyTorch's path. Built at first use by servelm/kernels.
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
 * with sums identical to the last bit.
 *
 * A gated MLP's gate/up weight can be packed with its rows in pairs of
 * 16-row blocks (gate, then up): both paths then write silu(gate) * up of
 * each pair (silu = 1), never the [M, N] product itself. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#include "vexp.h"

#include "amx.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define W8A8_VNNI 1
#ifdef KERNELS_AMX
#define W8A8_AMX 1
#endif
#endif

/* K is padded to a whole tile row of bytes where AMX may run, to 4 (one vpdpbusd group) elsewhere. */
#ifdef W8A8_AMX
#define K_ALIGN 64
#else
#define K_ALIGN 4
#endif
#define AMX_ROWS 32 /* rows per AMX step: 2 tiles of 16 */
/* Fewer rows stay on VNNI: its 6-row tile reads each weight vector once for them, and AMX's set-up (the tile
 * configuration, a zeroed tile of 16 rows) is no longer paid back (bench/w8a8_gemm.py). */
#define AMX_MIN_ROWS 8

#define TILE_ROWS 6   /* 6 rows x 4 blocks of sums, 4 of weights, 1 broadcast: 29 of the 32 registers */
#define TILE_BLOCKS 4 /* 64 outputs per panel */
#define CHUNK_ROWS 48 /* rows per work item: items split the rows too when there are few panels */

/* The tile's loops run a constant number of times once inlined: unrolled, its sums stay in registers. */
#define UNROLL _Pragma("GCC unroll 8")

static inline int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

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
/* Row m of x (bfloat16 bits or float32) as Kp bytes q + zero_point (the padding: zero_point, a zero), and its
 * scale: q + 128 for vpdpbusd's unsigned side, q itself for tdpbssd. Each 64 bytes of the row go chunk_stride
 * bytes after the last: 64 for a plain row, 1024 for a row of an AMX tile (16 rows x 64 bytes in a row). */
static void quantize_row(const void *x, int x_bf16, int64_t m, int64_t K, int64_t Kp, int zero_point,
                         int64_t chunk_stride, uint8_t *q, float *scale) {
    const uint16_t *xb = (const uint16_t *)x + m * K;
    const float *xf = (const float *)x + m * K;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 mask = (__mmask16)(K - k >= 16 ? 0xFFFF : (1u << (K - k)) - 1);
        const __m512 v = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(mask, xb + k)) : _mm512_maskz_loadu_ps(mask, xf + k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    *scale = top / 127.f;
    const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    const __m512i zp = _mm512_set1_epi32(zero_point);
    for (int64_t k = 0; k < Kp; k += 16) {
        const __mmask16 in = (__mmask16)(K - k >= 16 ? 0xFFFF : K > k ? (1u << (K - k)) - 1 : 0);
        const __mmask16 out = (__mmask16)(Kp - k >= 16 ? 0xFFFF : (1u << (Kp - k)) - 1);
        const __m512 v = x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(in, xb + k)) : _mm512_maskz_loadu_ps(in, xf + k);
        /* round to nearest even; |v| * inv <= 127, so q + 128 is in [1, 255] */
        const __m512i qi = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, inv)), zp);
        _mm_mask_storeu_epi8(q + k / 64 * chunk_stride + k % 64, out, _mm512_cvtepi32_epi8(qi));
    }
}

/* The int32 sums of ROWS rows of q x BLOCKS blocks of 16 outputs, into sums[r][16 * b + j]. Each (ROWS,
 * BLOCKS) is its own small function (tile_R_B below), so that its 24 sums get registers of their own. */
static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t Kp, const int8_t *w,
                                                      int32_t (*sums)[64], int ROWS, int BLOCKS) {
    __m512i acc[TILE_ROWS * TILE_BLOCKS];
    UNROLL for (int i = 0; i < ROWS * BLOCKS; i++) acc[i] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < Kp / 4; k4++) {
        __m512i wv[TILE_BLOCKS];
        UNROLL for (int b = 0; b < BLOCKS; b++) wv[b] = _mm512_loadu_si512(w + b * 16 * Kp + k4 * 64);
        UNROLL for (int r = 0; r < ROWS; r++) {
            int32_t four;
            memcpy(&four, q + r * Kp + 4 * k4, sizeof four);
            const __m512i xv = _mm512_set1_epi32(four);
            UNROLL for (int b = 0; b < BLOCKS; b++) acc[r * BLOCKS + b] = _mm512_dpbusd_epi32(acc[r * BLOCKS + b], xv, wv[b]);
        }
    }
    UNROLL for (int r = 0; r < ROWS; r++)
        UNROLL for (int b = 0; b < BLOCKS; b++) _mm512_storeu_si512(sums[r] + 16 * b, acc[r * BLOCKS + b]);
}

typedef void (*tile_fn)(const uint8_t *, int64_t, const int8_t *, int32_t (*)[64]);
#define TILE_FN(R, B)                                                                                            \
    static __attribute__((noinline)) void tile_##R##_##B(const uint8_t *q, int64_t Kp, const int8_t *w,        \
                                                         int32_t (*sums)[64]) {                                  \
        tile(q, Kp, w, sums, R, B);                                                                              \
    }
#define TILE_FNS(R) TILE_FN(R, 1) TILE_FN(R, 2) TILE_FN(R, 3) TILE_FN(R, 4)
TILE_FNS(1) TILE_FNS(2) TILE_FNS(3) TILE_FNS(4) TILE_FNS(5) TILE_FNS(6)
#define TILE_ROW(R) {tile_##R##_1, tile_##R##_2, tile_##R##_3, tile_##R##_4}
static const tile_fn TILES[TILE_ROWS][TILE_BLOCKS] = {TILE_ROW(1), TILE_ROW(2), TILE_ROW(3),
                                                      TILE_ROW(4), TILE_ROW(5), TILE_ROW(6)};

/* What one w8a8_gemm call writes its sums into, the same for all its tiles: out = (sums - comp) * row scale *
 * scales[n] + bias[n], rounded to x's dtype (comp NULL: none, the AMX sums). silu: the columns come in pairs
 * of 16-blocks, gate then up (N a multiple of 32), and out [M, N / 2] gets round(silu(gate)) * up of each
 * pair instead, each product rounded to x's dtype first, as a separate silu_mul over the GEMM's output.
 * f32_out: out is float32 whatever x's dtype, holding the values rounded to it. */
struct out_spec {
    const float *row_scales, *scales;
    const int32_t *comp;
    const void *bias;
    int x_bf16, silu, f32_out;
    int64_t N;
    void *out;
};

/* 16 outputs of row m at column n (mask: those before N) from the int32 sums, as float32. */
static inline __m512 scaled16(const int32_t *sums, const struct out_spec *o, int64_t m, int64_t n, __mmask16 mask) {
    const __m512i c = o->comp ? _mm512_loadu_si512(o->comp + n) : _mm512_setzero_si512();
    __m512 bv = _mm512_setzero_ps();
    if (o->bias)
        bv = o->x_bf16 ? widen16_bits(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)o->bias + n))
                       : _mm512_maskz_loadu_ps(mask, (const float *)o->bias + n);
    const __m512 s = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, o->scales + n), _mm512_set1_ps(o->row_scales[m]));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_loadu_si512(sums), c)), s, bv);
}

/* 16 float32 values rounded to x's dtype, stored at element n of row m (mask: those before the row's end). */
static inline void store16(const struct out_spec *o, int64_t m, int64_t n, int64_t width, __mmask16 mask, __m512 y) {
    if (o->x_bf16 && o->f32_out) {
#ifdef __AVX512BF16__
        y = widen16_bits((__m256i)_mm512_cvtneps_pbh(y));
#else
        float tmp[16];
        _mm512_storeu_ps(tmp, y);
        for (int i = 0; i < 16; i++) tmp[i] = bf16_round(tmp[i]);
        y = _mm512_loadu_ps(tmp);
#endif
        _mm512_mask_storeu_ps((float *)o->out + m * width + n, mask, y);
    } else if (o->x_bf16) {
        uint16_t *dst = (uint16_t *)o->out + m * width + n;
#ifdef __AVX512BF16__
        _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(y));
#else
        float tmp[16];
        _mm512_storeu_ps(tmp, y);
        for (int i = 0; i < 16; i++)
            if (mask >> i & 1) dst[i] = f32_to_bf16(tmp[i]);
#endif
    } else {
        _mm512_mask_storeu_ps((float *)o->out + m * width + n, mask, y);
    }
}

/* round(silu(round(g))) * round(u), rounded, for 16 lanes: silu_mul over the rounded GEMM outputs. */
static inline void store_silu16(const struct out_spec *o, int64_t m, int64_t n, __m512 g, __m512 u) {
    const int64_t width = o->N / 2;
#ifdef __AVX512BF16__
    if (o->x_bf16 && !o->f32_out) {
        const __m512 gr = widen16_bits((__m256i)_mm512_cvtneps_pbh(g)), ur = widen16_bits((__m256i)_mm512_cvtneps_pbh(u));
        _mm256_storeu_si256((__m256i *)((uint16_t *)o->out + m * width + n), silu_mul16_bf16(gr, ur));
        return;
    }
#endif
    float gs[16], us[16], y[16];
    _mm512_storeu_ps(gs, g);
    _mm512_storeu_ps(us, u);
    for (int i = 0; i < 16; i++) {
        const float gi = o->x_bf16 ? bf16_round(gs[i]) : gs[i];
        const float ui = o->x_bf16 ? bf16_round(us[i]) : us[i];
        const float si = o->x_bf16 ? bf16_round(silu(gi)) : silu(gi);
        y[i] = si * ui;
    }
    store16(o, m, n, width, 0xFFFF, _mm512_loadu_ps(y));
}

/* Rows m to m + rows of the outputs at columns n0 to n0 + cols (masked past N) from their sums, sums[r][j]. */
static void scale_out(int32_t (*sums)[64], int rows, int64_t cols, int64_t m, int64_t n0, const struct out_spec *o) {
    if (o->silu) {
        for (int64_t j = 0; j < cols; j += 32)
            for (int r = 0; r < rows; r++)
                store_silu16(o, m + r, (n0 + j) / 2, scaled16(sums[r] + j, o, m + r, n0 + j, 0xFFFF),
                             scaled16(sums[r] + j + 16, o, m + r, n0 + j + 16, 0xFFFF));
        return;
    }
    for (int64_t j = 0; j < cols; j += 16) {
        const int64_t n = n0 + j;
        const __mmask16 mask = (__mmask16)(o->N - n >= 16 ? 0xFFFF : (1u << (o->N - n)) - 1);
        for (int r = 0; r < rows; r++) store16(o, m + r, n, o->N, mask, scaled16(sums[r] + j, o, m + r, n, mask));
    }
}

#ifdef W8A8_AMX
/* A work item: up to 256 rows x 8 pairs of blocks (256 outputs). Its rows' tiles for one step (32 rows of K
 * int8: 28 KiB at K = 896) stay in L1 while the item's 8 pairs of weight blocks (in L2) pass over them; each
 * weight block is read from beyond L2 once per 256 rows, each row once per 256 outputs. */
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

static void amx_gemm(const void *x, int64_t M, int64_t K, const int8_t *packed, struct out_spec o, int nthreads) {
    const int64_t N = o.N;
    const int64_t Np = round_up(N, 16), Kp = round_up(K, K_ALIGN), Mp = round_up(M, AMX_ROWS);
    int8_t *q = aligned_alloc(64, (size_t)(Mp * Kp));
    /* the last step's rows past M multiply zeros: they are spread over its tiles, so those are cleared whole */
    memset(q + M / 16 * 16 * Kp, 0, (size_t)((Mp - M / 16 * 16) * Kp));
    float *row_scales = malloc(sizeof(float) * (size_t)M);
    o.row_scales = row_scales;
    const int64_t pairs = (Np / 16 + 1) / 2, row_blocks = (Mp + AMX_BLOCK_ROWS - 1) / AMX_BLOCK_ROWS;
    const int64_t pair_blocks = (pairs + AMX_BLOCK_PAIRS - 1) / AMX_BLOCK_PAIRS;
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
            const int64_t p_end = (pb + 1) * AMX_BLOCK_PAIRS < pairs ? (pb + 1) * AMX_BLOCK_PAIRS : pairs;
            for (int64_t m = rb * AMX_BLOCK_ROWS; m < m_end; m += AMX_ROWS)
                for (int64_t p = pb * AMX_BLOCK_PAIRS; p < p_end; p++) {
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
#endif

void w8a8_gemm(const void *x, int x_bf16, int64_t M, int64_t K, const int8_t *packed, const float *scales,
               const void *bias, int64_t N, int flags, void *out, int nthreads) {
#ifdef W8A8_VNNI
    struct out_spec o = {NULL, scales, NULL, bias, x_bf16, !!(flags & W8A8_SILU_MUL), !!(flags & W8A8_F32_OUT), N, out};
#ifdef W8A8_AMX
    if (M >= AMX_MIN_ROWS && amx_active()) {
        amx_gemm(x, M, K, packed, o, nthreads);
        return;
    }
#endif
    const int64_t Np = round_up(N, 16), Kp = round_up(K, K_ALIGN);
    o.comp = (const int32_t *)(packed + Np * Kp);
    uint8_t *q = aligned_alloc(64, (size_t)round_up(M * Kp, 64));
    float *row_scales = malloc(sizeof(float) * (size_t)M);
    o.row_scales = row_scales;
    const int64_t panels = (Np / 16 + TILE_BLOCKS - 1) / TILE_BLOCKS, chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS;
    /* One parallel region for both loops: on a busy machine each region's start waits until every thread
     * is scheduled again, which can cost more than the GEMM itself. */
    _Pragma("omp parallel num_threads(nthreads)") {
    _Pragma("omp for schedule(static)")
    for (int64_t m = 0; m < M; m++) quantize_row(x, x_bf16, m, K, Kp, 128, 64, q + m * Kp, row_scales + m);
    _Pragma("omp for collapse(2) schedule(static) nowait") /* the region's end waits */
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t n0 = p * TILE_BLOCKS * 16, m0 = c * CHUNK_ROWS;
            const int64_t blocks = (Np - n0) / 16 < TILE_BLOCKS ? (Np - n0) / 16 : TILE_BLOCKS;
            const int64_t rows = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
            const int8_t *w = packed + n0 * Kp;
            int32_t sums[TILE_ROWS][64] __attribute__((aligned(64)));
            for (int64_t m = m0; m < m0 + rows; m += TILE_ROWS) {
                const int r = M - m < TILE_ROWS ? (int)(M - m) : TILE_ROWS;
                TILES[r - 1][blocks - 1](q + m * Kp, Kp, w, sums);
                scale_out(sums, r, 16 * blocks, m, n0, &o);
            }
        }
    }
    free(q);
    free(row_scales);
#endif
}
