"""The forms FlashMLA's sparse kernels take (DeepSeek-V3.2's and V4's): their head counts, query
tokens and topk blocks, q and the sink padded to them, and the V3.2 decode's schedule, a
constant of the shapes."""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import validation
from jax_flashmla.base.validation import fail
from jax_flashmla.kernels import custom_calls

KERNEL_HEADS = (64, 128)  # what FlashMLA's sparse kernels take
KERNEL_QUERY_TOKENS = (1, 2)  # the sparse decode's
KERNEL_TOPK_BLOCK = 64  # FlashMLA's sparse decode takes topk in multiples of this
KERNEL_PREFILL_TOPK_BLOCK = 128  # and its sparse prefill in multiples of this


def kernel_head_count(h_q):
    """The kernel's heads (64 or 128) that h_q heads are padded to; h_q past them, unchanged
    (the decode refuses it)."""
    return next((h for h in KERNEL_HEADS if h >= h_q), h_q)


def kernel_topk(topk, block=KERNEL_TOPK_BLOCK):
    """The kernel's topk: topk rounded up to a multiple of `block` (the indices padded with -1,
    which it skips)."""
    return -(-topk // block) * block


def check_kernel_heads(where, q):
    """q as FlashMLA's sparse kernels take it: bfloat16, at most 128 heads."""
    if q.dtype != jnp.bfloat16:
        fail(TypeError, where, f"FlashMLA's sparse kernels take a bfloat16 q; got {q.dtype}")
    if q.shape[-2] > KERNEL_HEADS[-1]:
        fail(ValueError, where, f"FlashMLA's sparse kernels take at most {KERNEL_HEADS[-1]} "
                                f"heads; got h_q={q.shape[-2]} (split the heads)")


def kernel_heads(q, attn_sink):
    """q (..., h_q, d) bf16 (check_kernel_heads) and the sink (h_q,) padded with zeros to
    the kernel's heads (an empty sink where none is given), and whether a sink was given."""
    h_q = q.shape[-2]
    heads = kernel_head_count(h_q)
    q = jnp.pad(q, [(0, 0)] * (q.ndim - 2) + [(0, heads - h_q), (0, 0)])
    if attn_sink is None:  # the kernel reads no sink: an empty operand takes no kernel to make
        return q, jnp.zeros((0,), jnp.float32), False
    return q, jnp.pad(attn_sink, (0, heads - h_q)), True


@functools.lru_cache(maxsize=None)
def kernel_schedule(batch, heads, s_q, topk, num_sms):
    """FlashMLA's split-KV schedule for `batch` requests of `topk` keys each (the kernel's
    topk, a multiple of 64) at the kernel's `heads`, made by its scheduler once per shape at
    trace time: a numpy int32 array, the scheduler's rows (parts, 8) flattened, then num_splits
    (batch + 1). The decode takes it as a constant of the program, in one array so that XLA
    keeps it as written (num_splits alone, an arithmetic sequence here, it would rebuild as an
    iota at every execution)."""
    parts = validation.num_sm_parts(num_sms, heads, s_q)
    with jax.ensure_compile_time_eval():
        tile_md, num_splits = custom_calls.schedule(
            jnp.full((batch,), topk, jnp.int32), num_heads_q=heads, num_q_tokens=s_q,
            num_sm_parts=parts, fp8=False)
        return np.concatenate([np.asarray(tile_md).reshape(-1), np.asarray(num_splits)])


def check_kernel_decode(where, q):
    """q as FlashMLA's sparse decode takes it (check_kernel_heads, s_q 1 or 2)."""
    check_kernel_heads(where, q)
    if q.shape[1] not in KERNEL_QUERY_TOKENS:
        fail(ValueError, where, f"FlashMLA's sparse decode takes s_q in {KERNEL_QUERY_TOKENS}; "
                                f"got {q.shape[1]} (pass implementation='reference')")
