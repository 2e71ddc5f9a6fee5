// oneDNN's fp32 inner product as matmul_t (engine/models/layers/linear.py) calls it, for the fused CPU kernels
// (header-only, included by kernels/<op>/<op>_cpu.cpp). ATen registers torch.ops.mkldnn._linear_pointwise in x86
// builds without a C++ function, so it is called boxed through the dispatcher.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <optional>
#include <string>

namespace rnnserve {

constexpr const char* kOnednnLinear = "mkldnn::_linear_pointwise";

// Whether this PyTorch build has the op (kernels/gemv: onednn_fp32_gemm asks the same from Python).
inline bool onednn_linear_available() {
  return c10::Dispatcher::singleton().findSchema({kOnednnLinear, ""}).has_value();
}

// x [M, K] @ w [N, K]^T + b, fp32, contiguous [M, N].
inline at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow(kOnednnLinear, "");
  torch::jit::Stack stack{x, w, b, std::string("none"), c10::List<std::optional<at::Scalar>>(), std::string()};
  op.callBoxed(&stack);
  return stack.front().toTensor();
}

}  // namespace rnnserve
