// The sizes and byte layouts that the handlers, our kernels and the C++ model share, stated
// once for C++ and CUDA. jax_flashmla states them once for Python; the _cpu module's
// layouts() returns these, and tests/test_layouts.py checks that the two agree.
#ifndef JAX_FLASHMLA_FFI_LAYOUTS_H_
#define JAX_FLASHMLA_FFI_LAYOUTS_H_

#include <cstdint>

namespace jax_flashmla {

// Tokens per page of every paged cache (FlashMLA's block size).
inline constexpr int64_t kPageTokens = 64;

// The int32 fields of a row of FlashMLA's tile-scheduler metadata (the decode writes 7 and
// leaves the 8th unused).
inline constexpr int64_t kMetadataFields = 8;

// DeepSeek-V3.2's index-key cache (jax_flashmla/caches/index_keys.py): a page is its 64
// tokens' 128 e4m3 key values, token t's at [128 t, 128 t + 128), then their float32 scales,
// token t's at [8192 + 4 t, 8192 + 4 t + 4).
inline constexpr int64_t kIndexKeyDim = 128;
inline constexpr int64_t kIndexKeyScaleBytes = 4;
inline constexpr int64_t kIndexPageValuesBytes = kPageTokens * kIndexKeyDim;
inline constexpr int64_t kIndexPageBytes =
    kIndexPageValuesBytes + kPageTokens * kIndexKeyScaleBytes;

// DeepSeek-V4's cache (jax_flashmla/caches/v4.py), FlashMLA's MODEL1 page: 64 token rows of
// 576 bytes (448 e4m3, 64 bf16), then a row holding the tokens' 8-byte scale rows, token t's
// at [8 t, 8 t + 8). FlashMLA's kernel takes a page as a (64, 1, 584) view: 584 the bytes of
// a token's row and scales together, which fixes the view's token stride.
inline constexpr int64_t kV4RowBytes = 576;
inline constexpr int64_t kV4ScaleBytes = 8;
inline constexpr int64_t kV4PageRows = kPageTokens + 1;
inline constexpr int64_t kV4KernelTokenBytes = kV4RowBytes + kV4ScaleBytes;

}  // namespace jax_flashmla

#endif  // JAX_FLASHMLA_FFI_LAYOUTS_H_
