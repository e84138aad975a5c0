"""benchmarks/device_time.py: per-call device time from a trace. The GPU's part runs in
bench_grid.py on the GPU machine; here, its arithmetic on made-up activities, and on a real
(CPU) trace, that the host annotations around batches are found where the tracer puts them."""
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
import device_time  # noqa: E402
from device_time import BATCH_ANNOTATION, Event, batch_windows, spans_in_windows  # noqa: E402


def activity(start, end):
    return Event(start, end, "kernel", "stream", {})


def test_a_window_spans_its_activities_and_counts_overlaps_once():
    gpu = [activity(5, 8),                     # before the first window: not counted
           activity(10, 20), activity(18, 25),  # overlapping: busy 15, not 17
           activity(30, 40),                    # a gap of 5 before it
           activity(95, 130),                   # starts in the second window, ends after it
           activity(200, 210)]                  # in no window
    spans = spans_in_windows(gpu, [(10, 50), (90, 100), (150, 160)])
    assert spans[0] == (40 - 10, 15 + 10, 3)
    assert spans[1] == (130 - 95, 35, 1)
    assert spans[2] == (0, 0, 0)


def test_the_annotations_around_batches_are_found_in_a_real_trace():
    double = jax.jit(lambda x: 2 * x)
    x = jnp.ones(256)
    double(x).block_until_ready()
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir, profiler_options=device_time.profile_options()):
            for k in range(3):
                with jax.profiler.TraceAnnotation(f"{BATCH_ANNOTATION}{k}"):
                    double(x).block_until_ready()
        (path,) = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)
        planes = jax.profiler.ProfileData.from_file(path).planes
    host = sorted((e for plane in planes if plane.name == device_time.HOST_PLANE
                   for e in device_time.events_of(plane)), key=lambda e: e.start)
    windows = batch_windows(host, 3)
    assert all(start < end for start, end in windows)
    assert windows[0][1] <= windows[1][0] and windows[1][1] <= windows[2][0]
    with pytest.raises(RuntimeError, match="not of 0 to 3"):
        batch_windows(host, 4)
