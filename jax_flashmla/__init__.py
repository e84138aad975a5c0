"""FlashMLA's MLA decode for JAX: jit-native XLA FFI custom calls with a pure-JAX reference."""
from jax_flashmla.ops import MLAMetadata, get_mla_metadata, mla_decode
from jax_flashmla.reference import mla_decode_reference

__all__ = ["MLAMetadata", "get_mla_metadata", "mla_decode", "mla_decode_reference"]
