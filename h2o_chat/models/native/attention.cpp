// A decode step's attention on x86 CPUs (AVX2, FMA and F16C; built into both of the library's builds), for the H2O cache:
// one query per row and head over the first W slots of its layer plus the step's own key, returning the output and
// each key's softmax mass summed over the query heads that share its KV head. h2o_chat/engine/step/attention.py
// (`attention_over_slots`) calls it where PyTorch would run two batched products, a masked fill, a concatenation
// and a softmax, each over every row and head with a barrier between them; here each (row, KV head) reads its keys
// and values once, stored in float32 or in 8 bits with a float16 scale per token (`--kv-quant 8bit`, read as int8
// and widened in registers: a quarter of the bytes). Empty slots are neither read nor given mass.
//
// Each output's arithmetic depends only on its row's slots, not on W nor on the rows beside it (logits summed over
// the head's channels in their order, softmax sums in lanes by slot index, the step's own key added last): a row
// alone decodes as it does in a batch.
//
// Recall's decode steps (`recall_rank.step`) hand it the tokens they brought back from the store: their logits
// (already ranked with the step's query, so their keys are never read twice) and their values, attended in the same
// softmax after the slots and the step's own token, and given no mass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// e^x for 8 floats (Cephes' expf: 2^n times a degree-5 polynomial on [-ln 2 / 2, ln 2 / 2]; ~1 ulp). -inf gives 0
// through the caller's mask, not here (below -88.4 this returns ~1e-38).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// the horizontal sums of 8 vectors, as one vector (lane j: v[j]'s)
inline __m256 hsum8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
}

// One (row, KV head): its G queries (D channels each, scaled), its W slots (`k` and `v` their first, `sk` and `sv`
// elements apart; `ks`/`vs` their scales, or null), which hold a token
// (`valid`, `sm` apart), and the step's own key and value.
template <typename T>
struct Head {
  const float* q;
  int64_t G, D, Dv, W;
  const T* k;
  const T* v;
  int64_t sk, sv;
  const float* ks;  // each slot's scales, widened (null: float32 slots)
  const float* vs;
  const bool* valid;
  int64_t sm;
  const float* new_k;
  const float* new_v;
  int64_t R;            // recalled tokens (0: none)
  const float* more;    // their logits (G, R), scaled, -inf where none
  const float* more_v;  // their values (R, Dv)
};

// logits[g * P + s] = q_g . k_s (x its scale), -inf for an empty slot, for GT queries from g0: 4 slots at a time,
// each key's 8 channels read (and widened) once for the GT queries, 4 GT sums in registers. Each logit is summed
// alike whatever its place among the 4 (a lane of the same reduction).
template <typename T, int GT>
void logits(const Head<T>& h, int64_t P, int64_t g0, float* out) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t s0 = 0; s0 < h.W; s0 += 4) {
    const int64_t n = std::min<int64_t>(4, h.W - s0);
    const T* key[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) key[j] = h.k + (s0 + (j < n ? j : 0)) * h.sk;
    __m256 acc[GT][4];
#pragma GCC unroll 3
    for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < h.D; d += 8) {
      __m256 qv[GT];
#pragma GCC unroll 3
      for (int g = 0; g < GT; ++g) qv[g] = _mm256_loadu_ps(h.q + (g0 + g) * h.D + d);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = load8(key[j] + d);
#pragma GCC unroll 3
        for (int g = 0; g < GT; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
      }
    }
#pragma GCC unroll 3
    for (int g = 0; g < GT; ++g) {
      // per 128-bit half: (sum of a_j's 4 channels) for j = 0-3; the halves added: the 4 dot products
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
      alignas(16) float dot[4];
      _mm_store_ps(dot, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      float* row = out + (g0 + g) * P;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t s = s0 + j;
        row[s] = h.valid[s * h.sm] ? (h.ks == nullptr ? dot[j] : dot[j] * h.ks[s]) : minus_inf;
      }
    }
  }
}

// out[g][d0 + 0 .. 8 NV - 1] = sum over held slots of p[g][s] * scale_v[s] * v[s][...] + p_new[g] * new_v[...],
// for GT queries from g0 (their sums in registers, each slot's values read once for them)
template <typename T, int GT, int NV>
void weigh(const Head<T>& h, const float* probs, int64_t P, const float* own, int64_t g0, int64_t d0, float* out) {
  __m256 acc[GT][NV];
#pragma GCC unroll 3
  for (int g = 0; g < GT; ++g)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t s = 0; s < h.W; ++s) {
    if (!h.valid[s * h.sm]) continue;
    const float scale = h.vs == nullptr ? 1.0f : h.vs[s];
    __m256 w[GT];
#pragma GCC unroll 3
    for (int g = 0; g < GT; ++g) w[g] = _mm256_set1_ps(probs[(g0 + g) * P + s] * scale);
    const T* row = h.v + s * h.sv + d0;
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __m256 vv = load8(row + 8 * j);
#pragma GCC unroll 3
      for (int g = 0; g < GT; ++g) acc[g][j] = _mm256_fmadd_ps(w[g], vv, acc[g][j]);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < GT; ++g) {
    const __m256 p = _mm256_set1_ps(own[g0 + g]);
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      const __m256 mine = _mm256_loadu_ps(h.new_v + d0 + 8 * j);
      _mm256_storeu_ps(out + (g0 + g) * h.Dv + d0 + 8 * j, _mm256_fmadd_ps(p, mine, acc[g][j]));
    }
  }
}

// run.template operator()<GT>(g0) for the G queries in tiles of 3, then one of 2 or 1
template <typename Run>
void by_query_tiles(int64_t G, Run&& run) {
  int64_t g0 = 0;
  for (; g0 + 3 <= G; g0 += 3) run.template operator()<3>(g0);
  if (G - g0 == 2) run.template operator()<2>(g0);
  if (G - g0 == 1) run.template operator()<1>(g0);
}

// One (row, KV head): out (G, Dv), mass (W + 1), with `scratch` for G x P logits (P: W rounded up to 8) and the
// recalled tokens' G x R probabilities
template <typename T>
void attend(const Head<T>& h, float* out, float* mass, std::vector<float>& scratch) {
  const int64_t P = (h.W + 7) / 8 * 8;
  scratch.resize(h.G * P + h.G + h.G * h.R);
  float* probs = scratch.data();
  float* own = probs + h.G * P;  // each query's probability of the step's own token
  float* recalled = own + h.G;   // and of each recalled token
  by_query_tiles(h.G, [&]<int GT>(int64_t g0) { logits<T, GT>(h, P, g0, probs); });
  for (int64_t i = 0; i < h.G; ++i)
    for (int64_t s = h.W; s < P; ++s) probs[i * P + s] = -std::numeric_limits<float>::infinity();  // padding
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t g = 0; g < h.G; ++g) {
    float* p = probs + g * P;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < h.D; d += 8)
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(h.q + g * h.D + d), _mm256_loadu_ps(h.new_k + d), acc);
    const float mine = hsum(acc);
    __m256 top = _mm256_set1_ps(mine);
    for (int64_t s = 0; s < P; s += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(p + s));
    float largest = hmax(top);
    const float* more = h.more + g * h.R;
    for (int64_t r = 0; r < h.R; ++r) largest = std::max(largest, more[r]);
    const __m256 m = _mm256_set1_ps(largest);
    __m256 sums = _mm256_setzero_ps();
    for (int64_t s = 0; s < P; s += 8) {
      const __m256 x = _mm256_loadu_ps(p + s);
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, m)), _mm256_cmp_ps(x, minus_inf, _CMP_NEQ_OQ));
      _mm256_storeu_ps(p + s, e);
      sums = _mm256_add_ps(sums, e);
    }
    const float e_own = _mm256_cvtss_f32(exp8(_mm256_set1_ps(mine - largest)));
    float* back = recalled + g * h.R;
    float more_sum = 0.0f;  // the recalled tokens' exponentials, summed in their order
    for (int64_t r = 0; r < h.R; ++r) {
      back[r] = more[r] == -std::numeric_limits<float>::infinity()
                    ? 0.0f
                    : _mm256_cvtss_f32(exp8(_mm256_set1_ps(more[r] - largest)));
      more_sum += back[r];
    }
    const float inverse = 1.0f / (hsum(sums) + e_own + more_sum);
    const __m256 iv = _mm256_set1_ps(inverse);
    for (int64_t s = 0; s < P; s += 8) _mm256_storeu_ps(p + s, _mm256_mul_ps(_mm256_loadu_ps(p + s), iv));
    own[g] = e_own * inverse;
    for (int64_t r = 0; r < h.R; ++r) back[r] *= inverse;
  }
  for (int64_t s = 0; s < h.W; ++s) {
    float total = 0.0f;
    for (int64_t g = 0; g < h.G; ++g) total += probs[g * P + s];
    mass[s] = total;
  }
  float total = 0.0f;
  for (int64_t g = 0; g < h.G; ++g) total += own[g];
  mass[h.W] = total;
  int64_t d0 = 0;
  for (; d0 + 32 <= h.Dv; d0 += 32)
    by_query_tiles(h.G, [&]<int GT>(int64_t g0) { weigh<T, GT, 4>(h, probs, P, own, g0, d0, out); });
  for (; d0 < h.Dv; d0 += 8)
    by_query_tiles(h.G, [&]<int GT>(int64_t g0) { weigh<T, GT, 1>(h, probs, P, own, g0, d0, out); });
  for (int64_t g = 0; g < h.G; ++g)  // then the recalled tokens', added to the output in their order
    for (int64_t r = 0; r < h.R; ++r) {
      const float w = recalled[g * h.R + r];
      if (w == 0.0f) continue;
      const __m256 wv = _mm256_set1_ps(w);
      const float* row = h.more_v + r * h.Dv;
      float* o = out + g * h.Dv;
      for (int64_t d = 0; d < h.Dv; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(row + d), _mm256_loadu_ps(o + d)));
    }
}

// q (B, H, G, D) float32, the queries of KV head h (scaled); keys (B, H, W, D) and values (B, H, W, Dv), float32 or
// int8 with kscale/vscale (B, H, W, 1) float16; valid (B, 1, W) bool; new_k (B, H, 1, D) and new_v (B, H, 1, Dv)
// float32; recall's tokens brought back, if any: more (B, H, G, R) their logits, scaled (-inf: none), more_v
// (B, H, R, Dv) their values, float32. Returns (output (B, H, G, Dv) float32, mass (B, H, W + 1) float32: the
// slots', then the new token's; the recalled tokens get none).
std::tuple<at::Tensor, at::Tensor> decode_attention(const at::Tensor& q_in, const at::Tensor& keys,
                                                    const at::Tensor& values, const at::Tensor& valid,
                                                    const std::optional<at::Tensor>& kscale,
                                                    const std::optional<at::Tensor>& vscale, const at::Tensor& new_k,
                                                    const at::Tensor& new_v,
                                                    const std::optional<at::Tensor>& more_in,
                                                    const std::optional<at::Tensor>& more_v_in) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "q: (B, H, G, D) float32");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 && keys.size(0) == B && keys.size(1) == H &&
                  values.size(0) == B && values.size(1) == H && keys.size(2) == values.size(2) && keys.size(3) == D,
              "keys (B, H, W, D) and values (B, H, W, Dv) for q (B, H, G, D)");
  const int64_t W = keys.size(2), Dv = values.size(3);
  TORCH_CHECK(D % 8 == 0 && Dv % 8 == 0, "head sizes must be multiples of 8, not ", D, " and ", Dv);
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "keys and values: each slot's channels contiguous");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values of one dtype");
  const bool quantized = keys.scalar_type() == at::kChar;
  TORCH_CHECK(quantized || keys.scalar_type() == at::kFloat, "keys and values: float32 or int8");
  TORCH_CHECK(quantized == (kscale.has_value() && vscale.has_value()), "int8 keys and values come with their scales");
  if (quantized) {
    for (const at::Tensor* s : {&*kscale, &*vscale})
      TORCH_CHECK(s->scalar_type() == at::kHalf && s->dim() == 4 && s->size(0) == B && s->size(1) == H &&
                      s->size(2) == W && s->stride(2) == kscale->stride(2) && s->stride(1) == kscale->stride(1) &&
                      s->stride(0) == kscale->stride(0),
                  "scales: (B, H, W, 1) float16, both laid out alike");
  }
  TORCH_CHECK(valid.dim() == 3 && valid.scalar_type() == at::kBool && valid.size(0) == B && valid.size(1) == 1 &&
                  valid.size(2) == W,
              "valid: (B, 1, W) bool");
  TORCH_CHECK(new_k.scalar_type() == at::kFloat && new_v.scalar_type() == at::kFloat && new_k.dim() == 4 &&
                  new_v.dim() == 4 && new_k.size(0) == B && new_k.size(1) == H && new_k.size(2) == 1 &&
                  new_k.size(3) == D && new_v.size(0) == B && new_v.size(1) == H && new_v.size(2) == 1 &&
                  new_v.size(3) == Dv && new_k.stride(3) == 1 && new_v.stride(3) == 1,
              "new_k (B, H, 1, D), new_v (B, H, 1, Dv) float32");
  TORCH_CHECK(more_in.has_value() == more_v_in.has_value(), "recalled tokens come with their logits and values");
  at::Tensor more, more_v;
  int64_t R = 0;
  if (more_in.has_value()) {
    more = more_in->contiguous(), more_v = more_v_in->contiguous();
    TORCH_CHECK(more.dim() == 4, "more (B, H, G, R)");
    R = more.size(3);
    TORCH_CHECK(more.scalar_type() == at::kFloat && more_v.scalar_type() == at::kFloat && more.dim() == 4 &&
                    more_v.dim() == 4 && more.size(0) == B && more.size(1) == H && more.size(2) == G &&
                    more_v.size(0) == B && more_v.size(1) == H && more_v.size(2) == R && more_v.size(3) == Dv,
                "more (B, H, G, R) and more_v (B, H, R, Dv) float32");
  }
  at::Tensor out = at::empty({B, H, G, Dv}, q.options());
  at::Tensor mass = at::empty({B, H, W + 1}, q.options());
  const auto run = [&](auto* kind) {
    using T = std::remove_pointer_t<decltype(kind)>;
    const T* kp = static_cast<const T*>(keys.data_ptr());
    const T* vp = static_cast<const T*>(values.data_ptr());
    const at::Half* ksp = quantized ? kscale->data_ptr<at::Half>() : nullptr;
    const at::Half* vsp = quantized ? vscale->data_ptr<at::Half>() : nullptr;
    const bool* mp = valid.data_ptr<bool>();
    at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> scratch, scales(quantized ? 2 * W : 0);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / H, hh = i % H;
        if (quantized) {  // this head's scales widened once (F16C)
          const int64_t so = b * kscale->stride(0) + hh * kscale->stride(1), ss = kscale->stride(2);
          for (int64_t s = 0; s < W; ++s) {
            scales[s] = _cvtsh_ss(ksp[so + s * ss].x);
            scales[W + s] = _cvtsh_ss(vsp[so + s * ss].x);
          }
        }
        const Head<T> head{q.data_ptr<float>() + i * G * D,
                           G,
                           D,
                           Dv,
                           W,
                           kp + b * keys.stride(0) + hh * keys.stride(1),
                           vp + b * values.stride(0) + hh * values.stride(1),
                           keys.stride(2),
                           values.stride(2),
                           quantized ? scales.data() : nullptr,
                           quantized ? scales.data() + W : nullptr,
                           mp + b * valid.stride(0),
                           valid.stride(2),
                           new_k.data_ptr<float>() + b * new_k.stride(0) + hh * new_k.stride(1),
                           new_v.data_ptr<float>() + b * new_v.stride(0) + hh * new_v.stride(1),
                           R,
                           R ? more.data_ptr<float>() + i * G * R : nullptr,
                           R ? more_v.data_ptr<float>() + i * R * Dv : nullptr};
        attend(head, out.data_ptr<float>() + i * G * Dv, mass.data_ptr<float>() + i * (W + 1), scratch);
      }
    });
  };
  if (quantized) {
    run(static_cast<int8_t*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return {out, mass};
}

// Recall's ranking in a decode step (h2o_chat/engine/policies/recall_rank.py, `step`, whose PyTorch operations it
// replaces on CPU: a dozen small operators per layer, each a parallel region of its own), per (row, KV head) in one
// pass: the first pass over the coordinates of the entries it is given (the store's first `width`) in the head's
// principal directions (the largest over the group's queries of q B . low x its scale; an empty entry -inf), its
// `candidates` x k best (ties to the lower entry), their exact logits under each query (the keys widened from
// int8: exact in float32), the k best of those by their largest, and their values. A row that recalls fewer
// (`per_row`) ranks only its own number of candidates and gets -inf logits and the spare entry past its own
// number. Each (row, head)'s arithmetic is its own: a row ranks alone as in a batch.
struct Ranked {
  float value;
  int64_t at;
};

// a candidate of the exact pass: its exact value, then (its place among the candidates) its first pass's value and
// entry -- the candidates need not be sorted for ties to go as they would in first-pass order
struct Exact {
  float value;
  Ranked first;
  int64_t place;  // among the candidates (where its logits are)
};

// the first pass's order: the larger value first, ties to the lower entry (a total order)
inline bool before(const Ranked& a, const Ranked& b) { return a.value > b.value || (a.value == b.value && a.at < b.at); }

inline bool before(const Exact& a, const Exact& b) {
  return a.value > b.value || (a.value == b.value && before(a.first, b.first));
}

// the first pass's sums of 8 entries under one query (its R coordinates in the head's basis at `ql`; the entries'
// widened coordinates at `x`, R apart): R a constant, so that the 8 sums stay in registers
template <int R>
inline __m256 first8(const float* ql, const float* x) {
  __m256 acc[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    acc[j] = _mm256_mul_ps(_mm256_loadu_ps(ql), _mm256_load_ps(x + j * R));
#pragma GCC unroll 4
    for (int c = 8; c < R; c += 8)
      acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(ql + c), _mm256_load_ps(x + j * R + c), acc[j]);
  }
  return hsum8(acc);
}

// the n best of `all`'s first `size` into its first n places, in any order
template <typename T>
inline void best_of(std::vector<T>& all, int64_t n, int64_t size) {
  const auto better = [](const T& a, const T& b) { return before(a, b); };
  if (n < size) std::nth_element(all.begin(), all.begin() + n, all.begin() + size, better);
}

// the n best of `all` (sorted, best first) into its first n places
template <typename T>
inline void best_first(std::vector<T>& all, int64_t n) {
  best_of(all, n, static_cast<int64_t>(all.size()));
  std::sort(all.begin(), all.begin() + n, [](const T& a, const T& b) { return before(a, b); });
}

// a table's entry into the cache ahead of its reading (its `bytes`, a line at a time): the exact pass and the
// values read entries at random places of a store that the weights' stream has pushed out of the caches, each
// read a wait for memory unless asked for early (measured: half the op's time waited on its candidates' keys)
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(c + o, _MM_HINT_T0);
}
constexpr int64_t AHEAD = 16;  // candidates asked for ahead of the one read

// q (B, H, G, D) float32, unscaled; basis (B, H, D, r) float32; the first `width` entries' low (B, H, width, r) int8,
// lscale (B, H, width, 1) float16 and pos (B, H, width) int32 (-1: empty) -- a size, not a value, so that a
// compiled step's one program serves every width --; every entry's keys (B, H, E, D) and values (B, H, E, Dv) int8
// with kscale, vscale (B, H, E, 1) float16, the last entry the spare; pick (k,): k, the tokens a step recalls (a
// size too); per_row (B,) int64 or none. Returns (logits (B, H, G, k) float32 unscaled, values (B, H,
// k, Dv) float32, index (B, H, k) int64), best first.
std::tuple<at::Tensor, at::Tensor, at::Tensor> recall_step(
    const at::Tensor& q_in, const at::Tensor& basis, const at::Tensor& low, const at::Tensor& lscale,
    const at::Tensor& pos, const at::Tensor& keys, const at::Tensor& kscale, const at::Tensor& values,
    const at::Tensor& vscale, const at::Tensor& pick, int64_t candidates,
    const std::optional<at::Tensor>& per_row_in) {
  TORCH_CHECK(q_in.dim() == 4 && q_in.scalar_type() == at::kFloat, "q: (B, H, G, D) float32");
  const at::Tensor q = q_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  TORCH_CHECK(keys.dim() == 4 && low.dim() == 4, "keys: (B, H, E, D), low: (B, H, width, r)");
  const int64_t E = keys.size(2), width = low.size(2);
  const auto table = [&](const at::Tensor& t, at::ScalarType dtype, int64_t n, int64_t last, const char* what) {
    TORCH_CHECK(t.dim() == 4 && t.scalar_type() == dtype && t.size(0) == B && t.size(1) == H && t.size(2) == n &&
                    (last < 0 || t.size(3) == last) && t.stride(3) == 1,
                what, ": (B, H, entries, ...) with each entry's last dim contiguous, of the expected dtype, not ",
                t.sizes(), " strides ", t.strides(), " ", t.scalar_type());
  };
  table(keys, at::kChar, E, D, "keys");
  table(values, at::kChar, E, -1, "values");
  table(low, at::kChar, width, -1, "low");
  table(lscale, at::kHalf, width, 1, "lscale");
  for (const at::Tensor* s : {&kscale, &vscale}) table(*s, at::kHalf, E, 1, "scales");
  const int64_t Dv = values.size(3), r = low.size(3);
  TORCH_CHECK(basis.dim() == 4 && basis.scalar_type() == at::kFloat && basis.size(0) == B && basis.size(1) == H &&
                  basis.size(2) == D && basis.size(3) == r,
              "basis: (B, H, D, r) float32");
  const at::Tensor base = basis.contiguous();
  TORCH_CHECK(pos.dim() == 3 && pos.scalar_type() == at::kInt && pos.size(0) == B && pos.size(1) == H &&
                  pos.size(2) == width,
              "pos: (B, H, width) int32");
  const int64_t k = pick.size(0), spare = E - 1, C = candidates * k;
  TORCH_CHECK(pick.dim() == 1 && k >= 1 && candidates >= 1 && width < E && C <= width,
              "recall_step: k ", k, " x ", candidates, " candidates from ", width, " of ", E, " entries");
  at::Tensor per_row;
  if (per_row_in.has_value()) {
    per_row = per_row_in->to(at::kLong).contiguous();
    TORCH_CHECK(per_row.dim() == 1 && per_row.size(0) == B, "per_row: (B,)");
  }
  at::Tensor logits_out = at::empty({B, H, G, k}, q.options());
  at::Tensor values_out = at::empty({B, H, k, Dv}, q.options());
  at::Tensor index_out = at::empty({B, H, k}, q.options().dtype(at::kLong));
  const float minus_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, B * H, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> ql(G * r), exact(G * C);
    std::vector<Ranked> first(width);
    std::vector<Exact> second(C);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, h = i % H;
      const float* qi = q.data_ptr<float>() + i * G * D;
      const float* bi = base.data_ptr<float>() + i * D * r;
      const bool wide = r % 8 == 0 && r <= 32;  // the coordinates' blocks of 8 fit in registers
      for (int64_t g = 0; g < G; ++g) {  // the queries in the head's basis: q_g B
        if (wide) {
          __m256 acc[4];
          for (int64_t c = 0; c < r; c += 8) acc[c / 8] = _mm256_setzero_ps();
          for (int64_t d = 0; d < D; ++d)
            for (int64_t c = 0; c < r; c += 8)
              acc[c / 8] = _mm256_fmadd_ps(_mm256_set1_ps(qi[g * D + d]), _mm256_loadu_ps(bi + d * r + c), acc[c / 8]);
          for (int64_t c = 0; c < r; c += 8) _mm256_storeu_ps(&ql[g * r + c], acc[c / 8]);
        } else {
          for (int64_t c = 0; c < r; ++c) {
            float sum = 0.0f;
            for (int64_t d = 0; d < D; ++d) sum += qi[g * D + d] * bi[d * r + c];
            ql[g * r + c] = sum;
          }
        }
      }
      const auto at_entry = [&](const at::Tensor& t, int64_t e) {
        return b * t.stride(0) + h * t.stride(1) + e * t.stride(2);
      };
      const int8_t* lp = low.data_ptr<int8_t>() + at_entry(low, 0);
      const at::Half* lsp = lscale.data_ptr<at::Half>() + at_entry(lscale, 0);
      const int32_t* pp = pos.data_ptr<int32_t>() + b * pos.stride(0) + h * pos.stride(1);
      const int64_t sl = low.stride(2), sls = lscale.stride(2), sp = pos.stride(2);
      int64_t e = 0;
      if (wide) {  // 8 entries at a time (each lane its own entry's sums, in one order wherever it is)
        alignas(32) float x[8 * 32], scale[8], best[8];
        for (; e < width; e += 8) {
          const int64_t n = std::min<int64_t>(8, width - e);
          for (int64_t j = 0; j < 8; ++j) {
            for (int64_t c = 0; c < r; c += 8)
              _mm256_store_ps(x + j * r + c, j < n ? load8(lp + (e + j) * sl + c) : _mm256_setzero_ps());
            scale[j] = j < n ? _cvtsh_ss(lsp[(e + j) * sls].x) : 0.0f;
          }
          __m256 top = _mm256_set1_ps(minus_inf);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = &ql[g * r];
            const __m256 sums = r == 8    ? first8<8>(qg, x)
                                : r == 16 ? first8<16>(qg, x)
                                : r == 24 ? first8<24>(qg, x)
                                          : first8<32>(qg, x);
            top = _mm256_max_ps(top, _mm256_mul_ps(sums, _mm256_load_ps(scale)));
          }
          _mm256_store_ps(best, top);
          for (int64_t j = 0; j < n; ++j) first[e + j] = Ranked{pp[(e + j) * sp] >= 0 ? best[j] : minus_inf, e + j};
        }
      }
      for (; e < width; ++e) {  // other widths one at a time
        float best = minus_inf;
        if (pp[e * sp] >= 0) {
          const int8_t* coords = lp + e * sl;
          const float scale = _cvtsh_ss(lsp[e * sls].x);
          for (int64_t g = 0; g < G; ++g) {
            float dot = 0.0f;
            for (int64_t c = 0; c < r; ++c) dot += ql[g * r + c] * static_cast<float>(coords[c]);
            best = std::max(best, dot * scale);
          }
        }
        first[e] = Ranked{best, e};
      }
      best_of(first, C, width);  // the C best, in any order
      const int64_t recalls = per_row.defined() ? std::min<int64_t>(per_row.data_ptr<int64_t>()[b], k) : k;
      const int64_t own = per_row.defined() ? candidates * std::max<int64_t>(recalls, 0) : C;
      best_of(first, own, C);  // a row that recalls fewer ranks its own number: the best of them
      const int8_t* kp = keys.data_ptr<int8_t>();
      const at::Half* ksp = kscale.data_ptr<at::Half>();
      const auto ask = [&](int64_t c) {
        if (c < own) {
          prefetch(kp + at_entry(keys, first[c].at), D);
          prefetch(ksp + at_entry(kscale, first[c].at), 2);
        }
      };
      for (int64_t c = 0; c < AHEAD; ++c) ask(c);
      for (int64_t c = 0; c < C; ++c) {
        ask(c + AHEAD);
        const int64_t e = first[c].at;
        const bool empty = pp[e * sp] < 0;
        float best = minus_inf;
        if (!empty && c < own) {
          const int8_t* key = kp + at_entry(keys, e);
          const float scale = _cvtsh_ss(ksp[at_entry(kscale, e)].x);
          __m256 x[8];  // the key widened once for the G queries (D <= 64), else per query
          const bool once = D <= 64;
          if (once)
            for (int64_t d = 0; d < D; d += 8) x[d / 8] = _mm256_mul_ps(load8(key + d), _mm256_set1_ps(scale));
          for (int64_t g = 0; g < G; ++g) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t d = 0; d < D; d += 8)
              acc = _mm256_fmadd_ps(_mm256_loadu_ps(qi + g * D + d),
                                    once ? x[d / 8] : _mm256_mul_ps(load8(key + d), _mm256_set1_ps(scale)), acc);
            exact[g * C + c] = hsum(acc);
            best = std::max(best, exact[g * C + c]);
          }
        } else {
          for (int64_t g = 0; g < G; ++g) exact[g * C + c] = minus_inf;
        }
        second[c] = Exact{best, first[c], c};
      }
      best_first(second, k);
      const int8_t* vp = values.data_ptr<int8_t>();
      const at::Half* vsp = vscale.data_ptr<at::Half>();
      // the j-th recalled's entry: the spare past a row's own number (only where per_row says)
      const auto entry_of = [&](int64_t j) { return j >= recalls ? spare : second[j].first.at; };
      for (int64_t j = 0; j < k; ++j) {
        prefetch(vp + at_entry(values, entry_of(j)), Dv);
        prefetch(vsp + at_entry(vscale, entry_of(j)), 2);
      }
      float* lo = logits_out.data_ptr<float>() + i * G * k;
      int64_t* io = index_out.data_ptr<int64_t>() + i * k;
      float* vo = values_out.data_ptr<float>() + i * k * Dv;
      for (int64_t j = 0; j < k; ++j) {
        const bool fewer = j >= recalls;
        const int64_t c = second[j].place, e = entry_of(j);
        io[j] = e;
        for (int64_t g = 0; g < G; ++g) lo[g * k + j] = fewer ? minus_inf : exact[g * C + c];
        const int8_t* value = vp + at_entry(values, e);
        const float scale = _cvtsh_ss(vsp[at_entry(vscale, e)].x);
        for (int64_t d = 0; d < Dv; ++d) vo[j * Dv + d] = static_cast<float>(value[d]) * scale;
      }
    }
  });
  return {logits_out, values_out, index_out};
}

// A store entry's keep-priority under drop rule RULE (`store_place`): of entry e, and of entries e .. e + 7.
template <int RULE>
inline float priority1(const int32_t* pos, const float* score, const int32_t* marks, int64_t e) {
  if constexpr (RULE == 0) {
    return static_cast<float>(pos[e]);
  } else if constexpr (RULE == 1) {
    return -static_cast<float>(pos[e]);
  } else if constexpr (RULE == 2) {
    volatile float recalled = static_cast<float>(marks[e]) * 1e6f;  // rounded before the sum, as in PyTorch
    return recalled + score[e];
  } else {
    return score[e];
  }
}

template <int RULE>
inline __m256 priority8(const int32_t* pos, const float* score, const int32_t* marks, int64_t e) {
  if constexpr (RULE == 0 || RULE == 1) {
    const __m256 p = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + e)));
    return RULE == 0 ? p : _mm256_xor_ps(p, _mm256_set1_ps(-0.0f));
  } else if constexpr (RULE == 2) {
    __m256 recalled = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(marks + e))),
                                    _mm256_set1_ps(1e6f));
    __asm__("" : "+x"(recalled));  // rounded before the sum, as in PyTorch (never fused into one operation)
    return _mm256_add_ps(recalled, _mm256_loadu_ps(score + e));
  } else {
    return _mm256_loadu_ps(score + e);
  }
}

// The least (priority, tie, entry) of a table's (layer, row, head), candidates taken one at a time; a NaN priority
// anywhere makes it entry 0, as PyTorch's amin, then argmin, has it
struct Least {
  float low = std::numeric_limits<float>::infinity();
  int64_t low_tie = 0, victim = -1;  // none yet
  bool nan = false;
  void take(float p, int64_t tie, int64_t e) {
    nan |= p != p;
    if (victim < 0 || p < low || (p == low && (tie < low_tie || (tie == low_tie && e < victim)))) {
      low = p;
      low_tie = tie;
      victim = e;
    }
  }
  int64_t entry() const { return nan || victim < 0 ? 0 : victim; }
};

// The same over eight entries at a time, each lane keeping its own least; `into` hands the lanes' leasts on
struct Least8 {
  __m256 lane_p = _mm256_set1_ps(std::numeric_limits<float>::infinity()), nans = _mm256_setzero_ps();
  __m256i lane_tie = _mm256_set1_epi32(std::numeric_limits<int32_t>::max()), lane_e = _mm256_set1_epi32(-1);
  void take(__m256 p, __m256i tie, __m256i at) {
    nans = _mm256_or_ps(nans, _mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    const __m256 better = _mm256_or_ps(
        _mm256_cmp_ps(p, lane_p, _CMP_LT_OQ),
        _mm256_and_ps(_mm256_cmp_ps(p, lane_p, _CMP_EQ_OQ), _mm256_castsi256_ps(_mm256_cmpgt_epi32(lane_tie, tie))));
    lane_p = _mm256_blendv_ps(lane_p, p, better);
    lane_tie = _mm256_blendv_epi8(lane_tie, tie, _mm256_castps_si256(better));
    lane_e = _mm256_blendv_epi8(lane_e, at, _mm256_castps_si256(better));
  }
  void into(Least& least) const {
    alignas(32) float ps[8];
    alignas(32) int32_t ties[8], es[8];
    _mm256_store_ps(ps, lane_p);
    _mm256_store_si256(reinterpret_cast<__m256i*>(ties), lane_tie);
    _mm256_store_si256(reinterpret_cast<__m256i*>(es), lane_e);
    for (int j = 0; j < 8; ++j)
      if (es[j] >= 0) least.take(ps[j], ties[j], es[j]);
    least.nan |= _mm256_movemask_ps(nans) != 0;
  }
};

// One (layer, row, head) of the store (E entries, the last the spare; entries from `held` to the spare past the
// row's capacity): the entry `store_place` replaces -- the least (priority, tie, entry), an empty entry's priority
// -inf and its tie its index + 1, a held one's tie its position (`Least`). Eight entries at a time, then the rest.
template <int RULE>
int64_t lowest(const int32_t* pos, const float* score, const int32_t* marks, int64_t E, int64_t held) {
  const float inf = std::numeric_limits<float>::infinity();
  const int64_t spare = E - 1;
  Least least;
  int64_t e = 0;
  if (E >= 8) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    const __m256i below = _mm256_set1_epi32(static_cast<int32_t>(held - 1)), last = _mm256_set1_epi32(spare);
    Least8 lanes;
    for (; e + 8 <= E; e += 8) {
      const __m256i p32 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos + e));
      const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(e)), iota);
      const __m256i empty = _mm256_cmpgt_epi32(_mm256_setzero_si256(), p32);
      const __m256i beyond = _mm256_and_si256(_mm256_cmpgt_epi32(at, below), _mm256_cmpgt_epi32(last, at));
      __m256 p = _mm256_blendv_ps(priority8<RULE>(pos, score, marks, e), _mm256_set1_ps(-inf),
                                  _mm256_castsi256_ps(empty));
      p = _mm256_blendv_ps(p, _mm256_set1_ps(inf), _mm256_castsi256_ps(beyond));
      lanes.take(p, _mm256_blendv_epi8(p32, _mm256_add_epi32(at, one), empty), at);
    }
    lanes.into(least);
  }
  for (; e < E; ++e) {
    float p = pos[e] < 0 ? -inf : priority1<RULE>(pos, score, marks, e);
    if (e >= held && e < spare) p = inf;
    least.take(p, pos[e] >= 0 ? pos[e] : e + 1, e);
  }
  return least.entry();
}

// Each per-entry field of a table (L, B, H, E, ...) checked, and the bytes of one entry of it (its trailing dims
// contiguous): what `copy_spare` copies
std::vector<int64_t> entry_bytes_of(at::TensorList fields, int64_t L, int64_t B, int64_t H, int64_t E,
                                    const char* op) {
  std::vector<int64_t> bytes;
  for (const at::Tensor& f : fields) {
    TORCH_CHECK(f.dim() >= 4 && f.size(0) == L && f.size(1) == B && f.size(2) == H && f.size(3) == E, op,
                ": a field not (L, B, H, E, ...): ", f.sizes());
    int64_t inner = 1;
    for (int64_t d = f.dim() - 1; d >= 4; --d) {
      TORCH_CHECK(f.size(d) == 1 || f.stride(d) == inner, op, ": an entry's trailing dims not contiguous");
      inner *= f.size(d);
    }
    bytes.push_back(inner * static_cast<int64_t>(f.element_size()));
  }
  return bytes;
}

// Every field's spare entry (the last, E - 1) of head (l, b, h) copied into entry `victim`
inline void copy_spare(at::TensorList fields, const std::vector<int64_t>& entry_bytes, int64_t l, int64_t b,
                       int64_t h, int64_t victim) {
  for (size_t f = 0; f < fields.size(); ++f) {
    const at::Tensor& t = fields[f];
    char* base = static_cast<char*>(t.data_ptr()) +
                 (l * t.stride(0) + b * t.stride(1) + h * t.stride(2)) * static_cast<int64_t>(t.element_size());
    const int64_t step = t.stride(3) * static_cast<int64_t>(t.element_size());
    std::memcpy(base + victim * step, base + (t.size(3) - 1) * step, entry_bytes[f]);
  }
}

// Recall's store after a decode step (store.py, `Store.append_step`'s placement, whose PyTorch operations it
// replaces on CPU: a dozen passes over every layer's store, and a scatter per field): per (layer, row, KV head), the
// entry of lowest keep-priority under the store's `rule` (0: the oldest position first, 1: the latest, 2: the least
// recalled, then the lowest score, as marks x 1e6 + score in float32; 3: the lowest score), an empty entry -inf (a
// filling store appends) and a stored one past its row's `limit` +inf; ties to the lowest tie (a held entry's
// position, an empty one's index + 1), then to the first -- takes the spare's fields (the last entry, which holds
// the new token and may lose itself), and its head's drop count grows when it held a token. `fields` are the
// store's per-entry tensors (L, B, H, E, ...), each entry's trailing dims contiguous; pos, score and marks (L, B,
// H, E) int32, float32, int32 are among them; drops (L, B, H) int64; limit (B,) int64 or none (every row the
// capacity E - 1).
void store_place(at::TensorList fields, const at::Tensor& pos, const at::Tensor& score, const at::Tensor& marks,
                 const at::Tensor& drops, const std::optional<at::Tensor>& limit_in, int64_t rule) {
  TORCH_CHECK(rule >= 0 && rule <= 3, "store_place: rule 0-3, not ", rule);
  TORCH_CHECK(pos.dim() == 4 && pos.scalar_type() == at::kInt, "pos: (L, B, H, E) int32");
  const int64_t L = pos.size(0), B = pos.size(1), H = pos.size(2), E = pos.size(3), spare = E - 1;
  TORCH_CHECK(E >= 1, "store_place: no spare entry");
  for (const at::Tensor* t : {&pos, &score, &marks})
    TORCH_CHECK(t->sizes() == pos.sizes() && t->stride(3) == 1, "pos, score, marks: (L, B, H, E), entries contiguous");
  TORCH_CHECK(score.scalar_type() == at::kFloat && marks.scalar_type() == at::kInt, "score float32, marks int32");
  TORCH_CHECK(drops.dim() == 3 && drops.scalar_type() == at::kLong && drops.size(0) == L && drops.size(1) == B &&
                  drops.size(2) == H,
              "drops: (L, B, H) int64");
  const std::vector<int64_t> entry_bytes = entry_bytes_of(fields, L, B, H, E, "store_place");
  at::Tensor limit;
  if (limit_in.has_value()) {
    limit = limit_in->to(at::kLong).contiguous();
    TORCH_CHECK(limit.dim() == 1 && limit.size(0) == B, "limit: (B,)");
  }
  at::parallel_for(0, L * B * H, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t l = i / (B * H), b = (i / H) % B, h = i % H;
      const auto head = [&](const at::Tensor& t) { return l * t.stride(0) + b * t.stride(1) + h * t.stride(2); };
      const int32_t* pp = pos.data_ptr<int32_t>() + head(pos);
      const float* sp = score.data_ptr<float>() + head(score);
      const int32_t* mp = marks.data_ptr<int32_t>() + head(marks);
      const int64_t held = limit.defined() ? limit.data_ptr<int64_t>()[b] : spare;
      const int64_t victim = rule == 0   ? lowest<0>(pp, sp, mp, E, held)
                             : rule == 1 ? lowest<1>(pp, sp, mp, E, held)
                             : rule == 2 ? lowest<2>(pp, sp, mp, E, held)
                                         : lowest<3>(pp, sp, mp, E, held);
      if (pp[victim] >= 0) drops.data_ptr<int64_t>()[head(drops)] += 1;  // a token lost (the new one, if the spare)
      if (victim == spare) continue;
      copy_spare(fields, entry_bytes, l, b, h, victim);
    }
  });
}

// Eight int64 positions from `p` as int32 lanes (every position below 2^31: `slots_place` checks each row's newest)
inline __m256i positions8(const int64_t* p) {
  const __m256i pick = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);  // each int64's low half into the low lanes
  const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), pick);
  const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 4)), pick);
  return _mm256_permute2x128_si256(lo, hi, 0x20);
}

// One row's eviction rule (`Rules.priority` for that row): rank by score or by position; positions after `keep_after`
// kept, and those below `sinks`; slots from `limit` on never lost (+inf)
struct SlotRule {
  bool by_score;
  int64_t keep_after;  // newest - recent
  int64_t sinks;       // 0: none
  int64_t limit;       // S: none
};

// One (layer, row, head) of the slots (S of them, the last the spare): the slot a decode step's token takes -- the
// least (priority, tie, slot) where an empty slot's priority is -inf and its tie its index + 1, a held one's tie its
// position (`Least`). Eight slots at a time, then the rest.
int64_t slot_victim(const int64_t* pos, const float* score, int64_t S, const SlotRule& r) {
  const float inf = std::numeric_limits<float>::infinity();
  Least least;
  int64_t e = 0;
  if (S >= 8) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
    const __m256i after = _mm256_set1_epi32(static_cast<int32_t>(r.keep_after));
    const __m256i sinks = _mm256_set1_epi32(static_cast<int32_t>(r.sinks));
    const __m256i last_kept = _mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(r.limit, S) - 1));
    Least8 lanes;
    for (; e + 8 <= S; e += 8) {
      const __m256i p32 = positions8(pos + e);
      const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(e)), iota);
      const __m256i empty = _mm256_cmpgt_epi32(_mm256_setzero_si256(), p32);
      __m256i kept = _mm256_cmpgt_epi32(p32, after);
      if (r.sinks > 0) kept = _mm256_or_si256(kept, _mm256_andnot_si256(empty, _mm256_cmpgt_epi32(sinks, p32)));
      const __m256i beyond = _mm256_cmpgt_epi32(at, last_kept);
      __m256 p = r.by_score ? _mm256_loadu_ps(score + e) : _mm256_cvtepi32_ps(p32);
      p = _mm256_blendv_ps(p, _mm256_set1_ps(inf), _mm256_castsi256_ps(kept));
      p = _mm256_blendv_ps(p, _mm256_set1_ps(-inf), _mm256_castsi256_ps(empty));
      p = _mm256_blendv_ps(p, _mm256_set1_ps(inf), _mm256_castsi256_ps(beyond));
      lanes.take(p, _mm256_blendv_epi8(p32, _mm256_add_epi32(at, one), empty), at);
    }
    lanes.into(least);
  }
  for (; e < S; ++e) {
    float p = r.by_score ? score[e] : static_cast<float>(pos[e]);
    if (pos[e] > r.keep_after || (pos[e] >= 0 && pos[e] < r.sinks)) p = inf;
    if (pos[e] < 0) p = -inf;
    if (e >= r.limit) p = inf;
    least.take(p, pos[e] >= 0 ? pos[e] : e + 1, e);
  }
  return least.entry();
}

// The slots after a decode step (evict.py, `step` without a store, whose PyTorch operations it replaces on CPU: a
// dozen passes over every layer's slots, and a scatter per buffer): per (layer, row, KV head), the slot of lowest
// keep-priority (`Rules.priority`: the row's `by_score` ranks by score, else by position; positions after
// newest - recent kept, and those below the row's `sinks`; an empty slot -inf, so a filling cache appends; slots
// from the row's `limit` on +inf) takes the spare's fields (the last slot, which holds the step's token; the caller
// clears it). Ties to the oldest position, an empty slot's to its index + 1, then to the first slot. `fields` are the
// per-slot tensors (L, B, H, S, ...), each slot's trailing dims contiguous; pos (L, B, H, S) int64 and score float32
// are among them; newest (B,) int64; by_score (B,) bool, recent, sinks and limit (B,) int64, each or none (none:
// by position, none recent, no sinks, no limit -- a cache with room in every row: each row's first empty slot).
void slots_place(at::TensorList fields, const at::Tensor& pos, const at::Tensor& score, const at::Tensor& newest_in,
                 const std::optional<at::Tensor>& by_score_in, const std::optional<at::Tensor>& recent_in,
                 const std::optional<at::Tensor>& sinks_in, const std::optional<at::Tensor>& limit_in) {
  TORCH_CHECK(pos.dim() == 4 && pos.scalar_type() == at::kLong, "pos: (L, B, H, S) int64");
  const int64_t L = pos.size(0), B = pos.size(1), H = pos.size(2), S = pos.size(3), spare = S - 1;
  TORCH_CHECK(S >= 1, "slots_place: no spare slot");
  TORCH_CHECK(pos.stride(3) == 1 && score.sizes() == pos.sizes() && score.stride(3) == 1 &&
                  score.scalar_type() == at::kFloat,
              "pos (L, B, H, S) int64 and score float32, slots contiguous");
  const auto per_row = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, "slots_place: ", name, " (B,)");
    return t.to(at::kLong).contiguous();
  };
  const at::Tensor newest = per_row(newest_in, "newest");
  const at::Tensor by_score = by_score_in.has_value() ? per_row(*by_score_in, "by_score") : at::Tensor();
  const at::Tensor recent = recent_in.has_value() ? per_row(*recent_in, "recent") : at::Tensor();
  const at::Tensor sinks = sinks_in.has_value() ? per_row(*sinks_in, "sinks") : at::Tensor();
  const at::Tensor limit = limit_in.has_value() ? per_row(*limit_in, "limit") : at::Tensor();
  std::vector<SlotRule> rules(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = newest.data_ptr<int64_t>()[b];
    TORCH_CHECK(n >= 0 && n < std::numeric_limits<int32_t>::max(), "slots_place: positions must be below 2^31");
    const int64_t keep = n - (recent.defined() ? recent.data_ptr<int64_t>()[b] : 0);
    const int64_t sink = sinks.defined() ? sinks.data_ptr<int64_t>()[b] : 0;
    const int64_t lim = limit.defined() ? limit.data_ptr<int64_t>()[b] : S;
    rules[b] = {by_score.defined() && by_score.data_ptr<int64_t>()[b] != 0, std::max<int64_t>(keep, -1),
                std::clamp<int64_t>(sink, 0, std::numeric_limits<int32_t>::max()), std::clamp<int64_t>(lim, 0, S)};
  }
  const std::vector<int64_t> entry_bytes = entry_bytes_of(fields, L, B, H, S, "slots_place");
  at::parallel_for(0, L * B * H, 8, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t l = i / (B * H), b = (i / H) % B, h = i % H;
      const auto head = [&](const at::Tensor& t) { return l * t.stride(0) + b * t.stride(1) + h * t.stride(2); };
      const int64_t victim =
          slot_victim(pos.data_ptr<int64_t>() + head(pos), score.data_ptr<float>() + head(score), S, rules[b]);
      if (victim == spare) continue;
      copy_spare(fields, entry_bytes, l, b, h, victim);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(h2o_native, m) {
  m.def(
      "decode_attention(Tensor q, Tensor keys, Tensor values, Tensor valid, Tensor? kscale, Tensor? vscale, "
      "Tensor new_k, Tensor new_v, Tensor? more=None, Tensor? more_v=None) -> (Tensor, Tensor)");
  m.def(
      "recall_step(Tensor q, Tensor basis, Tensor low, Tensor lscale, Tensor pos, Tensor keys, Tensor kscale, "
      "Tensor values, Tensor vscale, Tensor pick, int candidates, Tensor? per_row=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "store_place(Tensor(a!)[] fields, Tensor pos, Tensor score, Tensor marks, Tensor(b!) drops, Tensor? limit, "
      "int rule) -> ()");
  m.def(
      "slots_place(Tensor(a!)[] fields, Tensor pos, Tensor score, Tensor newest, Tensor? by_score, Tensor? recent, "
      "Tensor? sinks, Tensor? limit) -> ()");
}

TORCH_LIBRARY_IMPL(h2o_native, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("recall_step", &recall_step);
  m.impl("store_place", &store_place);
  m.impl("slots_place", &slots_place);
}
