"""Public ops: get_mla_metadata and mla_decode, the logical op over the custom calls
(jax_flashmla/decode_primitive.py)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_flashmla import fp8 as fp8_quant
from jax_flashmla import checks, custom_calls, decode_primitive, kernels, validation

IMPLEMENTATIONS = ("custom_call", "reference")

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["tile_scheduler_metadata", "num_splits", "kernel_block_table",
                                "kernel_seq_lens", "seq_lens"],
                   meta_fields=["num_heads_q", "num_q_tokens", "fp8"])
@dataclasses.dataclass(frozen=True)
class MLAMetadata:
    """FlashMLA's split-KV schedule for one decode step, shared by every layer of the step.

    Attributes:
      tile_scheduler_metadata: (num_sm_parts, 8) int32, one row of work per SM part.
      num_splits: (batch + 1,) int32, prefix sums of the number of KV splits per request.
      num_heads_q, num_q_tokens: the layout it was computed for (static).
      fp8: made by the FP8 decode's scheduler, for a float8_e4m3fn cache (static).
      kernel_block_table, kernel_seq_lens: with fp8 and a block_table given to
        get_mla_metadata, the FP8 guard's copies of the step's block table (batch, max_pages)
        and lengths (batch,) int32, which the FP8 kernel reads; else None.
      seq_lens: with a block_table and num_pages given to get_mla_metadata, the (batch,) int32
        lengths it was made for: the step's, 0 for each request whose length or block-table
        entries are out of range (see there); mla_decode decodes these. Else None.
    """

    tile_scheduler_metadata: jax.Array
    num_splits: jax.Array
    num_heads_q: int
    num_q_tokens: int
    fp8: bool = False
    kernel_block_table: jax.Array | None = None
    kernel_seq_lens: jax.Array | None = None
    seq_lens: jax.Array | None = None


def _resolve(implementation):
    if implementation is None:
        return "custom_call" if kernels.flashmla_available() else "reference"
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be None or one of {IMPLEMENTATIONS}; "
                         f"got {implementation!r}")
    return implementation


def default_num_sms():
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or validation.DEFAULT_NUM_SMS)


def get_mla_metadata(seq_lens, *, num_heads_q, num_q_tokens=1, num_sms=None,
                     implementation=None, fp8=False, block_table=None, num_pages=None):
    """Computes FlashMLA's tile-scheduler metadata for one decode step.

    Args:
      seq_lens: (batch,) int32, KV length of each request (the query tokens included).
      num_heads_q: query heads per device (h_q).
      num_q_tokens: query tokens per request (s_q; > 1 for speculative verify / MTP).
      num_sms: SMs of the target GPU; defaults to the default device's SM count, or 132 (an
        H100/H200) on devices that have none, so CPU traces see GPU shapes.
      implementation: as in mla_decode. The pure-JAX reference needs no schedule: with it this
        returns None, which mla_decode accepts.
      fp8: for a float8_e4m3fn cache: FlashMLA's FP8 decode has its own scheduler
        (get_mla_decoding_metadata_dense_fp8), whose rows the bf16 decode cannot read, nor the
        reverse; mla_decode refuses a mismatch. It schedules a length of 0 as 1, as mla_decode
        gives it to the FP8 kernel (see there).
      block_table, num_pages: the step's (batch, max_pages) int32 block table and the pages it
        may name (a layer's cache, or its share of a stacked one), given together. The
        metadata is then made for the step's lengths with every out-of-range request's set to
        0 (a length outside [0, max_pages * 64], or a page it reads, among the first
        ceil(seq_lens / 64) entries of its row, outside [0, num_pages)), and carries those
        lengths: mla_decode decodes them, so that such a request comes out empty (out 0, lse
        +inf) on every implementation and no kernel reads outside the cache. It serves every
        layer's decode, whose table may also be this one plus the page where the layer starts
        in a stacked cache. With fp8 it also carries the guarded copy of the table that the
        FP8 kernel reads in place of the decode's (requests of length 0 as length 1 over page
        0, ffi/fp8_guard.h), so every layer's mla_decode must be given this very table; made
        here, the guard runs once per step. Without them each mla_decode guards its own
        inputs: XLA merges those guards across layers written out one after another, but its
        GPU compiler leaves them inside a lax.scan over layers, once per layer.

    Returns:
      MLAMetadata with tile_scheduler_metadata (num_sm_parts, 8) int32 and num_splits
      (batch + 1,) int32, where num_sm_parts = num_sms // ceil(num_q_tokens * num_heads_q /
      64), and with block_table the guard's kernel_block_table and kernel_seq_lens; or None
      for the reference.
    """
    validation.check_metadata_args(seq_lens, num_heads_q, num_q_tokens)
    if num_sms is not None:
        validation.check_num_sms("get_mla_metadata", num_sms)
    if block_table is not None or num_pages is not None:
        validation.check_metadata_block_table(block_table, seq_lens, num_pages)
    if checks.enabled():
        checks.lengths("get_mla_metadata", seq_lens)
    if _resolve(implementation) == "reference":
        return None
    if block_table is not None:
        seq_lens = safe_seq_lens(block_table, seq_lens, num_pages)
    parts = validation.num_sm_parts(num_sms or default_num_sms(), num_heads_q, num_q_tokens)
    return _make_metadata(seq_lens, block_table, num_heads_q=int(num_heads_q),
                          num_q_tokens=int(num_q_tokens), num_sm_parts=parts, fp8=bool(fp8))


def _make_metadata(seq_lens, block_table, *, num_heads_q, num_q_tokens, num_sm_parts, fp8):
    """The metadata for seq_lens; with a block_table it carries seq_lens and, for fp8, the
    guard's copies of both."""
    tile_md, num_splits = custom_calls.schedule(seq_lens, num_heads_q=num_heads_q,
                                                num_q_tokens=num_q_tokens,
                                                num_sm_parts=num_sm_parts, fp8=fp8)
    guarded = (None, None)
    if block_table is not None and fp8:
        guarded = custom_calls.FP8_GUARD(block_table=block_table, seq_lens=seq_lens)
    return MLAMetadata(tile_md, num_splits, num_heads_q, num_q_tokens, fp8, *guarded,
                       seq_lens=None if block_table is None else seq_lens)


def safe_seq_lens(block_table, seq_lens, num_pages):
    """seq_lens with 0 for each request whose length is outside [0, max_pages * 64] or one of
    whose read pages (its row's first ceil(seq_lens / 64) entries) is outside [0, num_pages):
    lengths no implementation reads outside the cache for, every other request's unchanged."""
    return jnp.where(checks.bad_requests(block_table, seq_lens, num_pages), 0, seq_lens)


def mla_decode(q, kv_cache, block_table, seq_lens, *, metadata=None, softmax_scale=None,
               causal=True, implementation=None, k_scale=None):
    """Multi-head latent attention decode over a paged KV cache (FlashMLA's dense decode).

    Args:
      q: (batch, s_q, h_q, 576) bfloat16 or float16; 512 latent + 64 rope columns per head.
        With a float8_e4m3fn cache q may also come already quantized with k_scale
        (float8_e4m3fn, as fp8.quantize(q, k_scale) makes it), as SGLang hands it to the
        kernel: the quantization can then fuse into whatever computed q.
      kv_cache: (num_pages, 64, 1, 576) of q's dtype, or float8_e4m3fn with k_scale (FlashMLA's
        FP8 decode); V is the first 512 columns of each row.
      block_table: (batch, max_pages) int32; entry j of request i is the page holding its
        tokens [64 j, 64 j + 64). Entries past a request's last page are never read.
      seq_lens: (batch,) int32 KV lengths; 0 is allowed (out 0, lse +inf). A request whose
        length is outside [0, max_pages * 64], or one of whose read pages (the first
        ceil(seq_lens / 64) entries of its row) is outside [0, num_pages), is decoded as one
        of length 0, on every implementation, the others as if it were not there. With a
        metadata that carries its lengths (get_mla_metadata(..., block_table=, num_pages=))
        those lengths are decoded, block_table's pages outside the cache are read as page 0,
        and a request whose length here is not the metadata's (a metadata of another step)
        comes out NaN (out NaN, lse as NaN leaves it, below) unless the metadata made it
        empty; with metadata=None this call works them out. With a metadata made without
        them out-of-range values are not caught: FlashMLA then reads through them.
      metadata: MLAMetadata from get_mla_metadata for these seq_lens, h_q and s_q, to share
        one schedule between the layers of a step. When None it is computed next to the
        kernel, per device for the local batch and heads when q is sharded (a given metadata
        describes the whole batch and all heads, so it cannot be used with a split q). One
        made with a block_table (FP8) carries the kernel's guarded copy of it: block_table
        must then be that same table.
      softmax_scale: a Python float, compiled into the call; defaults to 576 ** -0.5, the
        scale of the 576-wide dot product. DeepSeek's is (qk_nope_head_dim +
        qk_rope_head_dim) ** -0.5, times mscale ** 2 under YaRN (MLAConfig.softmax_scale).
      causal: with s_q > 1, query i sees the first s_k - s_q + i + 1 keys (speculative verify
        / MTP); with s_q = 1 it makes no difference.
      implementation: None picks "custom_call" on a Hopper GPU whose kernels and CUDA bridge
        are available, else "reference". "custom_call" is jax_flashmla's XLA custom call:
        FlashMLA's kernels on CUDA (lowering fails naming what is missing), its C++ model of
        them on CPU. "reference" is pure JAX.
      k_scale: with a float8_e4m3fn kv_cache (and only then), its per-tensor scale: float32 of
        shape () or (1,), an array so that one compiled step serves any scale. As SGLang does,
        q is quantized to float8_e4m3fn with this same scale (saturating at +-448, see
        jax_flashmla/fp8.py) unless it comes quantized, and the kernel gets the scale as
        descale_q and descale_k.

    Values are not checked unless jax_flashmla.value_checks() is on while the call is traced
    (jax_flashmla/checks.py: lengths, block-table entries, the metadata and the FP8 scale, as
    checkify errors).

    Returns:
      out: (batch, s_q, h_q, 512) in q's dtype; bfloat16 with a float8_e4m3fn cache.
      lse: (batch, h_q, s_q) float32, natural-log sum of exp(softmax_scale * q.k) over the keys
        each query sees; +inf where it sees none.

    NaN, on every implementation as in FlashMLA: a NaN in q's row of (token, head), or in
    any column of a key that query sees, makes that query's out NaN in all 512 columns (for
    a key: every head's). Its lse is then +inf, except under a metadata that splits the
    request over several SM parts (FlashMLA, the C++ model): there it is the log-sum-exp of
    the parts without the NaN, so out, not lse, carries it. A NaN in V column d of a key the
    causal mask hides from a query makes column d of that query's out NaN (the kernel weighs
    hidden keys by 0). Rows past a request's length are never read.
    """
    batch, s_q, h_q = validation.check_decode_args(q, kv_cache, block_table, seq_lens,
                                                   k_scale)
    fp8 = k_scale is not None
    implementation = _resolve(implementation)
    num_sms = default_num_sms()
    if metadata is not None:
        validation.check_metadata_matches(metadata, block_table, batch, s_q, h_q, fp8)
    elif implementation == "custom_call":
        validation.num_sm_parts(num_sms, h_q, s_q, where="mla_decode")
    if softmax_scale is None:
        softmax_scale = validation.HEAD_DIM ** -0.5
    validation.check_softmax_scale("mla_decode", softmax_scale)
    if checks.enabled():
        block_table, seq_lens, metadata = _checked_operands(q, kv_cache, block_table, seq_lens,
                                                            metadata, k_scale)
    elif metadata is None:
        seq_lens = safe_seq_lens(block_table, seq_lens, kv_cache.shape[0])
    if metadata is not None and metadata.seq_lens is not None:
        q, block_table, seq_lens = _under_carried_lengths(q, kv_cache, block_table, seq_lens,
                                                          metadata.seq_lens)
    operands = dict(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if fp8:
        scale = jnp.asarray(k_scale).reshape(1)
        if q.dtype != fp8_quant.FP8_DTYPE:
            operands["q"] = fp8_quant.quantize(q, scale)
        operands.update(descale_q=scale, descale_k=scale)
    if metadata is not None and implementation == "custom_call":
        operands.update(tile_scheduler_metadata=metadata.tile_scheduler_metadata,
                        num_splits=metadata.num_splits)
        if metadata.kernel_block_table is not None:
            operands.update(kernel_block_table=metadata.kernel_block_table,
                            kernel_seq_lens=metadata.kernel_seq_lens)
    return decode_primitive.mla_decode(operands, softmax_scale=float(softmax_scale),
                                       causal=bool(causal), num_sms=num_sms,
                                       implementation=implementation)


def _under_carried_lengths(q, kv_cache, block_table, seq_lens, carried):
    """(q, block_table, seq_lens) for a decode under a metadata that carries its lengths.

    The kernels decode the carried lengths, which are in range for the metadata's own table.
    This call's table gets each page outside the cache replaced by page 0, so no table makes
    them read outside it. A request whose length is not the metadata's (a metadata of another
    step), unless the metadata's is 0 (a request it made empty), gets NaN in its q rows, so
    its out is NaN rather than attention over the wrong keys. Both are elementwise: XLA fuses
    them into what computes q and the table."""
    stale = (seq_lens != carried) & (carried != 0)
    nan = jnp.asarray(jnp.nan, q.dtype)
    q = jnp.where(stale[:, None, None, None], nan, q)
    in_cache = (block_table >= 0) & (block_table < kv_cache.shape[0])
    return q, jnp.where(in_cache, block_table, 0), carried


def _checked_operands(q, kv_cache, block_table, seq_lens, metadata, k_scale):
    """jax_flashmla.checks' checks of one decode's values (value_checks() on), and operands
    that are safe whatever the values: a request with a bad length or block-table entry is
    decoded as an empty one (out 0, lse +inf), and the metadata is made anew for them."""
    where = "mla_decode"
    checks.lengths(where, seq_lens, block_table.shape[1])
    checks.block_table_entries(where, block_table, seq_lens, kv_cache.shape[0])
    if k_scale is not None:
        checks.scale(where, "k_scale", k_scale)
    bad = checks.bad_requests(block_table, seq_lens, kv_cache.shape[0])
    safe_lens = jnp.where(bad, 0, seq_lens)
    safe_table = jnp.where((block_table >= 0) & (block_table < kv_cache.shape[0]), block_table, 0)
    if metadata is None:
        return safe_table, safe_lens, None

    def made_for(table, lens):
        return _make_metadata(lens, None if metadata.seq_lens is None else table,
                              num_heads_q=metadata.num_heads_q,
                              num_q_tokens=metadata.num_q_tokens,
                              num_sm_parts=metadata.tile_scheduler_metadata.shape[0],
                              fp8=metadata.fp8)

    expected = made_for(block_table, seq_lens)
    names = ["tile_scheduler_metadata", "num_splits"]
    if metadata.kernel_block_table is not None:
        names += ["kernel_block_table", "kernel_seq_lens"]
    checks.metadata_matches(where, [getattr(metadata, n) for n in names],
                            [getattr(expected, n) for n in names], names, ignore=jnp.any(bad))
    return safe_table, safe_lens, made_for(safe_table, safe_lens)
