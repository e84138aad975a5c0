"""The cuDNN prefill core calls jax's private cuDNN wrapper only within the jax versions it is
tested with (ragged_attention.CUDNN_JAX_VERSIONS); elsewhere, or where the wrapper does not
import, asking for it is an error naming those versions, and the XLA core still runs."""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.kernels import ragged_attention

WRAPPER = "jax._src.cudnn.fused_attention_stablehlo"


def _segments(n):
    return ragged_attention.Segments(jnp.zeros((1,), jnp.int32), jnp.full((1,), n, jnp.int32))


def _attend(core):
    q = jnp.ones((4, 2, 8), jnp.bfloat16)
    k = v = jnp.ones((4, 2, 8), jnp.bfloat16)
    return ragged_attention.CORES[core](q, k, v, _segments(4), _segments(4), causal=True,
                                        scale=0.5)


def test_this_jax_is_in_the_tested_range():
    """A jax outside the range fails here until the cuDNN core is tested with it (the GPU
    prefill tests) and the range moved."""
    first, end = ragged_attention.CUDNN_JAX_VERSIONS
    minor = tuple(int(x) for x in jax.__version__.split(".")[:2])
    assert first <= minor < end, jax.__version__
    assert hasattr(ragged_attention.cudnn_wrapper(), "dot_product_attention")


@pytest.mark.parametrize("version", ["0.9.1", "0.12.0", "0.12.0.dev20270101", "1.0.0"])
def test_outside_the_range_cudnn_is_refused_by_name(monkeypatch, version):
    monkeypatch.setattr(jax, "__version__", version)
    message = (rf"cuDNN's flash attention \(implementation='custom_call'\) calls jax's private "
               rf"cuDNN wrapper, tested with jax >= 0\.10, < 0\.12; this is jax {version}: pass "
               rf"implementation='reference'")
    with pytest.raises(RuntimeError, match=message):
        ragged_attention.cudnn_wrapper()
    with pytest.raises(RuntimeError, match=message):  # before any cuDNN call is built
        _attend("cudnn")
    out, lse = _attend("xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)
    assert np.isfinite(np.asarray(lse)).all()


def test_a_wrapper_that_does_not_import_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, WRAPPER, None)  # import_module raises ImportError
    with pytest.raises(RuntimeError, match=r"jax's private cuDNN wrapper, which jax \S+ failed "
                                           r"to import \(.*\); it is tested with jax >= 0\.10, "
                                           r"< 0\.12: pass implementation='reference'"):
        _attend("cudnn")
