"""What a serving loop needs around the decode: pages and block tables for continuous
batching (PageAllocator, build_block_table from SGLang's req_to_token pool, V4PageTables for
DeepSeek-V4's window rings and compressed entries), a step's batch padded to a bucket, a
prompt's write into the cache, the chunks of a chunked prefill and their compiled shapes, one
decode step and a jitted loop of them (speculative decoding's target verify is a decode step
of the drafts, its multi-step drafting a decode loop of the draft model); and the XLA step
helpers: a queue that hands a step's small results (sampled tokens) to the host as soon as the
device wrote them, a compiled step called as two copies in turn (with the compiler options of
a step written as a loop), and the lse's layout as FlashMLA writes it."""
from jax_flashmla.serving.allocator import PageAllocator
from jax_flashmla.serving.block_table import build_block_table
from jax_flashmla.serving.chunks import plan_chunks
from jax_flashmla.serving.host_queue import HostQueue
from jax_flashmla.serving.loop import decode_loop, decode_step, pad_batch, write_prompt
from jax_flashmla.serving.step import AlternatingStep, lse_format
from jax_flashmla.serving.v4_pages import V4PageTables

__all__ = [
    "AlternatingStep", "HostQueue", "PageAllocator", "V4PageTables", "build_block_table",
    "decode_loop", "decode_step", "lse_format", "pad_batch", "plan_chunks", "write_prompt",
]
