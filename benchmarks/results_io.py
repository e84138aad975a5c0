"""How every benchmark writes its results, so that results/ stays under 1 MB: the JSON with each
point's summary figures alone, compact, and the plots at 80 dpi in 32 colours.

write_json leaves out of OUT.json the per-repeat samples (a list under a key ending in
`repeats` or `repeats_ms`: `repeats_ms`, `device_repeats_ms`, `us_repeats`, `v32_us_repeats`,
...), the device-time windows' kernel names (`device_time_kernels`) and bench_step's
per-layout `records` beside its `raw` (bench_step.records_by_layout(raw) rebuilds them); floats
go to 6 significant digits (timings vary run to run by far more than 1e-5). The reports render
their markdown from what is kept. Where it left something out, the result as given goes whole
to OUT.raw.json beside it (ignored by git), for a maintainer who wants the samples; a result
with nothing to leave out (a redraw or a merge of trimmed JSONs, or a report without samples)
leaves an OUT.raw.json already there as it was.

save_png draws a figure at 80 dpi, then keeps 32 colours (PIL's median cut over RGB, which
matplotlib's own dependency provides).

run_points runs a benchmark's points in turn and saves the result after each."""
import io
import json
import os
import re
import time

DPI = 80
COLOURS = 32  # the plots' few lines and their anti-aliasing read the same as in 64
SIGNIFICANT_DIGITS = 6
# A list under such a key holds a point's per-repeat samples.
PER_REPEAT = re.compile(r"(^|_)repeats(_ms)?$")
DROPPED_KEYS = ("device_time_kernels",)


def raw_path(path):
    """OUT.json -> OUT.raw.json (any other path: path + '.raw.json')."""
    return (path[:-len(".json")] if path.endswith(".json") else path) + ".raw.json"


def trimmed(value):
    """(value as OUT.json holds it, whether anything was left out of it)."""
    left_out = []

    def trim(v):
        if isinstance(v, float):
            return float(f"{v:.{SIGNIFICANT_DIGITS}g}")
        if isinstance(v, list):
            return [trim(x) for x in v]
        if not isinstance(v, dict):
            return v
        kept = {}
        for key, x in v.items():
            if (key in DROPPED_KEYS or (isinstance(x, list) and PER_REPEAT.search(key))
                    or (key == "records" and "raw" in v)):
                left_out.append(key)
            else:
                kept[key] = trim(x)
        return kept

    return trim(value), bool(left_out)


def _write(text, path):
    """Written whole to a side file, then renamed: a kill mid-write leaves the last good one."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_json(result, path):
    """path: the result trimmed (trimmed), compact; path's .raw.json: the result whole, where
    the trimming left something out."""
    small, left_out = trimmed(result)
    if left_out:
        _write(json.dumps(result, indent=1) + "\n", raw_path(path))
    _write(json.dumps(small, separators=(",", ":")) + "\n", path)


def save_png(fig, path, **savefig_kwargs):
    """fig.savefig(path) at DPI in COLOURS colours (savefig's other arguments as given)."""
    from PIL import Image

    buffer = io.BytesIO()
    fig.savefig(buffer, **dict(savefig_kwargs, format="png", dpi=DPI))
    buffer.seek(0)
    with Image.open(buffer) as image:
        image.convert("RGB").quantize(COLOURS).save(path, format="PNG", optimize=True)


def run_points(points, result, records, *, deadline_s, line, save):
    """points: (label, run) in order, run() a point's record. Each record joins `records` and
    is printed by line(record); a point that raises (memory at the largest, say) is recorded
    in result["failed"] and the others still run; none starts after deadline_s seconds (None:
    no deadline), its label joining result["not_run"]. save() after every point, so that a
    run cut short keeps what it measured."""
    start = time.perf_counter()
    for label, run in points:
        if deadline_s is not None and time.perf_counter() - start > deadline_s:
            result["not_run"].append(label)
            continue
        try:
            records.append(run())
            print(line(records[-1]), flush=True)
        except Exception as e:
            result["failed"][label] = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"{label}: failed: {result['failed'][label]}", flush=True)
        save()
