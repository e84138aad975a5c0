"""On the GPU machine: the CUDA custom calls inside XLA's command buffers (CUDA graphs).

XLA captures each command-buffer-compatible custom call by running its handler under stream
capture, and replays the captured graph while the call's buffer addresses stay the same. So a
replay must equal FlashMLA called from torch with whatever values the buffers then hold, and a
step whose buffers moved must be captured anew."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from jax_flashmla.kernels import custom_calls
from jax_flashmla.caches import fp8
from helpers import K_SCALE, make_decode_inputs, torch_decode

pytestmark = pytest.mark.gpu

LAYERS = 3
PROBE = Path(__file__).resolve().parent / "gpu_probe.py"
PROBE_LAYERS = 6
SCALE = 576 ** -0.5


def _probe(*args):
    """tests/gpu_probe.py's stdout, run in a process of its own."""
    # This process holds part of the GPU already: the probe's JAX takes memory as it goes.
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    run = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.splitlines()[-1:] == ["done"], (
        run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    return run.stdout


def _probe_lines(out, key):
    return [json.loads(line[len(key) + 1:]) for line in out.splitlines()
            if line.startswith(key + " ")]


def custom_call_targets(out):
    """The targets of the custom calls in the probe's compiled HLO."""
    (targets,) = _probe_lines(out, "custom_call_targets")
    return targets


def driver_calls(out):
    """Per call of the probe's step, the driver's graph calls: {function: count}."""
    calls = _probe_lines(out, "driver_calls")
    assert [c["call"] for c in calls] == list(range(len(calls))), out[-2000:]
    return [c["counts"] for c in calls]


def captures(counts):
    """How many stream captures a call made: XLA traces each custom call of a command buffer
    it records by running the call's handler under one."""
    return sum(n for name, n in counts.items() if name.startswith("cuStreamBeginCapture"))


def records(counts):
    """Whether a call built or changed a CUDA graph (a replay only launches one)."""
    return captures(counts) > 0 or any(not name.startswith("cuGraphLaunch") for name in counts)


def _step_inputs(seed, *, batch, s_q, h_q, fp8_cache=False):
    """q per layer, caches per layer, block table, lengths: FlashMLA-style inputs (NaN in unused
    rows and pages, sentinel slots past each request's pages)."""
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(seed), batch=batch, s_q=s_q,
                                       h_q=h_q, mean_sk=700, varlen=True, dtype=jnp.float32)
    qs, caches = [], []
    for layer in range(LAYERS):  # other values per layer, one block table
        qs.append(jnp.roll(q, layer, axis=0).astype(jnp.bfloat16))
        layer_kv = kv * (1 - layer / 8)
        caches.append(fp8.quantize(layer_kv, jnp.float32(K_SCALE)) if fp8_cache
                      else layer_kv.astype(jnp.bfloat16))
    return jnp.stack(qs), caches, jnp.asarray(bt), jnp.asarray(sl)


def _unrolled_step(fp8_cache):
    def step(qs, caches, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=caches[0].shape[0],
                                 num_heads_q=qs.shape[3], num_q_tokens=qs.shape[2],
                                 fp8=fp8_cache)
        scale = dict(k_scale=jnp.float32(K_SCALE)) if fp8_cache else {}
        return [jf.mla_decode(qs[i], caches[i], bt, sl, metadata=md, softmax_scale=SCALE,
                              **scale) for i in range(len(caches))]
    return step


def _expected(qs, caches, bt, sl, fp8_cache):
    scale = dict(k_scale=K_SCALE) if fp8_cache else {}
    return [torch_decode(fp8.quantize(qs[i], jnp.float32(K_SCALE)) if fp8_cache else qs[i],
                         caches[i], bt, sl, softmax_scale=SCALE, **scale)
            for i in range(len(caches))]


def _assert_bit_identical(results, expected):
    for (out, lse), (t_out, t_lse) in zip(results, expected):
        np.testing.assert_array_equal(np.asarray(out, np.float32), t_out)
        np.testing.assert_array_equal(np.asarray(lse), t_lse)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_the_custom_calls_are_captured_in_a_command_buffer(dtype):
    """A 6-layer step's metadata and decodes: each is captured (its handler run under stream
    capture) when XLA first records the step's command buffer, after its warm-up run; the
    third call replays the graph, launching it and building nothing."""
    out = _probe("capture", dtype)
    decode = custom_calls.DECODE_FP8 if dtype == "fp8" else custom_calls.DECODE
    targets = custom_call_targets(out)
    assert targets == sorted([decode.target] * PROBE_LAYERS + [custom_calls.METADATA.target]), out
    calls = driver_calls(out)
    assert sum(map(captures, calls)) >= len(targets), calls
    assert not records(calls[2]) and calls[2].get("cuGraphLaunch"), calls


def test_an_alternating_step_replays_without_recording_again():
    """Called as one executable, a donated step is recorded again at every call: its
    temporaries come back at another address. Through AlternatingStep each copy records at
    its second call (the first is XLA's warm-up) and only replays afterwards."""
    single = driver_calls(_probe("rerecord", "single"))
    alternating = driver_calls(_probe("rerecord", "alternating"))
    assert len(single) == len(alternating) == 8, (single, alternating)
    assert all(records(single[k]) for k in range(3, 8)), single
    assert records(alternating[2]) and records(alternating[3]), alternating
    assert not any(records(alternating[k]) for k in range(4, 8)), alternating
    assert all(alternating[k].get("cuGraphLaunch") for k in range(4, 8)), alternating


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("s_q,h_q", [(1, 128), (2, 64)])
def test_replays_with_new_values_and_addresses_equal_torch(fp8_cache, s_q, h_q):
    """One executable run on buffers at new addresses (XLA captures again), on the first ones
    again (it may replay its graph), and on new arrays made after others were freed (new
    values, often at freed addresses): every run bit-identical to FlashMLA called from torch."""
    step = jax.jit(_unrolled_step(fp8_cache))
    first = _step_inputs(1, batch=9, s_q=s_q, h_q=h_q, fp8_cache=fp8_cache)
    second = _step_inputs(2, batch=9, s_q=s_q, h_q=h_q, fp8_cache=fp8_cache)
    for inputs in (first, second, first):
        _assert_bit_identical(step(*inputs), _expected(*inputs, fp8_cache))
    del second
    third = _step_inputs(3, batch=9, s_q=s_q, h_q=h_q, fp8_cache=fp8_cache)
    _assert_bit_identical(step(*third), _expected(*third, fp8_cache))


def test_a_loop_step_is_captured_under_the_loop_step_options():
    """A scanned step jitted with AlternatingStep.LOOP_COMPILER_OPTIONS: its metadata and the
    decode in its loop's body are captured into XLA's command buffer; the third call only
    replays."""
    out = _probe("loop", "scan")
    assert custom_call_targets(out) == sorted(
        [custom_calls.DECODE.target, custom_calls.METADATA.target]), out
    calls = driver_calls(out)
    assert sum(map(captures, calls)) >= 2, calls
    assert not records(calls[2]) and calls[2].get("cuGraphLaunch"), calls


@pytest.mark.parametrize("options", [None, jf.serving.AlternatingStep.LOOP_COMPILER_OPTIONS],
                         ids=["xla_defaults", "loop_step_options"])
@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
def test_a_loop_over_stacked_layers_with_a_donated_cache_equals_torch(loop, options):
    """Layers as a loop over one stacked cache, written in place each step (donated), as a
    model holds them; three steps on one executable, with XLA's default options (the loop
    outside command buffers) and with the loop step's (the loop recorded into one)."""
    h_q, s_q = 32, 1

    def step(qs, stack, rows, slots, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=stack.shape[1], num_heads_q=h_q,
                                 num_q_tokens=s_q)

        def layer(cache, q, row):
            cache = jf.write_kv(cache, slots, kv=row)
            return cache, jf.mla_decode(q, cache, bt, sl, metadata=md, softmax_scale=SCALE)

        if loop == "scan":
            def body(_, xs):
                cache, q, row = xs
                cache, (out, lse) = layer(cache, q, row)
                return None, (cache, out, lse)
            _, (stack, outs, lses) = jax.lax.scan(body, None, (stack, qs, rows))
        else:
            outs = jnp.zeros(qs.shape[:-1] + (512,), jnp.bfloat16)
            lses = jnp.zeros((LAYERS, qs.shape[1], h_q, s_q), jnp.float32)

            def body(i, carry):
                stack, outs, lses = carry
                cache, (out, lse) = layer(stack[i], qs[i], rows[i])
                return stack.at[i].set(cache), outs.at[i].set(out), lses.at[i].set(lse)
            stack, outs, lses = jax.lax.fori_loop(0, LAYERS, body, (stack, outs, lses))
        return stack, outs, lses

    run = jax.jit(step, donate_argnums=1, compiler_options=options)
    qs, caches, bt, sl = _step_inputs(4, batch=5, s_q=s_q, h_q=h_q)
    stack = jnp.stack(caches)
    rng = np.random.default_rng(4)
    for _ in range(3):
        rows = jnp.asarray(rng.normal(0, 0.1, (LAYERS, 5, 576)), jnp.bfloat16)
        slots = jf.token_slots(bt, sl - 1)  # each request's last token, rewritten
        before = np.asarray(stack).copy()
        stack, outs, lses = run(qs, stack, rows, slots, bt, sl)
        written = [np.asarray(jf.write_kv(jnp.asarray(before[i]), slots, kv=rows[i]))
                   for i in range(LAYERS)]
        expected = _expected(qs, [jnp.asarray(w) for w in written], bt, sl, False)
        _assert_bit_identical(list(zip(outs, lses)), expected)
        np.testing.assert_array_equal(np.asarray(stack).view(np.uint16),
                                      np.stack(written).view(np.uint16))
        qs = qs[::-1]


@pytest.mark.parametrize("target", ["decode", "metadata"])
def test_an_allocation_outside_xla_buffers_is_refused(target):
    """A custom call given a buffer one element short of what FlashMLA's op allocates (a
    split-KV accumulator, num_splits): the op's allocation matches no buffer XLA gave it, and
    the call fails naming the size instead of taking memory from torch; the process goes on."""
    out = _probe("refuse", target)
    assert "refused:" in out and "asked torch's CUDA allocator for" in out, out
    assert "after: True" in out, out


def test_metadata_at_a_batch_whose_two_results_have_one_size():
    """h_q=128 on 132 SMs: 66 SM parts, so at batch 527 tile_scheduler_metadata (66, 8) and
    num_splits (528,) are both 2112 bytes; each still lands in its own buffer."""
    sl = jnp.asarray(np.random.default_rng(6).integers(1, 200, 527), jnp.int32)
    bt = jnp.zeros((527, 4), jnp.int32)
    md = jax.jit(lambda s: jf.get_mla_metadata(s, block_table=bt, num_pages=1,
                                               num_heads_q=128))(sl)
    assert md.tile_scheduler_metadata.shape == (66, 8)
    assert int(md.num_splits[0]) == 0 and int(md.num_splits[-1]) >= 527
    assert (np.diff(np.asarray(md.num_splits)) >= 1).all()
