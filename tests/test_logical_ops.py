"""The logical ops (kernels/logical.py) on 8 virtual CPU devices (tests/conftest.py): the
builder's partitioning, vmap and JVP rules on an op of the tests' own, then the sparse decode,
the sparse prefill and the indexer's selection split along their batch or rows under jit, vmapped
and differentiated. Off the GPU the sparse and indexer ops run their reference (their custom
calls are CUDA only); the dense decode's custom-call path is tests/test_sharding.py's. The GPU
runs of their custom calls split over two GPUs are tests/test_gpu_logical_ops.py's."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_flashmla.base import validation
from jax_flashmla.caches.sparse import quantize_tokens
from jax_flashmla.kernels import custom_calls, logical
from jax_flashmla.ops import sparse as sparse_ops
from jax_flashmla.ops.indexer import IndexQuery, index_scores
from jax_flashmla.reference.sparse import sparse_decode_reference
from jax_flashmla.sparse import (indexer_decode, indexer_prefill, IndexKeyCache, mask_indices,
                                 sparse_mla_decode, sparse_mla_prefill, write_sparse_kv)

NUM_SMS = 132
LENGTH = 8192  # each request's keys in the rows op's schedule: split over several SM parts


@pytest.fixture(scope="module")
def mesh():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, f"needs 8 devices (tests/conftest.py); JAX has {len(devices)}"
    return Mesh(np.array(devices[:8]), ("x",))


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def _splits(rows):
    """Each of `rows` requests' KV splits in the dense scheduler's plan for rows requests of
    LENGTH keys, made at trace time (as the sparse decode's schedule is): a constant of the
    shapes."""
    with jax.ensure_compile_time_eval():
        _, num_splits = custom_calls.schedule(
            jnp.full((rows,), LENGTH, jnp.int32), num_heads_q=64, num_q_tokens=1,
            num_sm_parts=validation.num_sm_parts(NUM_SMS, 64, 1), fp8=False)
        return np.diff(np.asarray(num_splits)).astype(np.float32)


SEEN = []  # the shapes the rows op's kernel function was traced on


def _rows_kernels(named, *, shift):
    SEEN.append((named["x"].shape, named["table"].shape))
    return named["x"] + named["table"].sum(0) + shift, named["plan"]


ROWS = logical.LogicalOp(
    "rows_plus_table",
    factors={"x": "r c", "table": "u c", "plan": "e", "y": "r c", "splits": "r"},
    results=("y", "splits"), split=("r",),
    abstract_eval=lambda avals, **_: (avals["x"], jax.core.ShapedArray(avals["x"].shape[:1],
                                                                      jnp.float32)),
    reference=lambda named, *, shift: (named["x"] + named["table"].sum(0) + shift,
                                       jnp.zeros(named["x"].shape[:1], jnp.float32)),
    kernels=_rows_kernels, no_gradient="the tests' op is forward-only", fold_vmap="r",
    constants={"plan": lambda avals, **_: _splits(avals["x"].shape[0])})


def test_each_device_runs_the_kernel_function_on_its_rows_and_the_whole_table(mesh):
    x = jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4)
    table = jnp.ones((3, 4), jnp.float32)
    op = jax.jit(lambda x, t: ROWS(dict(x=x, table=t), implementation="custom_call", shift=1.0))
    SEEN.clear()
    args = (_put(mesh, x, "x"), _put(mesh, table))
    y, splits = op(*args)
    # Traced for the whole shapes (custom_partitioning's call), then run on one device's rows.
    assert SEEN == [((16, 4), (3, 4)), ((2, 4), (3, 4))]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x + 4.0))
    assert tuple(y.sharding.spec)[:1] == ("x",)
    # Each device's schedule is its own two rows', not the whole batch's.
    np.testing.assert_array_equal(np.asarray(splits), np.tile(_splits(2), 8))
    assert not np.array_equal(_splits(2), _splits(16)[:2])
    assert "all-gather" not in op.lower(*args).compile().as_text()


def test_on_one_device_the_kernel_function_runs_on_the_whole_shapes():
    x = jnp.ones((16, 4), jnp.float32)
    SEEN.clear()
    _, splits = jax.jit(lambda x, t: ROWS(dict(x=x, table=t), implementation="custom_call",
                                          shift=0.0))(x, jnp.ones((3, 4), jnp.float32))
    assert SEEN == [((16, 4), (3, 4))]
    np.testing.assert_array_equal(np.asarray(splits), _splits(16))


def test_vmap_folds_into_the_rows_or_maps_one_call_at_a_time():
    x = jnp.arange(3 * 4 * 2, dtype=jnp.float32).reshape(3, 4, 2)
    table = jnp.ones((5, 2), jnp.float32)
    op = lambda x, t: ROWS(dict(x=x, table=t), implementation="custom_call", shift=0.0)
    SEEN.clear()
    y, _ = jax.jit(jax.vmap(op, in_axes=(1, None)))(x, table)  # the table shared: folded
    assert SEEN == [((12, 2), (5, 2))]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.moveaxis(x, 1, 0) + 5.0))
    SEEN.clear()
    tables = jnp.stack([table * (i + 1) for i in range(4)])  # one table each: one call each
    y, _ = jax.jit(jax.vmap(op, in_axes=(1, 0)))(x, tables)
    assert SEEN == [((3, 2), (5, 2))]
    expected = jnp.moveaxis(x, 1, 0) + 5.0 * jnp.arange(1, 5, dtype=jnp.float32)[:, None, None]
    np.testing.assert_array_equal(np.asarray(y), np.asarray(expected))


def test_the_jvp_names_the_op():
    table = jnp.ones((3, 4), jnp.float32)
    loss = lambda x: ROWS(dict(x=x, table=table), implementation="reference", shift=0.0)[0].sum()
    with pytest.raises(NotImplementedError, match=r"^rows_plus_table has no gradient: the "
                                                  r"tests' op is forward-only"):
        jax.grad(loss)(jnp.ones((2, 4), jnp.float32))


# -- the ops --------------------------------------------------------------------------------


def _sparse_decode_problem(batch=8, s_q=2, h_q=16, pages=6, topk=40):
    rng = np.random.default_rng(0)
    rows = rng.normal(0, 0.3, (pages, 64, 1, 576)).astype(np.float32)
    cache = quantize_tokens(jnp.asarray(rows))
    indices = rng.integers(-3, pages * 64 + 3, (batch, s_q, topk)).astype(np.int32)
    q = jnp.asarray(rng.normal(0, 1, (batch, s_q, h_q, 576)), jnp.bfloat16)
    sink = jnp.asarray(rng.normal(0, 1, (h_q,)), jnp.float32)
    return q, cache, jnp.asarray(indices), sink


def _sparse_prefill_problem(tokens=16, keys=300, h_q=16, topk=64):
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(0, 1, (tokens, h_q, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.2, (keys, 576)), jnp.bfloat16)
    indices = jnp.asarray(rng.integers(-5, keys + 5, (tokens, topk)), jnp.int32)
    return q, kv, indices, jnp.asarray(rng.normal(0, 1, (h_q,)), jnp.float32)


def _indexer_problem(rows=8, heads=4, pages=6):
    """(query (rows, heads, 128), cache, block_table (rows, 2), lengths (rows,))."""
    rng = np.random.default_rng(2)
    values = jnp.asarray(rng.normal(0, 1, (rows, heads, 128)), jnp.float8_e4m3fn)
    weights = jnp.asarray(rng.normal(0, 1, (rows, heads)), jnp.float32)
    slots = jnp.arange(pages * 64, dtype=jnp.int32)
    cache = write_sparse_kv(IndexKeyCache.create(pages), slots,
                             jnp.asarray(rng.normal(0, 1, (pages * 64, 128)), jnp.float32))
    block_table = jnp.asarray(rng.integers(0, pages, (rows, 2)), jnp.int32)
    lengths = jnp.asarray(rng.integers(0, 129, (rows,)), jnp.int32)
    return IndexQuery(values, weights), cache, block_table, lengths


def _sparse_decode(q, cache, indices, sink):
    return sparse_mla_decode(q, cache, indices, attn_sink=sink, implementation="reference")


def _sparse_prefill(q, kv, indices, sink):
    return sparse_mla_prefill(q, kv, indices, attn_sink=sink, implementation="reference")


def _indexer_decode(query, cache, block_table, lengths):
    query = IndexQuery(query.values[:, None], query.weights[:, None])
    return indexer_decode(query, cache, block_table, lengths, topk=32,
                          implementation="reference")


def _indexer_prefill(query, cache, block_table, lengths):
    """Each row a request of one new token."""
    cu_seqlens = jnp.arange(lengths.shape[0] + 1, dtype=jnp.int32)
    return indexer_prefill(query, cache, block_table, lengths, cu_seqlens, topk=32,
                           implementation="reference")


def _index_scores(query, cache, block_table, lengths):
    return index_scores(query, cache, block_table, lengths, implementation="reference")


# (name, the op on a problem, the problem, the split operands: True for those split along the
# first axis, the others whole (the cache is each problem's second operand), the results' axes
# along the split)
OPS = [
    ("sparse_mla_decode", _sparse_decode, _sparse_decode_problem, (True, False, True, False),
     (0, 0)),
    ("sparse_mla_prefill", _sparse_prefill, _sparse_prefill_problem, (True, False, True, False),
     (0, 1)),
    ("index_topk", _indexer_decode, _indexer_problem, (True, False, True, True), (0,)),
    ("index_topk", _indexer_prefill, _indexer_problem, (True, False, True, True), (0,)),
    ("index_topk", _index_scores, _indexer_problem, (True, False, True, True), (0,)),
]
IDS = ["sparse_decode", "sparse_prefill", "indexer_decode", "indexer_prefill", "index_scores"]


def _assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _assert_close(got, want):
    """Equal up to XLA's CPU matmuls, whose sums may round another way at another batch size
    (a bfloat16 unit in the last place); integers (selections) equal."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        if np.issubdtype(g.dtype, np.integer):
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-2,
                                       atol=1e-4)


@pytest.mark.parametrize("name,op,problem,split,axes", OPS, ids=IDS)
def test_split_along_batch_equals_each_devices_rows_alone(mesh, name, op, problem, split, axes):
    """Split over 8 devices, each device's results are, bit for bit, the op's on its rows and
    the whole cache on one device; and close to the op's on all rows at once."""
    args = problem()
    one = jax.devices("cpu")[0]
    spread = [jax.tree.map(lambda x, s=s: _put(mesh, x, "x" if s else None), a)
              for a, s in zip(args, split)]
    compiled = jax.jit(op).lower(*spread).compile()
    got = compiled(*spread)
    rows = args[0].shape[0] // 8 if not isinstance(args[0], tuple) else args[0][0].shape[0] // 8
    for i in range(8):
        local = [jax.tree.map(lambda x, s=s: x[i * rows:(i + 1) * rows] if s else x, a)
                 for a, s in zip(args, split)]
        want = jax.jit(op)(*jax.device_put(local, one))
        _assert_same([jax.lax.slice_in_dim(g, i * rows, (i + 1) * rows, axis=axis)
                      for g, axis in zip(jax.tree.leaves(got), axes)], jax.tree.leaves(want))
    _assert_close(got, jax.jit(op)(*jax.device_put(args, one)))
    for result, axis in zip(jax.tree.leaves(got), axes):
        assert tuple(result.sharding.spec)[axis] == "x", result.sharding
    moved = [line for line in compiled.as_text().split("\n")
             if re.search(r"all-gather|all-reduce|all-to-all|collective-permute", line)]
    if name == "index_topk":
        # XLA's SPMD partitioner runs the reference's lax.top_k on gathered scores (not the
        # GPU's path, the custom call); the cache is never moved.
        cache = args[1].data
        cache_type = f"{cache.dtype.name[0]}{cache.dtype.itemsize * 8}[{cache.shape[0]},"
        assert not [line for line in moved if cache_type in line], moved
    else:
        assert not moved, moved  # each device reads its rows' keys from its copy of the cache


@pytest.mark.parametrize("name,op,problem,split,axes", OPS, ids=IDS)
def test_vmap_equals_one_call_per_problem(name, op, problem, split, axes):
    """vmapped over problems sharing the cache (folded into the op's rows), and over problems
    each with its own cache (one op call each)."""
    first = problem()
    second = jax.tree.map(lambda x: x[::-1], first)  # the rows reversed, a cache's pages too
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), first, second)
    for shared_cache in (True, False):
        in_axes = tuple(None if shared_cache and i == 1 else 0 for i in range(4))
        batched = list(stacked)
        if shared_cache:
            batched[1] = first[1]
        got = jax.jit(jax.vmap(op, in_axes=in_axes))(*batched)
        for i, one in enumerate((first, second)):
            one = list(one)
            if shared_cache:
                one[1] = first[1]
            _assert_close(jax.tree.map(lambda x: x[i], got), jax.jit(op)(*one))


@pytest.mark.parametrize("name,op,problem,split,axes", OPS[:2], ids=IDS[:2])
def test_grad_names_the_op(name, op, problem, split, axes):
    q, *rest = problem()
    loss = lambda q: op(q, *rest)[0].astype(jnp.float32).sum()
    with pytest.raises(NotImplementedError, match=f"^{name} has no gradient"):
        jax.grad(loss)(q.astype(jnp.float32).astype(q.dtype))


def test_the_indexers_weights_have_no_gradient():
    query, cache, block_table, lengths = _indexer_problem()
    loss = lambda w: _index_scores(IndexQuery(query.values, w), cache, block_table,
                                   lengths).sum()
    with pytest.raises(NotImplementedError, match="^index_topk has no gradient"):
        jax.grad(loss)(query.weights)


def test_a_stack_of_masked_indices_splits_along_batch(mesh):
    """A layer's row of a stack of MaskedIndices reaches the op as the whole stack: its batch
    (the stack's second axis) splits with q's (close to one device's: see _assert_close)."""
    q, cache, indices, sink = _sparse_decode_problem()
    stack = mask_indices(jnp.stack([indices, indices[::-1]]), cache)
    decode = jax.jit(lambda q, c, s: sparse_mla_decode(q, c, s[1], implementation="reference"))
    want = decode(q, cache, stack)
    spread = (_put(mesh, q, "x"), _put(mesh, cache), jax.tree.map(
        lambda x: _put(mesh, x, None, "x"), stack))
    _assert_close(decode(*spread), want)


@pytest.fixture
def sparse_decode_kernel_on_cpu(monkeypatch):
    """The sparse decode's custom call (CUDA only) lowered on CPU to a stand-in, the reference
    on the kernel's operands (row `layer` of the stack, the padded heads and sink), and the
    custom call allowed off the GPU: the op's custom-call path, partitioning included, runs
    here. Yields the (q, schedule) shapes the stand-in was lowered for."""
    primitive = custom_calls.SPARSE_DECODE.primitive
    seen = []

    def stand_in(q, kv_cache, indices, attn_sink, schedule, *, softmax_scale, with_sink, layer):
        seen.append((q.shape, schedule.shape))
        out, lse = sparse_decode_reference(q, kv_cache, indices[layer],
                                           softmax_scale=softmax_scale,
                                           attn_sink=attn_sink if with_sink else None)
        batch, s_q, heads, _ = q.shape
        splits = batch + (schedule.shape[0] - batch - 1) // validation.METADATA_FIELDS
        return (out, lse, jnp.zeros((splits, heads, s_q, 512), jnp.float32),
                jnp.zeros((splits, heads, s_q), jnp.float32))

    mlir.register_lowering(primitive, mlir.lower_fun(stand_in, multiple_results=True),
                           platform="cpu")
    monkeypatch.setattr(validation, "gpu_refusal", lambda kernel: None)
    yield seen
    del mlir._platform_specific_lowerings["cpu"][primitive]


def test_the_sparse_decodes_custom_call_path_split_along_batch(mesh,
                                                              sparse_decode_kernel_on_cpu):
    """Each device's kernel gets its batch, heads padded to 64 and the schedule made for its
    batch; its results are, bit for bit, the path's on its rows alone."""
    q, cache, indices, sink = _sparse_decode_problem()
    decode = jax.jit(lambda *a: sparse_mla_decode(*a[:3], attn_sink=a[3],
                                                  implementation="custom_call"))
    spread = (_put(mesh, q, "x"), _put(mesh, cache), _put(mesh, indices, "x"), _put(mesh, sink))
    got = decode(*spread)
    local_schedule = sparse_ops.kernel_schedule(1, 64, 2, 64, sparse_ops.default_num_sms()).shape
    assert sparse_decode_kernel_on_cpu[-1] == ((1, 2, 64, 576), local_schedule)
    for i in range(8):
        want = decode(q[i:i + 1], cache, indices[i:i + 1], sink)
        _assert_same([g[i:i + 1] for g in got], want)
    _assert_close(got, jax.jit(_sparse_decode)(q, cache, indices, sink))
