// The gated diagonal linear recurrence h_t = a_t * h_{t-1} + b_t over a packed variable-length batch on CPU,
// in linear space or in log space (a_t = exp(log_a_t), b_t = exp(log_b_t)): the prefill scan of minGRU, minLSTM
// and RG-LRU. The PyTorch references walk time in Python (one pair of ops per step, for every sequence padded to
// the longest) or take logcumsumexp over chunks, a third of a minGRU prefill's time; here each thread task takes
// one sequence's block of channels through all its steps, the channels in vector lanes and the state in
// registers: one pass over a and b, one write of h. In log space the sequential form needs no log-sum-exp: the
// products of gates are never formed, so nothing underflows that the recurrence itself would not.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "cpu_math.h"

namespace {
using rnnserve::exp_to_limits;  // exp(-inf) = 0, exp(inf) = inf, NaN kept, as torch's exp
constexpr int64_t kChannels = 64;  // channels of one task: four 16-lane vectors of state

template <typename T, bool kLog>
void scan_block(const T* a, const T* b, int64_t stride, int64_t begin, int64_t end, int64_t c0, int64_t width,
                float* state, float* h, int64_t dim) {
  float carry[kChannels];
  std::copy(state, state + width, carry);
  for (int64_t t = begin; t < end; ++t) {
    const T* at_row = a + t * stride + c0;
    const T* bt_row = b + t * stride + c0;
    float* out = h + t * dim + c0;
#pragma omp simd
    for (int64_t c = 0; c < width; ++c) {
      const float gate = static_cast<float>(at_row[c]), input = static_cast<float>(bt_row[c]);
      carry[c] = kLog ? exp_to_limits(gate) * carry[c] + exp_to_limits(input) : gate * carry[c] + input;
      out[c] = carry[c];
    }
  }
  std::copy(carry, carry + width, state);
}

// a, b [T, D] (fp32, bf16 or fp16; unit stride along D, the same row stride), cu_seqlens [B + 1],
// initial_state [B, D] (linear space, >= 0 in log space) or None. Returns (h [T, D], final_state [B, D]) in fp32.
std::tuple<at::Tensor, at::Tensor> diag_scan_varlen(const at::Tensor& a_in, const at::Tensor& b_in,
                                                    const at::Tensor& cu_seqlens,
                                                    const std::optional<at::Tensor>& initial_state, bool log_space) {
  TORCH_CHECK(a_in.dim() == 2 && a_in.sizes() == b_in.sizes(), "diag_scan_varlen: a and b must both be [T, D]");
  TORCH_CHECK(a_in.scalar_type() == b_in.scalar_type(), "diag_scan_varlen: a and b must share a dtype");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, "diag_scan_varlen: cu_seqlens must be [B + 1]");
  const int64_t total = a_in.size(0), dim = a_in.size(1), batch = cu_seqlens.size(0) - 1;
  const at::Tensor offsets = cu_seqlens.to(at::kLong).contiguous();
  const int64_t* cu = offsets.data_ptr<int64_t>();
  TORCH_CHECK(cu[0] == 0 && cu[batch] == total, "diag_scan_varlen: cu_seqlens must run from 0 to T");
  for (int64_t s = 0; s < batch; ++s) TORCH_CHECK(cu[s] <= cu[s + 1], "diag_scan_varlen: cu_seqlens must not decrease");
  at::Tensor a = a_in, b = b_in;
  if (a.stride(1) != 1 || b.stride(1) != 1 || a.stride(0) != b.stride(0)) {
    a = a.contiguous();
    b = b.contiguous();
  }
  at::Tensor final_state = initial_state.has_value()
                               ? initial_state->to(at::kFloat).contiguous().clone()
                               : at::zeros({batch, dim}, a.options().dtype(at::kFloat));
  TORCH_CHECK(final_state.dim() == 2 && final_state.size(0) == batch && final_state.size(1) == dim,
              "diag_scan_varlen: initial_state must be [B, D]");
  at::Tensor h = at::empty({total, dim}, a.options().dtype(at::kFloat));
  if (total == 0 || dim == 0) return {h, final_state};
  const int64_t blocks = (dim + kChannels - 1) / kChannels;
  float* state = final_state.data_ptr<float>();
  float* out = h.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "diag_scan_varlen", [&] {
    const scalar_t* a_data = a.data_ptr<scalar_t>();
    const scalar_t* b_data = b.data_ptr<scalar_t>();
    at::parallel_for(0, batch * blocks, 1, [&](int64_t first, int64_t last) {
      for (int64_t task = first; task < last; ++task) {
        const int64_t seq = task / blocks, c0 = (task % blocks) * kChannels;
        const int64_t width = std::min(kChannels, dim - c0);
        float* carry = state + seq * dim + c0;
        if (log_space)
          scan_block<scalar_t, true>(a_data, b_data, a.stride(0), cu[seq], cu[seq + 1], c0, width, carry, out, dim);
        else
          scan_block<scalar_t, false>(a_data, b_data, a.stride(0), cu[seq], cu[seq + 1], c0, width, carry, out, dim);
      }
    });
  });
  return {h, final_state};
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(rnnserve, m) {
  m.def(
      "diag_scan_varlen(Tensor a, Tensor b, Tensor cu_seqlens, Tensor? initial_state, bool log_space) "
      "-> (Tensor, Tensor)",
      &diag_scan_varlen);
}
