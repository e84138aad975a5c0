"""On a machine of two GPUs or more: tensor-parallel and context-parallel decode with
FlashMLA equal the one-GPU result."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_flashmla as jf
from jax_flashmla import context_parallel as cp
from helpers import LSE_TOL, OUT_TOL, assert_flashmla_close, sharding_problem, split_for_dcp

pytestmark = pytest.mark.gpu(count=2)


@pytest.fixture(scope="module")
def gpus():
    return [d for d in jax.devices() if d.platform == "gpu"][:2]


def _problem(seed):
    return sharding_problem(seed, batch=16, h_q=128, mean_sk=1024)


def test_tensor_parallel_over_two_gpus_equals_one(gpus):
    q, kv, bt, sl = _problem(0)
    expected = jax.jit(jf.mla_decode)(*jax.device_put((q, kv, bt, sl), gpus[0]))
    mesh = Mesh(np.array(gpus), ("tp",))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    decode = jax.jit(jf.mla_decode)
    args = (put(q, None, None, "tp", None), put(kv), put(bt), put(sl))
    out, lse = decode(*args)
    assert "all-gather" not in decode.lower(*args).compile().as_text()
    assert_flashmla_close("out", out, np.asarray(expected[0], np.float32), **OUT_TOL)
    assert_flashmla_close("lse", lse, expected[1], **LSE_TOL)


@pytest.mark.parametrize("layout,tokens_per_device", [("round_robin", None), ("contiguous", 1024)])
def test_context_parallel_over_two_gpus_equals_one(gpus, layout, tokens_per_device):
    q, kv, bt, sl = _problem(1)
    sl = jnp.minimum(sl, 2 * 1024)
    expected = jax.jit(jf.mla_decode)(*jax.device_put((q, kv, bt, sl), gpus[0]))
    pages, tables, lens = split_for_dcp(kv, bt, sl, 2, layout, tokens_per_device)
    mesh = Mesh(np.array(gpus), ("dcp",))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
    out, lse = jax.jit(lambda *a: cp.dcp_mla_decode(*a, mesh=mesh, axis="dcp"))(
        put(q), put(pages, "dcp"), put(tables, "dcp"), put(lens, "dcp"))
    assert_flashmla_close("out", out, np.asarray(expected[0], np.float32), **OUT_TOL)
    assert_flashmla_close("lse", lse, expected[1], **LSE_TOL)
