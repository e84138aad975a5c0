"""MLA prefill and extend: new tokens over a cached prefix, in DeepSeek's non-absorbed form.

Each batch row is one request. Its new tokens sit at positions [prefix_len, prefix_len + n):
they attend to the request's prefix, read from the paged 576-wide latent cache through its
block table, and causally to themselves. Keys and values are the latent rows decompressed
through W_UK / W_UV (q and k of head dim qk_nope + 64, v of v_head_dim), as DeepSeek's
prefill computes them. A new prompt is prefix_len = 0.

The attention runs in parts merged through their LSEs, as FlashAttention-based serving
engines prefill in chunks: the new tokens over the prefix (no mask), in slices of at most
PREFIX_SLICE_BYTES of decompressed keys and values, and over themselves (causal). Each part
is cuDNN's flash attention on a GPU (jax's wrapper of it, which takes v narrower than q and
k) or, elsewhere, a blockwise pure-JAX attention. Neither holds a (new tokens x keys) array:
memory grows linearly with the tokens and the prefix.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla import checks, fp8, validation
from jax_flashmla.context_parallel import _merge_weights
from jax_flashmla.validation import PAGE_SIZE

IMPLEMENTATIONS = ("cudnn", "xla")
# The decompressed prefix keys and values held at a time: the prefix is attended in slices
# of this many bytes of K/V (48k keys of a request at 128 heads), so that memory stays
# bounded whatever its length, in few enough slices that each is one long cuDNN call.
PREFIX_SLICE_BYTES = 4 << 30
# Keys per step of the pure-JAX attention: its scores are (batch, heads, tokens, KEY_BLOCK).
KEY_BLOCK = 512


def _cudnn_usable():
    """cuDNN flash attention with v narrower than q/k: cuDNN >= 9.10 on a Hopper GPU."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
        device = jax.devices()[0]
        capability = tuple(int(x) for x in str(device.compute_capability).split("."))
        return (device.platform == "gpu" and capability >= (9, 0)
                and fa.check_cudnn_version() >= 91000)
    except Exception:  # noqa: BLE001 - no GPU, no cuDNN, or a jax without the wrapper
        return False


def _resolve(implementation, dtype):
    if implementation is None:
        cudnn = dtype in validation.SUPPORTED_DTYPES and _cudnn_usable()
        return "cudnn" if cudnn else "xla"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"mla_prefill: implementation must be None or one of "
                         f"{IMPLEMENTATIONS}; got {implementation!r}")
    if implementation == "cudnn" and dtype not in validation.SUPPORTED_DTYPES:
        raise TypeError(f"mla_prefill: implementation 'cudnn' takes bfloat16 or float16 q; got "
                        f"{dtype}")
    return implementation


# -- attention cores: (b, t, h, d) q over (b, s, h, d) k -> out (b, t, h, dv), lse (b, h, t) --
# Query i of a row sees keys [0, kv_lens) (causal=False) or [0, min(i + 1, kv_lens))
# (causal=True); queries at or past q_lens, and queries that see no key, get out 0, lse +inf.
# Keys and values past kv_lens must be finite (mla_prefill zeroes them): both cores multiply
# them by a weight of 0.

def _cudnn_attention(q, k, v, q_lens, kv_lens, *, causal, scale):
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    # cuDNN needs a key and a query per row: an empty row is computed on one and cleared.
    out, lse = fa.dot_product_attention(
        q, k, v, q_seqlen=jnp.maximum(q_lens, 1), kv_seqlen=jnp.maximum(kv_lens, 1),
        scale=scale, mask_type=mask, qkv_layout="BTNH", return_residual=True)
    return _clear_unseen(out, lse.astype(jnp.float32), q_lens, kv_lens)


def _xla_attention(q, k, v, q_lens, kv_lens, *, causal, scale):
    """Flash attention in pure JAX: an online softmax over KEY_BLOCK keys at a time, in float32."""
    b, t, h, _ = q.shape
    s = k.shape[1]
    blocks = max(1, math.ceil(s / KEY_BLOCK))
    pad = blocks * KEY_BLOCK - s
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, blocks, KEY_BLOCK, h, -1)
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, blocks, KEY_BLOCK, h, -1)
    q32 = q.astype(jnp.float32)
    query_pos = jnp.arange(t, dtype=jnp.int32)

    def step(carry, block):
        top, total, acc = carry
        index, k_blk, v_blk = block
        key_pos = index * KEY_BLOCK + jnp.arange(KEY_BLOCK, dtype=jnp.int32)
        visible = key_pos[None, None, :] < kv_lens[:, None, None]  # (b, 1, keys)
        if causal:
            visible = visible & (key_pos[None, None, :] <= query_pos[None, :, None])
        k_blk, v_blk = k_blk.astype(jnp.float32), v_blk.astype(jnp.float32)
        scores = jnp.einsum("bthd,bshd->bhts", q32, k_blk,
                            precision=jax.lax.Precision.HIGHEST) * scale
        scores = jnp.where(visible[:, None], scores, -jnp.inf)
        new_top = jnp.maximum(top, jnp.max(scores, axis=-1))
        shift = jnp.where(jnp.isfinite(new_top), new_top, 0.0)
        weights = jnp.exp(scores - shift[..., None])
        rescale = jnp.exp(jnp.where(jnp.isfinite(top), top, shift) - shift)
        total = total * rescale + jnp.sum(weights, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("bhts,bshd->bhtd", weights, v_blk,
                                                    precision=jax.lax.Precision.HIGHEST)
        return (new_top, total, acc), None

    init = (jnp.full((b, h, t), -jnp.inf, jnp.float32), jnp.zeros((b, h, t), jnp.float32),
            jnp.zeros((b, h, t, v.shape[-1]), jnp.float32))
    blocks_in = (jnp.arange(blocks, dtype=jnp.int32), jnp.moveaxis(k, 1, 0), jnp.moveaxis(v, 1, 0))
    (top, total, acc), _ = jax.lax.scan(step, init, blocks_in)
    seen = total > 0
    out = acc / jnp.where(seen, total, 1.0)[..., None]
    lse = top + jnp.log(jnp.where(seen, total, 1.0))
    return _clear_unseen(out.transpose(0, 2, 1, 3).astype(q.dtype), lse, q_lens, kv_lens)


def _clear_unseen(out, lse, q_lens, kv_lens):
    """out 0 and lse +inf for padded queries and rows without keys (FlashMLA's empty query)."""
    t = out.shape[1]
    live = (jnp.arange(t)[None, :] < q_lens[:, None]) & (kv_lens[:, None] > 0)  # (b, t)
    out = jnp.where(live[:, :, None, None], out, jnp.zeros((), out.dtype))
    lse = jnp.where(live[:, None, :] & ~jnp.isneginf(lse), lse, jnp.inf)
    return out, lse


_CORES = {"cudnn": _cudnn_attention, "xla": _xla_attention}


# -- the prefix, from the paged cache ---------------------------------------------------------

def _prefix_rows(kv_cache, block_table, start, size, kv_lens, k_scale, dtype):
    """Cache rows of positions [start, start + size) of every request, (b, size, 576) in
    dtype, 0 past each request's kv_lens rows of them. Pages come from the block table
    clipped into the cache, so no read leaves it."""
    first, last = start // PAGE_SIZE, (start + size + PAGE_SIZE - 1) // PAGE_SIZE
    pages = jnp.clip(block_table[:, first:last], 0, kv_cache.shape[0] - 1)
    rows = kv_cache[pages].reshape(block_table.shape[0], -1, kv_cache.shape[-1])
    rows = rows[:, start - first * PAGE_SIZE:start - first * PAGE_SIZE + size]
    rows = fp8.dequantize(rows, k_scale) if k_scale is not None else rows
    return _zero_past(rows.astype(dtype), kv_lens)


def _zero_past(rows, lens):
    """rows (b, s, d) with rows [lens, s) of each request set to 0. Flash attention weighs a
    masked key by 0 but still multiplies its value, and 0 * NaN is NaN: unused cache rows and
    padding may hold anything."""
    keep = jnp.arange(rows.shape[1])[None, :] < lens[:, None]
    return jnp.where(keep[:, :, None], rows, jnp.zeros((), rows.dtype))


def _decompress(rows, w_uk, w_uv):
    """Latent rows (b, s, kv_lora_rank + rope) -> k (b, s, h, d_nope + rope) and v (b, s, h,
    d_v), in rows' dtype (float32 accumulation), as DeepSeek's kv_b_proj expands them."""
    latent, k_pe = rows[..., :w_uk.shape[0]], rows[..., w_uk.shape[0]:]
    # Products in rows' dtype: a GPU's matmul accumulates bf16 in float32 and writes bf16,
    # half the bytes of a float32 product rounded after.
    k_nope = jnp.einsum("bsc,chd->bshd", latent, w_uk)
    v = jnp.einsum("bsc,chd->bshd", latent, w_uv)
    h = w_uk.shape[1]
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], k_pe.shape[:2] + (h, k_pe.shape[-1]))
    return jnp.concatenate([k_nope, k_pe], axis=-1), v


def _bad_rows(block_table, prefix_lens, query_lens, num_pages, max_prefix, t):
    """(b,): requests whose lengths are out of range or whose prefix pages leave the cache."""
    lens_bad = ((prefix_lens < 0) | (prefix_lens > max_prefix) | (query_lens < 0)
                | (query_lens > t))
    if max_prefix == 0:
        return lens_bad
    # The decode's rule for the pages a length reads; the lengths clipped into the table's
    # first max_prefix tokens, so that only the pages count.
    width = (max_prefix + PAGE_SIZE - 1) // PAGE_SIZE
    return lens_bad | checks.bad_requests(block_table[:, :width],
                                          jnp.clip(prefix_lens, 0, max_prefix), num_pages)


def _check_values(block_table, prefix_lens, query_lens, num_pages, max_prefix, t, k_scale):
    from jax.experimental import checkify
    where = "mla_prefill"
    for name, lens, bound in (("prefix_lens", prefix_lens, max_prefix),
                              ("query_lens", query_lens, t)):
        bad = (lens < 0) | (lens > bound)
        i = jnp.argmax(bad)
        checkify.check(~jnp.any(bad), f"{where}: {name}[{{i}}] = {{value}} is outside [0, {bound}]",
                       i=i, value=lens[i])
    if max_prefix:
        width = (max_prefix + PAGE_SIZE - 1) // PAGE_SIZE
        checks.block_table_entries(where, block_table[:, :width],
                                   jnp.clip(prefix_lens, 0, max_prefix), num_pages)
    if k_scale is not None:
        checks.scale(where, "k_scale", k_scale)


# -- the public op ----------------------------------------------------------------------------

def _check_args(q, kv, kv_cache, block_table, prefix_lens, query_lens, w_uk, w_uv, max_prefix,
                k_scale):
    where = "mla_prefill"
    validation.check_rank(where, "q", q, 4, "(batch, tokens, heads, qk_nope_head_dim + rope)")
    b, t, h, d_qk = q.shape
    if q.dtype not in validation.SUPPORTED_DTYPES + (np.dtype("float32"),):
        raise TypeError(f"{where}: q must be bfloat16, float16 or float32; got {q.dtype}")
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        validation.check_rank(where, name, w, 3, "(kv_lora_rank, heads, head_dim)")
        if w.shape[1] != h or w.shape[0] != w_uk.shape[0]:
            raise ValueError(f"{where}: {name} must have shape ({w_uk.shape[0]}, {h}, head_dim) "
                             f"for q's {h} heads; got {tuple(w.shape)}")
    rope = d_qk - w_uk.shape[2]
    if rope < 1:
        raise ValueError(f"{where}: q's last dim ({d_qk}) must exceed w_uk's head_dim "
                         f"({w_uk.shape[2]}) by the rope dim")
    width = w_uk.shape[0] + rope
    validation.check_rank(where, "kv", kv, 3, f"(batch, tokens, {width})")
    if kv.shape != (b, t, width):
        raise ValueError(f"{where}: kv must have shape {(b, t, width)} (the new tokens' cache "
                         f"rows: kv_lora_rank latent, then the {rope}-d rope key); got "
                         f"{tuple(kv.shape)}")
    if (not isinstance(max_prefix, (int, np.integer)) or isinstance(max_prefix, bool)
            or max_prefix < 0):
        raise ValueError(f"{where}: max_prefix must be a non-negative int (static: the prefix "
                         f"keys read per request); got {max_prefix!r}")
    for name, lens in (("prefix_lens", prefix_lens), ("query_lens", query_lens)):
        if lens is not None:
            validation.check_rank(where, name, lens, 1, "(batch,)")
            validation.check_int32(where, name, lens)
            if lens.shape[0] != b:
                raise ValueError(f"{where}: {name} must have shape ({b},); got {tuple(lens.shape)}")
    if max_prefix == 0:
        return
    if kv_cache is None or block_table is None or prefix_lens is None:
        raise ValueError(f"{where}: max_prefix = {max_prefix} needs kv_cache, block_table and "
                         "prefix_lens")
    validation.check_rank(where, "kv_cache", kv_cache, 4, f"(num_pages, 64, 1, {width})")
    if kv_cache.shape[1:] != (PAGE_SIZE, 1, width):
        raise ValueError(f"{where}: kv_cache must have shape (num_pages, 64, 1, {width}); got "
                         f"{tuple(kv_cache.shape)}")
    fp8_cache = np.dtype(kv_cache.dtype) == validation.FP8_DTYPE
    if fp8_cache != (k_scale is not None):
        raise ValueError(f"{where}: k_scale goes with a float8_e4m3fn kv_cache and only with it; "
                         f"got kv_cache {kv_cache.dtype} and k_scale "
                         f"{'given' if k_scale is not None else 'None'}")
    if k_scale is not None:
        validation.check_scale(where, "k_scale", k_scale)
    validation.check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    validation.check_int32(where, "block_table", block_table)
    pages = math.ceil(max_prefix / PAGE_SIZE)
    if block_table.shape[0] != b or block_table.shape[1] < pages:
        raise ValueError(f"{where}: block_table must have shape ({b}, >= {pages}) to hold "
                         f"max_prefix = {max_prefix} tokens; got {tuple(block_table.shape)}")


def mla_prefill(q, kv, kv_cache=None, block_table=None, prefix_lens=None, query_lens=None, *,
                w_uk, w_uv, softmax_scale, max_prefix=0, k_scale=None, implementation=None):
    """Attention of new tokens over their cached prefix and themselves (prefill, extend).

    Args:
      q: (batch, t, h, qk_nope_head_dim + 64) bfloat16 or float16 (float32 with "xla"): each
        new token's query, its no-rope part then its rope'd part. Row r holds request r's new
        tokens, at positions [prefix_lens[r], prefix_lens[r] + query_lens[r]), right-padded
        to t.
      kv: (batch, t, 576): the new tokens' cache rows (normalised latent, then rope'd key), as
        write_kv stores them, unquantized: the keys of the causal part, taken in q's dtype.
        (Any kv_lora_rank + rope width works; the paged cache's rows are 576 wide.)
      kv_cache: (num_pages, 64, 1, 576) of q's dtype, or float8_e4m3fn with k_scale: the
        paged cache holding each request's prefix rows. Needed when max_prefix > 0.
      block_table: (batch, max_pages) int32, max_pages * 64 >= max_prefix; only the first
        ceil(prefix_lens / 64) entries of a row are read.
      prefix_lens: (batch,) int32 cached tokens each request's new tokens follow; 0 for a new
        prompt. None means 0.
      query_lens: (batch,) int32 new tokens per row, in [0, t]; None means t.
      w_uk: (512, h, qk_nope_head_dim), w_uv: (512, h, v_head_dim): kv_b_proj's two halves,
        which decompress the latent into keys and values.
      softmax_scale: a Python float (MLAConfig.softmax_scale).
      max_prefix: static int: the most prefix tokens a request may have in this call; the
        prefix keys read per request. Bucket it (a power of two, say) so that a serving loop
        compiles a few times, not once per prefix length. 0: new prompts only, no cache read.
      k_scale: with a float8_e4m3fn kv_cache (and only then), its float32 scale (an array of
        shape () or (1,)); prefix rows are dequantized with it.
      implementation: None picks "cudnn" (cuDNN's flash attention) on a Hopper GPU, else
        "xla" (a blockwise pure-JAX attention).

    A request whose prefix_len is outside [0, max_prefix], whose query_len is outside [0, t],
    or one of whose prefix pages is outside [0, num_pages) is answered empty (out 0, lse
    +inf), the others untouched, and nothing outside the cache is read. With
    jax_flashmla.value_checks() on while tracing, such values are also checkify errors naming
    the request and the value.

    Returns:
      out: (batch, t, h, v_head_dim) in q's dtype; 0 for padded tokens.
      lse: (batch, h, t) float32 natural-log sum of exp(softmax_scale * q.k) over the keys
        each token sees; +inf for padded tokens. Parts of one query's keys computed apart
        (chunks, devices) merge exactly with merge_attention_states.
    """
    _check_args(q, kv, kv_cache, block_table, prefix_lens, query_lens, w_uk, w_uv, max_prefix,
                k_scale)
    validation.check_softmax_scale("mla_prefill", softmax_scale)
    core = functools.partial(_CORES[_resolve(implementation, q.dtype)], scale=float(softmax_scale))
    b, t = q.shape[:2]
    if prefix_lens is None:
        prefix_lens = jnp.zeros((b,), jnp.int32)
    if query_lens is None:
        query_lens = jnp.full((b,), t, jnp.int32)
    num_pages = 0 if kv_cache is None else kv_cache.shape[0]
    if checks.enabled():
        _check_values(block_table, prefix_lens, query_lens, num_pages, max_prefix, t, k_scale)
    bad = _bad_rows(block_table, prefix_lens, query_lens, num_pages, max_prefix, t)
    q_lens = jnp.where(bad, 0, query_lens)
    w_uk, w_uv = w_uk.astype(q.dtype), w_uv.astype(q.dtype)

    k, v = _decompress(_zero_past(kv.astype(q.dtype), q_lens), w_uk, w_uv)
    out, lse = core(q, k, v, q_lens, q_lens, causal=True)
    if max_prefix == 0:
        return out, lse
    h, d_kv = q.shape[2], q.shape[3] + w_uv.shape[2]
    per_key = b * h * d_kv * q.dtype.itemsize
    step = max(PAGE_SIZE, PREFIX_SLICE_BYTES // per_key // PAGE_SIZE * PAGE_SIZE)
    for start in range(0, max_prefix, step):
        size = min(step, max_prefix - start)
        kv_lens = jnp.where(bad, 0, jnp.clip(prefix_lens - start, 0, size))
        rows = _prefix_rows(kv_cache, block_table, start, size, kv_lens, k_scale, q.dtype)
        k, v = _decompress(rows, w_uk, w_uv)
        # Merged as they come, so that one slice's keys are freed before the next's.
        out, lse = _merge(out, lse, *core(q, k, v, q_lens, kv_lens, causal=False))
    return out.astype(q.dtype), lse


def _merge(out_a, lse_a, out_b, lse_b):
    """Two parts of each query's keys merged through their LSEs (merge_attention_states'
    rule), elementwise so that it fuses: out (b, t, h, d) float32, lse (b, h, t)."""
    weights, lse = _merge_weights(jnp.stack([lse_a, lse_b]))
    weights = weights.transpose(0, 1, 3, 2)[..., None]  # (2, b, t, h, 1)
    out = (weights[0] * out_a.astype(jnp.float32) + weights[1] * out_b.astype(jnp.float32))
    return out, lse
