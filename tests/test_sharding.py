"""Multi-device decode on 8 virtual CPU devices (tests/conftest.py sets them up before JAX
starts): heads and batch split under jit, and decode context parallelism. These fail, not
skip, when the devices are missing. They run on the CPU devices on every machine; the GPU
machine's multi-GPU runs are tests/test_gpu_multi.py."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashmla as jf
from jax_flashmla import context_parallel as cp
from jax_flashmla.caches import fp8
from helpers import (LSE_TOL, OUT_TOL, assert_flashmla_close, dense_attention_f64,
                     sharding_problem, split_for_dcp)

IMPLEMENTATIONS = ["custom_call", "reference"]
SCALE = 576 ** -0.5


@pytest.fixture(scope="module")
def devices():
    devices = jax.devices("cpu")
    assert len(devices) >= 8, (f"the sharding tests need 8 devices; JAX has {len(devices)} "
                               "(tests/conftest.py sets --xla_force_host_platform_device_count=8)")
    return devices


def _spec(array):
    spec = tuple(array.sharding.spec)
    return spec + (None,) * (array.ndim - len(spec))


def _put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,batch_axis,head_axis", [
    ((8,), None, "x"),      # tensor parallel: heads over 8 devices
    ((8,), "x", None),      # data-parallel attention: requests over 8 devices
    ((2, 4), "x", "y"),     # both
])
def test_split_decode_equals_one_device(devices, implementation, shape, batch_axis, head_axis):
    q, kv, bt, sl = sharding_problem(0)
    one = devices[0]
    expected = jax.jit(lambda *a: jf.mla_decode(*a, implementation=implementation))(
        *jax.device_put((q, kv, bt, sl), one))
    mesh = Mesh(np.array(devices[:np.prod(shape)]).reshape(shape), ("x", "y")[:len(shape)])
    decode = jax.jit(lambda *a: jf.mla_decode(*a, implementation=implementation))
    args = (_put(mesh, q, batch_axis, None, head_axis, None), _put(mesh, kv),
            _put(mesh, bt, batch_axis), _put(mesh, sl, batch_axis))
    out, lse = decode(*args)
    assert _spec(out)[:3] == (batch_axis, None, head_axis)
    assert_flashmla_close("out", out, np.asarray(expected[0], np.float32), **OUT_TOL)
    assert_flashmla_close("lse", lse, expected[1], **LSE_TOL)
    hlo = decode.lower(*args).compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    if implementation == "custom_call":
        assert "jax_flashmla_mla_decode" in hlo


def test_given_metadata_with_a_split_q_is_refused(devices):
    q, kv, bt, sl = sharding_problem(1)
    mesh = Mesh(np.array(devices[:8]), ("x",))

    @jax.jit
    def decode(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0],
                                 num_heads_q=q.shape[2], implementation="custom_call")
        return jf.mla_decode(q, kv, bt, sl, metadata=md, implementation="custom_call")

    with pytest.raises(Exception, match="pass metadata=None"):
        decode(_put(mesh, q, None, None, "x", None), _put(mesh, kv), bt, sl)


def test_mla_decode_inside_a_users_shard_map(devices):
    q, kv, bt, sl = sharding_problem(2)
    mesh = Mesh(np.array(devices[:4]), ("tp",))
    local = jax.shard_map(lambda *a: jf.mla_decode(*a, implementation="custom_call"), mesh=mesh,
                          in_specs=(P(None, None, "tp", None), P(), P(), P()),
                          out_specs=(P(None, None, "tp", None), P(None, "tp", None)))
    out, lse = jax.jit(local)(*(_put(mesh, x) for x in (q, kv, bt, sl)))
    expected = jf.mla_decode(*jax.device_put((q, kv, bt, sl), devices[0]),
                             implementation="custom_call")
    assert_flashmla_close("out", out, np.asarray(expected[0], np.float32), **OUT_TOL)
    assert_flashmla_close("lse", lse, expected[1], **LSE_TOL)


def test_merge_of_a_key_split_equals_whole_attention():
    q, kv, bt, sl = sharding_problem(3, batch=3)
    whole = jf.mla_decode(q, kv, bt, sl, implementation="reference")
    # Keys [0, cut) and [cut, len): the second part through a shifted block table.
    cut = jnp.minimum(sl, 64)
    first = jf.mla_decode(q, kv, bt, cut, implementation="reference")
    shifted = jnp.concatenate([bt[:, 1:], bt[:, :1]], axis=1)
    second = jf.mla_decode(q, kv, shifted, sl - cut, implementation="reference")
    out, lse = cp.merge_attention_states(jnp.stack([first[0], second[0]]),
                                         jnp.stack([first[1], second[1]]))
    assert_flashmla_close("out", out, np.asarray(whole[0], np.float32), **OUT_TOL)
    assert_flashmla_close("lse", lse, whole[1], **LSE_TOL)


def test_merge_of_empty_parts():
    outs = jnp.ones((3, 1, 1, 2, 4), jnp.bfloat16)
    lses = jnp.array([jnp.inf, -jnp.inf, jnp.inf])[:, None, None, None] * jnp.ones((3, 1, 2, 1))
    out, lse = cp.merge_attention_states(outs, lses)
    assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isposinf(np.asarray(lse)))
    lses = lses.at[1].set(0.5)  # one part saw keys: the merge is exactly that part
    out, lse = cp.merge_attention_states(outs * jnp.arange(1, 4)[:, None, None, None, None], lses)
    np.testing.assert_array_equal(np.asarray(out, np.float32), 2.0)
    np.testing.assert_array_equal(np.asarray(lse), 0.5)


def test_a_parts_nan_is_not_weighted_away():
    """A NaN lse in one part makes the merged out and lse NaN for that query alone, whatever
    the other parts saw; a NaN out makes the merged out NaN, whatever its part's lse."""
    outs = jnp.ones((3, 1, 1, 2, 4), jnp.float32)
    lses = jnp.array([0.5, jnp.inf, 2.0])[:, None, None, None] * jnp.ones((3, 1, 2, 1))
    out, lse = cp.merge_attention_states(outs, lses.at[1, 0, 0, 0].set(jnp.nan))
    assert np.all(np.isnan(np.asarray(out[0, 0, 0]))) and np.isnan(float(lse[0, 0, 0]))
    np.testing.assert_allclose(np.asarray(out[0, 0, 1]), 1.0, rtol=1e-6)
    assert np.isfinite(float(lse[0, 1, 0]))
    out, lse = cp.merge_attention_states(outs.at[2, 0, 0, 1, 3].set(jnp.nan), lses)
    assert np.isnan(float(out[0, 0, 1, 3])) and np.all(np.isfinite(np.asarray(lse)))
    np.testing.assert_allclose(np.asarray(out[0, 0, 0]), 1.0, rtol=1e-6)
    # A NaN out with lse +inf (a decode whose one split met a NaN) weighs 0 and stays NaN.
    out, _ = cp.merge_attention_states(outs.at[1, 0, 0, 1, 3].set(jnp.nan), lses)
    assert np.isnan(float(out[0, 0, 1, 3]))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("layout,n,tokens_per_device", [
    ("contiguous", 2, 192), ("contiguous", 4, 64), ("round_robin", 2, None),
    ("round_robin", 8, None)])
def test_dcp_equals_one_device(devices, implementation, layout, n, tokens_per_device):
    q, kv, bt, sl = sharding_problem(4, batch=4, h_q=16, mean_sk=150)
    sl = sl.at[jnp.argmax(sl)].set(3)  # shorter than the device count: some shards are empty
    if tokens_per_device:
        sl = jnp.minimum(sl, n * tokens_per_device)
    pages, tables, lens = split_for_dcp(kv, bt, sl, n, layout, tokens_per_device)
    mesh = Mesh(np.array(devices[:n]), ("dcp",))
    decode = jax.jit(lambda *a: cp.dcp_mla_decode(*a, mesh=mesh, axis="dcp",
                                                  implementation=implementation))
    out, lse = decode(_put(mesh, q), _put(mesh, pages, "dcp"), _put(mesh, tables, "dcp"),
                      _put(mesh, lens, "dcp"))
    ref_out, ref_lse = dense_attention_f64(np.asarray(q, np.float32), np.asarray(kv, np.float32),
                                           np.asarray(bt), np.asarray(sl), softmax_scale=SCALE,
                                           causal=True)
    assert_flashmla_close("out", out, ref_out, **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("bad", ["a page past one device's cache", "a local length past its table"])
def test_dcp_decodes_an_out_of_range_request_empty(devices, implementation, bad):
    """Out of range on one device only, the request is empty on all (out 0, lse +inf), as on
    one device; the other requests are as in the step without it."""
    n = 4
    q, kv, bt, sl = sharding_problem(4, batch=4, h_q=16, mean_sk=150)
    pages, tables, lens = split_for_dcp(kv, bt, sl, n, "round_robin", None)
    if bad == "a page past one device's cache":
        bad_tables, bad_lens = tables.at[2, 1, 0].set(pages.shape[0] // n), lens
    else:
        bad_tables, bad_lens = tables, lens.at[2, 1].set(tables.shape[2] * 64 + 1)
    mesh = Mesh(np.array(devices[:n]), ("dcp",))
    decode = jax.jit(lambda *a: cp.dcp_mla_decode(*a, mesh=mesh, axis="dcp",
                                                  implementation=implementation))
    run = lambda t, l: decode(_put(mesh, q), _put(mesh, pages, "dcp"), _put(mesh, t, "dcp"),
                              _put(mesh, l, "dcp"))
    out, lse = run(bad_tables, bad_lens)
    want_out, want_lse = run(tables, lens.at[:, 1].set(0))
    assert not np.any(np.asarray(out[1], np.float32)) and np.all(np.isposinf(np.asarray(lse[1])))
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_nan_key_on_one_device_poisons_its_request_on_all(devices, implementation):
    """A NaN in a key one device holds: that device's out is NaN (its lse +inf or finite, as
    mla_decode's NaN semantics give), and the merge keeps it NaN for that request whatever
    its weight; the other requests are as without it."""
    n = 4
    q, kv, bt, sl = sharding_problem(4, batch=4, h_q=16, mean_sk=150)
    pages, tables, lens = split_for_dcp(kv, bt, sl, n, "round_robin", None)
    poisoned_page = int(tables[2, 1, 0]) + 2 * (pages.shape[0] // n)  # device 2's first
    bad_pages = pages.at[poisoned_page, 0, 0, 9].set(jnp.nan)
    mesh = Mesh(np.array(devices[:n]), ("dcp",))
    decode = jax.jit(lambda *a: cp.dcp_mla_decode(*a, mesh=mesh, axis="dcp",
                                                  implementation=implementation))
    run = lambda p: decode(_put(mesh, q), _put(mesh, p, "dcp"), _put(mesh, tables, "dcp"),
                           _put(mesh, lens, "dcp"))
    out, lse = run(bad_pages)
    want_out, want_lse = run(pages)
    assert np.all(np.isnan(np.asarray(out[1], np.float32)))
    others = np.arange(4) != 1
    np.testing.assert_array_equal(np.asarray(out, np.float32)[others],
                                  np.asarray(want_out, np.float32)[others])
    np.testing.assert_array_equal(np.asarray(lse)[others], np.asarray(want_lse)[others])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_fp8_dcp_equals_one_device(devices, implementation):
    """An FP8 cache split round-robin over 4 devices (some local lengths 0, which the FP8
    kernel needs guarded), against the one-device FP8 decode of the same cache."""
    q, kv, bt, sl = sharding_problem(6, batch=4, h_q=16, mean_sk=150)
    sl = sl.at[jnp.argmax(sl)].set(3)
    k_scale = jnp.float32(1 / 400)
    kv8 = fp8.quantize(kv, k_scale)
    pages, tables, lens = split_for_dcp(kv8, bt, sl, 4, "round_robin", None)
    pages = pages.astype(jnp.float8_e4m3fn)  # exact: every e4m3 value is a bfloat16 value
    mesh = Mesh(np.array(devices[:4]), ("dcp",))
    decode = jax.jit(lambda *a: cp.dcp_mla_decode(*a[:4], mesh=mesh, axis="dcp",
                                                  implementation=implementation, k_scale=a[4]))
    out, lse = decode(_put(mesh, q), _put(mesh, pages, "dcp"), _put(mesh, tables, "dcp"),
                      _put(mesh, lens, "dcp"), k_scale)
    assert out.dtype == jnp.bfloat16
    one_out, one_lse = jf.mla_decode(q, kv8, bt, sl, k_scale=k_scale, implementation="reference")
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(one_out, np.float32),
                               atol=1e-2)
    np.testing.assert_array_equal(np.isinf(np.asarray(lse)), np.isinf(np.asarray(one_lse)))
    finite = np.isfinite(np.asarray(one_lse))
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(one_lse)[finite], rtol=1e-5)


@pytest.mark.parametrize("scatter_heads", [False, True])
def test_dcp_times_tp(devices, scatter_heads):
    q, kv, bt, sl = sharding_problem(5, batch=4, h_q=32, mean_sk=150)
    pages, tables, lens = split_for_dcp(kv, bt, sl, 2, "round_robin", None)
    mesh = Mesh(np.array(devices[:8]).reshape(2, 4), ("dcp", "tp"))
    decode = jax.jit(lambda *a: cp.dcp_mla_decode(*a, mesh=mesh, axis="dcp", head_axis="tp",
                                                  scatter_heads=scatter_heads,
                                                  implementation="custom_call"))
    out, lse = decode(_put(mesh, q, None, None, "tp", None), _put(mesh, pages, "dcp"),
                      _put(mesh, tables, "dcp"), _put(mesh, lens, "dcp"))
    heads = ("tp", "dcp") if scatter_heads else "tp"
    assert _spec(out)[2] == heads
    ref_out, ref_lse = dense_attention_f64(np.asarray(q, np.float32), np.asarray(kv, np.float32),
                                           np.asarray(bt), np.asarray(sl), softmax_scale=SCALE,
                                           causal=True)
    assert_flashmla_close("out", out, ref_out, **OUT_TOL)
    assert_flashmla_close("lse", lse, ref_lse, **LSE_TOL)


def test_dcp_scatter_heads_needs_heads_the_axis_divides(devices):
    q, kv, bt, sl = sharding_problem(5, batch=4, h_q=6, mean_sk=150)
    pages, tables, lens = split_for_dcp(kv, bt, sl, 4, "round_robin", None)
    mesh = Mesh(np.array(devices[:4]), ("dcp",))
    with pytest.raises(ValueError, match=r"scatter_heads splits each device's 6 heads over the "
                                         r"4 devices of axis 'dcp', which must divide them"):
        cp.dcp_mla_decode(q, pages, tables, lens, mesh=mesh, axis="dcp", scatter_heads=True,
                          implementation="custom_call")


@pytest.mark.parametrize("layout,tokens_per_device", [("contiguous", 128), ("round_robin", None)])
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "float8_e4m3fn"])
def test_dcp_write_puts_each_token_on_its_device(devices, layout, tokens_per_device, cache_dtype):
    n, batch = 4, 2
    mesh = Mesh(np.array(devices[:n]), ("dcp",))
    pages_per_device = 8
    cache = _put(mesh, jnp.zeros((n * pages_per_device, 64, 1, 576), cache_dtype), "dcp")
    # FP8: rows 1..8 over a scale of 0.5 are stored as 2..16, all exact in e4m3.
    scale = jnp.float32(0.5) if cache_dtype == "float8_e4m3fn" else None
    # Device r gives request i its local pages [4 i, 4 i + 4).
    tables = jnp.tile(jnp.arange(batch * 4, dtype=jnp.int32).reshape(1, batch, 4), (n, 1, 1))
    positions = _put(mesh, jnp.array([[0, 1, 130, 300], [5, 64, 127, 511]], jnp.int32))
    rows = _put(mesh, jnp.arange(1, 9, dtype=jnp.float32).reshape(batch, 4, 1)
                * jnp.ones((1, 1, 576)))
    written = cp.dcp_write_kv(cache, _put(mesh, tables, "dcp"), positions, mesh=mesh,
                              axis="dcp", layout=layout, tokens_per_device=tokens_per_device,
                              kv=rows, scale=scale)
    assert written.dtype == cache_dtype
    written = np.asarray(written, np.float32).reshape(n, pages_per_device * 64, 576)
    if scale is not None:
        written = written * float(scale)
    for i in range(batch):
        for t in range(4):
            p = int(positions[i, t])
            rank = p % n if layout == "round_robin" else p // tokens_per_device
            local = p // n if layout == "round_robin" else p % tokens_per_device
            slot = (4 * i + local // 64) * 64 + local % 64
            np.testing.assert_array_equal(written[rank, slot], float(rows[i, t, 0]))
    assert np.count_nonzero(written.any(-1)) == batch * 4  # nothing written anywhere else


def _collectives(hlo):
    """(op, result shape or tuple of shapes) of every collective in a compiled module."""
    ops = "all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute"
    found = re.findall(r"= (\(?[\w\[\],{}: ]*?\)?) (" + ops + r")(?:-start)?\(", hlo)
    return [(op, shape) for shape, op in found]


@pytest.mark.parametrize("dcp,tp,scatter_heads", [(2, 4, False), (4, 2, True), (8, 1, False)])
def test_a_dcp_step_moves_only_lses_and_outs(devices, dcp, tp, scatter_heads):
    """Two layers of a DCP x TP decode step (write the new rows, then decode) compiled on
    dcp * tp devices, q split over heads on the tp axis and the rows replicated, as a model's
    projections make them: per layer one all-gather of the local lse (dcp, b, h_q / tp, 1)
    and one all-reduce (or reduce-scatter) of the weighted out; nothing else moves."""
    batch, h_q, layers = 4, 32, 2
    q, kv, bt, sl = sharding_problem(7, batch=batch, h_q=h_q, mean_sk=300)
    pages, tables, lens = split_for_dcp(kv, bt, sl, dcp, "round_robin", None)
    mesh = Mesh(np.array(devices[:dcp * tp]).reshape(dcp, tp), ("dcp", "tp"))
    qs = jnp.stack([q * (layer + 1) for layer in range(layers)])
    rows = jnp.stack([q[:, :, layer] for layer in range(layers)])
    positions = (sl - 1)[:, None]

    def step(cache, qs, rows, tables, lens, positions):
        outs = []
        for layer in range(layers):
            cache = cp.dcp_write_kv(cache, tables, positions, mesh=mesh, axis="dcp",
                                    layout="round_robin", kv=rows[layer])
            outs.append(cp.dcp_mla_decode(qs[layer], cache, tables, lens, mesh=mesh,
                                          axis="dcp", head_axis="tp",
                                          scatter_heads=scatter_heads,
                                          implementation="custom_call")[0])
        return cache, outs

    args = (_put(mesh, pages, "dcp"), _put(mesh, qs, None, None, None, "tp", None),
            _put(mesh, rows), _put(mesh, tables, "dcp"), _put(mesh, lens, "dcp"),
            _put(mesh, positions))
    hlo = jax.jit(step, donate_argnums=0).lower(*args).compile().as_text()
    collectives = _collectives(hlo)
    local_heads = h_q // tp
    merge = (f"reduce-scatter f32[{batch},1,{local_heads // dcp},512]" if scatter_heads
             else f"all-reduce f32[{batch},1,{local_heads},512]")
    expected = [f"all-gather f32[{dcp},{batch},{local_heads},1]", merge] * layers
    # XLA may combine one op's collectives over the layers into one of a tuple of operands.
    moved = [f"{op} {array}" for op, shape in collectives
             for array in re.findall(r"\w+\[[\d,]*\]", shape)]
    assert sorted(moved) == sorted(expected), collectives
