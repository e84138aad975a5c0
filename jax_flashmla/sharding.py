"""mla_decode under jit with sharded inputs, without gathering q or the cache.

The custom call is wrapped in `jax.experimental.custom_partitioning` with a Shardy sharding
rule (the mechanism JAX documents for custom calls under Shardy, its default partitioner):
q may be split along batch (data-parallel attention) and heads (tensor parallel); the block
table and lengths (and the FP8 guard's copies of them that a metadata may carry) follow q's
batch split; the cache, the query tokens, the head dims, the metadata and the FP8 scales stay
replicated. Each device then runs the kernel on its local
batch and heads, with FlashMLA metadata computed for those local shapes when the split
changes them.

custom_partitioning has no vmap rule, so each partitioned call is also a `custom_vmap` that
maps sequentially over the vmapped axis: one custom call per element (FlashMLA has no
batch-of-batches form), the decode primitive itself never vmapped.
"""
import dataclasses
import functools

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flashmla import lowering, validation

# Factors: b batch, s query tokens, h query heads, d head dim (576), v V dim (512), n pages,
# p page size, k KV heads (1), m block-table width, x SM parts, y metadata fields, c batch + 1,
# e and f the (1,) FP8 scales of q and the cache.
_REPLICATED = {"s", "d", "v", "n", "p", "k", "m", "x", "y", "c", "e", "f"}


def _decode_rule(with_metadata, fp8, guard_in_metadata=False):
    operands = "b s h d, n p k d, b m, b" + (", x y, c" if with_metadata else "")
    operands += (", e, f" if fp8 else "") + (", b m, b" if guard_in_metadata else "")
    return operands + " -> b s h v, b h s"


def _replicated_factors(rule):
    """The rule's factors that must stay whole, in order of first appearance (Shardy wants
    them sorted by factor index)."""
    order = dict.fromkeys(rule.replace(",", " ").replace("->", " ").split())
    return tuple(f for f in order if f in _REPLICATED)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    softmax_scale: float
    causal: bool
    head_dim_v: int
    num_sms: int
    fp8: bool = False  # FlashMLA's FP8 decode: two more operands, descale_q and descale_k
    # With fp8: two more after the descales, the guard's kernel_block_table and
    # kernel_seq_lens, computed once per step with the metadata (get_mla_metadata).
    guard_in_metadata: bool = False


def _bind_decode(config, q, kv_cache, block_table, seq_lens, tile_md, num_splits, *fp8_args):
    """The decode primitive; for FP8, fp8_args are (descale_q, descale_k) and, with
    guard_in_metadata, the guard's (kernel_block_table, kernel_seq_lens), else the guard runs
    here."""
    params = dict(fp8=config.fp8, softmax_scale=config.softmax_scale, causal=config.causal,
                  head_dim_v=config.head_dim_v)
    if not config.fp8:
        return lowering.bind_decode(q, kv_cache, block_table, seq_lens, tile_md, num_splits,
                                    **params)
    descales, guarded = fp8_args[:2], fp8_args[2:]
    kernel_table, kernel_lens = guarded or lowering.bind_fp8_guard(block_table, seq_lens)
    return lowering.bind_decode(q, kv_cache, kernel_table, kernel_lens, seq_lens, tile_md,
                                num_splits, *descales, **params)


def _local_metadata(config, seq_lens, s_q, h_q):
    parts = validation.num_sm_parts(config.num_sms, h_q, s_q, 1)
    return lowering.bind_metadata(seq_lens, num_heads_q=h_q, num_q_tokens=s_q, num_heads_k=1,
                                  num_sm_parts=parts, fp8=config.fp8)


def _q_axes(q_sharding):
    spec = tuple(q_sharding.spec) + (None,) * (4 - len(q_sharding.spec))
    return spec[0], spec[2]  # mesh axes of q's batch and heads dims


def _shardings(mesh, batch_axes, head_axes, with_metadata, fp8, guard_in_metadata=False):
    named = lambda *spec: NamedSharding(mesh, P(*spec))
    args = [named(batch_axes, None, head_axes, None), named(), named(batch_axes, None),
            named(batch_axes)]
    if with_metadata:
        args += [named(), named()]
    if fp8:
        args += [named(), named()]
    if guard_in_metadata:
        args += [named(batch_axes, None), named(batch_axes)]
    results = (named(batch_axes, None, head_axes, None), named(batch_axes, head_axes, None))
    return tuple(args), results


def _map_sequentially(fn):
    """fn as a custom_vmap that runs it once per element of the vmapped axis."""
    wrapped = jax.custom_batching.custom_vmap(fn)

    @wrapped.def_vmap
    def _rule(axis_size, in_batched, *args):
        batched = [a for a, b in zip(args, in_batched) if b]

        def one(xs):
            it = iter(xs)
            return fn(*[next(it) if b else a for a, b in zip(args, in_batched)])

        outs = jax.lax.map(one, batched)
        return outs, jax.tree.map(lambda _: True, outs)

    return wrapped


@functools.cache
def partitioned_decode(config):
    """(q, kv_cache, block_table, seq_lens, tile_md, num_splits[, descale_q, descale_k[,
    kernel_block_table, kernel_seq_lens]]) -> (out, lse), shardable; the descales when
    config.fp8, the guard's copies when config.guard_in_metadata.

    The given metadata describes the whole batch and all heads, so it is only valid when the
    partitioner keeps both whole; a split that changes them is refused."""

    @custom_partitioning
    def decode(q, kv_cache, block_table, seq_lens, tile_md, num_splits, *fp8_args):
        return _bind_decode(config, q, kv_cache, block_table, seq_lens, tile_md, num_splits,
                            *fp8_args)

    def partition(mesh, arg_shapes, result_shape):
        batch_axes, head_axes = _q_axes(arg_shapes[0].sharding)
        if batch_axes is not None or head_axes is not None:
            raise ValueError(
                "mla_decode: metadata computed for the whole batch and all heads cannot be used "
                f"with q split along batch ({batch_axes}) or heads ({head_axes}); pass "
                "metadata=None (computed per device), or call the raw ops inside shard_map")
        args, results = _shardings(mesh, None, None, with_metadata=True, fp8=config.fp8,
                                   guard_in_metadata=config.guard_in_metadata)
        return mesh, functools.partial(_bind_decode, config), results, args

    rule = _decode_rule(with_metadata=True, fp8=config.fp8,
                        guard_in_metadata=config.guard_in_metadata)
    decode.def_partition(partition, sharding_rule=rule,
                         need_replication_factors=_replicated_factors(rule))
    return _map_sequentially(decode)


@functools.cache
def partitioned_decode_local_metadata(config):
    """(q, kv_cache, block_table, seq_lens[, descale_q, descale_k]) -> (out, lse), shardable
    along batch and heads; the FlashMLA metadata is computed on each device for its local
    batch and heads."""

    def local(q, kv_cache, block_table, seq_lens, *descales):
        tile_md, num_splits = _local_metadata(config, seq_lens, q.shape[1], q.shape[2])
        return _bind_decode(config, q, kv_cache, block_table, seq_lens, tile_md, num_splits,
                            *descales)

    decode = custom_partitioning(local)

    def partition(mesh, arg_shapes, result_shape):
        batch_axes, head_axes = _q_axes(arg_shapes[0].sharding)
        args, results = _shardings(mesh, batch_axes, head_axes, with_metadata=False,
                                   fp8=config.fp8)
        return mesh, local, results, args

    rule = _decode_rule(with_metadata=False, fp8=config.fp8)
    decode.def_partition(partition, sharding_rule=rule,
                         need_replication_factors=_replicated_factors(rule))
    return _map_sequentially(decode)
