"""What a serving loop needs around the decode: pages and block tables for continuous
batching (PageAllocator, build_block_table from SGLang's req_to_token pool), batch buckets, a
prompt's write into the cache, the chunks and length buckets of a chunked prefill, one decode
step and a jitted loop of them; and the XLA step helpers: a queue that hands a step's small
results (sampled tokens) to the host as soon as the device wrote them, a compiled step called
as two copies in turn, the compiler options of a step written as a loop, and the lse's layout
as FlashMLA writes it."""
from jax_flashmla.serving.allocator import OutOfPagesError, PageAllocator
from jax_flashmla.serving.block_table import build_block_table, pages_for_tokens
from jax_flashmla.serving.chunks import length_bucket, plan_chunks
from jax_flashmla.serving.host_queue import HostQueue, HostQueueOverrunError
from jax_flashmla.serving.loop import bucket_for, decode_loop, decode_step, pad_batch, write_prompt
from jax_flashmla.serving.step import LOOP_STEP_COMPILER_OPTIONS, AlternatingStep, lse_format

__all__ = [
    "AlternatingStep", "HostQueue", "HostQueueOverrunError", "LOOP_STEP_COMPILER_OPTIONS",
    "OutOfPagesError", "PageAllocator", "bucket_for", "build_block_table", "decode_loop",
    "decode_step", "length_bucket", "lse_format", "pad_batch", "pages_for_tokens", "plan_chunks",
    "write_prompt",
]
