"""Public ops: get_mla_metadata and mla_decode, the logical op over the custom calls
(jax_flashmla/kernels/decode_primitive.py)."""
import jax
import jax.numpy as jnp

from jax_flashmla.base import checks, trusted, validation
from jax_flashmla.caches import fp8 as fp8_quant
from jax_flashmla.kernels import custom_calls, decode_primitive
from jax_flashmla.kernels import library as kernels

@trusted.library_made(["seq_lens", "tile_scheduler_metadata", "num_splits"],
                      ["num_heads_q", "num_q_tokens", "max_pages", "fp8"], "get_mla_metadata")
class MLAMetadata:
    """One decode step's lengths and FlashMLA's split-KV schedule for them, shared by every
    layer of the step. Made by get_mla_metadata alone (jax_flashmla/base/trusted.py): the kernels
    trust its lengths and schedule.

    Attributes:
      seq_lens: (batch,) int32, the lengths it was made for: the step's, 0 for each request
        whose length or block-table entries are out of range (get_mla_metadata); mla_decode
        decodes these.
      tile_scheduler_metadata: (num_sm_parts, 8) int32, one row of work per SM part; None when
        made for the pure-JAX reference, which needs no schedule.
      num_splits: (batch + 1,) int32, prefix sums of the number of KV splits per request; None
        with tile_scheduler_metadata.
      num_heads_q, num_q_tokens: the layout it was computed for (static).
      max_pages: the width of the block table it was made with (static), which bounds its
        lengths (at most max_pages * 64).
      fp8: made by the FP8 decode's scheduler, for a float8_e4m3fn cache (static).
    """

    __slots__ = ("seq_lens", "tile_scheduler_metadata", "num_splits", "num_heads_q",
                 "num_q_tokens", "max_pages", "fp8")


def _resolve(where, implementation):
    """None picks the custom call where FlashMLA's kernels can run; "custom_call" runs anywhere
    (off the GPU, the C++ model of FlashMLA's kernels)."""
    return validation.resolve_implementation(where, implementation,
                                             runs_here=kernels.flashmla_available)


def default_num_sms():
    device = jax.devices()[0]
    return int(getattr(device, "core_count", 0) or validation.DEFAULT_NUM_SMS)


def get_mla_metadata(seq_lens, *, block_table, num_pages, num_heads_q, num_q_tokens=1,
                     num_sms=None, implementation=None, fp8=False):
    """Computes one decode step's metadata: its in-range lengths and FlashMLA's tile-scheduler
    metadata for them.

    Args:
      seq_lens: (batch,) int32, KV length of each request (the query tokens included).
      block_table: the step's (batch, max_pages) int32 block table.
      num_pages: the pages block_table may name: a layer's cache (its first dimension), or
        its share of a stacked one. A request whose length is outside [0, max_pages * 64], or
        one of whose read pages (the first ceil(seq_lens / 64) entries of its row) is outside
        [0, num_pages), is scheduled as one of length 0: mla_decode gives it out 0, lse +inf,
        on every implementation, and no kernel reads outside the cache.
      num_heads_q: query heads per device (h_q).
      num_q_tokens: query tokens per request (s_q; > 1 for speculative verify / MTP).
      num_sms: SMs of the target GPU; defaults to the default device's SM count, or 132 (an
        H100/H200) on devices that have none, so CPU traces see GPU shapes.
      implementation: as in mla_decode. The pure-JAX reference needs no schedule: its
        metadata carries the lengths alone, and any implementation's mla_decode accepts it.
      fp8: for a float8_e4m3fn cache: FlashMLA's FP8 decode has its own scheduler
        (get_mla_decoding_metadata_dense_fp8), whose rows the bf16 decode cannot read, nor the
        reverse; mla_decode refuses a mismatch. It schedules a length of 0 as 1, as mla_decode
        gives it to the FP8 kernel (see there).

    The metadata serves every layer of the step: each layer's mla_decode may take this
    block_table or, in a stacked cache, this one plus the page where the layer starts. A
    decode whose lengths are not the metadata's (a metadata of another step) comes out NaN for
    those requests (see mla_decode).

    Returns:
      MLAMetadata with seq_lens (batch,) int32, tile_scheduler_metadata (num_sm_parts, 8)
      int32 and num_splits (batch + 1,) int32, where num_sm_parts = num_sms //
      ceil(num_q_tokens * num_heads_q / 64); the last two None for the reference.
    """
    validation.check_metadata_args(seq_lens, num_heads_q, num_q_tokens)
    validation.check_metadata_block_table(block_table, seq_lens, num_pages)
    if num_sms is not None:
        validation.check_num_sms("get_mla_metadata", num_sms)
    if checks.enabled():
        checks.lengths("get_mla_metadata", seq_lens, block_table.shape[1])
        checks.block_table_entries("get_mla_metadata", block_table, seq_lens, num_pages)
    seq_lens = safe_seq_lens(block_table, seq_lens, num_pages)
    if _resolve("get_mla_metadata", implementation) == "reference":
        return MLAMetadata._make(seq_lens, None, None, int(num_heads_q), int(num_q_tokens),
                                 block_table.shape[1], bool(fp8))
    parts = validation.num_sm_parts(num_sms or default_num_sms(), num_heads_q, num_q_tokens)
    return _make_metadata(seq_lens, num_heads_q=int(num_heads_q), num_q_tokens=int(num_q_tokens),
                          max_pages=block_table.shape[1], num_sm_parts=parts, fp8=bool(fp8))


def _make_metadata(seq_lens, *, num_heads_q, num_q_tokens, max_pages, num_sm_parts, fp8):
    tile_md, num_splits = custom_calls.schedule(seq_lens, num_heads_q=num_heads_q,
                                                num_q_tokens=num_q_tokens,
                                                num_sm_parts=num_sm_parts, fp8=fp8)
    return MLAMetadata._make(seq_lens, tile_md, num_splits, num_heads_q, num_q_tokens, max_pages,
                             fp8)


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
        of length 0, on every implementation, the others as if it were not there.
      metadata: MLAMetadata from get_mla_metadata, to share one schedule and one range check
        between the layers of a step. The metadata's lengths are decoded, and a request the
        metadata did not make empty comes out NaN (out NaN, lse as NaN leaves it, below) where
        its length here is not the metadata's (a metadata of another step), or its carried
        length passes block_table's max_pages * 64 or a page it reads in block_table is
        outside the cache (a metadata of another table); such pages, and those past
        block_table's columns, are read as page 0, never outside the cache nor past a row of
        the table. When None the lengths are checked and the schedule is computed next to
        the kernel, per device for the local batch and heads when q is sharded (a given
        metadata describes the whole batch and all heads, so it cannot be used with a split
        q).
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
        jax_flashmla/caches/fp8.py) unless it comes quantized, and the kernel gets the scale as
        descale_q and descale_k.

    Values are not checked unless jax_flashmla.value_checks() is on while the call is traced
    (jax_flashmla/base/checks.py: lengths, block-table entries, the metadata and the FP8 scale, as
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
    implementation = _resolve("mla_decode", implementation)
    num_sms = default_num_sms()
    if metadata is not None:
        validation.check_metadata_matches(metadata, batch, s_q, h_q, fp8)
    scheduled = metadata is not None and metadata.tile_scheduler_metadata is not None
    if implementation == "custom_call" and not scheduled:
        validation.num_sm_parts(num_sms, h_q, s_q, where="mla_decode")
    if softmax_scale is None:
        softmax_scale = validation.HEAD_DIM ** -0.5
    validation.check_softmax_scale("mla_decode", softmax_scale)
    if checks.enabled():
        metadata = _check_values(kv_cache, block_table, seq_lens, metadata, k_scale)
    if metadata is None:
        seq_lens = safe_seq_lens(block_table, seq_lens, kv_cache.shape[0])
    else:
        q, block_table, seq_lens = _under_carried_lengths(q, kv_cache, block_table, seq_lens,
                                                          metadata)
    operands = dict(q=q, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens)
    if fp8:
        scale = jnp.asarray(k_scale).reshape(1)
        if q.dtype != fp8_quant.FP8_DTYPE:
            operands["q"] = fp8_quant.quantize(q, scale)
        operands.update(descale_q=scale, descale_k=scale)
    if scheduled and implementation == "custom_call":
        operands.update(tile_scheduler_metadata=metadata.tile_scheduler_metadata,
                        num_splits=metadata.num_splits)
    return decode_primitive.mla_decode(operands, softmax_scale=float(softmax_scale),
                                       causal=bool(causal), num_sms=num_sms,
                                       implementation=implementation)


def _under_carried_lengths(q, kv_cache, block_table, seq_lens, metadata):
    """(q, block_table, seq_lens) for a decode under a metadata: the kernels decode the
    carried lengths, which are in range for the table the metadata was made with, over
    this call's table padded with page 0 to that table's width where it is narrower (the
    metadata's schedule names blocks up to its lengths, whatever length the kernel gets).

    A request the metadata did not make empty gets NaN in its q rows, so that its out is NaN
    rather than attention over other keys, where this call's length is not the metadata's (a
    metadata of another step), or its carried length passes this call's table or one of the
    pages it reads there is outside the cache (a metadata of another table); those pages are
    read as page 0, so no table makes a kernel read outside the cache or past a table's
    row. The reduction over the table fuses with what computes the table (a layer's page
    offset), the rest into what computes q."""
    carried = metadata.seq_lens
    outside = jnp.any(checks.bad_entries(block_table, carried, kv_cache.shape[0]), axis=1)
    past = carried > block_table.shape[1] * validation.PAGE_SIZE
    poisoned = ((seq_lens != carried) | outside | past) & (carried != 0)
    q = jnp.where(poisoned[:, None, None, None], jnp.asarray(jnp.nan, q.dtype), q)
    in_cache = (block_table >= 0) & (block_table < kv_cache.shape[0])
    block_table = jnp.where(in_cache, block_table, 0)
    missing = metadata.max_pages - block_table.shape[1]
    if missing > 0:
        block_table = jnp.pad(block_table, ((0, 0), (0, missing)))
    return q, block_table, carried


def _check_values(kv_cache, block_table, seq_lens, metadata, k_scale):
    """jax_flashmla.base.checks' checks of one decode's values (value_checks() on). Returns the
    metadata to decode with: the given one's lengths with their schedule made anew, so that
    no schedule, whatever its fields, reaches a kernel while its error is on its way."""
    where = "mla_decode"
    checks.lengths(where, seq_lens, block_table.shape[1])
    checks.block_table_entries(where, block_table, seq_lens, kv_cache.shape[0])
    if k_scale is not None:
        checks.scale(where, "k_scale", k_scale)
    if metadata is None:
        return None
    checks.metadata_lengths(where, metadata.seq_lens, seq_lens)
    if metadata.tile_scheduler_metadata is None:
        return metadata
    expected = _make_metadata(metadata.seq_lens, num_heads_q=metadata.num_heads_q,
                              num_q_tokens=metadata.num_q_tokens,
                              max_pages=metadata.max_pages,
                              num_sm_parts=metadata.tile_scheduler_metadata.shape[0],
                              fp8=metadata.fp8)
    names = ["tile_scheduler_metadata", "num_splits"]
    checks.metadata_matches(where, [getattr(metadata, n) for n in names],
                            [getattr(expected, n) for n in names], names)
    return expected
