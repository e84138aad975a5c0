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
from device_time import (BATCH_ANNOTATION, Event, annotated_windows,  # noqa: E402
                         batch_after_blocker)


def activity(start, end, name="kernel"):
    return Event(start, end, name, "stream", {})


def test_a_batch_runs_from_its_blockers_end_to_its_last_activity():
    gpu = [activity(5, 8),                          # before the window: not counted
           activity(10, 12, "set-up"),              # before the blocker: not counted
           activity(12, 100, "matmul"),             # the blocker, the longest
           activity(98, 110, "first"),              # launched early, overlapping the blocker
           activity(108, 120), activity(125, 130),  # busy 110-120 and 125-130
           activity(300, 310)]                      # after the window: not counted
    batch = batch_after_blocker(gpu, (10, 200), queued_until=50)
    assert batch == (130 - 100, 10 + 10 + 5, 3, True, "matmul", "first")
    # The host still queueing when the blocker ended: flagged.
    assert not batch_after_blocker(gpu, (10, 200), queued_until=101).host_ahead
    with pytest.raises(RuntimeError, match="no GPU activity"):
        batch_after_blocker(gpu, (200, 250), queued_until=0)


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
    windows = annotated_windows(host, BATCH_ANNOTATION, 3)
    assert all(start < end for start, end in windows)
    assert windows[0][1] <= windows[1][0] and windows[1][1] <= windows[2][0]
    with pytest.raises(RuntimeError, match="not of 0 to 3"):
        annotated_windows(host, BATCH_ANNOTATION, 4)
