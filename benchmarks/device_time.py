"""Per-call device time from the GPU's own timestamps: what CUDA events recorded on the stream
around a batch of calls would measure, for jax and torch alike. torch's events cannot bracket a
jitted call (XLA runs it on a stream of its own), but XLA's CUPTI tracer (jax.profiler) records
every GPU activity in the process, torch's too, and the host's annotations on the same clock.

Each batch starts with a blocker, one long spinning kernel on the stream the calls use, and the
host queues all the batch's calls behind it before the GPU reaches them. The batch's device
time runs from the blocker's end to its last activity's end: every gap between its calls (XLA's
between executions among them) and nothing of the host's dispatch, which the profiler slows,
nor of the final sync. Batches are told apart by host annotations around them."""
import collections
import gc
import glob
import tempfile
import time

import jax
import jax.numpy as jnp

from timing import turn_order

# Planes and lines of an XSpace (tsl/profiler/utils/xplane_schema.h).
GPU_PLANE_PREFIX = "/device:GPU:"
CUPTI_PLANE = "/host:CUPTI"
HOST_PLANE = "/host:CPU"
GPU_SUMMARY_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "TensorFlow Ops",
                     "Source code", "Framework Name Scope", "XLA TraceMe")
# Batch k runs inside the host annotation BATCH_ANNOTATION + str(k), its blocker and calls
# (not the sync) inside QUEUED_ANNOTATION + str(k).
BATCH_ANNOTATION = "jax_flashmla timed batch "
QUEUED_ANNOTATION = "jax_flashmla queued batch "
# Calls per batch: XLA keeps at most 32 executions of a device in flight (the trace's
# ComputeSemaphoreAcquire [capacity=32]), so this many, with the blocker, are all queued at once.
QUEUED_CALLS = 24
# Seconds a blocker lasts: the host's time to queue QUEUED_CALLS jitted calls several times
# over, even under the profiler (0.1-0.2 ms a call on the H200).
BLOCKER_S = 0.01


class Event(collections.namedtuple("Event", "start end name line stats")):
    @property
    def correlation(self):
        return self.stats.get("correlation_id")


def events_of(plane, keep_line=lambda name: True):
    return [Event(e.start_ns, e.start_ns + e.duration_ns, e.name, line.name, dict(e.stats))
            for line in plane.lines if keep_line(line.name) for e in line.events]


def profile_options():
    """The profiler without its Python tracer (which would slow the host's dispatch)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def traced(run, options, keep_host_line=lambda name: name != "python"):
    """(GPU activities, driver API calls, host events: XLA's annotations, the driver calls
    where the tracer puts them there, and the caller's) of one run, each time-sorted."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, profiler_options=options):
            run()
        (path,) = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
        data = jax.profiler.ProfileData.from_file(path)
    gpu, api, host = [], [], []
    for plane in data.planes:
        if plane.name.startswith(GPU_PLANE_PREFIX):
            gpu += events_of(plane, lambda name: name not in GPU_SUMMARY_LINES)
        elif plane.name == CUPTI_PLANE:
            api += events_of(plane)
        elif plane.name == HOST_PLANE:
            host += events_of(plane, keep_host_line)
    if not gpu:
        raise RuntimeError("the trace holds no GPU activity (is CUPTI available?)")
    return tuple(sorted(events, key=lambda e: e.start) for events in (gpu, api, host))


Batch = collections.namedtuple("Batch", "span_ns busy_ns activities host_ahead blocker first")


def batch_after_blocker(gpu, window, queued_until):
    """One batch from the GPU activities that start inside window (start, end): the longest of
    them is the blocker, the batch is every one after it in start order. Returns its span from
    the blocker's end to its last activity's end, the time within that the GPU was busy with
    them (overlaps counted once), how many there are, whether the host had queued them all (at
    queued_until) before the blocker ended, and the names of the blocker and of the first."""
    inside = sorted((e for e in gpu if window[0] <= e.start < window[1]), key=lambda e: e.start)
    if not inside:
        raise RuntimeError(f"no GPU activity in the batch's window {window}")
    blocker = max(range(len(inside)), key=lambda k: inside[k].end - inside[k].start)
    begin = inside[blocker].end
    batch = inside[blocker + 1:]
    busy, cursor = 0, begin
    for e in batch:
        start = max(e.start, cursor)
        if e.end > start:
            busy += e.end - start
            cursor = e.end
    end = max((e.end for e in batch), default=begin)
    return Batch(end - begin, busy, len(batch), queued_until < begin, inside[blocker].name,
                 batch[0].name if batch else None)


def annotated_windows(host, prefix, batches):
    """The (start, end) of the host annotations prefix + "0" to prefix + str(batches - 1)."""
    windows = {int(e.name[len(prefix):]): (e.start, e.end)
               for e in host if e.name.startswith(prefix)}
    if sorted(windows) != list(range(batches)):
        raise RuntimeError(f"the trace holds the annotations {prefix!r} of batches "
                           f"{sorted(windows)}, not of 0 to {batches - 1}")
    return [windows[k] for k in range(batches)]


def _spin_kernel(iterations):
    """A jitted Pallas kernel of one program that runs a chain of `iterations` dependent
    multiply-adds: GPU time at almost no power, one activity on XLA's stream."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.fori_loop(0, iterations, lambda i, acc: acc * 0.999999 + 1e-6,
                                       x_ref[...])
    return jax.jit(pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((32,), jnp.float32)))


def _lasting(make, run, sync, seconds):
    """make(n)'s blocker with n doubled from 2**22 until run(blocker) lasts `seconds` (wall
    clock, its dispatch included)."""
    n = 2**22
    while True:
        blocker = make(n)
        sync(run(blocker))  # compiles
        start = time.perf_counter()
        sync(run(blocker))
        if time.perf_counter() - start >= seconds or n >= 2**30:
            return blocker
        n *= 2


def spin_blockers(torch=None):
    """name -> a blocker: "jax" a spinning kernel on XLA's stream (Pallas), "torch" (given
    the torch module) torch.cuda._sleep on torch's current stream; each lasts BLOCKER_S and
    returns what must stay alive until the batch's sync. Spinning, not a matrix product: after
    one at full power the GPU's clocks differed from batch to batch (the H200, 5% either way in
    the next calls' kernels)."""
    x = jnp.zeros((32,), jnp.float32)
    spin = _lasting(_spin_kernel, lambda kernel: kernel(x), jax.block_until_ready, BLOCKER_S)
    blockers = dict(jax=lambda: spin(x))
    if torch is not None:
        cycles = _lasting(lambda n: n, torch.cuda._sleep, lambda _: torch.cuda.synchronize(),
                          BLOCKER_S)
        blockers["torch"] = lambda: torch.cuda._sleep(cycles)
    return blockers


def traced_calls(call, sync, calls=QUEUED_CALLS):
    """The GPU activities (time-sorted) of `calls` calls of call(i) back to back, then sync, under
    a trace of their own: each activity's kernel, where device_time_in_turns hands back the
    batches' spans alone."""
    def run():
        for i in range(calls):
            result = call(i)
        sync(result)
    gpu, _, _ = traced(run, profile_options())
    return gpu


def device_time_in_turns(variants, repeats, calls=QUEUED_CALLS):
    """variants: name -> (call taking the call's index, sync, blocker). Under one trace, every
    repeat runs a batch of each variant in turn (timing.turn_order): its blocker, then `calls`
    calls queued behind it, then the sync, each batch inside host annotations; a call of each
    variant first, outside the trace, so that no compilation holds the host back. Returns name ->
    dict(per_call, busy_per_call, kernels): seconds of device time per call, one sample per
    repeat, of that the time the GPU was busy, and the names of a batch's blocker and first
    activity. Raises where the host had not queued a batch's calls before its blocker ended
    (the GPU would then have timed the host)."""
    for call, sync, _ in variants.values():
        sync(call(0))
    order = []

    def run():
        for repeat in range(repeats):
            for name in turn_order(variants, repeat):
                call, sync, blocker = variants[name]
                with jax.profiler.TraceAnnotation(f"{BATCH_ANNOTATION}{len(order)}"):
                    with jax.profiler.TraceAnnotation(f"{QUEUED_ANNOTATION}{len(order)}"):
                        blocked = blocker()
                        for i in range(calls):
                            result = call(i)
                    sync(result)
                del blocked
                order.append(name)

    collecting = gc.isenabled()
    gc.disable()  # as in timing.timed_batch: no collection pauses the host mid-batch
    try:
        # The annotations are on the Python thread's line, which the tracer names "python".
        gpu, _, host = traced(run, profile_options(), keep_host_line=lambda name: True)
    finally:
        if collecting:
            gc.enable()
    windows = annotated_windows(host, BATCH_ANNOTATION, len(order))
    queued = annotated_windows(host, QUEUED_ANNOTATION, len(order))
    result = {name: dict(per_call=[], busy_per_call=[]) for name in variants}
    for name, window, (_, queued_until) in zip(order, windows, queued):
        batch = batch_after_blocker(gpu, window, queued_until)
        if not batch.host_ahead:
            raise RuntimeError(f"{name}: the host queued its calls after the blocker ended")
        if batch.activities < calls:
            raise RuntimeError(f"{name}: {batch.activities} GPU activities in a batch of "
                               f"{calls} calls")
        result[name]["per_call"].append(batch.span_ns / 1e9 / calls)
        result[name]["busy_per_call"].append(batch.busy_ns / 1e9 / calls)
        result[name]["kernels"] = dict(blocker=batch.blocker[:120], first=batch.first[:120])
    return result
