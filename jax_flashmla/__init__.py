"""FlashMLA's MLA decode for JAX: jit-native XLA FFI custom calls with a pure-JAX reference,
prefill and extend over the paged cache (mla_prefill), and the paged KV cache around them.

Namespaces: serving (pages, block tables, DeepSeek-V4's page tables, chunked prefill, decode
steps and loops, speculative decoding's too, and the XLA step helpers AlternatingStep and
HostQueue), context_parallel (the KV cache split over devices), sparse (DeepSeek-V3.2's and
V4's sparse attention and their FP8 caches), flax (the DeepSeek-V3, V3.2 and V4 attention
layers; needs flax, imported on first use)."""
import importlib

from jax_flashmla import serving, sparse
from jax_flashmla.base.checks import value_checks
from jax_flashmla.caches.paged import PagedKVCache, token_slots, write_kv
from jax_flashmla.ops import context_parallel
from jax_flashmla.ops.decode import get_mla_metadata, mla_decode
from jax_flashmla.ops.prefill import mla_prefill

__all__ = [
    "PagedKVCache", "context_parallel", "flax", "get_mla_metadata", "mla_decode", "mla_prefill",
    "serving", "sparse", "token_slots", "value_checks", "write_kv",
]


def __getattr__(name):
    # jax_flashmla.flax needs flax, an optional dependency: imported when first asked for.
    if name == "flax":
        return importlib.import_module("jax_flashmla.flax")
    raise AttributeError(f"module 'jax_flashmla' has no attribute {name!r}")
