// h2o-chat's one native library (h2o_chat/models/native/__init__.py builds, checks and loads it): 4-bit weight
// products for x86 CPUs with AMX (Intel Xeon 4th generation and later), y (M, N) = x (M, K) W^T: int4_mm for
// prompt chunks, int4_mv for decode steps (below).
// W is held in the layout PyTorch's own CPU kernel packs it in (`aten::_convert_weight_to_int4pack_for_cpu`, its
// AVX-512 build: blocks of 64 output channels; byte j of a block's row k holds channel j in its low nibble and
// channel j + 32 in its high one), with bfloat16 scales and zeros per group of 32 input channels, (K / 32, N, 2):
// w = (q - 8) * scale + zero.
//
// PyTorch's kernel costs time in proportion to the rows beyond a few (it dequantizes the weights again for every
// block of 4 rows). Here each block of 64 output channels is dequantized once per call into a bfloat16 panel (what
// AMX multiplies: each weight computed in float32, rounded to bfloat16), and every tile of 16 rows is multiplied
// against it, the products summed in float32. A row's result depends on that row alone.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <cstdint>
#include <vector>

namespace {

constexpr int64_t BN = 64;  // output channels per packed block
constexpr int64_t TM = 16;  // rows per tile
constexpr int64_t TK = 32;  // input channels per tile (bfloat16: 64 bytes a row)
constexpr int64_t PREFETCH = 4;  // groups of weights asked for ahead of the one multiplied (int4_mv)

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: the output, 16 channels each (rows x 16 float32); tmm4: x (rows x 32 bfloat16); tmm5-7: the weights,
// 16 pairs of input channels x 16 output channels x 2.
void configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 5; ++t) c.colsb[t] = 64, c.rows[t] = rows;
  for (int t = 5; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  _tile_loadconfig(&c);
}

// x's tile (its rows `stride` bytes apart, 32 bfloat16 each) times a panel's 16 pairs of input channels (a row of
// 64 output channels x 2), summed into the output tiles tmm0-3.
inline void multiply_tile(const uint16_t* x, int64_t stride, const uint16_t* panel) {
  _tile_loadd(4, x, stride);
  _tile_loadd(5, panel, BN * 4);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, panel + 32, BN * 4);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(7, panel + 64, BN * 4);
  _tile_dpbf16ps(2, 4, 7);
  _tile_loadd(5, panel + 96, BN * 4);
  _tile_dpbf16ps(3, 4, 5);
}

// The output tiles into c (rows x 64 float32).
inline void store_tiles(float* c) {
  _tile_stored(0, c, BN * 4);
  _tile_stored(1, c + 16, BN * 4);
  _tile_stored(2, c + 32, BN * 4);
  _tile_stored(3, c + 48, BN * 4);
}

bool amx_permitted() {
  // Linux hands AMX's tile state to a process that asks (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// What both kernels take: x (M, K) bfloat16, the weights of N (whole blocks of 64) by K (groups of 32) packed as
// PyTorch packs them, their scales and zeros; and a CPU that lets this process use AMX.
void check_arguments(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: (M, K) contiguous bfloat16");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(), "packed: (N, K / 2) uint8");
  const int64_t K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.size(1) * 2 == K, "packed holds ", packed.size(1) * 2, " input channels, x has ", K);
  TORCH_CHECK(N % BN == 0 && K % TK == 0 && group == TK, "unsupported shape N ", N, " K ", K, " group ", group);
  TORCH_CHECK(scales_zeros.scalar_type() == at::kBFloat16 && scales_zeros.is_contiguous() &&
                  scales_zeros.dim() == 3 && scales_zeros.size(0) == K / group && scales_zeros.size(1) == N,
              "scales_zeros: (K / group, N, 2) bfloat16");
  TORCH_CHECK(amx_permitted(), "the kernel needs AMX, which this CPU or kernel does not give");
}

// The block of 64 output channels at `packed` (K rows of 32 bytes), dequantized into panel[K / 2][64][2]: pairs
// of input channels side by side for each output channel, as AMX's second operand reads them.
void dequantize_block(const uint8_t* packed, const at::BFloat16* sz, int64_t N, int64_t n0, int64_t K, uint16_t* panel) {
  alignas(64) int16_t index[32];
  for (int i = 0; i < 16; ++i) index[2 * i] = i, index[2 * i + 1] = 16 + i;
  const __m512i pairs = _mm512_load_si512(index);
  const __m512i low = _mm512_set1_epi32(15);
  alignas(64) float scale[BN], shift[BN];
  for (int64_t g = 0; g < K / TK; ++g) {
    for (int64_t j = 0; j < BN; ++j) {
      const float s = static_cast<float>(sz[(g * N + n0 + j) * 2]);
      scale[j] = s, shift[j] = static_cast<float>(sz[(g * N + n0 + j) * 2 + 1]) - 8 * s;  // (q - 8) s + z
    }
    for (int64_t k = g * TK; k < (g + 1) * TK; k += 2) {
      const uint8_t* row0 = packed + k * (BN / 2);
      const uint8_t* row1 = row0 + BN / 2;
      uint16_t* out = panel + (k / 2) * BN * 2;
      for (int q = 0; q < 4; ++q) {  // 16 channels: q 0, 1 the low nibbles of bytes 0-15, 16-31; q 2, 3 the high
        const int byte = (q & 1) * 16;
        __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row0 + byte)));
        __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row1 + byte)));
        if (q < 2) {
          v0 = _mm512_and_si512(v0, low), v1 = _mm512_and_si512(v1, low);
        } else {
          v0 = _mm512_srli_epi32(v0, 4), v1 = _mm512_srli_epi32(v1, 4);
        }
        const __m512 s = _mm512_load_ps(scale + q * 16), z = _mm512_load_ps(shift + q * 16);
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), s, z);
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), s, z);
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w1, w0);  // w0's 16 then w1's 16
        _mm512_storeu_si512(out + q * 32, _mm512_permutexvar_epi16(pairs, both));
      }
    }
  }
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros) {
  check_arguments(x, packed, group, scales_zeros);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* ws = packed.data_ptr<uint8_t>();
  const auto* sz = scales_zeros.data_ptr<at::BFloat16>();
  auto* ys = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / BN, 1, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> panel(K / 2 * BN * 2);
    alignas(64) float c[TM * BN];
    int configured = -1;
    for (int64_t b = b0; b < b1; ++b) {
      dequantize_block(ws + b * BN * K / 2, sz, N, b * BN, K, panel.data());
      for (int64_t m0 = 0; m0 < M; m0 += TM) {
        const int rows = static_cast<int>(std::min(TM, M - m0));
        if (rows != configured) {
          configure(rows);
          configured = rows;
        }
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint16_t* a = xs + m0 * K;
        for (int64_t k0 = 0; k0 < K; k0 += TK) {
          multiply_tile(a + k0, K * 2, panel.data() + (k0 / 2) * BN * 2);
        }
        store_tiles(c);
        for (int r = 0; r < rows; ++r) {
          at::BFloat16* out = ys + (m0 + r) * N + b * BN;
          for (int j = 0; j < BN; ++j) out[j] = static_cast<at::BFloat16>(c[r * BN + j]);
        }
      }
    }
    _tile_release();
  });
  return y;
}


// Decode steps (a few rows): the products taken exactly per group of 32 input channels, y = sum over groups of
// scale * sum(x (q - 8)) + zero * sum(x), so that no weight is rounded. The 4-bit values minus 8 are bfloat16
// exactly: one lookup (vpermw) turns a nibble into its bfloat16, with no float arithmetic per weight, which makes
// this cheaper than PyTorch's kernel for one row and flat in the rows up to 16. Each group's tile sums (float32)
// are stored and scaled; a row's result depends on that row alone, whatever the rows beside it.
void dequantize_group(const uint8_t* packed, int64_t g, const __m512i lut, uint16_t* panel) {
  for (int64_t p = 0; p < TK / 2; ++p) {  // pairs of input channels g * 32 + 2p, + 1
    const uint8_t* row0 = packed + (g * TK + 2 * p) * (BN / 2);
    const uint8_t* row1 = row0 + BN / 2;
    uint16_t* out = panel + p * BN * 2;
    for (int h = 0; h < 2; ++h) {  // bytes 0-15: channels 0-15 (low nibbles) and 32-47; bytes 16-31: 16-31, 48-63
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row0 + 16 * h));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row1 + 16 * h));
      const __m256i ab = _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
      const __m512i w = _mm512_cvtepu8_epi16(ab);  // channel n's two input channels side by side, as words
      _mm512_storeu_si512(out + 32 * h, _mm512_permutexvar_epi16(w, lut));  // index: the low 5 bits
      _mm512_storeu_si512(out + 64 + 32 * h, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut));
    }
  }
}

// 16 pairs of bfloat16 (32 bits each: a channel's scale and zero, or two neighbouring inputs) as two float32
// vectors, the first and the second of each pair.
inline void split_pairs(__m512i v, __m512& first, __m512& second) {
  first = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  second = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(0xFFFF0000)));
}

at::Tensor int4_mv(const at::Tensor& x, const at::Tensor& packed, int64_t group, const at::Tensor& scales_zeros) {
  check_arguments(x, packed, group, scales_zeros);
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0), G = K / TK;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* ws = packed.data_ptr<uint8_t>();
  const auto* sz = reinterpret_cast<const uint32_t*>(scales_zeros.data_ptr<at::BFloat16>());  // (scale, zero) pairs
  auto* ys = y.data_ptr<at::BFloat16>();
  std::vector<float> sums(M * G);  // each row's sum of x over each group, in one fixed order
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      __m512 even, odd;
      split_pairs(_mm512_loadu_si512(xs + m * K + g * TK), even, odd);
      sums[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
    }
  }
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = static_cast<at::BFloat16>(static_cast<float>((i & 15) - 8)).x;
  const __m512i lut = _mm512_load_si512(table);
  at::parallel_for(0, N / BN, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint16_t panel[TK / 2 * BN * 2];
    alignas(64) float c[TM * BN];
    alignas(64) float acc[TM * BN];
    int configured = -1;
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* block = ws + b * BN * K / 2;
      for (int64_t m0 = 0; m0 < M; m0 += TM) {
        const int rows = static_cast<int>(std::min(TM, M - m0));
        if (rows != configured) {
          configure(rows);
          configured = rows;
        }
        for (int i = 0; i < rows * BN; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
        for (int64_t g = 0; g < G; ++g) {
          // the weights stream from memory: ask for those a few groups ahead (the tile instructions keep the
          // core from running far enough ahead to issue those loads itself); past the block, the next one's
          const char* ahead = reinterpret_cast<const char*>(block + (g + PREFETCH) * TK * BN / 2);
          for (int line = 0; line < TK * BN / 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
          dequantize_group(block, g, lut, panel);
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          multiply_tile(xs + m0 * K + g * TK, K * 2, panel);
          store_tiles(c);
          __m512 scale[4], zero[4];
          const uint32_t* pairs = sz + g * N + b * BN;
          for (int t = 0; t < 4; ++t) split_pairs(_mm512_loadu_si512(pairs + 16 * t), scale[t], zero[t]);
          for (int r = 0; r < rows; ++r) {
            const __m512 s = _mm512_set1_ps(sums[(m0 + r) * G + g]);
            for (int t = 0; t < 4; ++t) {
              float* a = acc + r * BN + 16 * t;
              __m512 v = _mm512_fmadd_ps(scale[t], _mm512_load_ps(c + r * BN + 16 * t), _mm512_load_ps(a));
              _mm512_store_ps(a, _mm512_fmadd_ps(zero[t], s, v));
            }
          }
        }
        for (int r = 0; r < rows; ++r) {
          __m256i* out = reinterpret_cast<__m256i*>(ys + (m0 + r) * N + b * BN);
          for (int t = 0; t < 4; ++t)
            _mm256_storeu_si256(out + t, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(acc + r * BN + 16 * t)));
        }
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(h2o_native, m) {
  m.def("int4_mm(Tensor x, Tensor packed, int group, Tensor scales_zeros) -> Tensor");
  m.def("int4_mv(Tensor x, Tensor packed, int group, Tensor scales_zeros) -> Tensor");
}

TORCH_LIBRARY_IMPL(h2o_native, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int4_mv", &int4_mv);
}
