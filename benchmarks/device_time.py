"""Per-call device time from the GPU's own timestamps: what CUDA events recorded on the stream
around a batch of calls would measure, for jax and torch alike. torch's events cannot bracket a
jitted call (XLA runs it on a stream of its own), but XLA's CUPTI tracer (jax.profiler) records
every GPU activity in the process, torch's too, and the host's annotations on the same clock.

A batch's device time runs from its first GPU activity's start to its last one's end. It holds
every gap between the calls inside the batch (XLA's between executions among them), and not
what a wall-clock batch also charges to its calls: the first dispatch before the GPU starts and
the sync's wake-up after it ends. Batches are told apart by a host annotation around each."""
import collections
import glob
import tempfile

import jax

from timing import timed_batch, turn_order

# Planes and lines of an XSpace (tsl/profiler/utils/xplane_schema.h).
GPU_PLANE_PREFIX = "/device:GPU:"
CUPTI_PLANE = "/host:CUPTI"
HOST_PLANE = "/host:CPU"
GPU_SUMMARY_LINES = ("XLA Modules", "XLA Ops", "Steps", "Launch Stats", "TensorFlow Ops",
                     "Source code", "Framework Name Scope", "XLA TraceMe")
# The host annotation around batch k is named BATCH_ANNOTATION + str(k).
BATCH_ANNOTATION = "jax_flashmla timed batch "


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


Span = collections.namedtuple("Span", "span_ns busy_ns activities")


def spans_in_windows(gpu, windows):
    """For each (start, end) window, the GPU activities that start inside it: from the first's
    start to the last's end, the time the GPU was busy with one of them (overlaps counted
    once), and how many there were."""
    spans = []
    for window_start, window_end in windows:
        inside = sorted((e for e in gpu if window_start <= e.start < window_end),
                        key=lambda e: e.start)
        if not inside:
            spans.append(Span(0, 0, 0))
            continue
        busy, cursor = 0, inside[0].start
        for e in inside:
            start = max(e.start, cursor)
            if e.end > start:
                busy += e.end - start
                cursor = e.end
        spans.append(Span(max(e.end for e in inside) - inside[0].start, busy, len(inside)))
    return spans


def batch_windows(host, batches):
    """The (start, end) of the host annotations around batches 0, ..., batches - 1."""
    windows = {int(e.name[len(BATCH_ANNOTATION):]): (e.start, e.end)
               for e in host if e.name.startswith(BATCH_ANNOTATION)}
    if sorted(windows) != list(range(batches)):
        raise RuntimeError(f"the trace holds the annotations of batches {sorted(windows)}, not "
                           f"of 0 to {batches - 1}")
    return [windows[k] for k in range(batches)]


def device_time_in_turns(variants, calls, repeats):
    """variants: name -> (call taking the call's index, sync); calls: name -> calls per batch.
    Under one trace, every repeat runs a batch of each variant in turn (timing.turn_order),
    each inside its own host annotation. Returns name -> dict(per_call, busy_per_call): seconds
    of device time per call, one sample per repeat (its batch's span over its calls), and of
    that the time the GPU was busy."""
    order = []

    def run():
        for repeat in range(repeats):
            for name in turn_order(variants, repeat):
                call, sync = variants[name]
                with jax.profiler.TraceAnnotation(f"{BATCH_ANNOTATION}{len(order)}"):
                    timed_batch(call, sync, calls[name])
                order.append(name)

    # The annotations are on the Python thread's line, which the tracer names "python".
    gpu, _, host = traced(run, profile_options(), keep_host_line=lambda name: True)
    spans = spans_in_windows(gpu, batch_windows(host, len(order)))
    result = {name: dict(per_call=[], busy_per_call=[]) for name in variants}
    for name, span in zip(order, spans):
        if span.activities < calls[name]:
            raise RuntimeError(f"{name}: {span.activities} GPU activities in a batch of "
                               f"{calls[name]} calls")
        result[name]["per_call"].append(span.span_ns / 1e9 / calls[name])
        result[name]["busy_per_call"].append(span.busy_ns / 1e9 / calls[name])
    return result
