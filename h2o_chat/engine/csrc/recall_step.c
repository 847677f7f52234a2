/* A decode step's ranking of recall's store (engine/store.py, `Store._recall_step`), one call per layer.

   The operators it replaces (a product over the store, a maximum over the group, a top-k, a gather of the
   candidates' keys, their product, a second maximum and top-k, the recall marks, the values' gather) cost
   microseconds each on a CPU whatever their size, and the top-k sorts where a selection suffices; here each
   (row, KV head) is ranked in one pass over its entries:

   - two passes (`low` given): the query projected on the head's principal directions scores every stored
     entry by its coordinates (bf16, widened in vector registers; the maximum over the group's query heads);
     the `many` best are ranked by their exact logits;
   - exact (`low` NULL): every stored entry is ranked by its exact logits;

   then the `k` best by exact logit (the maximum over the group) are recalled: their logits (G x k, unscaled),
   their values, and a mark each. Nothing is sorted: the first pass lists the entries scoring at least a
   threshold the same (row, head)'s last step left (`candidates`), and when the list holds enough the
   candidates are the best of it; otherwise every 8th score estimates a threshold and one branch-free pass keeps
   the entries above it (`top_entries`); the exact k-th best is found by histograms (`kth_largest`); ties at it
   are taken in entry order. Both ways choose the same entries.

   A layer has few (row, head)s (3 on the embedded model), so the threads share each one's passes over its
   entries and its candidates (`PARTS` ranges each), not whole heads.

   Keys and values are float32 (a CPU model's store), float16 or bfloat16 (a GPU model's: `kind`), read as they
   are stored and widened to float32 in registers (F16C or AVX-512 converts float16 in vectors); the arithmetic
   is float32 throughout, so a 16-bit store ranks as a float32 store holding the same numbers.

   Plain C (no PyTorch headers: it builds in a second), called through ctypes by engine/native.py. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define TILE 256 /* the first pass's ranges are whole tiles */
#define LANES 16 /* entries scored at once by the first pass, in vectors (GCC's and clang's vector extensions:
                   one AVX-512 register, or as many narrower ones as the processor has) */
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
#define PREFETCH 8 /* candidates' keys requested ahead */
#define LOOSE 2    /* a step's threshold for the next: about its LOOSE x many-th best first-pass score */
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* the k-th largest of a[0..m) (1 <= k <= m) by quickselect, reordering a */
static float quickselect(float *a, int m, int k) {
    int lo = 0, hi = m - 1, target = k - 1;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        float x = a[lo], y = a[mid], z = a[hi];
        float pivot = (x > y) ? ((y > z) ? y : ((x > z) ? z : x)) : ((x > z) ? x : ((y > z) ? z : y));
        int i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else break;
    }
    return a[target];
}

/* the k-th largest of a[0..m) (1 <= k <= m), overwriting a: a histogram of 256 equal bins between the least
   and the largest keeps only the bin that holds it, until few are left (branch-free passes: a quickselect's
   comparisons are mispredicted half the time). `loose` (may be NULL): from the first histogram, a value at most
   the `k2`-th largest (k2 >= k; the lower edge of its bin), NAN when there was no histogram. */
static float kth_largest(float *a, int m, int k, int k2, float *loose) {
    if (loose != NULL) *loose = NAN;
    while (m > 64) {
        float lo = a[0], hi = a[0];
        for (int i = 1; i < m; i++) {
            lo = MIN(lo, a[i]);
            hi = MAX(hi, a[i]);
        }
        float span = hi - lo;
        if (!(span > 0.f) || !(span < INFINITY)) break; /* all equal, or infinities / NaN: quickselect */
        float scale = 255.99f / span;
        int count[256] = {0};
        for (int i = 0; i < m; i++) count[(int)((a[i] - lo) * scale)]++;
        if (loose != NULL) {
            int bin = 255, above = 0;
            while (bin > 0 && above + count[bin] < MIN(k2, m)) above += count[bin--];
            *loose = lo + bin / scale;
            loose = NULL;
        }
        int bin = 255, above = 0;
        while (above + count[bin] < k) above += count[bin--];
        int kept = 0;
        for (int i = 0; i < m; i++) {
            a[kept] = a[i];
            kept += (int)((a[i] - lo) * scale) == bin;
        }
        if (kept == m) break; /* no progress (values too close for the bins) */
        m = kept;
        k -= above;
    }
    return quickselect(a, m, k);
}

/* idx[0..m), distinct entries below n, into ascending order (flags: n bytes of scratch) */
static void sort_entries(int32_t *idx, int m, int n, uint8_t *flags) {
    memset(flags, 0, (size_t)(n > 0 ? n : 0));
    for (int c = 0; c < m; c++) flags[idx[c]] = 1;
    int c = 0;
    for (int e = 0; e < n; e++) {
        idx[c] = e;
        c += flags[e];
    }
}

/* the `want` best of the entries sel[0..m) (NULL: 0..m), listed in entry order, by scores: into out, in entry
   order unless NaN scores had to fill it (returns 0 then); fwork holds m floats. Those above the want-th largest
   score are taken and the first of those equal to it, as many as it takes.
   `loose`: as `kth_largest`'s, for LOOSE x want. */
static int best_of(const float *scores, const int32_t *sel, int m, int want, int32_t *out, float *fwork,
                   float *loose) {
    for (int c = 0; c < m; c++) fwork[c] = scores[sel ? sel[c] : c];
    float v = kth_largest(fwork, m, want, LOOSE * want, loose);
    int above = 0;
    for (int c = 0; c < m; c++) above += scores[sel ? sel[c] : c] > v;
    int ties = want - above, o = 0; /* the first `ties` entries equal to v join those above it */
    for (int c = 0; c < m; c++) {
        int e = sel ? sel[c] : c;
        float x = scores[e];
        int tie = (x == v) & (ties > 0);
        out[o] = e;
        o += (x > v) | tie;
        ties -= tie;
    }
    if (o == want) return 1;
    for (int c = 0; c < m && o < want; c++) { /* NaN scores (never above nor equal): any, to fill */
        int e = sel ? sel[c] : c;
        if (scores[e] != scores[e]) out[o++] = e;
    }
    return 0;
}

/* the `want` best entries of scores[0..n) into out (in entry order unless NaN scores filled it: returns 0 then);
   fwork holds n floats, iwork n int32. The want-th largest score is found among the entries above a threshold
   that every 8th score estimates (among all of them when the estimate lets fewer than `want` through).
   `next` (may be NULL): a threshold for the next step's first pass to start from (`recall_step`). */
static int top_entries(const float *scores, int n, int want, int32_t *out, float *fwork, int32_t *iwork,
                       float *next) {
    if (next != NULL) *next = NAN;
    if (want >= n) {
        for (int e = 0; e < n; e++) out[e] = e;
        return 1;
    }
    if (n >= 8 * want && n >= 1024) {
        int ns = n / 8, ks = want / 8 + 8 + want / 32;
        for (int j = 0; j < ns; j++) fwork[j] = scores[8 * j];
        float thr = kth_largest(fwork, ns, ks < ns ? ks : ns, LOOSE * want / 8, next);
        int kept = 0;
        for (int e = 0; e < n; e++) {
            iwork[kept] = e;
            kept += scores[e] >= thr;
        }
        if (kept >= want) return best_of(scores, iwork, kept, want, out, fwork, NULL);
    }
    return best_of(scores, NULL, n, want, out, fwork, next);
}

/* bf16 (the upper half of a float32's bits) to float32 */
static inline float widen(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

enum { F32 = 0, F16 = 1, BF16 = 2 }; /* how keys and values are stored (`kind`) */

/* IEEE half (float16) to float32, without the processor's conversion instructions */
static inline float half_to_float(uint16_t h) {
    union {
        uint32_t u;
        float f;
    } v;
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0) { /* zero or subnormal: man x 2^-24 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exp == 31) { /* infinity or NaN */
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112) << 23) | (man << 13);
    }
    return v.f;
}

/* n elements stored as `kind` at src, widened into dst */
static inline void widen_row(float *dst, const char *src, int n, int kind) {
    if (kind == F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    int i = 0;
    if (kind == BF16) {
        for (; i < n; i++) dst[i] = widen(h[i]);
        return;
    }
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + i))));
#elif defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; i++) dst[i] = half_to_float(h[i]);
}

#define MAX_D 256 /* a 16-bit store's key channels, widened per candidate into a buffer on the stack */

/* A layer's ranking is cut into parts of equal work so that the machine's threads share it evenly (a layer has
   few (row, head)s: 3 on the embedded model, which two threads would split 2:1): the first pass and the
   candidates' exact logits in `PARTS` ranges of entries per (row, head), the selections per (row, head). */
#define PARTS 8

typedef struct {
    int G, D, Dv, r, n, many, k, nc, kind, esize;
    int64_t N;
    const float *q, *basis;
    const char *keys, *values; /* `kind`, esize bytes an element */
    const uint16_t *low;
    int32_t *marks;
    float *out_logits, *out_values, *fscratch;
    int32_t *iscratch;
} Step;

/* (row, head) bh's scratch: score (n: first-pass score, then the candidates' exact maximum), fwork (n: the
   selections'), exact (G n: the candidates' exact logits); cand (n: the candidates), top (k: the recalled
   among them), work (n: the selections') */
#define SCORE(s, bh) ((s)->fscratch + (int64_t)(bh) * ((s)->G + 2) * (s)->N)
#define FWORK(s, bh) (SCORE(s, bh) + (s)->N)
#define EXACT(s, bh) (SCORE(s, bh) + 2 * (s)->N)
#define CAND(s, bh) ((s)->iscratch + (int64_t)(bh) * 3 * (s)->N)
#define TOP(s, bh) (CAND(s, bh) + (s)->N)
#define WORK(s, bh) (CAND(s, bh) + 2 * (s)->N)

/* the first-pass scores of entries t0 .. t0 + LANES (coordinates lh, row stride N): the maximum over the group of
   qr (G x R) times the entries' R coordinates. Inlined with R = 16, the coordinates stay in vector registers. */
static inline __attribute__((always_inline)) vf block_scores(const uint16_t *lh, int64_t N, int t0, const float *qr,
                                                             int G, const int R) {
    vf x[16], best;
    for (int j = 0; j < R; j++) { /* the block's coordinates, widened once for the whole group */
        vh h;
        memcpy(&h, lh + (int64_t)j * N + t0, sizeof h);
        x[j] = (vf)(__builtin_convertvector(h, vu) << 16);
    }
    for (int g = 0; g < G; g++) {
        vf acc = x[0] * qr[g * R];
        for (int j = 1; j < R; j++) acc += x[j] * qr[g * R + j];
        if (g == 0) best = acc;
        else {
            vu more = (vu)(acc > best);
            best = (vf)(((vu)acc & more) | ((vu)best & ~more));
        }
    }
    return best;
}

/* first pass, entries [m0, m1) of bh (whole tiles): the query projected on the head's principal directions
   scores each entry by its coordinates, the maximum over the group's query heads. Entries scoring at least
   `thr` (unless NaN) are listed in work[m0..), in entry order; returns how many. */
static int first_pass(const Step *s, int bh, int m0, int m1, float thr) {
    int G = s->G, D = s->D, r = s->r;
    const float *qh = s->q + (int64_t)bh * G * D;
    const float *B = s->basis + (int64_t)bh * D * r;
    float qr[64 * 16];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < r; j++) {
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc += qh[g * D + d] * B[d * r + j];
            qr[g * r + j] = acc;
        }
    const uint16_t *lh = s->low + (int64_t)bh * r * s->N;
    float *score = SCORE(s, bh);
    int32_t *hit = WORK(s, bh) + m0;
    int hits = 0, listing = thr == thr;
    int t0 = m0;
    for (; t0 + LANES <= m1; t0 += LANES) {
        vf best = r == 16 ? block_scores(lh, s->N, t0, qr, G, 16) : block_scores(lh, s->N, t0, qr, G, r);
        memcpy(score + t0, &best, sizeof best);
        if (listing) {
#if defined(__AVX512F__)
            /* the lanes at or above thr packed into one register, stored whole (what follows is overwritten) */
            __mmask16 at = _mm512_cmp_ps_mask((__m512)best, _mm512_set1_ps(thr), _CMP_GE_OQ);
            __m512i entry = _mm512_add_epi32(_mm512_set1_epi32(t0), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9,
                                                                                      8, 7, 6, 5, 4, 3, 2, 1, 0));
            _mm512_storeu_si512((void *)(hit + hits), _mm512_maskz_compress_epi32(at, entry));
            hits += __builtin_popcount(at);
#else
            for (int t = 0; t < LANES; t++) {
                hit[hits] = t0 + t;
                hits += best[t] >= thr;
            }
#endif
        }
    }
    for (int t = t0; t < m1; t++) { /* the last few */
        float best = -INFINITY;
        for (int g = 0; g < G; g++) {
            float acc = 0.f;
            for (int j = 0; j < r; j++) acc += qr[g * r + j] * widen(lh[(int64_t)j * s->N + t]);
            best = MAX(best, acc);
        }
        score[t] = best;
        hit[hits] = t;
        hits += listing && best >= thr;
    }
    return hits;
}

/* the G logits of one key (their maximum returned), written `stride` apart; inlined with the common head sizes */
static inline __attribute__((always_inline)) float dots(const float *qh, const float *kk, int G, const int D,
                                                        float *out, int stride) {
    float best = -INFINITY;
    for (int g = 0; g < G; g++) {
        const float *qq = qh + g * D;
        float dot = 0.f;
        for (int d = 0; d < D; d++) dot += qq[d] * kk[d];
        out[g * stride] = dot;
        best = MAX(best, dot);
    }
    return best;
}

/* exact logits of bh's candidates [c0, c1) (in entry order: their keys are read forward, prefetched ahead --
   scattered rows of a store larger than the caches are most of this pass's time otherwise); score[c] = their
   maximum over the group */
static void exact_logits(const Step *s, int bh, int c0, int c1) {
    int G = s->G, D = s->D, nc = s->nc, row = D * s->esize;
    const float *qh = s->q + (int64_t)bh * G * D;
    const char *kh = s->keys + (int64_t)bh * s->N * row;
    const int32_t *cand = CAND(s, bh);
    float *score = SCORE(s, bh), *exact = EXACT(s, bh), wide[MAX_D];
    for (int c = c0; c < c1; c++) {
        if (c + PREFETCH < c1) {
            const char *ahead = kh + (int64_t)cand[c + PREFETCH] * row;
            for (int b = 0; b < row; b += 64) __builtin_prefetch(ahead + b);
        }
        const float *kk = (const float *)(kh + (int64_t)cand[c] * row);
        if (s->kind != F32) {
            widen_row(wide, (const char *)kk, D, s->kind);
            kk = wide;
        }
        score[c] = D == 64    ? dots(qh, kk, G, 64, exact + c, nc)
                   : D == 128 ? dots(qh, kk, G, 128, exact + c, nc)
                              : dots(qh, kk, G, D, exact + c, nc);
    }
}

/* bh's recalled [j0, j1) of the k best candidates by exact logit (TOP, `top_entries`): their logits, values
   and a recall mark each */
static void recall_out(const Step *s, int bh, int j0, int j1) {
    int G = s->G, k = s->k, nc = s->nc, Dv = s->Dv;
    const int32_t *cand = CAND(s, bh), *top = TOP(s, bh);
    const float *exact = EXACT(s, bh);
    float *ol = s->out_logits + (int64_t)bh * G * k;
    float *ov = s->out_values + (int64_t)bh * k * Dv;
    const char *vh = s->values + (int64_t)bh * s->N * Dv * s->esize;
    int32_t *mk = s->marks + (int64_t)bh * s->N;
    for (int j = j0; j < j1; j++) {
        int c = top[j];
        int e = cand[c];
        for (int g = 0; g < G; g++) ol[g * k + j] = exact[g * nc + c];
        widen_row(ov + (int64_t)j * Dv, vh + (int64_t)e * Dv * s->esize, Dv, s->kind);
        mk[e] += 1;
    }
}

/* part p of PARTS of [0, m), in whole tiles when `tiles` */
static void share(int m, int p, int tiles, int *a, int *b) {
    int64_t unit = tiles ? TILE : 1, units = (m + unit - 1) / unit;
    *a = (int)MIN((int64_t)m, units * p / PARTS * unit);
    *b = (int)MIN((int64_t)m, units * (p + 1) / PARTS * unit);
}

/* bh's candidates, the `many` best entries by first-pass score (in entry order). The entries that scored at
   least the threshold this (row, head) left for this step are listed by the first pass: when they are at least
   `many` and not too many, the candidates are among them (every entry above the many-th best is); otherwise all
   `n` are ranked (`top_entries`). Either way the same entries, and a threshold is left for the next step: about
   the LOOSE x many-th best score, so that the next query's list holds the candidates unless its scores moved a lot. */
static int candidates(const Step *s, int bh, const int *hits, float *threshold) {
    int n = s->n, many = s->many, m = 0;
    int32_t *cand = CAND(s, bh), *work = WORK(s, bh);
    float next = NAN, *score = SCORE(s, bh), *fwork = FWORK(s, bh);
    int ordered = -1;
    if (threshold != NULL && *threshold == *threshold) {
        for (int p = 0; p < PARTS; p++) { /* the parts' lists, one after the other */
            int a, b, c = hits[p];
            share(n, p, 1, &a, &b);
            if (a != m) memmove(work + m, work + a, sizeof(int32_t) * c);
            m += c;
        }
        if (m >= many && m <= 2 * LOOSE * many) ordered = best_of(score, work, m, many, cand, fwork, &next);
    }
    int listed = ordered >= 0;
    if (!listed) ordered = top_entries(score, n, many, cand, fwork, work, &next);
    if (!ordered) sort_entries(cand, many, n, (uint8_t *)work);
    if (threshold != NULL) *threshold = next;
    return listed;
}

/* Every (row, head) of a layer, shared by `threads` (OpenMP, PyTorch's own runtime). `keys` and `values` stored
   as `kind` (F32, F16, BF16); the query, basis, logits and values out in float32. `low`: the stored keys'
   coordinates in bf16, (BH, r, N); NULL for an exact ranking. `thresholds` (BH; may be NULL): what each
   (row, head)'s last step left for this one (NaN: nothing), updated. Scratch: per (row, head), (G + 2) N floats
   and 3 N int32. Returns how many (row, head)s took their candidates from the first pass's lists (>= 0), or < 0
   for arguments it cannot take. */
int recall_step(int BH, int G, int D, int Dv, int r, int64_t N, int n, int many, int k, const float *q,
                const float *basis, const uint16_t *low, const void *keys, const void *values, int32_t *marks,
                float *thresholds, float *out_logits, float *out_values, float *fscratch, int32_t *iscratch,
                int threads, int kind) {
    if (k > n || n > N || (low != NULL && k > many) || G * r > 1024 || r > 16 || G > 64 || threads < 1) return -1;
    if (kind < F32 || kind > BF16 || (kind != F32 && D > MAX_D)) return -1;
    int two = low != NULL && many < n;
    Step s = {G, D, Dv, r, n, many, k, two ? many : n, kind, kind == F32 ? 4 : 2, N, q, basis,
              (const char *)keys, (const char *)values, low, marks, out_logits, out_values, fscratch, iscratch};
    Step *sp = &s;
    int hits[two ? BH * PARTS : 1], listed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (two) {
#pragma omp for schedule(static)
            for (int u = 0; u < BH * PARTS; u++) {
                int a, b, bh = u / PARTS;
                share(n, u % PARTS, 1, &a, &b);
                hits[u] = a < b ? first_pass(sp, bh, a, b, thresholds ? thresholds[bh] : NAN) : 0;
            }
#pragma omp for schedule(dynamic, 1) reduction(+ : listed)
            for (int bh = 0; bh < BH; bh++)
                listed += candidates(sp, bh, hits + bh * PARTS, thresholds ? thresholds + bh : NULL);
        } else {
#pragma omp for schedule(static)
            for (int bh = 0; bh < BH; bh++)
                for (int m = 0; m < n; m++) CAND(sp, bh)[m] = m;
        }
#pragma omp for schedule(static)
        for (int u = 0; u < BH * PARTS; u++) {
            int a, b;
            share(sp->nc, u % PARTS, 0, &a, &b);
            if (a < b) exact_logits(sp, u / PARTS, a, b);
        }
#pragma omp for schedule(dynamic, 1)
        for (int bh = 0; bh < BH; bh++)
            top_entries(SCORE(sp, bh), sp->nc, k, TOP(sp, bh), FWORK(sp, bh), WORK(sp, bh), NULL);
#pragma omp for schedule(static)
        for (int u = 0; u < BH * PARTS; u++) {
            int a, b;
            share(k, u % PARTS, 0, &a, &b);
            if (a < b) recall_out(sp, u / PARTS, a, b);
        }
    }
    return listed;
}
