// h2o-chat's native library for x86 CPUs without AMX but with AVX2 and FMA (AMD EPYC before Zen 4, Intel before
// Sapphire Rapids): the 4-bit weight products y (M, N) = x (M, K) W^T, on 8-bit activations as llama.cpp's Q4 x Q8
// products (below), for prompt chunks (`int4_mm`) and decode steps (`int4_mv`) alike: one product, so a token
// read in a chunk and the same token decoded by a step are multiplied the same way.
// h2o_chat/models/native/__init__.py builds, checks and loads it where int4_amx.cpp cannot run.
// W is held in the layout PyTorch's own CPU kernel packs it in (`aten::_convert_weight_to_int4pack_for_cpu`: blocks
// of `block` output channels, 32 where PyTorch's kernel uses AVX2 and 64 where it uses AVX-512; byte j of a block's
// row k holds channel j in its low nibble and channel j + block / 2 in its high one), with bfloat16 scales and zeros
// per group of 32 input channels, (K / 32, N, 2): w = (q - 8) * scale + zero.
//
// Its float32 predecessor dequantized each block of output channels once per call into a float32 panel for prompt
// chunks (2x PyTorch's AVX2 kernel, which dequantizes again every few rows: a chunk of 512 rows cost ~170x one
// row); the 8-bit product reads the nibbles as they are and took the same time for chunks of 16-512 rows
// (2026-11-28, AMD EPYC Zen 3), 1.3-2x less for decode steps.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t GK = 32;  // input channels per group (one scale and zero)

// x (M, K) bfloat16, the weights of N (whole blocks of `block`) by K (groups of 32) packed as PyTorch packs them,
// and their scales and zeros.
void check_arguments(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros,
                     int64_t block) {
  TORCH_CHECK(block == 32 || block == 64, "block: 32 or 64 output channels, not ", block);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: (M, K) contiguous bfloat16");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: (N, K / 2) uint8");
  const int64_t K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "packed holds ", packed.size(1) * 2, " input channels, x has ", K);
  TORCH_CHECK(N % block == 0 && K % GK == 0 && group == GK, "unsupported shape N ", N, " K ", K, " group ", group);
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.dim() == 3 && scales_zeros.size(0) == K / group && scales_zeros.size(1) == N,
              "scales_zeros: (K / group, N, 2) bfloat16");
}

// The product (`int4_mv`, and `int4_mm` on this build): turning nibbles into floats, or multiplying them as
// floats, costs more than reading them. As llama.cpp's
// Q4 x Q8 products on AVX2: each row of x is rounded per group of 32 input channels to 8-bit integers and a scale,
// but for the group's largest x, kept as it is (`round_rows`: rounding it too, with the others by its scale, cost
// 1.6% in perplexity; without it, nothing measurable). Each group's sum of xq q is taken in integers (q in 0..15,
// the nibbles as they are: vpmaddubsw on 4 input channels of 8 output channels, summed in 16 bits over the group),
// then scaled once per group: y += scale (d sum(xq q) + x_largest q_largest) + (zero - 8 scale) sum(x), the float
// sum of x per row and group exact (experiments.md, "8-bit activations in the decode steps' products"). Each row's
// rounding and sums are its own: a row's product is the one it gets alone, whatever the rows beside it.
struct Group {  // of 32 input channels of a row of x
  float d;        // the scale of its rounded values
  float sum;      // the float sum of its x
  float kept;     // its largest x, kept as it is
  int32_t at;     // where that is in the group
};

struct Rounded {
  int64_t K, groups;          // input channels and groups of 32 per row
  std::vector<int8_t> q;      // (M, K): round(x / d), 0 at the group's largest
  std::vector<Group> group;  // (M, K / 32)
};

// x (M, K) bfloat16, rounded per group of 32 to 8 bits: its largest magnitude kept as it is, the others
// q = round(x / d), d = (the next largest magnitude) / 127.
Rounded round_rows(const at::BFloat16* x, int64_t M, int64_t K) {
  const int64_t groups = M * (K / GK);
  Rounded out{K, K / GK, std::vector<int8_t>(M * K), std::vector<Group>(groups)};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const auto largest = [](__m256 v) {
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0b01001110));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0b10110001));  // in every lane
  };
  for (int64_t i = 0; i < groups; ++i) {
    __m256 v[4], a[4];
    for (int p = 0; p < 4; ++p) {  // bfloat16 is a float32's high half: exact
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i * GK + 8 * p));
      v[p] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
      a[p] = _mm256_and_ps(v[p], magnitude);
    }
    const __m256 sum = _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]));
    const __m256 top = largest(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
    int at = 0;
    for (int p = 3; p >= 0; --p) {  // the first lane holding it
      const int mask = _mm256_movemask_ps(_mm256_cmp_ps(a[p], top, _CMP_EQ_OQ));
      if (mask) at = 8 * p + __builtin_ctz(mask);
    }
    alignas(32) float sums[8], values[GK];
    for (int p = 0; p < 4; ++p) _mm256_store_ps(values + 8 * p, v[p]);
    const float kept = values[at];
    for (int p = 0; p < 4; ++p) {  // without it
      const __m256i lane = _mm256_setr_epi32(8 * p, 8 * p + 1, 8 * p + 2, 8 * p + 3, 8 * p + 4, 8 * p + 5, 8 * p + 6,
                                             8 * p + 7);
      a[p] = _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(lane, _mm256_set1_epi32(at))), a[p]);
    }
    const float next = _mm256_cvtss_f32(largest(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]))));
    _mm256_store_ps(sums, sum);
    float total = 0.0f;
    for (int l = 0; l < 8; ++l) total += sums[l];
    const float d = next / 127.0f, inverse = next > 0.0f ? 127.0f / next : 0.0f;
    out.group[i] = Group{d, total, kept, at};
    __m256i words[4];
    for (int p = 0; p < 4; ++p) words[p] = _mm256_cvtps_epi32(_mm256_mul_ps(v[p], _mm256_set1_ps(inverse)));
    // 32 int32 to bytes (the largest saturated, then zeroed), in order: packs interleave the 128-bit lanes, the
    // permute puts them back
    const __m256i shorts01 = _mm256_packs_epi32(words[0], words[1]), shorts23 = _mm256_packs_epi32(words[2], words[3]);
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(shorts01, shorts23),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + i * GK), bytes);
    out.q[i * GK + at] = 0;
  }
  return out;
}

// The bytes of rows k..k+3 of a run (`stride` apart, 8 of each from `w`) as quads: byte i of row k + j at 4 i + j,
// in two 128-bit halves (bytes 0-3 and 4-7; `upper`: bytes 8-11 and 12-15 of 16 read).
template <bool upper>
inline __m256i quads(const uint8_t* w, int64_t stride) {
  __m128i r[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) r[j] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + j * stride + 8 * upper));
  const __m128i pairs01 = _mm_unpacklo_epi8(r[0], r[1]), pairs23 = _mm_unpacklo_epi8(r[2], r[3]);
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(pairs01, pairs23)),
                                 _mm_unpackhi_epi16(pairs01, pairs23), 1);
}

// R rows of x, rounded (`xr`, from its row m: their int8 values and each group's scale, sum and largest x), times
// V * 8 channels of the run at `bytes` (its row k at bytes + k * stride; V = 4: all its 32 channels, V = 2: those of
// its bytes 8h to 8h + 7), added into y (`ldy` apart, zeroed by the caller). The run's 16 bytes hold channels
// c_lo + 0-15 in their low nibbles and c_hi + 0-15 in their high ones. Each 4 input channels' products are summed
// in 16-bit integers over the group (at most 8 x 2 x 15 x 127 < 2^15: no overflow), then in pairs to 32 bits. Every
// loop over rows and vectors is unrolled (the accumulators stay in registers: R * V + V + 1 <= 16).
template <int R, int V>
void multiply_run(const Rounded& xr, int64_t m, const uint8_t* bytes, int64_t stride, const at::BFloat16* sz,
                  int64_t N, int64_t c_lo, int64_t c_hi, int64_t h, float* y, int64_t ldy) {
  static_assert(R * V + V + 1 <= 16 && (V == 2 || V == 4));
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const __m256 eight = _mm256_set1_ps(8.0f);
  const int64_t K = xr.K, groups = xr.groups, ldx = K;
  const int8_t* x = xr.q.data() + m * K;
  const Group* rows = xr.group.data() + m * groups;  // this tile's first row's groups
  const int64_t first = V == 4 ? 0 : h;  // the first 8-byte half read
  // vector j: the 8 channels of the low (j even) or high nibbles of bytes 8 (first + j / 2) + 0-7
  int64_t channel[V];
#pragma GCC unroll 4
  for (int j = 0; j < V; ++j) channel[j] = (j % 2 == 0 ? c_lo : c_hi) + 8 * (first + j / 2);
  for (int64_t g = 0; g < groups; ++g) {
    __m256i acc[R][V];
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < V; ++j) acc[r][j] = _mm256_setzero_si256();
    const uint8_t* w = bytes + g * GK * stride + 8 * first;
    for (int64_t k = g * GK; k < (g + 1) * GK; k += 4, w += 4 * stride) {
      __m256i q[V];
      const __m256i q0 = quads<false>(w, stride);
      q[0] = _mm256_and_si256(q0, low), q[1] = _mm256_and_si256(_mm256_srli_epi16(q0, 4), low);
      if constexpr (V == 4) {
        const __m256i q1 = quads<true>(w, stride);
        q[2] = _mm256_and_si256(q1, low), q[3] = _mm256_and_si256(_mm256_srli_epi16(q1, 4), low);
      }
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, x + r * ldx + k, 4);
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 4
        for (int j = 0; j < V; ++j) acc[r][j] = _mm256_add_epi16(acc[r][j], _mm256_maddubs_epi16(q[j], xv));
      }
    }
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 scale[V], offset[V];
#pragma GCC unroll 4
    for (int j = 0; j < V; ++j) {  // 8 (scale, zero) pairs of bfloat16: the bfloat16 is a float32's high half
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz + (g * N + channel[j]) * 2));
      scale[j] = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
      offset[j] = _mm256_fnmadd_ps(eight, scale[j], _mm256_castsi256_ps(_mm256_and_si256(pairs, high)));
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const Group group = rows[r * groups + g];
      const uint8_t* row = bytes + (g * GK + group.at) * stride + 8 * first;  // the row of the group's largest x
#pragma GCC unroll 2
      for (int part = 0; part < V / 2; ++part) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * part)));
#pragma GCC unroll 2
        for (int side = 0; side < 2; ++side) {  // low nibbles, then high ones
          const int j = 2 * part + side;
          const __m256 nibbles = _mm256_cvtepi32_ps(side == 0 ? _mm256_and_si256(v, _mm256_set1_epi32(15))
                                                              : _mm256_srli_epi32(v, 4));
          const __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r][j], ones));
          const __m256 dot =
              _mm256_fmadd_ps(_mm256_set1_ps(group.kept), nibbles, _mm256_mul_ps(products, _mm256_set1_ps(group.d)));
          float* out = y + r * ldy + channel[j];
          const __m256 sum = _mm256_fmadd_ps(dot, scale[j], _mm256_loadu_ps(out));
          _mm256_storeu_ps(out, _mm256_fmadd_ps(offset[j], _mm256_set1_ps(group.sum), sum));
        }
      }
    }
  }
}

using RunFn = void (*)(const Rounded&, int64_t, const uint8_t*, int64_t, const at::BFloat16*, int64_t, int64_t,
                       int64_t, int64_t, float*, int64_t);
// A run's 32 channels for 1-2 rows (its unpacking shared by the rows), or half of them for up to 4 (5 or 6 would
// hold more accumulators than GCC keeps in registers: it spilled them, a load and a store per product).
constexpr int RV = 4;
constexpr RunFn WHOLE[3] = {nullptr, multiply_run<1, 4>, multiply_run<2, 4>};
constexpr RunFn HALVES[RV + 1] = {nullptr, multiply_run<1, 2>, multiply_run<2, 2>, multiply_run<3, 2>,
                                  multiply_run<4, 2>};

at::Tensor int4_mv(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros,
                   int64_t block) {
  check_arguments(x, packed, group, scales_zeros, block);
  const int64_t BN = block;
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  if (M == 0) return at::empty({M, N}, x.options());
  const Rounded rounded = round_rows(x.data_ptr<at::BFloat16>(), M, K);
  at::Tensor y = at::zeros({M, N}, x.options().dtype(at::kFloat));
  float* ys = y.data_ptr<float>();
  const uint8_t* ws = packed.data_ptr<uint8_t>();
  const at::BFloat16* sz = scales_zeros.data_ptr<at::BFloat16>();
  const int64_t runs = BN / 32;  // 16-byte runs per block row
  at::parallel_for(0, N / BN * runs, runs, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = u / runs, r = u % runs, n0 = b * BN;
      const uint8_t* bytes = ws + b * BN * (K / 2) + 16 * r;
      const int64_t c_lo = n0 + 16 * r, c_hi = n0 + BN / 2 + 16 * r;
      if (M <= 2) {
        WHOLE[M](rounded, 0, bytes, BN / 2, sz, N, c_lo, c_hi, 0, ys, N);
        continue;
      }
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t m = 0; m < M; m += RV) {
          const int rows = static_cast<int>(std::min<int64_t>(RV, M - m));
          HALVES[rows](rounded, m, bytes, BN / 2, sz, N, c_lo, c_hi, h, ys + m * N, N);
        }
      }
    }
  });
  return y.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY(h2o_native, m) {
  m.def("int4_mm(Tensor x, Tensor packed, int group, Tensor scales_zeros, int block) -> Tensor");
  m.def("int4_mv(Tensor x, Tensor packed, int group, Tensor scales_zeros, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(h2o_native, CPU, m) {
  m.impl("int4_mm", &int4_mv);  // one product for chunks and steps (above)
  m.impl("int4_mv", &int4_mv);
}
