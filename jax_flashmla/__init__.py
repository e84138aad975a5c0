"""FlashMLA's MLA decode for JAX: jit-native XLA FFI custom calls with a pure-JAX reference,
prefill and extend over the paged cache (mla_prefill), the paged KV cache around them, and
multi-device decode. A serving loop's helpers (pages, block tables, batch buckets, chunked
prefill, decode loops) are in jax_flashmla.serving."""
from jax_flashmla import serving
from jax_flashmla.cache import PagedKVCache, token_slots, write_kv
from jax_flashmla.checks import value_checks
from jax_flashmla.context_parallel import dcp_mla_decode, dcp_write_kv, merge_attention_states
from jax_flashmla.ops import (LOOP_STEP_COMPILER_OPTIONS, MLAMetadata, get_mla_metadata, lse_format,
                              mla_decode)
from jax_flashmla.prefill import mla_prefill
from jax_flashmla.reference import mla_decode_reference
from jax_flashmla.speculative import (multi_step_draft, multi_step_draft_metadata, target_verify,
                                      target_verify_metadata)
from jax_flashmla.step import AlternatingStep

__all__ = [
    "AlternatingStep", "LOOP_STEP_COMPILER_OPTIONS", "MLAMetadata", "PagedKVCache",
    "dcp_mla_decode", "dcp_write_kv", "get_mla_metadata", "lse_format", "merge_attention_states",
    "mla_decode", "mla_decode_reference", "mla_prefill", "multi_step_draft", "multi_step_draft_metadata",
    "serving", "target_verify", "target_verify_metadata", "token_slots", "value_checks",
    "write_kv"
]
