/* A decode step's ranking of recall's store (engine/store.py, `Store._recall_step`), one call per layer.

   The operators it replaces (a product over the store, a maximum over the group, a top-k, a gather of the
   candidates' keys, their product, a second maximum and top-k, the recall marks, the values' gather) cost
   microseconds each on a CPU whatever their size, and the top-k sorts where a selection suffices; here each
   (row, KV head) is ranked in one pass over its entries:

   - two passes (`low` given): the query projected on the head's principal directions scores every stored
     entry by its coordinates (the maximum over the group's query heads); the `many` best are ranked by their
     exact logits;
   - exact (`low` NULL): every stored entry is ranked by its exact logits;

   then the `k` best by exact logit (the maximum over the group) are recalled: their logits (G x k, unscaled),
   their values, and a mark each. Nothing is sorted (`top_entries`): every 8th score estimates a threshold, one
   branch-free pass keeps the entries above it (all of them when the estimate lets too few through), and the
   exact k-th best among those is found by histograms (`kth_largest`); ties at it are taken in entry order.

   Plain C (no PyTorch headers: it builds in a second), float32, called through ctypes by engine/native.py. */
#include <stdint.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TILE 256
#define PREFETCH 8 /* candidates' keys requested ahead */
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
   comparisons are mispredicted half the time) */
static float kth_largest(float *a, int m, int k) {
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

/* the `want` best entries of scores[0..n) into out (their indices, in no particular order); fwork holds n
   floats, iwork n int32. The want-th largest score is found among the entries above a threshold that every 8th
   score estimates (among all of them when the estimate lets fewer than `want` through); the entries above it are
   taken, then those equal to it in entry order. */
static void top_entries(const float *scores, int n, int want, int32_t *out, float *fwork, int32_t *iwork) {
    if (want >= n) {
        for (int e = 0; e < n; e++) out[e] = e;
        return;
    }
    const int32_t *sel = NULL;
    int m = n;
    if (n >= 8 * want && n >= 1024) {
        int ns = n / 8, ks = want / 8 + 8 + want / 32;
        for (int s = 0; s < ns; s++) fwork[s] = scores[8 * s];
        float thr = kth_largest(fwork, ns, ks < ns ? ks : ns);
        int kept = 0;
        for (int e = 0; e < n; e++) {
            iwork[kept] = e;
            kept += scores[e] >= thr;
        }
        if (kept >= want) {
            sel = iwork;
            m = kept;
        }
    }
    for (int c = 0; c < m; c++) fwork[c] = scores[sel ? sel[c] : c];
    float v = kth_largest(fwork, m, want);
    int o = 0;
    for (int c = 0; c < m; c++) {
        int e = sel ? sel[c] : c;
        out[o] = e;
        o += scores[e] > v;
    }
    for (int c = 0; c < m && o < want; c++) { /* ties at v, in entry order */
        int e = sel ? sel[c] : c;
        if (scores[e] == v) out[o++] = e;
    }
    for (int c = 0; c < m && o < want; c++) { /* NaN scores (never above, never equal): any to fill */
        int e = sel ? sel[c] : c;
        if (scores[e] != scores[e]) out[o++] = e;
    }
}

/* one (row, head) of `recall_step`; scratch: (G + 2) N floats and 3 N int32 */
static void rank_head(int bh, int G, int D, int Dv, int r, int64_t N, int n, int many, int k, const float *q,
                      const float *basis, const float *low, const float *keys, const float *values, int32_t *marks,
                      float *out_logits, float *out_values, float *fscratch, int32_t *iscratch) {
    float *score = fscratch;          /* n: first-pass score, then exact maximum */
    float *fwork = fscratch + N;      /* n: the selections' scratch */
    float *exact = fscratch + 2 * N;  /* G n: exact logits of the ranked entries */
    int32_t *cand = iscratch;         /* n: the ranked entries */
    int32_t *top = iscratch + N;      /* k <= n: the recalled among them */
    int32_t *work = iscratch + 2 * N; /* n: the selections' scratch */
    const float *qh = q + (int64_t)bh * G * D;
    const float *kh = keys + (int64_t)bh * N * D;
    int nc;
    if (low != NULL && many < n) {
        /* the query in the basis: G x r */
        float qr[64 * 16];
        const float *B = basis + (int64_t)bh * D * r;
        for (int g = 0; g < G; g++)
            for (int j = 0; j < r; j++) {
                float s = 0.f;
                for (int d = 0; d < D; d++) s += qh[g * D + d] * B[d * r + j];
                qr[g * r + j] = s;
            }
        const float *lh = low + (int64_t)bh * r * N;
        for (int m0 = 0; m0 < n; m0 += TILE) {
            int len = n - m0 < TILE ? n - m0 : TILE;
            float acc[TILE];
            for (int t = 0; t < len; t++) acc[t] = -INFINITY;
            for (int g = 0; g < G; g++) {
                float part[TILE];
                for (int t = 0; t < len; t++) part[t] = 0.f;
                for (int j = 0; j < r; j++) {
                    const float *row = lh + (int64_t)j * N + m0;
                    float w = qr[g * r + j];
                    for (int t = 0; t < len; t++) part[t] += w * row[t];
                }
                for (int t = 0; t < len; t++) acc[t] = MAX(acc[t], part[t]);
            }
            memcpy(score + m0, acc, sizeof(float) * len);
        }
        top_entries(score, n, many, cand, fwork, work);
        nc = many;
    } else {
        nc = n;
        for (int m = 0; m < n; m++) cand[m] = m;
    }
    /* exact logits of the candidates; score[c] = their maximum over the group. The candidates' keys are
       read in entry order, prefetched ahead: scattered rows of a store larger than the caches are most of
       this pass's time otherwise. */
    if (nc < n) sort_entries(cand, nc, n, (uint8_t *)work);
    for (int c = 0; c < nc; c++) {
        if (c + PREFETCH < nc) {
            const char *ahead = (const char *)(kh + (int64_t)cand[c + PREFETCH] * D);
            for (int b = 0; b < D * 4; b += 64) __builtin_prefetch(ahead + b);
        }
        const float *kk = kh + (int64_t)cand[c] * D;
        float best = -INFINITY;
        for (int g = 0; g < G; g++) {
            const float *qq = qh + g * D;
            float s = 0.f;
            for (int d = 0; d < D; d++) s += qq[d] * kk[d];
            exact[g * nc + c] = s;
            best = MAX(best, s);
        }
        score[c] = best;
    }
    top_entries(score, nc, k, top, fwork, work);
    float *ol = out_logits + (int64_t)bh * G * k;
    float *ov = out_values + (int64_t)bh * k * Dv;
    const float *vh = values + (int64_t)bh * N * Dv;
    int32_t *mk = marks + (int64_t)bh * N;
    for (int s = 0; s < k; s++) {
        int c = top[s];
        int e = cand[c];
        for (int g = 0; g < G; g++) ol[g * k + s] = exact[g * nc + c];
        memcpy(ov + (int64_t)s * Dv, vh + (int64_t)e * Dv, sizeof(float) * Dv);
        mk[e] += 1;
    }
}

/* Every (row, head) of a layer, `threads` at a time (OpenMP, sharing PyTorch's runtime). Scratch: per thread,
   (G + 2) N floats and 3 N int32. Returns 0, or < 0 for arguments it cannot take. */
int recall_step(int BH, int G, int D, int Dv, int r, int64_t N, int n, int many, int k, const float *q,
                const float *basis, const float *low, const float *keys, const float *values, int32_t *marks,
                float *out_logits, float *out_values, float *fscratch, int32_t *iscratch,
                int threads) {
    if (k > n || n > N || (low != NULL && k > many) || G * r > 1024 || threads < 1) return -1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && BH > 1)
    for (int bh = 0; bh < BH; bh++) {
        int t = 0;
#ifdef _OPENMP
        t = omp_get_thread_num();
#endif
        rank_head(bh, G, D, Dv, r, N, n, many, k, q, basis, low, keys, values, marks, out_logits, out_values,
                  fscratch + (int64_t)t * (G + 2) * N, iscratch + (int64_t)t * 3 * N);
    }
    return 0;
}
