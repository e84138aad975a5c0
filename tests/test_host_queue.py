"""HostQueue: arrays pushed inside jitted steps come out on the host in push order, with the
values the step computed; on the GPU machine the push is captured into XLA's command buffer
with the step and holds across replays."""
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashmla.serving import HostQueue
from jax_flashmla.kernels import custom_calls
from test_gpu_capture import _probe, captures, custom_call_targets, driver_calls

DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def _device(platform):
    return jax.devices(platform)[0]


@pytest.mark.parametrize("platform", DEVICES)
@pytest.mark.parametrize("shape,dtype", [((), jnp.int32), ((5,), jnp.int32),
                                         ((3, 7), jnp.bfloat16), ((2, 1000), jnp.float32)])
def test_pushes_come_out_in_order_with_the_steps_values(platform, shape, dtype):
    device = _device(platform)
    queue = HostQueue(shape, dtype, depth=3, device=device)

    @jax.jit
    def step(x):
        y = x * 3 + 1
        queue.push(y)
        return y

    x = jax.device_put(jnp.arange(np.prod(shape, dtype=int), dtype=dtype).reshape(shape) % 7,
                       device)
    for _ in range(4):
        x = step(x)
        popped = queue.pop(timeout_s=30)
        assert popped.dtype == np.dtype(dtype) and popped.shape == shape
        np.testing.assert_array_equal(popped, np.asarray(x))


@pytest.mark.parametrize("platform", DEVICES)
def test_steps_may_run_ahead_by_the_depth(platform):
    device = _device(platform)
    queue = HostQueue((4,), jnp.int32, depth=3, device=device)
    step = jax.jit(lambda x: (queue.push(x + 1), x + 1)[1])
    x = jax.device_put(jnp.zeros(4, jnp.int32), device)
    outs = []
    for _ in range(3):
        x = step(x)
        outs.append(x)
    for out in outs:
        np.testing.assert_array_equal(queue.pop(timeout_s=30), np.asarray(out))


@pytest.mark.parametrize("platform", DEVICES)
def test_a_push_under_scan_pushes_every_iteration(platform):
    device = _device(platform)
    queue = HostQueue((2,), jnp.float32, depth=8, device=device)

    def body(x, _):
        x = x * 2
        queue.push(x)
        return x, None

    step = jax.jit(lambda x: jax.lax.scan(body, x, None, length=5)[0])
    step(jax.device_put(jnp.ones(2, jnp.float32), device))
    for i in range(5):
        np.testing.assert_array_equal(queue.pop(timeout_s=30), np.full(2, 2.0 ** (i + 1)))


@pytest.mark.parametrize("platform", DEVICES)
def test_an_overrun_is_named_and_the_next_pop_goes_on(platform):
    device = _device(platform)
    queue = HostQueue((), jnp.int32, depth=2, device=device)
    step = jax.jit(lambda x: (queue.push(x), x + 1)[1])
    x = jax.device_put(jnp.int32(1), device)
    for _ in range(3):  # pushes 1, 2, 3: 3 overwrites 1
        x = step(x)
    jax.block_until_ready(x)
    with pytest.raises(HostQueue.OverrunError, match="push 1 was overwritten by push 3"):
        queue.pop(timeout_s=30)
    assert int(queue.pop(timeout_s=30)) == 2
    assert int(queue.pop(timeout_s=30)) == 3


def test_a_pop_with_nothing_pushed_times_out():
    queue = HostQueue((3,), jnp.int32, device=_device("cpu"))
    with pytest.raises(TimeoutError, match="push 1 did not come within 0.05 s"):
        queue.pop(timeout_s=0.05)


def test_a_long_pop_ends_on_ctrl_c():
    """pop spins with the GIL released in short slices, so Python's signal handlers run: a
    SIGINT ends a pop that would wait 60 s within a second."""
    script = textwrap.dedent("""
        import os, signal, threading, time
        import jax.numpy as jnp
        from jax_flashmla.serving import HostQueue
        # Ctrl-C's handler, as an interactive shell's process has it: a process started in the
        # background of a non-interactive shell inherits SIGINT ignored, and waited 60 s.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        queue = HostQueue((2,), jnp.int32)
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            queue.pop(timeout_s=60)
        except KeyboardInterrupt:
            print("interrupted after", time.monotonic() - start)
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert run.stdout.startswith("interrupted after"), (run.stdout, run.stderr[-2000:])
    assert float(run.stdout.split()[-1]) < 1.5, run.stdout


@pytest.mark.parametrize("platform", DEVICES)
def test_a_queue_needs_neither_torch_nor_flashmlas_kernels(platform):
    """A process where torch cannot be imported and no kernel library is named pushes and
    pops as any other."""
    script = textwrap.dedent("""
        import sys
        sys.modules["torch"] = None  # import torch raises ImportError
        import jax, jax.numpy as jnp
        from jax_flashmla.serving import HostQueue
        queue = HostQueue((4,), jnp.int32)
        step = jax.jit(lambda x: (queue.push(x * 2), x + 1)[1])
        x = step(jnp.arange(4, dtype=jnp.int32))
        print(queue.pop().tolist(), jax.devices()[0].platform)
        """)
    env = {k: v for k, v in os.environ.items() if k != "JAX_FLASHMLA_KERNEL_LIBRARY"}
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=env)
    expected = "[0, 2, 4, 6] " + ("cpu" if platform == "cpu" else "gpu")
    assert run.stdout.strip() == expected, (run.stdout, run.stderr[-3000:])


def test_bad_arguments_are_named():
    cpu = _device("cpu")
    with pytest.raises(ValueError, match=r"depth must be an int >= 1, got 0"):
        HostQueue((2,), jnp.int32, depth=0, device=cpu)
    with pytest.raises(ValueError, match=r"at most 1048576 bytes, got shape \(1048577,\)"):
        HostQueue((1 << 20 | 1,), jnp.uint8, device=cpu)
    queue = HostQueue((2,), jnp.int32, device=cpu)
    with pytest.raises(ValueError, match=r"x must be \(2,\) int32 .* got \(3,\) int32"):
        jax.jit(queue.push)(jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"x must be \(2,\) int32 .* got \(2,\) float32"):
        jax.jit(queue.push)(jnp.zeros(2, jnp.float32))


def test_each_queue_is_its_own_custom_call():
    """Two queues' pushes lower to custom calls naming each queue, so that no executable
    pushes into another queue (nor one cached from another process)."""
    cpu = _device("cpu")
    a, b = HostQueue((2,), jnp.int32, device=cpu), HostQueue((2,), jnp.int32, device=cpu)
    text = jax.jit(lambda x: (a.push(x), b.push(x + 1), x)[-1]).lower(
        jnp.zeros(2, jnp.int32)).as_text()
    assert text.count("jax_flashmla_host_queue_push") == 2
    assert f"queue_id = {a._id}" in text and f"queue_id = {b._id}" in text


def test_a_push_is_kept_without_a_jax_effect():
    """The push has no result and declares no JAX effect (an executable with effects runs
    through JAX's slower dispatch at every call), yet stays in the jaxpr and the executable."""
    queue = HostQueue((2,), jnp.int32, device=_device("cpu"))
    f = lambda x: (queue.push(x), x + 1)[1]  # noqa: E731
    jaxpr = jax.make_jaxpr(f)(jnp.zeros(2, jnp.int32))
    assert not jaxpr.effects
    assert "jax_flashmla_host_queue_push" in jax.jit(f).lower(
        jnp.zeros(2, jnp.int32)).compile().as_text()


@pytest.mark.gpu
def test_a_gpu_push_of_a_cpu_queue_fails():
    queue = HostQueue((2,), jnp.int32, device=_device("cpu"))
    step = jax.jit(lambda x: (queue.push(x), x + 1)[1])
    with pytest.raises(Exception, match="no HostQueue .* of CUDA device 0"):
        jax.block_until_ready(step(jax.device_put(jnp.zeros(2, jnp.int32), _device("gpu"))))


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["alternating", "single"])
def test_a_step_pushes_from_its_command_buffer(how):
    """A 6-layer decode step with a push: the push is traced into XLA's command buffer with
    the decodes and the metadata, and each of 8 calls' pop equals that call's out."""
    out = _probe("queue", how)
    assert "pops equal outs: True" in out, out
    targets = custom_call_targets(out)
    assert custom_calls.HOST_QUEUE_PUSH.target in targets and len(targets) == 6 + 1 + 1, out
    assert sum(map(captures, driver_calls(out))) >= len(targets), out
