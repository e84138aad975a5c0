"""On the GPU machine: torch code in another thread of the process, allocating, computing and
reading its allocator's statistics while jitted decodes run (each call lends XLA's buffers to
FlashMLA's op through torch's allocator), sees torch's own allocator and correct results."""
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from helpers import make_decode_inputs, torch_decode

pytestmark = pytest.mark.gpu

DECODES = 400
SCALE = 576 ** -0.5


def _torch_work(torch, stop, report):
    """Until `stop`: allocations of assorted sizes, a matmul checked against its float64
    value, torch's memory statistics, and once in a while an emptied cache."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    # The thread's first matmul gives its cuBLAS handle a workspace, which torch keeps.
    warm = torch.ones(8, 8, device="cuda")
    (warm @ warm).sum().item()
    del warm
    baseline = torch.cuda.memory_allocated()
    rounds = 0
    try:
        while not stop.is_set() or rounds < 20:
            size = 64 * (1 + rounds % 17)
            x = torch.randn(size, size, device="cuda", generator=generator)
            y = x @ x.T
            want = x.double().cpu() @ x.double().cpu().T
            error = float((y.double().cpu() - want).abs().max())
            if error > 1e-2 * size:
                raise AssertionError(f"round {rounds}: a {size}x{size} matmul is off by {error}")
            allocated = torch.cuda.memory_allocated()
            if allocated < baseline + x.nbytes + y.nbytes:
                raise AssertionError(f"round {rounds}: torch.cuda.memory_allocated() {allocated} "
                                     f"is below what this thread holds")
            stats = torch.cuda.memory_stats()
            if stats["allocated_bytes.all.current"] != allocated:
                raise AssertionError(f"round {rounds}: memory_stats disagrees: {stats}")
            if torch.cuda.get_allocator_backend() != "native":
                raise AssertionError(torch.cuda.get_allocator_backend())
            del x, y
            if rounds % 25 == 0:
                torch.cuda.empty_cache()
            rounds += 1
        torch.cuda.synchronize()
        report["after"] = torch.cuda.memory_allocated() - baseline
    except BaseException as e:  # noqa: BLE001 - reported to the test's thread
        report["error"] = repr(e)
    report["rounds"] = rounds


def test_a_torch_thread_beside_jitted_decodes_sees_torchs_own_allocator():
    torch = pytest.importorskip("torch")
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(0), batch=6, s_q=1, h_q=64,
                                       mean_sk=900, varlen=True, dtype=jnp.bfloat16)
    q, kv, bt, sl = map(jnp.asarray, (q, kv, bt, sl))
    # Two custom calls, too few for XLA's command buffer: every call runs the handlers, and
    # so lends buffers through torch's allocator.
    decode = jax.jit(lambda q, kv, bt, sl: jf.mla_decode(q, kv, bt, sl, softmax_scale=SCALE))
    want_out, want_lse = torch_decode(q, kv, bt, sl, softmax_scale=SCALE)
    stop, report = threading.Event(), {}
    worker = threading.Thread(target=_torch_work, args=(torch, stop, report))
    worker.start()
    try:
        for i in range(DECODES):
            out, lse = decode(q * (1 + i % 3), kv, bt, sl)
            if i % 3 == 0:
                np.testing.assert_array_equal(np.asarray(out, np.float32), want_out)
                np.testing.assert_array_equal(np.asarray(lse), want_lse)
    finally:
        stop.set()
        worker.join(timeout=120)
    assert not worker.is_alive() and "error" not in report, report
    assert report["rounds"] >= 20 and report["after"] == 0, report
