"""The FP8 decode's guard for requests of length 0 (ffi/fp8_guard.h) as a step runs it: once
per step, whether the layers are written out one after another (XLA merges their guards) or
are a lax.scan (get_mla_metadata(..., block_table=) makes it with the metadata), with results
equal to single calls; and the errors of a metadata that carries it. CPU here; the scans also
run on the GPU (tests/test_gpu_fp8.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashmla as jf
from jax_flashmla import fp8
from helpers import (FP8_LAYERS, K_SCALE, fp8_custom_calls, fp8_layers, guard_table,
                     scan_over_fp8_layers)

@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("guard_in_metadata", [False, True])
def test_a_scan_over_layers_guards_once_per_step(guard_in_metadata):
    # XLA's CPU compiler hoists a loop-invariant guard out of the loop by itself.
    assert scan_over_fp8_layers(guard_in_metadata) == (1, 1)


@pytest.mark.usefixtures("on_cpu")
def test_the_metadatas_guard_replaces_the_layers_own():
    """Layers written out one after another with a metadata that carries the guard: that one
    guard and no other, and the results of the layers' own guards."""
    qs, kv8, bt, sl = fp8_layers()

    def step(qs, kv, bt, sl, guard_in_metadata):
        md = jf.get_mla_metadata(sl, num_heads_q=16, fp8=True, implementation="custom_call",
                                 **guard_table(bt, kv, guard_in_metadata))
        return [jf.mla_decode(qs[i], kv, bt, sl, metadata=md, k_scale=jnp.float32(K_SCALE),
                              implementation="custom_call") for i in range(FP8_LAYERS)]

    with_md = jax.jit(lambda *a: step(*a, True))
    assert fp8_custom_calls(with_md.lower(qs, kv8, bt, sl).compile().as_text()) == (1, FP8_LAYERS)
    plain = jax.jit(lambda *a: step(*a, False))(qs, kv8, bt, sl)
    for (out, lse), (plain_out, plain_lse) in zip(with_md(qs, kv8, bt, sl), plain):
        np.testing.assert_array_equal(np.asarray(out, np.float32),
                                      np.asarray(plain_out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(plain_lse))


def test_the_metadatas_guard_under_a_mesh_gathers_nothing():
    """Replicated over 8 CPU devices (a given metadata keeps batch and heads whole): the
    guard's copies travel with the metadata and the results equal one device's."""
    devices = jax.devices("cpu")
    assert len(devices) >= 8, "tests/conftest.py sets 8 CPU devices"
    qs, kv8, bt, sl = fp8_layers()

    def step(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, num_heads_q=16, fp8=True, implementation="custom_call",
                                 block_table=bt, num_pages=kv.shape[0])
        return jf.mla_decode(q, kv, bt, sl, metadata=md, k_scale=jnp.float32(K_SCALE),
                             implementation="custom_call")

    step = jax.jit(step)
    expected = step(*jax.device_put((qs[0], kv8, bt, sl), devices[0]))
    mesh = Mesh(np.array(devices[:8]), ("x",))
    args = jax.device_put((qs[0], kv8, bt, sl), NamedSharding(mesh, P()))
    assert "all-gather" not in step.lower(*args).compile().as_text()
    for got, want in zip(step(*args), expected):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(fp8=True, num_pages=None), ValueError,
     r"get_mla_metadata: block_table and num_pages go together .*; got block_table alone"),
    (dict(fp8=True, table=(4, 0)), ValueError,
     r"block_table must have shape \(4, max_pages >= 1\) for seq_lens of shape \(4,\); got "
     r"\(4, 0\)"),
    (dict(fp8=True, table=(3, 4)), ValueError,
     r"block_table must have shape \(4, max_pages >= 1\) .* got \(3, 4\)"),
    (dict(fp8=True, table=(4,)), ValueError,
     r"block_table must have rank 2 \(batch, max_pages\); got shape \(4,\)"),
    (dict(fp8=True, dtype=jnp.float32), TypeError, r"block_table .*int32"),
])
def test_get_mla_metadata_rejects_a_block_table(kwargs, exc, pattern):
    sl = jnp.ones((4,), jnp.int32)
    table = jnp.zeros(kwargs.get("table", (4, 2)), kwargs.get("dtype", jnp.int32))
    with pytest.raises(exc, match=pattern):
        jf.get_mla_metadata(sl, num_heads_q=16, fp8=kwargs["fp8"], implementation="custom_call",
                            block_table=table, num_pages=kwargs.get("num_pages", 8))


def test_mla_decode_rejects_the_guard_of_another_block_table():
    qs, kv8, bt, sl = fp8_layers()
    md = jf.get_mla_metadata(sl, num_heads_q=16, fp8=True, implementation="custom_call",
                             block_table=jnp.concatenate([bt, bt], axis=1),
                             num_pages=kv8.shape[0])
    with pytest.raises(ValueError, match=r"mla_decode: metadata carries the guarded copy of a "
                                         r"block_table of shape \(4, 8\)"):
        jf.mla_decode(qs[0], kv8, bt, sl, metadata=md, k_scale=jnp.float32(K_SCALE),
                      implementation="custom_call")
