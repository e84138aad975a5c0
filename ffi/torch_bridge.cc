#include "torch_bridge.h"

#include <cstdint>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/from_blob.h>

#include "buffer_lending.h"

namespace jax_flashmla {
namespace {

namespace ffi = xla::ffi;

OpArg ArgForName(std::string_view name, bool* known) {
  static const std::unordered_map<std::string_view, OpArg> kNames = {
      {"q", OpArg::kQ},
      {"kv_cache", OpArg::kKvCache},
      {"kv", OpArg::kKvCache},
      {"kcache", OpArg::kKvCache},
      {"k_cache", OpArg::kKvCache},
      {"head_size_v", OpArg::kHeadDimV},
      {"head_dim_v", OpArg::kHeadDimV},
      {"d_v", OpArg::kHeadDimV},
      {"seqlens_k", OpArg::kSeqLens},
      {"cache_seqlens", OpArg::kSeqLens},
      {"block_table", OpArg::kBlockTable},
      {"softmax_scale", OpArg::kSoftmaxScale},
      {"sm_scale", OpArg::kSoftmaxScale},
      {"is_causal", OpArg::kCausal},
      {"causal", OpArg::kCausal},
      {"tile_scheduler_metadata", OpArg::kTileSchedulerMetadata},
      {"num_splits", OpArg::kNumSplits},
      {"is_fp8", OpArg::kIsFp8},
      {"is_fp8_kvcache", OpArg::kIsFp8},
      {"num_q_tokens_per_head_k", OpArg::kQTokensPerHeadK},
      {"num_heads_per_head_k", OpArg::kQTokensPerHeadK},
      {"h_k", OpArg::kNumHeadsK},
      {"num_heads_k", OpArg::kNumHeadsK},
      {"h_q", OpArg::kNumHeadsQ},
      {"num_heads_q", OpArg::kNumHeadsQ},
      {"descale_q", OpArg::kDescaleQ},
      {"descale_k", OpArg::kDescaleK},
      {"indices", OpArg::kIndices},
      {"attn_sink", OpArg::kAttnSink},
      {"topk_length", OpArg::kTopkLength},
      {"extra_kv", OpArg::kExtraKv},
      {"extra_k_cache", OpArg::kExtraKv},
      {"extra_indices", OpArg::kExtraIndices},
      {"extra_indices_in_kvcache", OpArg::kExtraIndices},
      {"extra_topk_length", OpArg::kExtraTopkLength},
  };
  auto it = kNames.find(name);
  *known = it != kNames.end();
  return *known ? it->second : OpArg::kCount;
}

// How to fill each schema argument of one op: from a slot of OpArgs, or with a constant
// (the schema's default, or None for an optional feature jax_flashmla does not use).
struct CallPlan {
  c10::OperatorHandle handle;
  std::vector<std::variant<OpArg, c10::IValue>> sources;
};

CallPlan MakePlan(std::string_view qualified_name) {
  const size_t sep = qualified_name.find("::");
  if (sep == std::string_view::npos)
    throw std::runtime_error("FlashMLA op name '" + std::string(qualified_name) +
                             "' is not of the form namespace::name");
  auto handle = c10::Dispatcher::singleton().findSchema(
      {std::string(qualified_name), ""});
  if (!handle.has_value())
    throw std::runtime_error("torch op " + std::string(qualified_name) +
                             " is not registered: the FlashMLA kernel library was not loaded "
                             "into this process");
  CallPlan plan{*handle, {}};
  for (const c10::Argument& arg : handle->schema().arguments()) {
    bool known = false;
    const OpArg slot = ArgForName(arg.name(), &known);
    if (known) {
      plan.sources.emplace_back(slot);
    } else if (arg.default_value().has_value()) {
      plan.sources.emplace_back(*arg.default_value());
    } else if (arg.type()->kind() == c10::TypeKind::OptionalType) {
      plan.sources.emplace_back(c10::IValue());
    } else {
      throw std::runtime_error("torch op " + std::string(qualified_name) + " takes argument '" +
                               arg.name() + "', which jax_flashmla does not know how to fill (" +
                               c10::toString(handle->schema()) + ")");
    }
  }
  return plan;
}

// Looks plans up by the attribute's string_view, without making a std::string per call.
struct NameHash {
  using is_transparent = void;
  size_t operator()(std::string_view name) const { return std::hash<std::string_view>{}(name); }
};

// Plans are made once per op name: reading the schema is not per-call work.
const CallPlan& PlanFor(std::string_view qualified_name) {
  static std::mutex mutex;
  static std::unordered_map<std::string, CallPlan, NameHash, std::equal_to<>> plans;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = plans.find(qualified_name);
  if (it == plans.end())
    it = plans.emplace(std::string(qualified_name), MakePlan(qualified_name)).first;
  return it->second;
}

c10::ScalarType ToScalarType(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16:
      return at::kBFloat16;
    case ffi::DataType::F16:
      return at::kHalf;
    case ffi::DataType::F32:
      return at::kFloat;
    case ffi::DataType::S32:
      return at::kInt;
    case ffi::DataType::F8E4M3FN:
      return at::kFloat8_e4m3fn;
    default:
      throw std::runtime_error("jax_flashmla passes no buffer of XLA dtype " +
                               std::to_string(static_cast<int>(dtype)) + " to torch");
  }
}

}  // namespace

void CallTorchOp(std::string_view qualified_name, const OpArgs& args,
                 const std::vector<at::Tensor>& buffers, const std::vector<Returned>& returned) {
  const CallPlan& plan = PlanFor(qualified_name);
  torch::jit::Stack stack;
  stack.reserve(plan.sources.size());
  for (const auto& source : plan.sources) {
    if (const OpArg* slot = std::get_if<OpArg>(&source)) {
      const c10::IValue& value = args[static_cast<size_t>(*slot)];
      stack.push_back(value);
    } else {
      stack.push_back(std::get<c10::IValue>(source));
    }
  }
  std::string refusal;
  {
    LendBuffers lending(buffers, qualified_name);
    plan.handle.callBoxed(&stack);
    refusal = lending.Refusal();
  }
  if (!refusal.empty()) throw std::runtime_error(refusal);
  // Ops return either one Tensor[] or a tuple of (optional) tensors.
  std::vector<at::Tensor> results;
  for (const c10::IValue& value : stack) {
    if (value.isTensorList()) {
      for (const at::Tensor& t : value.toTensorVector()) results.push_back(t);
    } else if (value.isTensor()) {
      results.push_back(value.toTensor());
    }
  }
  if (results.size() < returned.size())
    throw std::runtime_error(std::string(qualified_name) + " returned " +
                             std::to_string(results.size()) + " tensors, fewer than " +
                             "jax_flashmla's " + std::to_string(returned.size()) + " results");
  for (size_t i = 0; i < returned.size(); ++i) {
    const at::Tensor& buffer = buffers[returned[i].buffer];
    if (!IsBuffer(results[i], buffer))
      throw std::runtime_error(std::string(qualified_name) + " returned its " +
                               returned[i].name +
                               " elsewhere than in XLA's buffer, or in another layout (shape " +
                               c10::str(results[i].sizes()) + ", strides " +
                               c10::str(results[i].strides()) + "; XLA's buffer: shape " +
                               c10::str(buffer.sizes()) + ", strides " +
                               c10::str(buffer.strides()) + ")");
  }
}

at::Tensor WrapBuffer(void* data, ffi::Span<const int64_t> dims, ffi::DataType dtype,
                      int device) {
  const c10::Device cuda(at::kCUDA, static_cast<c10::DeviceIndex>(device));
  // The target device is given: without it from_blob asks the driver where the pointer lives
  // (cudaPointerGetAttributes), for every buffer of every call.
  return at::for_blob(data, at::IntArrayRef(dims.begin(), dims.size()))
      .options(at::TensorOptions().dtype(ToScalarType(dtype)).device(cuda))
      .target_device(cuda)
      .make_tensor();
}

}  // namespace jax_flashmla
