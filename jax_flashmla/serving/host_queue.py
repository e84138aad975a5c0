"""Small arrays from a jitted step to the host as soon as the device has written them."""
import ctypes
import math
import secrets
import time

import jax
import numpy as np

import jax_flashmla._cpu as _cpu
from jax_flashmla.kernels import custom_calls
from jax_flashmla.kernels import library as kernels

HEADER_BYTES = 64  # ffi/host_queue.h
WRITING = 1 << 63
MAX_BYTES = 1 << 20
WAIT_SLICE_S = 0.1


class HostQueue:
    """A first-in first-out queue of arrays of one shape and dtype from the device to the host.

    `push(x)` inside a jitted step copies x into host memory when the device reaches it in
    the step; `pop()` on the host returns the next pushed array, in push order, as a numpy
    array. pop spins on that memory, so it returns microseconds after the device wrote it,
    without waiting for XLA to mark the step's outputs ready (a host callback after the step's
    kernels end, on a GPU a few hundred microseconds later) or copying them. A serving loop
    pushes each step's sampled tokens and pops them before it plans the next step, instead of
    `jax.device_get` or `jax.block_until_ready`; it may launch up to `depth` steps before it
    pops the first.

    shape, dtype: of each array pushed (at most 1 MiB). depth: how many pushed arrays the queue
    holds unpopped; a push beyond that overwrites the oldest, whose pop raises
    HostQueue.OverrunError (the pop after it goes on from the oldest array still held). device:
    the device whose steps push (default: JAX's first); a step that pushes runs on it alone (on
    a GPU a push from another device fails with an XLA error). On a GPU the push is one small
    kernel, captured with the step into XLA's command buffers (jax_flashmla._cuda, which needs
    neither torch nor FlashMLA's kernels; making a queue raises RuntimeError where it was not
    built); on the CPU a copy. A push
    completes after the step's work before it: what the step computes after its push may still
    be running when pop returns.

    The queue's host memory lives until the process exits (a captured push keeps its address
    as long as its executable lives).
    """

    class OverrunError(RuntimeError):
        """A push overwrote a result before the host popped it: more than `depth` pushes ran
        ahead of the pops."""

    def __init__(self, shape, dtype, *, depth=2, device=None):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"HostQueue depth must be an int >= 1, got {depth!r}")
        self.depth = depth
        self.device = jax.devices()[0] if device is None else device
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        if self.nbytes > MAX_BYTES:
            raise ValueError(f"HostQueue arrays must be at most {MAX_BYTES} bytes, got shape "
                             f"{self.shape} of {self.dtype} ({self.nbytes} bytes)")
        self.slot_bytes = HEADER_BYTES + -(-max(self.nbytes, 1) // HEADER_BYTES) * HEADER_BYTES
        self._id = secrets.randbits(63)  # in the HLO: no two queues' executables are the same
        platform = self.device.platform
        if platform == "cpu":
            address = _cpu.host_queue_create(self._id, self.slot_bytes, self.depth)
        elif platform == "gpu":
            cuda = kernels.register_cuda_targets()
            address = cuda.host_queue_create(self._id, self.slot_bytes, self.depth,
                                             self.device.local_hardware_id)
        else:
            raise ValueError(f"HostQueue: no host queue for platform {platform!r} "
                             f"(device {self.device}); cpu and gpu have one")
        self._address = address
        self._memory = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (self.slot_bytes * depth)).from_address(address))
        self._popped = 0

    def push(self, x):
        """Pushes x (of the queue's shape and dtype) when the device reaches it; returns None.
        Call it inside the jitted step (outside jit it runs as a step of its own)."""
        if tuple(x.shape) != self.shape or np.dtype(x.dtype) != self.dtype:
            raise ValueError(f"HostQueue.push: x must be {self.shape} {self.dtype} (the "
                             f"queue's), got {tuple(x.shape)} {np.dtype(x.dtype)}")
        custom_calls.HOST_QUEUE_PUSH(payload=x, queue_id=self._id)

    def pop(self, timeout_s=60.0):
        """The next pushed array, in push order, once the device has written it. Raises
        TimeoutError after timeout_s with nothing pushed, HostQueue.OverrunError where later
        pushes overwrote it."""
        expected = self._popped + 1
        slot = (expected - 1) % self.depth
        base = slot * self.slot_bytes
        sequence = self._address + base
        deadline = time.monotonic() + timeout_s
        # Spun in slices, between which Python handles signals (Ctrl-C ends a long wait).
        while (seen := _cpu.host_queue_wait(sequence, expected, WAIT_SLICE_S)) == 0:
            if time.monotonic() > deadline:
                break
        if seen == 0:
            raise TimeoutError(f"HostQueue.pop: push {expected} did not come within "
                               f"{timeout_s} s ({self._popped} popped)")
        payload = self._memory[base + HEADER_BYTES:base + HEADER_BYTES + self.nbytes].copy()
        if seen != expected or self._sequence(base) != expected:
            newer = max(seen, self._sequence(base)) & ~WRITING
            self._popped = newer - self.depth  # the next pop: the oldest this slot allows
            raise self.OverrunError(
                f"HostQueue.pop: push {expected} was overwritten by push {newer} before it was "
                f"popped; the queue holds {self.depth} (its depth): pop before more pushes run "
                f"ahead (the next pop returns push {self._popped + 1} or a later overrun)")
        self._popped = expected
        return payload.view(self.dtype).reshape(self.shape)

    def _sequence(self, base):
        return int(self._memory[base:base + 8].view(np.uint64)[0])
