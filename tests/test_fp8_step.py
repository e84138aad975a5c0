"""The FP8 decode in a step: its kernel is given requests of length 0 as length 1 over page 0
(fp8.guard_empty_requests), computed from each decode's own block table, so one metadata
serves any table of its lengths (a stacked cache's layers, another table altogether) and XLA
computes the kernel's table once for layers that share one. CPU here; the scan also runs on
the GPU (tests/test_gpu_fp8.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashmla as jf
from jax_flashmla.caches import fp8
from helpers import FP8_LAYERS, K_SCALE, fp8_kernel_tables, fp8_layers, scan_over_fp8_layers


def _metadata(bt, sl, num_pages):
    return jf.get_mla_metadata(sl, block_table=bt, num_pages=num_pages, num_heads_q=16, fp8=True,
                               implementation="custom_call")


def _decode(q, kv, bt, sl, md):
    return jf.mla_decode(q, kv, bt, sl, metadata=md, k_scale=jnp.float32(K_SCALE),
                         implementation="custom_call")


def _assert_same(got, want):
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.usefixtures("on_cpu")
def test_a_scan_over_layers_computes_the_kernels_table_outside_the_loop():
    # XLA's CPU compiler hoists the loop-invariant table out of the loop by itself.
    assert [op for _, op in fp8_kernel_tables(scan_over_fp8_layers())] == ["get-tuple-element"]


@pytest.mark.usefixtures("on_cpu")
def test_layers_written_out_share_one_kernel_table():
    qs, kv8, bt, sl = fp8_layers()

    @jax.jit
    def step(qs, kv, bt, sl):
        md = _metadata(bt, sl, kv.shape[0])
        return [_decode(qs[i], kv, bt, sl, md) for i in range(FP8_LAYERS)]

    tables = fp8_kernel_tables(step.lower(qs, kv8, bt, sl).compile().as_text())
    assert len(tables) == FP8_LAYERS and len({name for name, _ in tables}) == 1
    one = jax.jit(lambda q, kv, bt, sl: _decode(q, kv, bt, sl, None))
    for i, got in enumerate(step(qs, kv8, bt, sl)):
        _assert_same(got, one(qs[i], kv8, bt, sl))


@pytest.mark.usefixtures("on_cpu")
def test_a_metadata_serves_another_block_table_of_its_lengths():
    """The FP8 kernel reads the decode's own table: a metadata made with table A, given to a
    decode with table B (the same lengths, the rows moved to other pages), gives B's answer."""
    qs, kv8, bt, sl = fp8_layers()
    pages = kv8.shape[0]
    moved = jnp.roll(kv8, 5, axis=0)
    moved_bt = jnp.where(bt < pages, (bt + 5) % pages, bt)
    md_a = _metadata(bt, sl, pages)
    got = jax.jit(_decode)(qs[0], moved, moved_bt, sl, md_a)
    _assert_same(got, jax.jit(_decode)(qs[0], moved, moved_bt, sl, _metadata(moved_bt, sl, pages)))
    _assert_same(got, jax.jit(_decode)(qs[0], kv8, bt, sl, md_a))


@pytest.mark.usefixtures("on_cpu")
def test_a_stacked_cache_shares_the_steps_metadata():
    """Layer l's pages at l * P onwards, its table the step's plus l * P: one metadata made
    for the step's table and P pages serves every layer, each layer equal to a decode of its
    own cache."""
    qs, kv8, bt, sl = fp8_layers()
    pages, scale = kv8.shape[0], jnp.float32(K_SCALE)
    caches = [fp8.quantize(fp8.dequantize(kv8, scale) * 0.5 ** l, scale)
              for l in range(FP8_LAYERS)]

    @jax.jit
    def step(qs, stack, bt, sl):
        md = _metadata(bt, sl, pages)
        return [_decode(qs[l], stack, bt + l * pages, sl, md) for l in range(FP8_LAYERS)]

    one = jax.jit(lambda q, kv, bt, sl: _decode(q, kv, bt, sl, None))
    in_cache = jnp.where(bt < pages, bt, 0)  # the sentinels, shifted, would still be past it
    for l, got in enumerate(step(qs, jnp.concatenate(caches), in_cache, sl)):
        _assert_same(got, one(qs[l], caches[l], bt, sl))


def test_the_metadata_under_a_mesh_gathers_nothing():
    """Replicated over 8 CPU devices (a given metadata keeps batch and heads whole): the
    results equal one device's."""
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "tests/conftest.py sets 8 CPU devices"
    qs, kv8, bt, sl = fp8_layers()
    step = jax.jit(lambda q, kv, bt, sl: _decode(q, kv, bt, sl, _metadata(bt, sl, kv.shape[0])))
    expected = step(*jax.device_put((qs[0], kv8, bt, sl), devices[0]))
    mesh = Mesh(np.array(devices[:8]), ("x",))
    args = jax.device_put((qs[0], kv8, bt, sl), NamedSharding(mesh, P()))
    assert "all-gather" not in step.lower(*args).compile().as_text()
    _assert_same(step(*args), expected)


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(num_pages=None), ValueError,
     r"get_mla_metadata: num_pages must be given .*; got None"),
    (dict(table=None), ValueError,
     r"get_mla_metadata: block_table must be given .*; got None"),
    (dict(table=(4, 0)), ValueError,
     r"block_table must have shape \(4, max_pages >= 1\) for seq_lens of shape \(4,\); got "
     r"\(4, 0\)"),
    (dict(table=(3, 4)), ValueError,
     r"block_table must have shape \(4, max_pages >= 1\) .* got \(3, 4\)"),
    (dict(table=(4,)), ValueError,
     r"block_table must have rank 2 \(batch, max_pages\); got shape \(4,\)"),
    (dict(dtype=jnp.float32), TypeError, r"block_table .*int32"),
])
def test_get_mla_metadata_rejects_a_block_table(kwargs, exc, pattern):
    sl = jnp.ones((4,), jnp.int32)
    shape = kwargs.get("table", (4, 2))
    table = None if shape is None else jnp.zeros(shape, kwargs.get("dtype", jnp.int32))
    with pytest.raises(exc, match=pattern):
        jf.get_mla_metadata(sl, block_table=table, num_pages=kwargs.get("num_pages", 8),
                            num_heads_q=16, fp8=True, implementation="custom_call")
