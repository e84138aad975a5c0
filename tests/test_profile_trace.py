"""benchmarks/profile_decode.py's reading of a profiler trace, on a made-up timeline."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from profile_decode import DECODE_KERNEL, summarize_trace  # noqa: E402


def _launch(ts, correlation):
    return dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=ts, dur=2,
                args=dict(correlation=correlation))


def _gpu(cat, name, ts, dur, correlation):
    return dict(cat=cat, name=name, ts=ts, dur=dur, args=dict(correlation=correlation))


def test_two_decodes_with_a_copy_and_an_overlap():
    decode = f"void sm90::{DECODE_KERNEL}<T>"
    events = [
        _launch(0, 1), _gpu("kernel", decode, 10, 100, 1),
        _launch(5, 2), _gpu("gpu_memcpy", "Memcpy DtoD", 108, 4, 2),  # overlaps 2 us
        _launch(40, 3), _gpu("kernel", decode, 120, 100, 3),  # 8 us idle before it
        dict(cat="cpu_op", name="aten::empty", ts=1, dur=1, args={}),
    ]
    s = summarize_trace(dict(traceEvents=events), decodes=2)
    assert s["span_us"] == pytest.approx(210 / 2)
    assert s["busy_us"] == pytest.approx((100 + 2 + 100) / 2)
    assert s["idle_us"] == pytest.approx(8 / 2)
    assert s["activities"][decode[:90]] == dict(per_decode=1.0, mean_us=100)
    assert s["activities"]["Memcpy DtoD"] == dict(per_decode=0.5, mean_us=4)
    assert s["launch_to_start_us"] == dict(median=78, min=8)
    assert s["host_us_between_decodes"] == 40
    assert s["host_activities"] == {"cudaLaunchKernel": dict(per_decode=1.5, mean_us=2),
                                    "aten::empty": dict(per_decode=0.5, mean_us=1)}


def test_a_trace_without_gpu_activity_is_an_error():
    with pytest.raises(RuntimeError, match="no GPU activity"):
        summarize_trace(dict(traceEvents=[_launch(0, 1)]), decodes=1)
