/* The grouped bf16 GEMM for few rows per expert, on CPUs with AVX512-BF16
 * (moefleet.models.cpu_dpbf16 builds, measures and calls it; see its docstring).
 *
 * out[p, o] = a[p] . w[e, o] for the rows p of segment e, [ends[e-1], ends[e]); rows from
 * the last end on are 0. a: [P, I] contiguous; w: [E, O, I], unit stride along I, row
 * stride row_stride, expert stride expert_stride; out: [P, O] contiguous; I a multiple
 * of 32. All bf16 (as uint16), sums in float32, one rounding to bf16 (to nearest even).
 * The outputs are split between `threads` OpenMP threads when the weights hold
 * `min_split` elements or more: torch's own runtime (the process has loaded its libgomp,
 * so this library binds to it and runs on the same, already running, threads).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define CHUNK 16 /* the most rows of one pass (accumulators: 16 of the 32 registers) */

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* R rows (a compile-time constant after inlining, so the accumulators stay in registers)
 * against every weight row: each 32-wide slice of a weight row is loaded once and used
 * for all R rows, so the weight is read once per pass. */
static inline __attribute__((always_inline)) void rows_k(
        const uint16_t* a, const uint16_t* w, uint16_t* out, int64_t O, int64_t o_lo,
        int64_t o_hi, int64_t I, int64_t row_stride, int R) {
    for (int64_t o = o_lo; o < o_hi; ++o) {
        const uint16_t* wr = w + o * row_stride;
        __m512 acc[CHUNK];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < I; i += 32) {
            /* The weight row two ahead, into L2. The hardware prefetchers stop at each 4 KB
             * page (a 2048-wide bf16 row is one), so without this every row starts with a
             * stall and several rows' products no longer hide the reads (measured: 8 rows
             * 1.46 ms a weight before, 0.59 with it). A prefetch never faults, so the rows
             * past the last need no test. */
            _mm_prefetch((const char*)(wr + 2 * row_stride + i), _MM_HINT_T1);
            __m512bh wv = (__m512bh)_mm512_loadu_si512((const void*)(wr + i));
            for (int r = 0; r < R; ++r)
                acc[r] = _mm512_dpbf16_ps(
                    acc[r], (__m512bh)_mm512_loadu_si512((const void*)(a + r * I + i)), wv);
        }
        for (int r = 0; r < R; ++r) out[r * O + o] = to_bf16(_mm512_reduce_add_ps(acc[r]));
    }
}

#define ROWS_CASE(R) case R: rows_k(a, w, out, O, o_lo, o_hi, I, row_stride, R); break;

static void rows(const uint16_t* a, const uint16_t* w, uint16_t* out, int64_t O, int64_t o_lo,
                 int64_t o_hi, int64_t I, int64_t row_stride, int R) {
    switch (R) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
        ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
        ROWS_CASE(13) ROWS_CASE(14) ROWS_CASE(15) ROWS_CASE(16)
        default: break;
    }
}

/* The outputs [o_lo, o_hi) of every segment */
static void segments_range(const uint16_t* a, const uint16_t* w, const int64_t* ends,
                           uint16_t* out, int64_t P, int64_t E, int64_t O, int64_t I,
                           int64_t expert_stride, int64_t row_stride, int64_t o_lo,
                           int64_t o_hi) {
    /* Rows per pass over a weight: their activations (cap * I bf16) stay within 32 KB, L1,
     * since every weight row walks all of them; a cyclic walk larger than L1 misses
     * on every load (measured at 2048 wide: 8 rows 0.51 ms a weight, 10 rows 1.2). */
    int64_t cap = 16384 / I;
    cap = cap < 2 ? 2 : cap > CHUNK ? CHUNK : cap;
    int64_t start = 0;
    for (int64_t e = 0; e < E; ++e) {
        int64_t end = ends[e] < P ? ends[e] : P;  /* ends are cumulative: never below start */
        /* Equal chunks of at most `cap` rows (12 rows at cap 8: 6 and 6, not 8 and 4) */
        int64_t n = end - start, chunks = (n + cap - 1) / cap;
        for (int64_t c = 0, r0 = start; c < chunks; ++c) {
            int R = (int)((n - (r0 - start) + (chunks - c) - 1) / (chunks - c));
            rows(a + r0 * I, w + e * expert_stride, out + r0 * O, O, o_lo, o_hi, I,
                 row_stride, R);
            r0 += R;
        }
        if (end > start) start = end;
    }
    for (int64_t p = start; p < P; ++p)
        memset(out + p * O + o_lo, 0, (size_t)(o_hi - o_lo) * 2);
}

void segments_bf16(const uint16_t* a, const uint16_t* w, const int64_t* ends, uint16_t* out,
                   int64_t P, int64_t E, int64_t O, int64_t I, int64_t expert_stride,
                   int64_t row_stride, int64_t threads, int64_t min_split) {
#ifdef _OPENMP
    if (threads > 1 && E * O * I >= min_split) {
        /* whole blocks of 64 weight rows per thread: each thread's reads stay sequential */
        int64_t step = (O + threads - 1) / threads;
        step = (step + 63) / 64 * 64;
#pragma omp parallel num_threads((int)threads)
        {
            int64_t lo = (int64_t)omp_get_thread_num() * step;
            int64_t hi = lo + step < O ? lo + step : O;
            if (lo < hi)
                segments_range(a, w, ends, out, P, E, O, I, expert_stride, row_stride, lo, hi);
        }
        return;
    }
#endif
    (void)threads;
    (void)min_split;
    segments_range(a, w, ends, out, P, E, O, I, expert_stride, row_stride, 0, O);
}
