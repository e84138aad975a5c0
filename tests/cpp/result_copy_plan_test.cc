// The bridge's copy planning (PlanResultCopy) and the kernel's index arithmetic (SourceUnit),
// run on the host over CPU tensors of the layouts FlashMLA returns and some it could: each
// plan, executed unit by unit, must reproduce torch's own copy. And WrapBuffer's tensors.
// Prints one line per check.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>

#include <ATen/ATen.h>

#include "torch_bridge.h"

namespace {

using jax_flashmla::PlanResultCopy;
using jax_flashmla::SourceUnit;
using jax_flashmla::StridedCopy;

bool Check(const char* name, const at::Tensor& src) {
  const at::Tensor dst = at::empty(src.sizes(), src.options());
  const StridedCopy copy = PlanResultCopy(src, dst, name);
  for (int64_t i = 0; i < copy.units; ++i)
    std::memcpy(static_cast<char*>(copy.dst) + i * copy.unit_bytes,
                static_cast<const char*>(copy.src) + SourceUnit(copy, i) * copy.unit_bytes,
                copy.unit_bytes);
  const bool equal = at::equal(dst, src.contiguous());
  std::printf("%s %s unit_bytes=%d contiguous=%d\n", equal ? "ok" : "MISMATCH", name,
              copy.unit_bytes, copy.src_contiguous ? 1 : 0);
  return equal;
}

bool Rejects(const char* name, const at::Tensor& src, const at::Tensor& dst) {
  try {
    PlanResultCopy(src, dst, name);
  } catch (const std::exception& e) {
    std::printf("ok %s rejected: %s\n", name, e.what());
    return true;
  }
  std::printf("MISMATCH %s was not rejected\n", name);
  return false;
}

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

}  // namespace

int main() {
  at::manual_seed(0);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  bool ok = true;
  // out as FlashMLA returns it: (b, s_q, h_q, 512), contiguous.
  ok &= Check("out", at::randn({3, 2, 16, 512}, bf16));
  // lse: (b, h_q, s_q) as a transposed view of (b, s_q, h_q); for s_q = 1 that is contiguous.
  ok &= Check("lse_s_q_2", at::randn({3, 2, 16}, f32).transpose(1, 2));
  ok &= Check("lse_s_q_1", at::randn({3, 1, 16}, f32).transpose(1, 2));
  // Rows of 512 inside wider rows: 16-byte units along strided rows.
  ok &= Check("out_padded_rows", at::randn({3, 2, 16, 520}, bf16).narrow(3, 0, 512));
  // A start that is not 16-byte aligned: element units.
  ok &= Check("out_unaligned", at::randn({3 * 2 * 16 * 512 + 1}, bf16)
                                   .narrow(0, 1, 3 * 2 * 16 * 512).view({3, 2, 16, 512}));
  // Any permutation of a small odd shape; rank 2 (padded to 4).
  ok &= Check("permuted", at::randn({3, 5, 7}, f32).permute({2, 0, 1}));
  ok &= Check("rank_2", at::randn({7, 9}, f32).t());
  ok &= Rejects("wrong_shape", at::zeros({2, 3}, f32), at::zeros({3, 2}, f32));
  ok &= Rejects("wrong_dtype", at::zeros({2, 3}, f32), at::zeros({2, 3}, bf16));
  ok &= Rejects("rank_5", at::zeros({1, 2, 1, 2, 1}, f32), at::zeros({1, 2, 1, 2, 1}, f32));
  ok &= Rejects("8_byte_elements", at::zeros({4}, at::kDouble), at::zeros({4}, at::kDouble));
  ok &= CheckWrap();
  return ok ? 0 : 1;
}
