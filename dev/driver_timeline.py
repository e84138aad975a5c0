"""A step's driver calls on a timeline, from dev/driver_trace.c (LD_PRELOADed, no CUPTI).

Per step, relative to the step's call (µs): when the call returned and when the sync after it
returned, and per driver function and thread (`caller`: the thread that called the step;
`other`: any other) how many calls, their summed host time, the first call's start and the
last's end; `host_function` is a function enqueued with cuLaunchHostFunc as it ran, so its
start is when the GPU reached it (plus the driver's latency). Each number is the median over
the steps.
"""
import ctypes
import statistics

import numpy as np

STEP, RETURNED, READY = 100, 101, 102
RECORD = np.dtype([("t0", np.int64), ("t1", np.int64), ("tid", np.int32), ("fn", np.int32)])


class DriverTrace:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.driver_trace_name.restype = ctypes.c_char_p
        self.lib.driver_trace_take.restype = ctypes.c_long
        self.names = [self.lib.driver_trace_name(i).decode()
                      for i in range(self.lib.driver_trace_num_fns())]
        self.buffer = np.zeros(1 << 20, RECORD)

    def _take(self):
        n = self.lib.driver_trace_take(self.buffer.ctypes.data_as(ctypes.c_void_p),
                                       len(self.buffer))
        if n > len(self.buffer):
            raise RuntimeError(f"driver_trace: {n} records, {len(self.buffer)} kept")
        return self.buffer[:n].copy()

    def timeline(self, launch, sync, steps):
        """{key: median µs or count} over `steps` synced steps."""
        launch(), sync()
        self._take()
        self.lib.driver_trace_enable(1)
        for _ in range(steps):
            self.lib.driver_trace_mark(STEP)
            launch()
            self.lib.driver_trace_mark(RETURNED)
            sync()
            self.lib.driver_trace_mark(READY)
        self.lib.driver_trace_enable(0)
        return self.summary(self._take())

    def summary(self, records):
        marks = records[records["fn"] >= STEP]
        starts = marks[marks["fn"] == STEP]
        caller = int(starts["tid"][0])
        per_step = []
        for i, start in enumerate(starts):
            end = starts["t0"][i + 1] if i + 1 < len(starts) else np.iinfo(np.int64).max
            window = records[(records["t0"] >= start["t0"]) & (records["t0"] < end)]
            us = lambda t: (int(t) - int(start["t0"])) / 1e3  # noqa: E731
            step = {}
            for fn, key in ((RETURNED, "returned"), (READY, "ready")):
                step[key] = us(window["t0"][window["fn"] == fn][0])
            calls = window[window["fn"] < STEP]
            for fn in np.unique(calls["fn"]):
                for role, mask in (("caller", calls["tid"] == caller),
                                   ("other", calls["tid"] != caller)):
                    these = calls[(calls["fn"] == fn) & mask]
                    if len(these):
                        key = f"{self.names[fn]} {role}"
                        step[f"{key} n"] = len(these)
                        step[f"{key} us"] = float((these["t1"] - these["t0"]).sum()) / 1e3
                        step[f"{key} first"] = us(these["t0"].min())
                        step[f"{key} last_end"] = us(these["t1"].max())
            per_step.append(step)
        keys = sorted({k for step in per_step for k in step},
                      key=lambda k: (k not in ("returned", "ready"), k))
        return {k: round(statistics.median(s.get(k, 0) for s in per_step), 1) for k in keys}
