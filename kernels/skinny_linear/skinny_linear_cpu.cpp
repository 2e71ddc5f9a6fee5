// y = x W^T (+ bias) for bf16 activations x [M, K] with few rows (a decode batch, M <= 32) on Intel AMX.
//
// With so few rows a linear layer is bound by streaming W from memory, yet oneDNN repacks W into its own
// blocked layout on every call and reaches about half of the memory bandwidth. Here W is read once, as it
// is stored: a 16-row block of W is directly an AMX "A" tile (16 rows x 32 bf16), and x, which is small,
// is repacked per call into "B" tiles (pairs of consecutive k of one row of x per 32-bit element), so each
// tile product yields a 16 (outputs) x M (rows) block of y^T, accumulated in fp32 and rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RNNSERVE_HAVE_AMX 1
#endif

namespace {
constexpr int64_t kTileRows = 16;  // outputs per A tile, k-pairs per B tile, rows of x per B tile
constexpr int64_t kStepK = 32;     // bf16 elements of k per tile product
constexpr int64_t kMaxRows = 2 * kTileRows;
constexpr int64_t kPrefetchSteps = 2;  // how far ahead W is prefetched (see prefetch_rows)

#ifdef RNNSERVE_HAVE_AMX
// Linux hands out AMX tile state only to a process that asks for it (once; oneDNN asks the same way).
bool request_amx() {
  static const bool granted = [] {
    constexpr int kArchReqXcompPerm = 0x1023;
    constexpr int kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0 = a block of W; 1, 2 = x rows [0, 16) and [16, M); 3, 4 = the matching blocks of y^T.
TileConfig tile_config(int64_t rows) {
  TileConfig cfg;
  const int64_t first = std::min(rows, kTileRows), second = rows - first;
  cfg.rows[0] = kTileRows;
  cfg.colsb[0] = kStepK * 2;
  cfg.rows[1] = cfg.rows[3] = kTileRows;
  cfg.colsb[1] = cfg.colsb[3] = static_cast<uint16_t>(first * 4);
  if (second > 0) {
    cfg.rows[2] = cfg.rows[4] = kTileRows;
    cfg.colsb[2] = cfg.colsb[4] = static_cast<uint16_t>(second * 4);
  }
  return cfg;
}

// x [M, K] -> B tiles [2][steps][16 k-pairs][16 rows] of (x[m, 2p], x[m, 2p + 1]) pairs, zero-padded.
// Whole steps gather one k-pair of up to 16 rows per instruction; a partial last step goes pair by pair.
std::vector<uint32_t> pack_rows(const at::BFloat16* x, int64_t rows, int64_t k, int64_t row_stride,
                                int64_t steps) {
  std::vector<uint32_t> packed(2 * steps * kTileRows * kTileRows, 0);
  const int64_t full_steps = k / kStepK;
  for (int64_t m0 = 0; m0 < rows; m0 += kTileRows) {
    const int64_t tile_rows = std::min(kTileRows, rows - m0);
    const __mmask16 valid = static_cast<__mmask16>((1u << tile_rows) - 1);
    const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(static_cast<int>(row_stride * 2)));
    uint32_t* tiles = packed.data() + (m0 / kTileRows) * steps * kTileRows * kTileRows;
    const char* base = reinterpret_cast<const char*>(x + m0 * row_stride);
    for (int64_t pair = 0; pair < full_steps * kTileRows; ++pair) {
      const __m512i column = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, offsets, base + pair * 4, 1);
      _mm512_storeu_si512(tiles + pair * kTileRows, column);
    }
    for (int64_t m = m0; m < m0 + tile_rows; ++m) {
      const uint16_t* row = reinterpret_cast<const uint16_t*>(x + m * row_stride);
      for (int64_t pair = full_steps * kTileRows; pair < (k + 1) / 2; ++pair) {
        const uint32_t lo = row[2 * pair], hi = 2 * pair + 1 < k ? row[2 * pair + 1] : 0;
        tiles[pair * kTileRows + m - m0] = lo | (hi << 16);
      }
    }
  }
  return packed;
}

// Brings the cache lines of W that the A tile will load `step` steps into this block (or, past its end,
// into the next one) into L1: a tile load that misses waits on every row, and the hardware prefetchers
// leave most of that latency exposed.
inline void prefetch_rows(const at::BFloat16* w, int64_t w_stride, int64_t n, int64_t n0, int64_t step,
                          int64_t steps, bool next_block) {
  if (step >= steps) {
    if (!next_block) return;
    n0 += kTileRows;
    step -= steps;
  }
  const int64_t end = std::min(n, n0 + kTileRows);
  for (int64_t row = n0; row < end; ++row) _mm_prefetch(w + row * w_stride + step * kStepK, _MM_HINT_T0);
}

// One thread's share of output blocks [block_begin, block_end), 16 outputs each.
void amx_blocks(const at::BFloat16* w, int64_t w_stride, const uint32_t* packed, const float* bias,
                at::BFloat16* y, int64_t rows, int64_t n, int64_t k, int64_t steps, int64_t block_begin,
                int64_t block_end) {
  const TileConfig cfg = tile_config(rows);
  _tile_loadconfig(&cfg);
  const bool two = rows > kTileRows;
  const int64_t padded_k = steps * kStepK;
  const bool exact_k = k == padded_k;
  std::vector<at::BFloat16> staged;  // a zero-padded copy of a block that the tiles cannot read in place
  alignas(64) float out[2][kTileRows][kTileRows];
  const int64_t tile_bytes = kTileRows * kTileRows * 4;
  for (int64_t block = block_begin; block < block_end; ++block) {
    const int64_t n0 = block * kTileRows, outputs = std::min(kTileRows, n - n0);
    const at::BFloat16* a = w + n0 * w_stride;
    int64_t a_stride = w_stride;
    if (outputs < kTileRows || !exact_k) {
      staged.assign(kTileRows * padded_k, at::BFloat16(0.f));
      for (int64_t i = 0; i < outputs; ++i) std::memcpy(&staged[i * padded_k], a + i * w_stride, k * 2);
      a = staged.data();
      a_stride = padded_k;
    }
    _tile_zero(3);
    if (two) _tile_zero(4);  // an unconfigured tile faults
    for (int64_t s = 0; s < steps; ++s) {
      prefetch_rows(w, w_stride, n, n0, s + kPrefetchSteps, steps, block + 1 < block_end);
      _tile_loadd(0, a + s * kStepK, a_stride * 2);
      _tile_loadd(1, reinterpret_cast<const char*>(packed) + s * tile_bytes, kTileRows * 4);
      _tile_dpbf16ps(3, 0, 1);
      if (two) {
        _tile_loadd(2, reinterpret_cast<const char*>(packed) + (steps + s) * tile_bytes, kTileRows * 4);
        _tile_dpbf16ps(4, 0, 2);
      }
    }
    _tile_stored(3, out[0], kTileRows * 4);
    if (two) _tile_stored(4, out[1], kTileRows * 4);
    const __mmask16 valid = static_cast<__mmask16>((1u << outputs) - 1);
    const __m512 bias_block = bias ? _mm512_maskz_loadu_ps(valid, bias + n0) : _mm512_setzero_ps();
    const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32(kTileRows));
    for (int64_t m = 0; m < rows; ++m) {  // column m of the y^T block is row m of y
      const __m512 values = _mm512_i32gather_ps(column, &out[m / kTileRows][0][m % kTileRows], 4);
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(values, bias_block));
      _mm256_mask_storeu_epi16(y + m * n + n0, valid, reinterpret_cast<const __m256i&>(rounded));
    }
  }
  _tile_release();
}
#endif

bool skinny_linear_available() {
#ifdef RNNSERVE_HAVE_AMX
  return request_amx();
#else
  return false;
#endif
}

// x [M, K] bf16 (unit stride along K, 1 <= M <= 32), weight [N, K] bf16 (unit stride along K), bias [N]
// (any float dtype) or None. Returns y [M, N] bf16, contiguous.
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(skinny_linear_available(), "skinny_linear needs AMX-BF16 (and a build with it)");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "x and weight must be bf16");
  const int64_t rows = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "weight has ", weight.size(1), " inputs, x has ", k);
  TORCH_CHECK(rows >= 1 && rows <= kMaxRows, "skinny_linear takes 1 to ", kMaxRows, " rows, got ", rows);
  TORCH_CHECK(k >= 1 && (x.stride(1) == 1 || k == 1) && (weight.stride(1) == 1 || k == 1),
              "x and weight need a unit stride along K");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "bias must be [N]");
    bias32 = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({rows, n}, x.options());
#ifdef RNNSERVE_HAVE_AMX
  const int64_t steps = (k + kStepK - 1) / kStepK;
  const std::vector<uint32_t> packed = pack_rows(x.data_ptr<at::BFloat16>(), rows, k, x.stride(0), steps);
  const float* bias_data = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const int64_t blocks = (n + kTileRows - 1) / kTileRows;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    amx_blocks(weight.data_ptr<at::BFloat16>(), weight.stride(0), packed.data(), bias_data,
               y.data_ptr<at::BFloat16>(), rows, n, k, steps, begin, end);
  });
#endif
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def("skinny_linear_available() -> bool", &skinny_linear_available);
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &skinny_linear);
}
