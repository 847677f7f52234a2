// h2o-chat's native library for x86 CPUs without AMX but with AVX2 and FMA (AMD EPYC before Zen 4, Intel before
// Sapphire Rapids): the 4-bit weight products of prompt chunks, y (M, N) = x (M, K) W^T (`int4_mm`).
// h2o_chat/models/native/__init__.py builds, checks and loads it where int4_amx.cpp cannot run.
// W is held in the layout PyTorch's own CPU kernel packs it in (`aten::_convert_weight_to_int4pack_for_cpu`: blocks
// of `block` output channels, 32 where PyTorch's kernel uses AVX2 and 64 where it uses AVX-512; byte j of a block's
// row k holds channel j in its low nibble and channel j + block / 2 in its high one), with bfloat16 scales and zeros
// per group of 32 input channels, (K / 32, N, 2): w = (q - 8) * scale + zero.
//
// PyTorch's AVX2 kernel dequantizes the weights again for every few rows: a chunk of 37 rows costs 15x one row, of
// 512 rows ~170x. Here each block of output channels is dequantized once per call into a float32 panel (each
// weight exact in float32 up to one rounding: fma(q - 8, scale, zero)), and every row is multiplied against it
// with fused multiply-adds, 6 rows and 16 channels at a time. Each output is summed over the input channels in
// their order, one fused multiply-add each, whatever the rows beside it: a row's result is the one it gets alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t GK = 32;  // input channels per group (one scale and zero)
constexpr int RM = 6;       // rows per tile: 6 rows x 16 channels = 12 accumulators of AVX2's 16 registers

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

// The block of BN output channels at `packed` (K rows of BN / 2 bytes), dequantized into panel[K][BN] float32.
template <int64_t BN>
void dequantize_block(const uint8_t* packed, const at::BFloat16* sz, int64_t N, int64_t n0, int64_t K, float* panel) {
  const __m128i low = _mm_set1_epi8(15);
  const __m256 eight = _mm256_set1_ps(8.0f);
  alignas(32) float scale[BN], zero[BN];
  for (int64_t g = 0; g < K / GK; ++g) {
    for (int64_t j = 0; j < BN; ++j) {
      scale[j] = static_cast<float>(sz[(g * N + n0 + j) * 2]);
      zero[j] = static_cast<float>(sz[(g * N + n0 + j) * 2 + 1]);
    }
    for (int64_t k = g * GK; k < (g + 1) * GK; ++k) {
      float* out = panel + k * BN;
      for (int64_t half = 0; half < BN / 32; ++half) {  // 16 bytes: 16 channels' low nibbles, 16 others' high ones
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + k * (BN / 2) + 16 * half));
        const __m128i lo = _mm_and_si128(bytes, low);                     // channels 16 half + 0-15
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);  // channels BN / 2 + 16 half + 0-15
        const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int p = 0; p < 4; ++p) {  // 8 channels each
          const int64_t c = (p < 2 ? 0 : BN / 2) + 16 * half + 8 * (p & 1);
          const __m256 q = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[p])), eight);
          _mm256_storeu_ps(out + c, _mm256_fmadd_ps(q, _mm256_load_ps(scale + c), _mm256_load_ps(zero + c)));
        }
      }
    }
  }
}

// R rows of x (float32, `ldx` apart) times 16 channels of the panel (BN wide, from column c), into y (`ldy` apart).
// The accumulators are named, not an array: GCC keeps an array of them on the stack, a store per multiply-add.
template <int R>
inline void multiply_rows(const float* x, int64_t ldx, const float* panel, int64_t BN, int64_t K, int64_t c, float* y,
                          int64_t ldy) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
  __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const float* w = panel + c;
  for (int64_t k = 0; k < K; ++k, w += BN) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    __m256 xv = _mm256_broadcast_ss(x + k);
    a00 = _mm256_fmadd_ps(xv, w0, a00), a01 = _mm256_fmadd_ps(xv, w1, a01);
    if constexpr (R > 1) {
      xv = _mm256_broadcast_ss(x + ldx + k);
      a10 = _mm256_fmadd_ps(xv, w0, a10), a11 = _mm256_fmadd_ps(xv, w1, a11);
    }
    if constexpr (R > 2) {
      xv = _mm256_broadcast_ss(x + 2 * ldx + k);
      a20 = _mm256_fmadd_ps(xv, w0, a20), a21 = _mm256_fmadd_ps(xv, w1, a21);
    }
    if constexpr (R > 3) {
      xv = _mm256_broadcast_ss(x + 3 * ldx + k);
      a30 = _mm256_fmadd_ps(xv, w0, a30), a31 = _mm256_fmadd_ps(xv, w1, a31);
    }
    if constexpr (R > 4) {
      xv = _mm256_broadcast_ss(x + 4 * ldx + k);
      a40 = _mm256_fmadd_ps(xv, w0, a40), a41 = _mm256_fmadd_ps(xv, w1, a41);
    }
    if constexpr (R > 5) {
      xv = _mm256_broadcast_ss(x + 5 * ldx + k);
      a50 = _mm256_fmadd_ps(xv, w0, a50), a51 = _mm256_fmadd_ps(xv, w1, a51);
    }
  }
  const __m256 acc[6][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy + c, acc[r][0]);
    _mm256_storeu_ps(y + r * ldy + c + 8, acc[r][1]);
  }
}

template <int R>
void multiply_tile(const float* x, int64_t ldx, const float* panel, int64_t BN, int64_t K, float* y, int64_t ldy) {
  for (int64_t c = 0; c < BN; c += 16) multiply_rows<R>(x, ldx, panel, BN, K, c, y, ldy);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t);
constexpr TileFn TILES[RM + 1] = {nullptr,          multiply_tile<1>, multiply_tile<2>, multiply_tile<3>,
                                  multiply_tile<4>, multiply_tile<5>, multiply_tile<6>};

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros,
                   int64_t block) {
  check_arguments(x, packed, group, scales_zeros, block);
  const int64_t BN = block;
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  if (M == 0) return at::empty({M, N}, x.options());
  const at::Tensor xf = x.to(at::kFloat);  // bfloat16 to float32 is exact
  at::Tensor y = at::empty({M, N}, xf.options());
  const float* xs = xf.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const uint8_t* ws = packed.data_ptr<uint8_t>();
  const at::BFloat16* sz = scales_zeros.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / BN, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> panel(K * BN);
    for (int64_t b = b0; b < b1; ++b) {
      if (BN == 32) {
        dequantize_block<32>(ws + b * BN * (K / 2), sz, N, b * BN, K, panel.data());
      } else {
        dequantize_block<64>(ws + b * BN * (K / 2), sz, N, b * BN, K, panel.data());
      }
      for (int64_t m = 0; m < M; m += RM) {
        const int rows = static_cast<int>(std::min<int64_t>(RM, M - m));
        TILES[rows](xs + m * K, K, panel.data(), BN, K, ys + m * N + b * BN, N);
      }
    }
  });
  return y.to(at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY(h2o_native, m) {
  m.def("int4_mm(Tensor x, Tensor packed, int group, Tensor scales_zeros, int block) -> Tensor");
}

TORCH_LIBRARY_IMPL(h2o_native, CPU, m) {
  m.impl("int4_mm", &int4_mm);
}
