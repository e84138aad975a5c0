"""The Bazel-built FFI extension (BUILD.bazel) runs the CPU decode as the CMake-built one does.

.ci/bazel.sh builds //:jax_flashmla/_cpu.so and runs this file with JAX_FLASHMLA_BAZEL_EXT set
to it and JAX_FLASHMLA_REQUIRE_BAZEL=1. Without JAX_FLASHMLA_BAZEL_EXT the test skips (the plain
pytest run does not build with Bazel), unless JAX_FLASHMLA_REQUIRE_BAZEL=1 turns the skip into a
failure.

The module is loaded in a subprocess as jax_flashmla._cpu before jax_flashmla is imported, so
that jax_flashmla registers the Bazel build's FFI targets instead of the installed module's.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

EXT_ENV = "JAX_FLASHMLA_BAZEL_EXT"
REQUIRE_ENV = "JAX_FLASHMLA_REQUIRE_BAZEL"

CHILD = textwrap.dedent("""
    import importlib.util, json, os, sys

    path = os.path.realpath(sys.argv[1])
    spec = importlib.util.spec_from_file_location("jax_flashmla._cpu", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["jax_flashmla._cpu"] = module
    spec.loader.exec_module(module)

    import jax
    import jax.numpy as jnp
    import numpy as np
    import jax_flashmla
    from jax_flashmla.kernels import custom_calls

    batch, s_q, h_q, page = 3, 2, 16, 64
    seq_lens = np.array([3, 70, 150], np.int32)  # >= s_q: every query sees a key
    max_pages = -(-int(seq_lens.max()) // page)
    rng = np.random.default_rng(0)
    # Pages in a shuffled order, so that the block table is really followed.
    block_table = rng.permutation(batch * max_pages).reshape(batch, max_pages).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((batch, s_q, h_q, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.standard_normal((batch * max_pages, page, 1, 576)), jnp.bfloat16)

    def run(implementation):
        fn = jax.jit(lambda *a: jax_flashmla.mla_decode(*a, implementation=implementation))
        out, lse = fn(q, kv, jnp.asarray(block_table), jnp.asarray(seq_lens))
        return np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    out, lse = run("custom_call")
    ref_out, ref_lse = run("reference")
    hlo = jax.jit(lambda *a: jax_flashmla.mla_decode(*a, implementation="custom_call")).lower(
        q, kv, jnp.asarray(block_table), jnp.asarray(seq_lens)).as_text()
    print(json.dumps({
        "backend": jax.default_backend(),
        "module_file": os.path.realpath(sys.modules["jax_flashmla._cpu"].__file__),
        "lowering_uses_it": custom_calls._cpu is module,
        # Every jax_flashmla extension mapped into the process: the Bazel one only.
        "mapped_modules": sorted({line.split()[-1] for line in open("/proc/self/maps")
                                  if "/_cpu" in line and ".so" in line}),
        "targets": sorted(module.registrations()),
        "custom_call_in_hlo": "jax_flashmla_mla_decode" in hlo,
        "shapes": [list(out.shape), list(lse.shape)],
        "out_max_abs_err": float(np.max(np.abs(out - ref_out))),
        "out_close": bool(np.allclose(out, ref_out, rtol=2e-2, atol=2e-2)),
        "lse_max_abs_err": float(np.max(np.abs(lse - ref_lse))),
        "finite": bool(np.isfinite(out).all() and np.isfinite(lse).all()),
    }))
""")


@pytest.fixture(scope="module")
def bazel_extension():
    path = os.environ.get(EXT_ENV)
    if not path:
        reason = f"{EXT_ENV} is not set (.ci/bazel.sh builds the extension with Bazel and sets it)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{REQUIRE_ENV}=1 but {reason}")
        pytest.skip(reason)
    if not os.path.isfile(path):
        pytest.fail(f"{EXT_ENV}={path} is not a file")
    return os.path.realpath(path)


@pytest.fixture(scope="module")
def child_result(bazel_extension):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", CHILD, bazel_extension], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bazel_module_is_the_one_jax_flashmla_uses(bazel_extension, child_result):
    assert child_result["backend"] == "cpu"
    assert child_result["module_file"] == bazel_extension
    assert child_result["lowering_uses_it"]
    assert child_result["mapped_modules"] == [bazel_extension]
    # The same custom-call targets as the CMake-built module registers.
    from jax_flashmla import _cpu
    assert child_result["targets"] == sorted(_cpu.registrations())


def test_bazel_module_runs_the_cpu_decode(child_result):
    assert child_result["custom_call_in_hlo"]
    assert child_result["shapes"] == [[3, 2, 16, 512], [3, 16, 2]]
    assert child_result["finite"]
    # Both outputs are rounded to bf16 (8 bits of mantissa): a bf16 tolerance.
    assert child_result["out_close"], child_result
    assert child_result["lse_max_abs_err"] <= 2e-2, child_result
