"""MLA prefill and extend: new tokens over a cached prefix, in DeepSeek's non-absorbed form.

A batch is ragged: the requests' new tokens lie along one token axis, request r's at rows
[query_starts[r], query_starts[r] + query_lens[r]), at positions [prefix_lens[r],
prefix_lens[r] + query_lens[r]) of its sequence. They attend to the request's prefix, read
from the paged 576-wide latent cache through its block table, and causally to themselves. Keys
and values are the latent rows decompressed through W_UK / W_UV (q and k of head dim qk_nope +
64, v of v_head_dim), as DeepSeek's prefill computes them. A new prompt is prefix_len = 0.

The prefixes lie along one key axis of max_prefix_tokens rows, one request after the other,
and are attended in parts of at most PREFIX_SLICE_BYTES of decompressed keys and values; the
new tokens attend to themselves in one more part. The parts merge through their LSEs, as
FlashAttention-based serving engines prefill in chunks. Several requests' prefixes are
attended in fixed slices of the axis. One request's prefix is too where it fills the axis;
otherwise it is cut into parts it fills, of power-of-two sizes, each attended without cuDNN's
padding masks, and a last part of PREFIX_PART_KEYS for what is left, masked: what is read and
computed follows the prefix's length, not the axis's, however far a serving loop buckets
max_prefix_tokens past it. Each part is ragged flash attention (ragged_attention): cuDNN's on a
GPU, or a blockwise pure-JAX one. Nothing holds a (tokens x keys) array.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.base import checks, validation
from jax_flashmla.base.validation import PAGE_SIZE
from jax_flashmla.caches import fp8
from jax_flashmla.kernels import ragged_attention

# The ragged attention core of each implementation: cuDNN's flash attention (an XLA custom
# call) and the blockwise pure-JAX one.
CORES = {"custom_call": ragged_attention.CORES["cudnn"],
         "reference": ragged_attention.CORES["xla"]}
# The decompressed prefix keys and values held at a time: the prefixes are attended in slices
# of this many bytes of K/V (48k keys at 128 heads), so that memory stays bounded whatever
# their length, in few enough slices that each is one long cuDNN call.
PREFIX_SLICE_BYTES = 4 << 30
# The keys of one request's last prefix part: what its power-of-two parts leave of its prefix
# (fewer keys than this) is attended in one part of this many, with a padding mask. Smaller
# parts would cost more in their merges (elementwise over out) than they save.
PREFIX_PART_KEYS = 2048
# DeepSeek's rope key: the cache rows' columns past the latent.
ROPE_DIM = validation.HEAD_DIM - validation.HEAD_DIM_V


def _cudnn_missing():
    """None where cuDNN's flash attention with v narrower than q/k can run (cuDNN >= 9.10 on a
    Hopper GPU, JAX's default device), else what it needs and what is here, for an error."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return f"a Hopper GPU as JAX's default backend; got {device.platform}"
    try:
        fa = ragged_attention.cudnn_wrapper()
        capability = tuple(int(x) for x in str(device.compute_capability).split("."))
        version = fa.check_cudnn_version()
    except Exception as e:  # noqa: BLE001 - no cuDNN, or a jax or GPU without what is asked
        return f"cuDNN on a Hopper GPU; looking for them raised {e!r}"
    if capability < (9, 0):
        return f"a Hopper GPU; got compute capability {device.compute_capability}"
    if version < 91000:
        return f"cuDNN >= 9.10; got {version}"
    return None


def cudnn_usable():
    """Whether cuDNN's flash attention can run here (benchmarks/bench_prefill.py asks too)."""
    return _cudnn_missing() is None


def resolve_implementation(implementation, dtype, head_dim=None):
    """The implementation for q of this dtype and head dim (unchecked where None): None picks
    "custom_call" (cuDNN's flash attention) where it can run, else "reference"; "custom_call"
    where it cannot is an error naming what it needs."""
    # jax's wrapper of cuDNN takes q/k head dims that are multiples of 8, up to 256.
    head_dim_fits = head_dim is None or (head_dim % 8 == 0 and head_dim <= 256)

    def refusal():
        # Here, not in jax's wrapper, whose errors name neither the argument nor the way out.
        if dtype not in validation.SUPPORTED_DTYPES:
            return TypeError, f"takes bfloat16 or float16 q; got {dtype}"
        missing = _cudnn_missing()
        if missing is not None:
            return ValueError, f"(cuDNN's flash attention) needs {missing}"
        if not head_dim_fits:
            return ValueError, f"needs q's head dim a multiple of 8 up to 256; got {head_dim}"
        return None

    return validation.resolve_implementation("mla_prefill", implementation,
                                             runs_here=lambda: refusal() is None,
                                             refusal=refusal)


# -- keys and values --------------------------------------------------------------------------

def _prefix_rows(kv_cache, block_table, segments, first, size, k_scale, dtype):
    """Rows [first, first + size) of the prefix axis (both multiples of 64), (size, 576) in
    dtype: each the cache row of its request's prefix position, 0 where no request's prefix
    is. Each prefix starts on a page of the axis, so whole pages are gathered; they come from
    the block table clipped into the cache, so no read leaves it."""
    pages = ragged_attention.ordered(segments.starts // PAGE_SIZE,
                                     (segments.lens + PAGE_SIZE - 1) // PAGE_SIZE)
    owner, local = ragged_attention.owners(pages, size // PAGE_SIZE, first // PAGE_SIZE)
    column = jnp.minimum(local, block_table.shape[1] - 1)
    page = jnp.clip(block_table[jnp.maximum(owner, 0), column], 0, kv_cache.shape[0] - 1)
    rows = kv_cache[page].reshape(size, kv_cache.shape[-1])
    rows = fp8.dequantize(rows, k_scale) if k_scale is not None else rows
    # Flash attention weighs a key outside every request by 0 but still multiplies its
    # value: unused cache rows may hold anything, NaN included. A row is held when its page
    # is and its position is within the page owner's prefix.
    position = local[:, None] * PAGE_SIZE + jnp.arange(PAGE_SIZE, dtype=jnp.int32)
    held = (owner[:, None] >= 0) & (position < segments.lens[jnp.maximum(owner, 0)][:, None])
    return jnp.where(held.reshape(size, 1), rows.astype(dtype), jnp.zeros((), dtype))


def _row_weights(w_uk, w_uv, rope):
    """(w_k, w_v) over the whole rows (kv_lora_rank + rope columns): w_k (rows, h, d_nope +
    rope) is W_UK on the latent columns and an identity from the rope columns to each head's,
    w_v (rows, h, d_v) W_UV with zeros on the rope columns. One matmul of the rows then makes
    each head's whole key: no pass concatenating the rope key to k_nope, and no copy of the
    latent columns out of the gathered rows."""
    rank, h, nope = w_uk.shape
    eye = jnp.broadcast_to(jnp.eye(rope, dtype=w_uk.dtype)[:, None, :], (rope, h, rope))
    w_k = jnp.concatenate([
        jnp.concatenate([w_uk, jnp.zeros((rank, h, rope), w_uk.dtype)], axis=-1),
        jnp.concatenate([jnp.zeros((rope, h, nope), w_uk.dtype), eye], axis=-1)])
    return w_k, jnp.pad(w_uv, ((0, rope), (0, 0), (0, 0)))


def _decompress(rows, w_k, w_v):
    """Latent rows (s, kv_lora_rank + rope) -> k (s, h, d_nope + rope) and v (s, h, d_v), in
    rows' dtype (float32 accumulation), as DeepSeek's kv_b_proj expands them (the rope key
    copied to every head exactly: a product by 1 and sums of zeros)."""
    # Each matmul takes operands no other matmul shares (a barrier's outputs, no copy): XLA's
    # dot merger joins matmuls sharing an operand (k's and v's the rows, each part's the
    # weights) into one product over the concatenation, then copies each result out of it.
    rows_k, rows_v, w_k, w_v = jax.lax.optimization_barrier((rows, rows, w_k, w_v))
    # Products in rows' dtype: a GPU's matmul accumulates bf16 in float32 and writes bf16,
    # half the bytes of a float32 product rounded after.
    return jnp.einsum("sc,chd->shd", rows_k, w_k), jnp.einsum("sc,chd->shd", rows_v, w_v)


def _non_finite_values_in_keys(k, v):
    """(k, v) for the reference's core, which multiplies every value of a key block by each query's
    weight, 0 for the queries that do not see the key, and 0 * NaN is NaN: a NaN in one
    request's value would reach the queries of the others whose rows share its block. A key
    whose value (for a head) holds a NaN or inf becomes NaN, and its value 0: the core masks
    scores with a select, so the NaN reaches exactly the queries that see the key, making their
    out NaN, and the others weigh an exact 0. Finite values pass unchanged. (A NaN or inf in a
    row makes its key NaN anyway: each entry reaches every column of k, some by a weight of 0.)
    """
    bad = ~jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)  # (s, h, 1)
    return (jnp.where(bad, jnp.asarray(jnp.nan, k.dtype), k),
            jnp.where(bad, jnp.zeros((), v.dtype), v))


# -- the prefix's parts ------------------------------------------------------------------------

def _merged_in_turn(attend, parts, out, lse):
    """out and lse merged with attend(first, size) of each of parts, one after the other (so
    that a part's keys are freed before the next part's are made): out in float32."""
    for first, size in parts:
        part_out, part_lse = attend(first, size)
        out, lse = ragged_attention.merge([out, part_out], [lse, part_lse])
    return out, lse


def _part_sizes(capacity, step):
    """One request's prefix parts on an axis of capacity keys, static: (tops, tail, last). A
    prefix takes each part it fills, in order, each from where the last one it took ended:
    the tops (as many parts of the largest power of two times last within step and capacity
    as the axis holds), then each of tail (the powers of two times last below them). Fewer
    than last keys are then left, attended in one more part of last keys."""
    last = min(PREFIX_PART_KEYS, capacity, step)
    top = last
    while 2 * top <= min(step, capacity):
        top *= 2
    tail, size = [], top // 2
    while size >= last:
        tail.append(size)
        size //= 2
    return [top] * (capacity // top), tail, last


def _one_prefix_in_parts(attend, prefix_len, capacity, step, dtype, out, lse):
    """One request's out and lse merged with its prefix's attention, part by part
    (_part_sizes): what is gathered, decompressed and attended follows the prefix's length,
    not the axis's, and every part but the last is attended without cuDNN's padding masks.
    A part's out is in dtype (q's), the merged out in float32."""
    tops, tail, last = _part_sizes(capacity, step)
    # The tops merge one after the other (their keys freed in turn); one the prefix does not
    # reach passes out through (a copy: the axis is rarely a top longer than the prefix).
    for i, size in enumerate(tops):
        out, lse = jax.lax.cond(
            (i + 1) * size <= prefix_len,
            functools.partial(_merged_in_turn, attend, [(i * size, size)]),
            lambda out, lse: (out.astype(jnp.float32), lse), out, lse)
    start = jnp.minimum(prefix_len // tops[0], len(tops)) * tops[0]
    # The rest are fewer and smaller: each returns its own part (out 0, lse +inf where it is
    # not taken), all merged at the end in one pass, so that none copies out.
    outs, lses = [out], [lse]
    for i, size in enumerate([*tail, last]):
        take = start < prefix_len if i == len(tail) else start + size <= prefix_len
        part_out, part_lse = jax.lax.cond(
            take, functools.partial(attend, size=size),
            lambda first: (jnp.zeros(out.shape, dtype), jnp.full(lse.shape, jnp.inf, lse.dtype)),
            start)
        outs.append(part_out)
        lses.append(part_lse)
        start = jnp.where(take, start + size, start)
    return ragged_attention.merge(outs, lses)


# -- bad values -------------------------------------------------------------------------------

def _layout(block_table, prefix_lens, query_lens, query_starts, num_pages, capacity, t):
    """(bad, prefix_starts): the requests answered empty, and where each request's prefix
    starts on the prefix axis: the prefixes of the others one after the other, in order, each
    from a page boundary (so that a request's keys fall into the cores' blocks alike wherever
    its prefix lies, and its answer does not change with the requests before it); past the
    axis, some position at least capacity + 1."""
    in_range = _in_range(query_lens, query_starts, t)
    bad = ~in_range | _overlaps(query_starts, query_lens, in_range)[0]
    bad = bad | (prefix_lens < 0) | (prefix_lens > capacity)
    if capacity:
        bad = bad | checks.bad_requests(block_table, jnp.clip(prefix_lens, 0, capacity),
                                        num_pages)
    taken = (jnp.clip(prefix_lens, 0, capacity) + PAGE_SIZE - 1) // PAGE_SIZE * PAGE_SIZE
    prefix_starts = _starts(jnp.where(bad, 0, taken), capacity + 1)
    return bad | (prefix_lens > capacity - prefix_starts), prefix_starts


def _starts(lens, cap):
    """(batch,) int32: where segments of these lengths (each in [0, cap]) start, one after the
    other from 0: exact up to cap; past it, some value at least cap, never one wrapped back
    below it, whatever the batch."""
    ends = jnp.cumsum(lens)
    if lens.shape[0] * cap >= 2**31:  # else no sum can wrap
        # The first sum past cap is above it or, wrapped, negative (no length exceeds cap);
        # the sums after it may wrap anywhere, but are past cap from there on.
        past = jax.lax.cummax(((ends > cap) | (ends < 0)).astype(jnp.int32)) > 0
        ends = jnp.where(past, cap, ends)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])


def _in_range(query_lens, query_starts, t):
    """(batch,): requests whose rows lie within the t rows of q (compared so as not to wrap:
    t - a start >= 0 fits int32)."""
    return (query_lens >= 0) & (query_starts >= 0) & (query_lens <= t - query_starts)


def _overlaps(query_starts, query_lens, in_range):
    """((batch,) requests whose rows begin before an earlier request's end, (batch,) the
    latest end of the requests in range before each)."""
    ends = jnp.where(in_range, query_starts + query_lens, 0)
    before = jnp.concatenate([jnp.zeros((1,), jnp.int32), jax.lax.cummax(ends)[:-1]])
    return (query_lens > 0) & (query_starts < before), before


def _check_values(block_table, prefix_lens, query_lens, query_starts, prefix_starts, num_pages,
                  capacity, t, k_scale, packed):
    """The checkify checks of what _layout answers empty: each names the first request at
    fault and its values."""
    from jax.experimental import checkify
    where = "mla_prefill"

    def check(bad, message, **values):
        i = jnp.argmax(bad)
        checkify.check(~jnp.any(bad), f"{where}: {message}", i=i,
                       **{name: v[i] for name, v in values.items()})

    in_range = _in_range(query_lens, query_starts, t)
    # The first request out of range starts within [0, t] when packed: those before it fit.
    start = ("from row {start}, packed after the requests before it" if packed
             else "with query_starts[{i}] = {start}")
    check(~in_range, f"query_lens[{{i}}] = {{length}} {start}: rows outside [0, {t})",
          length=query_lens, start=query_starts)
    overlaps, before = _overlaps(query_starts, query_lens, in_range)
    check(overlaps, "query_starts[{i}] = {start} is before the end of an earlier request's "
          "rows ({end}); requests go in order, apart", start=query_starts, end=before)
    check((prefix_lens < 0) | (prefix_lens > capacity),
          f"prefix_lens[{{i}}] = {{value}} is outside [0, {capacity}]", value=prefix_lens)
    # The first prefix past the axis starts within it: the prefixes before it fit.
    check(prefix_lens > capacity - prefix_starts,
          f"prefix_lens[{{i}}] = {{value}} from position {{start}} of the prefix axis (the "
          f"prefixes one after the other, each from a page) ends past max_prefix_tokens = "
          f"{capacity}",
          value=prefix_lens, start=prefix_starts)
    if capacity:
        max_pages = block_table.shape[1]
        if max_pages * PAGE_SIZE < capacity:  # else each prefix within the axis fits its row
            check(prefix_lens > max_pages * PAGE_SIZE, f"prefix_lens[{{i}}] = {{value}} needs "
                  f"more pages than block_table's rows hold ({max_pages} of {PAGE_SIZE} "
                  "tokens)", value=prefix_lens)
        checks.block_table_entries(where, block_table, jnp.clip(prefix_lens, 0, capacity),
                                   num_pages)
    if k_scale is not None:
        checks.scale(where, "k_scale", k_scale)


# -- the public op ----------------------------------------------------------------------------

def _check_args(q, kv, kv_cache, block_table, prefix_lens, query_lens, query_starts, w_uk, w_uv,
                capacity, k_scale):
    where = "mla_prefill"
    fail = functools.partial(validation.fail, ValueError, where)
    validation.check_rank(where, "q", q, 3, "(tokens, heads, qk_nope_head_dim + rope)")
    t, h, d_qk = q.shape
    if q.dtype not in validation.SUPPORTED_DTYPES + (np.dtype("float32"),):
        validation.fail(TypeError, where, f"q must be bfloat16, float16 or float32; got "
                                          f"{q.dtype}")
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        validation.check_rank(where, name, w, 3, "(kv_lora_rank, heads, head_dim)")
        if w.shape[1] != h or w.shape[0] != w_uk.shape[0]:
            fail(f"{name} must have shape ({w_uk.shape[0]}, {h}, head_dim) for q's {h} heads; "
                 f"got {tuple(w.shape)}")
    rank, nope = w_uk.shape[0], w_uk.shape[2]
    validation.check_rank(where, "kv", kv, 2, "(tokens, kv_lora_rank + rope)")
    # q and kv each say how wide the rope key is: where they disagree, the one that says
    # DeepSeek's 64 is taken to be right, else kv (its rows are the cache's).
    rope_q, rope_kv = d_qk - nope, kv.shape[1] - rank
    rope = rope_q if rope_q == ROPE_DIM or (rope_q > 0 and rope_kv < 1) else rope_kv
    if rope < 1:
        fail(f"q's last dim ({d_qk}) must exceed w_uk's head_dim ({nope}) by the rope dim")
    if rope_q != rope:
        absorbed = (f" (a {d_qk}-wide q is the decode's absorbed one; mla_prefill takes the "
                    "non-absorbed q, its heads' no-rope part then rope part)"
                    if d_qk == validation.HEAD_DIM else "")
        fail(f"q must have shape ({t}, {h}, {nope + rope}): qk_nope_head_dim {nope} (w_uk's "
             f"last dim) + the {rope}-d rope key (kv's {kv.shape[1]}-wide rows less "
             f"kv_lora_rank {rank}); got {tuple(q.shape)}{absorbed}")
    if kv.shape != (t, rank + rope):
        fail(f"kv must have shape {(t, rank + rope)} (the new tokens' cache rows: kv_lora_rank "
             f"latent, then the {rope}-d rope key of q's {d_qk} = {nope} + {rope}); got "
             f"{tuple(kv.shape)}")
    width = rank + rope
    if (not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool)
            or not 0 <= capacity < 2**31 or capacity % PAGE_SIZE):
        fail(f"max_prefix_tokens must be a non-negative int below 2**31 (positions on it are "
             f"int32), a multiple of {PAGE_SIZE} (static: the prefix keys read for the whole "
             f"batch); got {capacity!r}")
    b = None
    for name, lens in (("query_lens", query_lens), ("prefix_lens", prefix_lens),
                       ("query_starts", query_starts)):
        if lens is None:
            continue
        validation.check_rank(where, name, lens, 1, "(batch,)")
        validation.check_int32(where, name, lens)
        if b is not None and lens.shape[0] != b:
            fail(f"{name} must have shape ({b},) like query_lens; got {tuple(lens.shape)}")
        b = lens.shape[0] if b is None else b
    if (query_starts is not None or prefix_lens is not None) and query_lens is None:
        fail("query_lens is needed with prefix_lens or query_starts (it says how many requests "
             "there are and how many new tokens each has)")
    if b == 0:
        fail("query_lens must hold at least one request; got shape (0,)")
    if capacity == 0:
        return
    if kv_cache is None or block_table is None or prefix_lens is None:
        fail(f"max_prefix_tokens = {capacity} needs kv_cache, block_table and prefix_lens")
    validation.check_rank(where, "kv_cache", kv_cache, 4, f"(num_pages, 64, 1, {width})")
    if kv_cache.shape[1:] != (PAGE_SIZE, 1, width):
        fail(f"kv_cache must have shape (num_pages, 64, 1, {width}); got "
             f"{tuple(kv_cache.shape)}")
    fp8_cache = np.dtype(kv_cache.dtype) == validation.FP8_DTYPE
    if fp8_cache != (k_scale is not None):
        fail(f"k_scale goes with a float8_e4m3fn kv_cache and only with it; got kv_cache "
             f"{kv_cache.dtype} and k_scale {'given' if k_scale is not None else 'None'}")
    if k_scale is not None:
        validation.check_scale(where, "k_scale", k_scale)
    validation.check_rank(where, "block_table", block_table, 2, "(batch, max_pages)")
    validation.check_int32(where, "block_table", block_table)
    if block_table.shape[0] != b:
        fail(f"block_table must have {b} rows, one per request; got {tuple(block_table.shape)}")


def mla_prefill(q, kv, kv_cache=None, block_table=None, prefix_lens=None, query_lens=None, *,
                w_uk, w_uv, softmax_scale, max_prefix_tokens=0, query_starts=None, k_scale=None,
                implementation=None):
    """Attention of a ragged batch of new tokens over their cached prefixes and themselves.

    Args:
      q: (tokens, h, qk_nope_head_dim + 64) bfloat16 or float16 (float32 with "reference"): each
        new token's query, its no-rope part then its rope'd part. Request r's new tokens are
        rows [query_starts[r], query_starts[r] + query_lens[r]), at positions
        [prefix_lens[r], prefix_lens[r] + query_lens[r]) of its sequence. Other rows are
        padding.
      kv: (tokens, 576): the new tokens' cache rows (normalised latent, then rope'd key), as
        write_kv stores them, unquantized: the keys of the causal part, taken in q's dtype.
        (Any kv_lora_rank + rope width works; the paged cache's rows are 576 wide.)
      kv_cache: (num_pages, 64, 1, 576) of q's dtype, or float8_e4m3fn with k_scale: the
        paged cache holding each request's prefix rows. Needed when max_prefix_tokens > 0.
      block_table: (batch, max_pages) int32; only the first ceil(prefix_lens[r] / 64)
        entries of row r are read.
      prefix_lens: (batch,) int32 cached tokens each request's new tokens follow; 0 for a new
        prompt. None means 0.
      query_lens: (batch,) int32 new tokens per request. None means one request of all rows.
      w_uk: (512, h, qk_nope_head_dim), w_uv: (512, h, v_head_dim): kv_b_proj's two halves,
        which decompress the latent into keys and values.
      softmax_scale: a Python float (MLAConfig.softmax_scale).
      max_prefix_tokens: static int, a multiple of 64: the length of the batch's prefix axis,
        on which each prefix takes its pages' 64 * ceil(prefix_len / 64) keys, one after the
        other; their sum must fit. Bucket it (a power of two, say) so that a serving loop
        compiles a few times, not once per prefix length: one request's prefix is read and
        decompressed in parts that follow its length, not the axis's. 0: new prompts only,
        no cache read.
      query_starts: (batch,) int32 first row of each request in q, in request order, apart
        (rows of one request before the next's). None packs them: each request right after
        the one before, from row 0.
      k_scale: with a float8_e4m3fn kv_cache (and only then), its float32 scale (an array of
        shape () or (1,)); prefix rows are dequantized with it.
      implementation: None picks "custom_call" (cuDNN's flash attention, an XLA custom call)
        where it can run (cuDNN >= 9.10 on a Hopper GPU, JAX's default backend; q bfloat16 or
        float16 of a head dim a multiple of 8 up to 256), else "reference" (a blockwise
        pure-JAX attention). "custom_call" where it cannot run is an error.

    A request is answered empty (out 0, lse +inf), the others untouched and nothing outside
    the cache read, when its rows leave [0, tokens) or overlap an earlier request's, when its
    prefix_len is outside [0, max_prefix_tokens] or needs more pages than its block table
    row has, when one of those pages is outside [0, num_pages), or when its prefix ends past
    max_prefix_tokens after the pages of the requests before it not answered empty, whatever
    the values (no int32 sum of them wraps). With jax_flashmla.value_checks() on while
    tracing, such values are also checkify errors naming the argument, the request and the
    value.

    A NaN or inf in kv or in a prefix row reaches no other request's queries; with "reference",
    exactly the queries that see its key, whose out it makes NaN.

    Returns:
      out: (tokens, h, v_head_dim) in q's dtype; 0 in padding rows.
      lse: (h, tokens) float32 natural-log sum of exp(softmax_scale * q.k) over the keys each
        token sees; +inf in padding rows. Parts of one query's keys computed apart (chunks,
        devices) merge exactly with merge_attention_states (out[None], lse[None]).
    """
    _check_args(q, kv, kv_cache, block_table, prefix_lens, query_lens, query_starts, w_uk, w_uv,
                max_prefix_tokens, k_scale)
    validation.check_softmax_scale("mla_prefill", softmax_scale)
    t = q.shape[0]
    if query_lens is None:
        query_lens = jnp.full((1,), t, jnp.int32)
    if prefix_lens is None:
        prefix_lens = jnp.zeros(query_lens.shape, jnp.int32)
    return _prefill(q, kv, kv_cache, block_table, prefix_lens, query_lens, query_starts,
                    w_uk.astype(q.dtype), w_uv.astype(q.dtype), k_scale,
                    scale=float(softmax_scale), capacity=max_prefix_tokens,
                    implementation=resolve_implementation(implementation, q.dtype, q.shape[2]),
                    value_checks=checks.enabled())


# Jitted so that a call outside jit compiles once, not op by op; inside jit it is inlined.
# value_checks is static because the checks are traced in only while they are enabled.
@functools.partial(jax.jit, static_argnames=("scale", "capacity", "implementation",
                                             "value_checks"))
def _prefill(q, kv, kv_cache, block_table, prefix_lens, query_lens, query_starts, w_uk, w_uv,
             k_scale, *, scale, capacity, implementation, value_checks):
    core = functools.partial(CORES[implementation], scale=scale)
    t, b = q.shape[0], query_lens.shape[0]
    packed = query_starts is None
    if packed:
        query_starts = _starts(jnp.clip(query_lens, 0, t + 1), t + 1)
    num_pages = 0 if kv_cache is None else kv_cache.shape[0]
    bad, prefix_starts = _layout(block_table, prefix_lens, query_lens, query_starts, num_pages,
                                 capacity, t)
    if value_checks:
        _check_values(block_table, prefix_lens, query_lens, query_starts, prefix_starts,
                      num_pages, capacity, t, k_scale, packed)
    shift = None
    if b == 1 and not packed:
        # One request goes through cuDNN's plain layout, which reads from row 0.
        shift = jnp.where(bad[0], 0, query_starts[0])
        q, kv = jnp.roll(q, -shift, axis=0), jnp.roll(kv, -shift, axis=0)
        query_starts = jnp.zeros_like(query_starts)
    q_segments = ragged_attention.ordered(query_starts, jnp.where(bad, 0, query_lens))

    owner, _ = ragged_attention.owners(q_segments, t)
    new_rows = jnp.where((owner >= 0)[:, None], kv.astype(q.dtype), jnp.zeros((), q.dtype))
    w_k, w_v = _row_weights(w_uk, w_uv, kv.shape[1] - w_uk.shape[0])

    def keys_values(rows):
        k, v = _decompress(rows, w_k, w_v)
        return _non_finite_values_in_keys(k, v) if implementation == "reference" else (k, v)

    k, v = keys_values(new_rows)
    out, lse = core(q, k, v, q_segments, q_segments, causal=True)
    if capacity:
        prefixes = ragged_attention.ordered(prefix_starts, jnp.where(bad, 0, prefix_lens))
        # cuDNN's packed layout pads v to q's head dim (ragged_attention.cudnn_attention).
        v_width = q.shape[2] if b > 1 else w_uv.shape[2]
        per_key = q.shape[1] * (q.shape[2] + v_width) * q.dtype.itemsize
        step = max(PAGE_SIZE, PREFIX_SLICE_BYTES // per_key // PAGE_SIZE * PAGE_SIZE)
        slices = [(first, min(step, capacity - first)) for first in range(0, capacity, step)]

        def attend(first, size):
            """The queries' attention to prefix rows [first, first + size) of the axis, read
            and decompressed here; first may be traced."""
            k, v = keys_values(_prefix_rows(kv_cache, block_table, prefixes, first, size,
                                            k_scale, q.dtype))
            return core(q, k, v, q_segments, ragged_attention.clip(prefixes, first, size),
                        causal=False)

        if b == 1:
            whole_axis = functools.partial(_merged_in_turn, attend, slices)
            in_parts = functools.partial(_one_prefix_in_parts, attend, prefixes.lens[0],
                                         capacity, step, q.dtype)
            out, lse = jax.lax.cond(prefixes.lens[0] == capacity, whole_axis, in_parts, out, lse)
        else:
            out, lse = _merged_in_turn(attend, slices, out, lse)
    out = out.astype(q.dtype)
    if shift is not None:
        out, lse = jnp.roll(out, shift, axis=0), jnp.roll(lse, shift, axis=1)
    return out, lse
