"""bench_grid.py's report: the JSON, the markdown table and the PNG plots (GB/s and TFLOPS, for
each cache dtype). Run alone it redraws the markdown and the plots from a (possibly partial)
JSON, e.g. on a machine with matplotlib when the GPU machine has none, or first joins the
reports of a grid's parts run apart (e.g. on two GPUs at once, one part per GPU):

    python benchmarks/grid_report.py benchmarks/results/grid_h200.json
    python benchmarks/grid_report.py --merge grid_h200.json grid_h200_bf16.json grid_h200_fp8.json
"""
import json
import statistics
import sys

from results_io import save_png, write_json

# Colour, marker and line of each implementation, the same in both plots.
STYLE = {
    "flashmla": dict(color="C0", marker="o", linestyle="-", label="jax_flashmla (jit)"),
    "torch": dict(color="C1", marker="s", linestyle="--", label="FlashMLA from torch"),
    "reference": dict(color="C2", marker="^", linestyle="-", label="pure-JAX reference (jit)"),
    "flashmla_step": dict(color="C3", marker="D", linestyle=":", label="jax_flashmla, N-layer step"),
    "torch_step": dict(color="C4", marker="v", linestyle=":", label="torch, N-layer step"),
}
# Settings that must agree for runs to be reported as one grid.
SHARED_SETTINGS = ("device", "batch", "layers", "rotations", "target_ms", "repeats", "timing",
                   "fp8_q", "jax", "decode_op", "device_time")
# The large shapes: mean s_k from here on, where mla_decode is to be within 3% of torch-direct per
# call.
LARGE_S_K = 8192


def merge(reports):
    """One report from the reports of one grid's parts: all their points (a point measured twice
    is an error), the first's settings, and under meta["parts"] each part's date, dtypes, mean
    s_k, GPU (CUDA_VISIBLE_DEVICES when set) and copy ceiling. The ceiling drawn is the highest
    of the parts' (each point's fraction of it was taken against its own part's)."""
    first = reports[0]["meta"]
    for report in reports[1:]:
        differing = [k for k in SHARED_SETTINGS if report["meta"].get(k) != first.get(k)]
        if differing:
            raise ValueError(f"the parts were not run alike: {differing} differ")
    points, seen = [], set()
    for report in reports:
        for point in report["points"]:
            key = (point["mean_s_k"], point["varlen"], dtype_of(point), point["h_q"], point["s_q"])
            if key in seen:
                raise ValueError(f"the point {key} is in two parts")
            seen.add(key)
            points.append(point)
    parts = [dict(date=r["meta"]["date"], resumed=r["meta"].get("resumed", []),
                  gpu=r["meta"].get("visible_devices"), copy=r["meta"]["copy"],
                  dtypes=sorted({dtype_of(p) for p in r["points"]}),
                  mean_s_k=sorted({p["mean_s_k"] for p in r["points"]})) for r in reports]
    ceiling = max(reports, key=lambda r: r["meta"]["copy"]["ceiling_gbps"])["meta"]["copy"]
    meta = dict(first, dtypes=sorted({d for part in parts for d in part["dtypes"]},
                                     key=lambda d: d != "bfloat16"), copy=ceiling, parts=parts)
    return dict(meta=meta, points=points,
                not_run=[n for r in reports for n in r["not_run"]])


def ratio(point, impl, base="torch"):
    """impl's time over base's at one point (per step for the step implementations), or None:
    against torch the median of per-repeat ratios where the two were timed in turns."""
    impls = point["impls"]
    if impl not in impls or base not in impls:
        return None
    if base in ("torch", "torch_step") and "vs_torch" in impls[impl]:
        return impls[impl]["vs_torch"]
    key = "step_ms" if "step_ms" in impls[impl] and "step_ms" in impls[base] else "ms"
    return impls[impl][key] / impls[base][key]


def fitted_ratio(point):
    """jax_flashmla's per-call time over torch's as the slopes of batch time over batch length
    (the median of per-repeat ratios), or None where the run did not fit them."""
    return point["impls"].get("flashmla", {}).get("vs_torch_fitted")


def device_ratio(point):
    """jax_flashmla's per-call device time (the GPU's timestamps, device_time.py) over torch's,
    the median of per-repeat ratios, or None where the run did not trace them."""
    return point["impls"].get("flashmla", {}).get("vs_torch_device")


def dtype_of(point):
    return point.get("dtype", "bfloat16")  # reports written before FP8 hold bf16 points only


def dtypes_of(results):
    return sorted({dtype_of(p) for p in results["points"]}, key=lambda d: d != "bfloat16")


def point_summary(point):
    """One progress line."""
    parts = []
    for impl, r in point["impls"].items():
        text = f"{impl} {r['ms']:.4g} ms {r['gbps']:.4g} GB/s ({r['of_copy']:.0%})"
        if impl == "flashmla" and ratio(point, "flashmla") is not None:
            text += f" x{ratio(point, 'flashmla'):.3f} of torch"
            if fitted_ratio(point) is not None:
                text += f" (fitted x{fitted_ratio(point):.3f})"
            if device_ratio(point) is not None:
                text += f" (device x{device_ratio(point):.3f})"
        if impl == "flashmla_step" and ratio(point, "flashmla_step", "torch_step") is not None:
            text += f" step x{ratio(point, 'flashmla_step', 'torch_step'):.3f} of torch's"
        parts.append(text)
    parts += [f"{impl} skipped" for impl in point["skipped"]]
    return "; ".join(parts)


def _stats(values):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return (f"median {statistics.median(values):.3f}, range {min(values):.3f}–{max(values):.3f} "
            f"({len(values)} points)")


def _cell(point, impl, field, fmt):
    r = point["impls"].get(impl)
    if r is None:
        return "skipped" if impl in point["skipped"] else "–"
    return format(r[field], fmt)


def summary_lines(results):
    """The run's findings, one markdown bullet each (per cache dtype when there are several)."""
    dtypes = dtypes_of(results)
    lines = []
    for dtype in dtypes:
        points = [p for p in results["points"] if dtype_of(p) == dtype]
        if len(dtypes) > 1:
            lines.append(f"- {dtype} cache:")
        lines += [("  " if len(dtypes) > 1 else "") + line
                  for line in _summary_of(results["meta"], points)]
    if results["not_run"]:
        lines.append(f"- Not run (deadline): {len(results['not_run'])} points.")
    return lines


def _summary_of(meta, points):
    checks = [p["checks"] for p in points]
    equal = [c["equals_torch"] for c in checks if "equals_torch" in c]
    diffs = [c["max_abs_diff_vs_reference"] for c in checks if "max_abs_diff_vs_reference" in c]
    of_copy = [p["impls"]["flashmla"]["of_copy"] for p in points if "flashmla" in p["impls"]]
    lines = [
        f"- jax_flashmla / torch-direct per call: {_stats(ratio(p, 'flashmla') for p in points)}; "
        f"at mean s_k ≥ {LARGE_S_K}: "
        f"{_stats(ratio(p, 'flashmla') for p in points if p['mean_s_k'] >= LARGE_S_K)}.",
        *([f"- The same, fitted (the slope of batch time over batch length, without what each "
           f"batch pays once): {_stats(fitted_ratio(p) for p in points)}; at mean s_k ≥ "
           f"{LARGE_S_K}: "
           f"{_stats(fitted_ratio(p) for p in points if p['mean_s_k'] >= LARGE_S_K)}."]
          if any(fitted_ratio(p) is not None for p in points) else []),
        *([f"- The same by device time (the GPU's timestamps over calls queued ahead of the GPU, "
           f"as CUDA events on the stream): {_stats(device_ratio(p) for p in points)}; at "
           f"mean s_k ≥ {LARGE_S_K}: "
           f"{_stats(device_ratio(p) for p in points if p['mean_s_k'] >= LARGE_S_K)}."]
          if any(device_ratio(p) is not None for p in points) else []),
        f"- Decode step of {meta['layers']} layers (metadata once per step), jax_flashmla / "
        f"torch loop: {_stats(ratio(p, 'flashmla_step', 'torch_step') for p in points)}.",
        f"- Pure-JAX reference / jax_flashmla: "
        f"{_stats(ratio(p, 'reference', 'flashmla') for p in points)}; skipped at "
        f"{sum('reference' in p['skipped'] for p in points)} points (memory budget, or failed: "
        "the JSON's `skipped` says).",
        f"- jax_flashmla's GB/s as a fraction of the copy ceiling: {_stats(of_copy)}.",
    ]
    if equal:
        lines.append(f"- jax_flashmla's out equals torch-direct's bit for bit at {sum(equal)} of "
                     f"{len(equal)} points.")
    if diffs:
        lines.append(f"- Largest |jax_flashmla - reference| in out: {max(diffs):.3g}.")
    return lines


def write_markdown(results, path):
    meta, points = results["meta"], results["points"]
    copy = meta["copy"]
    dtypes = meta.get("dtypes", [meta.get("dtype")])
    copy_text = ", ".join(f"{k[:-len('_gbps')]} {v:.4g}" for k, v in copy.items()
                          if k.endswith("_gbps") and k != "ceiling_gbps")
    lines = [
        f"# FlashMLA decode grid: {meta['device']}",
        "",
        f"{meta['date']}; jax {meta['jax']}" + (f", torch {meta['torch']}, `{meta['decode_op']}`"
                                                 if "torch" in meta else "")
        + f"; jax_flashmla runs {meta['flashmla_path']}. Cache {', '.join(dtypes)}"
        + (_fp8_text(meta) if len(dtypes) > 1 or dtypes != ["bfloat16"] else "")
        + f", b={meta['batch']}, "
        f"{meta['rotations']} (q, block_table) sets rotated; N calls then a device sync, median of "
        f"{meta['repeats']} repeats of ~{meta['target_ms']:g} ms"
        + _timing_text(meta.get("timing", ""))
        + _device_time_text(meta.get("device_time"))
        + ". GB/s and TFLOPS by FlashMLA's formulas; per-layer figures for the steps.",
        "",
        f"Device copy (read + write, {copy['mib']} MiB): {copy_text} GB/s; ceiling "
        f"{copy['ceiling_gbps']:.4g} GB/s.",
        "",
        *_parts_lines(meta),
        "## Summary",
        "",
        *summary_lines(results),
        "",
        "## Per point",
        "",
        "ms per call (per layer for the steps); ratios are times over torch-direct's (the step's "
        "over the torch loop's).",
        "",
        "| cache | lengths | s_q | h_q | mean s_k | jax_flashmla ms | torch ms | ratio | "
        "fitted ratio | device ratio | GB/s | of copy | TFLOPS | reference ms | step ms/layer "
        "(jax / torch) | step ratio |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: |",
    ]
    order = dtypes_of(results)
    key = lambda p: (order.index(dtype_of(p)), p["varlen"], p["s_q"], p["h_q"], p["mean_s_k"])
    for p in sorted(points, key=key):
        r, step_r = ratio(p, "flashmla"), ratio(p, "flashmla_step", "torch_step")
        fitted, device = fitted_ratio(p), device_ratio(p)
        lines.append(" | ".join([
            "| fp8" if dtype_of(p) != "bfloat16" else "| bf16",
            "varlen" if p["varlen"] else "fixed", str(p["s_q"]), str(p["h_q"]),
            str(p["mean_s_k"]),
            _cell(p, "flashmla", "ms", ".4f"), _cell(p, "torch", "ms", ".4f"),
            *("–" if x is None else f"{x:.3f}" for x in (r, fitted, device)),
            _cell(p, "flashmla", "gbps", ".4g"),
            _cell(p, "flashmla", "of_copy", ".0%"), _cell(p, "flashmla", "tflops", ".4g"),
            _cell(p, "reference", "ms", ".4f"),
            f"{_cell(p, 'flashmla_step', 'ms', '.4f')} / {_cell(p, 'torch_step', 'ms', '.4f')}",
            ("–" if step_r is None else f"{step_r:.3f}") + " |"]))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _fp8_text(meta):
    if meta.get("fp8_q") == "given quantized":
        return (" (FP8: one per-tensor k scale; q quantized with it once, outside the timed "
                "calls, and given to both in FP8)")
    return (" (FP8: one per-tensor k scale; jax_flashmla quantizes q inside the call, torch gets "
            "it quantized)")


def _timing_text(timing):
    """How the run's points were timed (meta["timing"], bench_grid.TIMING), in words."""
    if "turns" not in timing:
        return ", one implementation after another"
    text = ", the implementations in turns within each repeat"
    if "alternating" in timing:
        text += " (the order reversed every other repeat)"
    text += ", ratios the median of per-repeat ratios"
    if "per call fitted" in timing:
        text += ("; per call also fitted: jax_flashmla and torch timed over batches of 0.5, 1 "
                 "and 2 times N calls, the ratio of the slopes of batch time over batch length")
    if "lse as written" in timing:
        text += "; jax_flashmla's lse returned as FlashMLA wrote it (`lse_format`), as torch's"
    if "step over layer caches" in timing:
        text += ("; a step's layers, as a model's, share one block table (set 0's), each over "
                 "a cache of its own (the pages rolled), so an FP8 step guards once")
    if "FP8 guard in the metadata" in timing:
        text += ("; jax_flashmla's FP8 calls get a metadata per set made with its block table "
                 "(the guard for empty requests in it, as a step's), so they guard nothing")
    if "metadata with the block table" in timing:
        text += ("; jax_flashmla's calls get a metadata per set made with its block table, as "
                 "a step's")
    return text


def _device_time_text(device_time):
    """How the run timed by the GPU's timestamps (meta["device_time"]), in words."""
    if not device_time:
        return ""
    return (f"; per call also by device time: jax_flashmla and torch traced (jax.profiler) in "
            f"turns, {device_time['batches']} batches each of {device_time['calls']} calls "
            "queued behind a long spinning kernel, the GPU's timestamps from its end to the "
            "batch's last kernel's over the calls")


def _parts_lines(meta):
    """For a merged report, a line per part run: when, what, where, its copy ceiling."""
    if "parts" not in meta:
        return []
    lines = ["Run in parts (joined with `grid_report.py --merge`):", ""]
    for part in meta["parts"]:
        resumed = f", resumed {', '.join(part['resumed'])}" if part["resumed"] else ""
        gpu = f" on GPU {part['gpu']}" if part["gpu"] is not None else ""
        lines.append(f"- {part['date']}{resumed}{gpu}: {', '.join(part['dtypes'])}, mean s_k "
                     f"{', '.join(map(str, part['mean_s_k']))}; copy ceiling "
                     f"{part['copy']['ceiling_gbps']:.4g} GB/s.")
    return lines + [""]


def _panel(ax, here, metric, ceiling, layers):
    """One (lengths, s_q, h_q) panel: metric against mean s_k per implementation, and the
    copy bandwidth: the ceiling itself in GB/s, the roof it sets at each point's arithmetic
    intensity in TFLOPS."""
    for impl, style in STYLE.items():
        xy = [(p["mean_s_k"], p["impls"][impl][metric]) for p in here if impl in p["impls"]]
        if xy:
            label = style["label"].replace("N-layer", f"{layers}-layer")
            ax.plot(*zip(*xy), markersize=4, **dict(style, label=label))
    roof = [(p["mean_s_k"], ceiling if metric == "gbps" else ceiling * p["flops"] / p["bytes"] / 1e3)
            for p in here]  # GB/s x FLOP/byte / 1e3 = TFLOPS
    ax.plot(*zip(*roof), color="k", linestyle=":", linewidth=1, label="copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)


def write_plots(results, stem):
    """stem.png (bf16 cache) and stem_fp8.png: a panel per (lengths, s_q) row and per (metric,
    h_q) column, GB/s then TFLOPS. Returns the paths written; none where matplotlib is
    missing."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plots (grid_report.py draws them from the JSON)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for dtype in dtypes_of(results):
        points = [p for p in results["points"] if dtype_of(p) == dtype]
        suffix = "" if dtype == "bfloat16" else "_fp8"
        written += _plots(plt, results["meta"], points, dtype, stem + suffix)
    return written


def _plots(plt, meta, points, dtype, stem):
    rows = sorted({(p["varlen"], p["s_q"]) for p in points})
    cols = [(metric, unit, h_q) for metric, unit in (("gbps", "GB/s"), ("tflops", "TFLOPS"))
            for h_q in sorted({p["h_q"] for p in points})]
    s_ks = sorted({p["mean_s_k"] for p in points})
    fig, axes = plt.subplots(len(rows), len(cols), squeeze=False, sharex=True,
                             figsize=(max(6.0, 3.4 * len(cols)), 2.6 * len(rows) + 0.8),
                             layout="constrained")
    for (varlen, s_q), ax_row in zip(rows, axes):
        for (metric, unit, h_q), ax in zip(cols, ax_row):
            here = sorted((p for p in points if (p["varlen"], p["s_q"], p["h_q"]) ==
                           (varlen, s_q, h_q)), key=lambda p: p["mean_s_k"])
            if here:
                _panel(ax, here, metric, meta["copy"]["ceiling_gbps"], meta["layers"])
            ax.set_title(f"{unit}: {'varlen' if varlen else 'fixed'}, s_q={s_q}, h_q={h_q}",
                         fontsize=9)
    for ax in axes[-1]:
        ax.set_xticks(s_ks, [str(s) for s in s_ks])
        ax.set_xlabel("mean s_k")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=8,
               ncol=min(len(labels), 3 * len(cols)))
    fig.suptitle(f"FlashMLA decode, {meta['device']}, b={meta['batch']}, {dtype} cache")
    path = f"{stem}.png"
    save_png(fig, path, bbox_inches="tight")
    plt.close(fig)
    return [path]


def main():
    args = sys.argv[1:]
    if args[:1] == ["--merge"] and len(args) >= 3:
        path = args[1]
        reports = []
        for part in args[2:]:
            with open(part) as f:
                reports.append(json.load(f))
        results = merge(reports)
        write_json(results, path)
    elif len(args) == 1:
        path = args[0]
        with open(path) as f:
            results = json.load(f)
    else:
        sys.exit(__doc__)
    stem = path[:-len(".json")] if path.endswith(".json") else path
    write_markdown(results, stem + ".md")
    print("wrote", ", ".join([stem + ".md"] + write_plots(results, stem)))


if __name__ == "__main__":
    main()
