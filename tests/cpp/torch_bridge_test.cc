// The bridge's host side on torch's CPU libraries: WrapBuffer's tensors, and the errors of
// CallTorchOp for ops it cannot call (raised before it lends any buffer: no_lending.cc stands
// in for buffer lending). Prints one line per check.
#include <cstdio>
#include <exception>
#include <string>

#include <ATen/core/Tensor.h>

#include "torch_bridge.h"

namespace {

// WrapBuffer's tensor over an XLA buffer: the device given (no driver query, which on this
// machine, without CUDA, would fail), the buffer's shape and dtype, and its memory.
bool CheckWrap() {
  alignas(16) static float buffer[2 * 3 * 4];
  const int64_t dims[] = {2, 3, 4};
  const at::Tensor t = jax_flashmla::WrapBuffer(
      buffer, xla::ffi::Span<const int64_t>(dims, 3), xla::ffi::DataType::F32, /*device=*/1);
  const bool ok = t.device() == c10::Device(at::kCUDA, 1) && t.sizes() == at::IntArrayRef(dims) &&
                  t.scalar_type() == at::kFloat && t.data_ptr() == buffer && t.is_contiguous();
  std::printf("%s wrap device=%s sizes=%s\n", ok ? "ok" : "MISMATCH", t.device().str().c_str(),
              c10::str(t.sizes()).c_str());
  return ok;
}

// CallTorchOp on `op` must throw an error containing `expected`.
bool CheckRefused(const char* name, const char* op, const std::string& expected) {
  try {
    jax_flashmla::CallTorchOp(op, jax_flashmla::OpArgs{}, {}, {});
  } catch (const std::exception& e) {
    const bool ok = std::string(e.what()).find(expected) != std::string::npos;
    std::printf("%s %s\n", ok ? "ok" : "MISMATCH", name);
    if (!ok) std::printf("  got: %s\n", e.what());
    return ok;
  }
  std::printf("MISMATCH %s was not refused\n", name);
  return false;
}

}  // namespace

int main() {
  bool ok = CheckWrap();
  ok &= CheckRefused("unregistered_op", "sgl_kernel::no_such_op", "is not registered");
  ok &= CheckRefused("unqualified_name", "fwd_kvcache_mla", "is not of the form namespace::name");
  // aten::relu takes `self`, which the bridge has no value for.
  ok &= CheckRefused("unknown_argument", "aten::relu", "takes argument 'self'");
  return ok ? 0 : 1;
}
