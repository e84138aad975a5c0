"""Run by tests/test_gpu_capture.py in a process of its own (the driver-call counter must
subscribe before JAX starts, and a failure must not take the test session down):
  python tests/gpu_probe.py capture bf16|fp8   a 6-layer step, run three times
  python tests/gpu_probe.py loop scan           a 6-layer step under lax.scan with
                                                AlternatingStep.LOOP_COMPILER_OPTIONS, run
                                                three times
  python tests/gpu_probe.py rerecord single|alternating
                                                a donated 6-layer step called 8 times, as one
                                                executable or through AlternatingStep
  python tests/gpu_probe.py queue alternating|single
                                                a donated 6-layer step that pushes a slice
                                                of its out to a HostQueue, called 8 times
                                                through AlternatingStep or as one executable;
                                                each pop against the step's out
  python tests/gpu_probe.py refuse decode|metadata
                                                a custom call whose scratch or result buffer
                                                is one element short of what FlashMLA allocates
The step modes print, per call, a line `driver_calls {json}`: the CUDA driver's graph work
during that call (tests/cpp/driver_call_counter.c), and after compiling, `custom_call_targets
{json}`: the targets of the compiled HLO's custom calls.
Prints what it found, last line "done"."""
import ctypes
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla.caches import fp8 as fp8_cache
from jax_flashmla.kernels import custom_calls
from jax_flashmla.kernels import library as kernels

# Enough layers for XLA to make a command buffer of the step (>= 5 commands by default).
LAYERS = 6
ROOT = Path(__file__).resolve().parents[1]


class DriverCalls:
    """tests/cpp/driver_call_counter.c, compiled here and subscribed to the driver's calls."""

    def __init__(self):
        sys.path.insert(0, str(ROOT))  # build_env.py, where the builds find CUDA too
        from build_env import find_cuda_include, find_cupti
        include, library = find_cupti()
        if include is None or library is None:
            raise RuntimeError(f"CUPTI is missing: header dir {include}, library {library}")
        built = Path(tempfile.mkdtemp()) / "driver_call_counter.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-I", include,
                        "-I", find_cuda_include(), str(ROOT / "tests/cpp/driver_call_counter.c"),
                        "-o", str(built)], check=True)
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        self._lib = ctypes.CDLL(str(built))
        self._lib.driver_call_counter_name.restype = ctypes.c_char_p
        if status := self._lib.driver_call_counter_start():
            raise RuntimeError(f"CUPTI refused the subscription (status {status})")
        self._counts = (ctypes.c_int64 * 4096)()

    def report(self, call):
        """Prints the graph and stream-capture calls since the last report, as call `call`'s."""
        self._lib.driver_call_counter_take(self._counts, len(self._counts))
        names = {self._lib.driver_call_counter_name(i): n for i, n in enumerate(self._counts)
                 if n}
        graph_work = {name.decode(): n for name, n in names.items()
                      if name and name.startswith((b"cuGraph", b"cuStreamBeginCapture"))}
        print("driver_calls", json.dumps({"call": call, "counts": graph_work}), flush=True)


def report_custom_calls(compiled):
    """Prints the targets of jax_flashmla's custom calls in the compiled HLO. (XLA forms its
    command buffers from the compiled program's thunks, after the HLO: whether a custom call
    runs inside one shows in the driver's calls, as a stream capture when it is recorded.)"""
    targets = re.findall(r'custom_call_target="(jax_flashmla_\w+)"', compiled.as_text())
    print("custom_call_targets", json.dumps(sorted(targets)), flush=True)


def capture(dtype, driver_calls):
    fp8 = dtype == "fp8"
    rng = np.random.default_rng(0)
    sl = jnp.asarray(rng.integers(1, 500, 4), jnp.int32)
    bt = jnp.asarray(rng.permutation(32).reshape(4, 8), jnp.int32)
    cache = jnp.asarray(rng.normal(0, 0.1, (32, 64, 1, 576)), jnp.bfloat16)
    scale = jnp.float32(1 / 400)
    if fp8:
        cache = fp8_cache.quantize(cache, scale)
    qs = jnp.asarray(rng.normal(0, 0.1, (LAYERS, 4, 1, 16, 576)), jnp.bfloat16)

    def step(qs, cache, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=cache.shape[0], num_heads_q=16,
                                 fp8=fp8)
        extra = dict(k_scale=scale) if fp8 else {}
        return [jf.mla_decode(qs[i], cache, bt, sl, metadata=md, **extra)[0]
                for i in range(LAYERS)]

    run = jax.jit(step).lower(qs, cache, bt, sl).compile()
    report_custom_calls(run)
    for k in range(3):
        jax.block_until_ready(run(qs, cache, bt, sl))
        driver_calls.report(k)


def loop(kind, driver_calls):
    assert kind == "scan", kind
    rng = np.random.default_rng(3)
    sl = jnp.asarray(rng.integers(1, 500, 4), jnp.int32)
    bt = jnp.asarray(rng.permutation(32).reshape(4, 8), jnp.int32)
    cache = jnp.asarray(rng.normal(0, 0.1, (32, 64, 1, 576)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(0, 0.1, (4, 1, 16, 576)), jnp.bfloat16)

    def step(q, cache, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=cache.shape[0], num_heads_q=16)

        def body(q, _):
            out, _ = jf.mla_decode(q, cache, bt, sl, metadata=md)
            return jnp.concatenate([out.astype(q.dtype), q[..., 512:]], axis=-1), None
        return jax.lax.scan(body, q, None, length=LAYERS)[0]

    options = jf.serving.AlternatingStep.LOOP_COMPILER_OPTIONS
    run = jax.jit(step, compiler_options=options).lower(q, cache, bt, sl).compile()
    report_custom_calls(run)
    for k in range(3):
        jax.block_until_ready(run(q, cache, bt, sl))
        driver_calls.report(k)


def _donated_step(seed, how, push=None):
    """A donated 6-layer step (write_kv, mla_decode per layer on a stacked cache), compiled,
    through AlternatingStep where how is "alternating", with its arguments; push(q) is called
    on the last layer's q."""
    rng = np.random.default_rng(seed)
    sl = jnp.asarray(rng.integers(64, 500, 4), jnp.int32)
    bt = jnp.asarray(rng.permutation(32).reshape(4, 8), jnp.int32)
    cache = jnp.asarray(rng.normal(0, 0.1, (LAYERS * 32, 64, 1, 576)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(0, 0.1, (4, 1, 16, 576)), jnp.bfloat16)
    slots = jf.token_slots(bt, (sl - 1)[:, None])

    def step(cache, q, bt, sl, slots):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=32, num_heads_q=16)
        for layer in range(LAYERS):
            cache = jf.write_kv(cache, slots + layer * 32 * 64, kv=q[:, :, 0])
            out, _ = jf.mla_decode(q, cache, bt + layer * 32, sl, metadata=md)
            q = jnp.concatenate([out.astype(q.dtype), q[..., 512:]], axis=-1)
        if push is not None:
            push(q)
        return cache, q

    compiled = jax.jit(step, donate_argnums=0).lower(cache, q, bt, sl, slots).compile()
    report_custom_calls(compiled)
    run = jf.serving.AlternatingStep(compiled) if how == "alternating" else compiled
    return run, (cache, q, bt, sl, slots)


def rerecord(how, driver_calls):
    run, (cache, *args) = _donated_step(2, how)
    for k in range(8):
        cache, out = run(cache, *args)
        jax.block_until_ready(out)
        driver_calls.report(k)


def queue(how, driver_calls):
    results = jf.serving.HostQueue((4, 8), jnp.bfloat16, depth=2)
    run, (cache, q, *args) = _donated_step(4, how, lambda q: results.push(q[:, 0, 0, :8]))
    same = []
    for k in range(8):
        cache, out = run(cache, q, *args)
        popped = results.pop(timeout_s=30)
        same.append(np.array_equal(popped, np.asarray(out)[:, 0, 0, :8]))
        driver_calls.report(k)
        q = out * 0.5  # new values every step
    print("pops equal outs:", all(same), same)


def refuse(target):
    rng = np.random.default_rng(1)
    sl = jnp.asarray(rng.integers(1, 300, 3), jnp.int32)
    bt = jnp.asarray(rng.permutation(15).reshape(3, 5), jnp.int32)
    md = jf.get_mla_metadata(sl, block_table=bt, num_pages=15, num_heads_q=16)
    ops = kernels.ensure_cuda_targets()
    parts = md.tile_scheduler_metadata.shape[0]
    if target == "metadata":
        call = jax.ffi.ffi_call(custom_calls.METADATA.target, (
            jax.ShapeDtypeStruct((parts, 8), jnp.int32),
            jax.ShapeDtypeStruct((3,), jnp.int32)))  # num_splits is (batch + 1,)
        result = call(sl, op=ops.metadata, num_q_tokens_per_head_k=np.int64(16),
                      num_heads_k=np.int64(1), num_heads_q=np.int64(16),
                      written_fields=np.int64(7))
    else:
        q = jnp.asarray(rng.normal(0, 0.1, (3, 1, 16, 576)), jnp.bfloat16)
        cache = jnp.asarray(rng.normal(0, 0.1, (15, 64, 1, 576)), jnp.bfloat16)
        splits = 3 + parts - 1  # one split short
        call = jax.ffi.ffi_call(custom_calls.DECODE.target, (
            jax.ShapeDtypeStruct((3, 1, 16, 512), jnp.bfloat16),
            jax.ShapeDtypeStruct((3, 16, 1), jnp.float32),
            jax.ShapeDtypeStruct((splits, 16, 1, 512), jnp.float32),
            jax.ShapeDtypeStruct((splits, 16, 1), jnp.float32)))
        result = call(q, cache, bt, sl, md.tile_scheduler_metadata, md.num_splits,
                      op=ops.decode, softmax_scale=np.float32(0.1), causal=True)
    try:
        jax.block_until_ready(result)
        print("not refused")
    except Exception as e:  # noqa: BLE001 - the error's text is what is probed
        print("refused:", str(e).replace("\n", " "))
    # The process and the GPU are still usable afterwards.
    out, lse = jf.mla_decode(jnp.zeros((3, 1, 16, 576), jnp.bfloat16),
                             jnp.zeros((15, 64, 1, 576), jnp.bfloat16), bt, sl)
    print("after:", bool(np.isfinite(np.asarray(lse)).all()))


if __name__ == "__main__":
    mode, variant = sys.argv[1:]
    if mode == "refuse":
        refuse(variant)
    else:  # the counter subscribes before JAX starts CUDA
        {"capture": capture, "loop": loop, "rerecord": rerecord,
         "queue": queue}[mode](variant, DriverCalls())
    print("done")
