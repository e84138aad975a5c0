"""bench_sparse.py's results as JSON, a markdown report and a plot: per call, the sparse decode's
time against torch's and the dense decode's (against b); the step's µs per layer against b.

  python benchmarks/sparse_report.py --merge OUT PART.json [PART.json ...]
joins parts that ran separately into OUT.{json,md,png}; a point measured in a later part
replaces the earlier part's."""
import argparse
import json
import statistics

import step_report
from grid_report import _stats
from results_io import save_png, write_json
from timing import paired_ratios

# Per call, by device time at b = CALL_BAR_B: the call on MaskedIndices within CALL_BAR of
# torch's. Both hand the kernel the indices as they are; the call on raw indices also masks
# them, a pass torch's call does not make (FlashMLA's kernel skips -1 alone and has no
# programmatic dependent launch to overlap it with), so its ratio is reported beside with the
# mask's cost.
CALL_BAR, CALL_BAR_B = 1.03, 128
STEP_VARIANTS = (("jax_scan", "scan, alt."), ("jax_unrolled", "unrolled, alt."),
                 ("torch_graph", "torch graph"),
                 ("torch_graph_shared", "torch graph, schedule per step"))
JAX_STEPS = ("jax_scan", "jax_unrolled")
# --unguarded's bars by (b, layers): the unrolled step's cost over the same step of bare
# decodes (what the mask of the indices and the op's checks cost) at most this.
PROTECTION_BARS = {(1, 61): 0.02, (128, 61): 0.01}
UNGUARDED_TITLE = "## The cost of out-of-range protection in the step"


def _paired(record, impl, base, field):
    """impl's over base's per-repeat `field` samples (timed in turns): their median ratio."""
    ours, theirs = (record["impls"].get(name, {}).get(field + "_repeats") for name in (impl, base))
    return None if not ours or not theirs else paired_ratios(ours, theirs)[0]


def call_ratios(record):
    """The sparse call (and the call on MaskedIndices) over torch's, and the sparse call over
    the dense decode's, by wall clock and by device time, each the median of per-repeat
    ratios; None where a side was not timed."""
    return dict(vs_torch=_paired(record, "sparse", "torch", "us"),
                vs_torch_device=_paired(record, "sparse", "torch", "device_us"),
                premasked_vs_torch=_paired(record, "premasked", "torch", "us"),
                premasked_vs_torch_device=_paired(record, "premasked", "torch", "device_us"),
                sparse_over_dense=_paired(record, "sparse", "dense", "us"),
                sparse_over_dense_device=_paired(record, "sparse", "dense", "device_us"))


def call_bar_met(record, key="premasked_vs_torch_device"):
    """Whether the point meets the per-call bar (key "vs_torch_device": whether the call on
    raw indices, its mask included, does); None where it has none (b other than CALL_BAR_B,
    or no device ratio)."""
    if record["b"] != CALL_BAR_B or record.get(key) is None:
        return None
    return record[key] <= CALL_BAR


def mask_us(record):
    """The raw-index call's device µs over the call's on MaskedIndices (its mask of the
    indices), or None where either was not timed."""
    times = [record["impls"].get(name, {}).get("device_us") for name in ("sparse", "premasked")]
    return None if None in times else times[0] - times[1]


def best_graph_us(record, field="us"):
    """The faster torch graph's µs per layer (the jax steps' schedule is a constant of the
    program; the graph with get_mla_decoding_metadata makes one per step), or None where
    neither ran; field "queued_us" for the steps queued."""
    times = [record.get(f"{name}_{field}") for name, _ in STEP_VARIANTS
             if name.startswith("torch")]
    times = [t for t in times if t is not None]
    return min(times) if times else None


def step_ratios(record, field="us"):
    """{jax step: its µs per layer over the faster torch graph's}, where a graph ran; field
    "queued_us" for the steps queued."""
    graph = best_graph_us(record, field)
    if graph is None:
        return {}
    return {name: record[f"{name}_{field}"] / graph for name in JAX_STEPS
            if record.get(f"{name}_{field}") is not None}


def step_bar_met(record):
    """Whether every jax step is within step_report's bar of the faster graph (1.05 where its
    step takes >= 2 ms, else 1.15); None without one."""
    ratios = step_ratios(record)
    if not ratios:
        return None
    return max(ratios.values()) <= step_report.bar(dict(record, torch_graph_us=best_graph_us(record)))


def protection_bar_met(record):
    """Whether the protections' cost is within PROTECTION_BARS; None without a bar or a cost."""
    bar = PROTECTION_BARS.get((record["b"], record["layers"]))
    if bar is None or "unguarded_cost" not in record:
        return None
    return record["unguarded_cost"] <= bar


def _fmt(value, spec=".1f"):
    return "-" if value is None else format(value, spec)


def _yes(value):
    return "-" if value is None else ("yes" if value else "NO")


def _range_us(values):
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    return f"median {statistics.median(values):.1f} µs, range {min(values):.1f}–{max(values):.1f}"


def _time(record, impl):
    """'device (wall)' µs of one call, or '-'."""
    r = record["impls"].get(impl)
    if r is None:
        return "skipped" if impl in record["skipped"] else "-"
    return f"{_fmt(r.get('device_us'))} ({_fmt(r['us'])})"


def _pair(record, key):
    return f"{_fmt(record.get(key + '_device'), '.3f')} ({_fmt(record.get(key), '.3f')})"


def call_line(record):
    """One progress line."""
    return (f"{record['label']}: sparse {_time(record, 'sparse')} premasked "
            f"{_time(record, 'premasked')} torch {_time(record, 'torch')} dense "
            f"{_time(record, 'dense')} µs; vs torch {_pair(record, 'vs_torch')}, premasked "
            f"{_pair(record, 'premasked_vs_torch')}; sparse/dense "
            f"{_pair(record, 'sparse_over_dense')}")


def summary_lines(result):
    """The run's findings against its bars, one markdown bullet each."""
    calls, steps = result["per_call"], result["step"]
    at_bar = [r for r in calls if call_bar_met(r) is not None]
    identical = [r["checks"]["out_identical"] and r["checks"]["lse_identical"]
                 for r in calls if "out_identical" in r["checks"]]
    lines = []
    if calls:
        lines.append(f"- Per call, sparse / torch by device time: "
                     f"{_stats(r.get('vs_torch_device') for r in calls)}; by wall clock over "
                     f"batches: {_stats(r.get('vs_torch') for r in calls)}.")
        if at_bar:
            lines.append(f"- At b={CALL_BAR_B} by device time, on MaskedIndices (the indices "
                         f"handed to the kernel as they are, as torch's call hands them), "
                         f"premasked / torch: "
                         f"{_stats(r['premasked_vs_torch_device'] for r in at_bar)}; within "
                         f"{CALL_BAR} at {sum(call_bar_met(r) for r in at_bar)} of "
                         f"{len(at_bar)} points.")
            raw = [met for met in (call_bar_met(r, "vs_torch_device") for r in at_bar)
                   if met is not None]  # a point whose raw call failed has no ratio
            lines.append(f"- At b={CALL_BAR_B} on raw indices (the call masks them first), "
                         f"sparse / torch: {_stats(r['vs_torch_device'] for r in at_bar)}; "
                         f"within {CALL_BAR} at {sum(raw)} of {len(raw)} points; the mask "
                         f"{_range_us(mask_us(r) for r in at_bar)} a call.")
        if any(r.get("premasked_vs_torch_device") is not None for r in calls):
            lines.append(f"- premasked / torch by device time, all points: "
                         f"{_stats(r.get('premasked_vs_torch_device') for r in calls)}.")
        if identical:
            lines.append(f"- out and lse bit-identical to torch's at {sum(identical)} of "
                         f"{len(identical)} points.")
        for context in sorted({r["context"] for r in calls}):
            here = [r for r in calls if r["context"] == context]
            lines.append(f"- Sparse / dense at context {context}, by device time: "
                         f"{_stats(r.get('sparse_over_dense_device') for r in here)}; by wall "
                         f"clock: {_stats(r.get('sparse_over_dense') for r in here)}.")
    met = [step_bar_met(r) for r in steps if step_bar_met(r) is not None]
    if met:
        lines.append(f"- Step, jax_flashmla / torch graph by µs per layer: "
                     f"{_stats(v for r in steps for v in step_ratios(r).values())}; both jax "
                     f"steps within their bar at {sum(met)} of {len(met)} points.")
    queued = [v for r in steps for v in step_ratios(r, "queued_us").values()]
    if queued:
        lines.append(f"- Step queued (steps launched before one sync), jax_flashmla / torch "
                     f"graph: {_stats(queued)}.")
    guarded = [r for r in steps if "unguarded_cost" in r]
    if guarded:
        met = [m for m in map(protection_bar_met, guarded) if m is not None]
        costs = ", ".join(f"{100 * r['unguarded_cost']:+.2f}% at b={r['b']}" for r in guarded)
        within = f"; within its bar at {sum(met)} of {len(met)} points" if met else ""
        lines.append(f"- Out-of-range protection in the step (the unrolled step's cost over "
                     f"the same step of bare decodes): {costs}{within}; outs the same bit for "
                     f"bit at {sum(r['unguarded_identical'] for r in guarded)} of "
                     f"{len(guarded)} points.")
    if result["not_run"]:
        lines.append(f"- Not run (deadline): {', '.join(result['not_run'])}.")
    return lines


def _step_options(meta):
    """How the jax steps were compiled beyond their defaults, for the step table's text."""
    parts = [f"the scan {meta['scan_unroll']} layers an iteration"] if meta.get(
        "scan_unroll") else []
    parts += [f"{k}={v}" for k, v in (meta.get("xla_options") or {}).items()]
    return f" ({', '.join(parts)})" if parts else ""


def markdown(result):
    meta = result["meta"]
    lines = [f"# Sparse MLA decode (DeepSeek-V3.2), {meta['device']}, jax {meta['jax']}", "",
             f"{meta['date']}; sparse_mla_decode runs {meta['implementation']}; top-k "
             f"{meta['topk']} tokens of each request's context, softmax scale "
             f"{meta['softmax_scale']:.4g}.", "", "## Summary", "", *summary_lines(result)]
    if result["per_call"]:
        lines += [
            "", "## Per call", "",
            "µs per call by device time (the GPU's timestamps over batches queued behind a "
            "spinning kernel), and in brackets by wall clock over batches of calls; "
            f"{meta['rotations']} sets of (q, indices) in turn; sparse, premasked and torch "
            "timed in turns, dense in turns of its own. sparse: sparse_mla_decode "
            "jitted; premasked: the same on MaskedIndices made beforehand (its out and lse "
            "compared with sparse's); torch: sparse_decode_fwd from torch on the same q, cache "
            "and indices; "
            "dense: mla_decode over the whole context in bf16. Ratios: medians of per-repeat "
            f"ratios, device (wall). Bar: premasked / torch <= {CALL_BAR} by device time at "
            f"b={CALL_BAR_B}; mask: sparse's device µs over premasked's. Identical: sparse's out and lse bit for bit torch's, and "
            "premasked's sparse's.", "",
            "| b | context | h_q | s_q | sparse | torch | sparse / torch | premasked "
            "| premasked / torch | bar met | mask | dense | sparse / dense "
            "| out, lse identical |",
            "| " + " | ".join(["---"] * 14) + " |"]
        for r in result["per_call"]:
            checks = r["checks"]
            identical = (None if "out_identical" not in checks
                         else checks["out_identical"] and checks["lse_identical"]
                         and checks.get("premasked_identical", True))
            lines.append("| " + " | ".join(
                [str(r[k]) for k in ("b", "context", "h_q", "s_q")]
                + [_time(r, "sparse"), _time(r, "torch"), _pair(r, "vs_torch"),
                   _time(r, "premasked"), _pair(r, "premasked_vs_torch"),
                   _yes(call_bar_met(r)), _fmt(mask_us(r)), _time(r, "dense"),
                   _pair(r, "sparse_over_dense"), _yes(identical)]) + " |")
    if result["step"]:
        lines += [
            "", f"## A {meta['layers']}-layer decode step, µs per layer", "",
            "Wall clock of the median step / layers (GPU span per layer in brackets)"
            + (f", the variants timed in turns ({meta['step_rounds']} rounds)"
               if meta.get("step_rounds") else "")
            + ". The jax steps are called through AlternatingStep"
            + _step_options(meta) + "; the torch graph is sparse_decode_fwd "
            "per layer making its own schedule, captured in a CUDA graph, and the same with "
            "one get_mla_decoding_metadata per step (SGLang's; the jax steps' schedule is a "
            "constant of the program). "
            "Ratio: a jax step over the faster torch graph; bar 1.05 where that graph's step "
            "takes >= 2 ms, else 1.15. `caches`: distinct layer caches in the stacked cache (layer l "
            "reads cache l mod that many).", "",
            "| b | context | h_q | s_q | L | caches | "
            + " | ".join(label for _, label in STEP_VARIANTS)
            + " | scan ratio | unrolled ratio | bar | bar met | out identical |",
            "| " + " | ".join(["---"] * 15) + " |"]
        for r in result["step"]:
            ratios = step_ratios(r)
            identical = [r[k] for k in r if k.endswith("_out_identical")]
            lines.append("| " + " | ".join(
                [str(r[k]) for k in ("b", "context", "h_q", "s_q", "layers", "layer_caches")]
                + [f"{_fmt(r.get(name + '_us'))} ({_fmt(r.get(name + '_gpu_us'))})"
                   if name not in r["skipped"] else "skipped" for name, _ in STEP_VARIANTS]
                + [_fmt(ratios.get(name), ".3f") for name in JAX_STEPS]
                + [f"{step_report.bar(dict(r, torch_graph_us=best_graph_us(r))):.2f}"
                   if ratios else "-", _yes(step_bar_met(r)),
                   _yes(all(identical) if identical else None)]) + " |")
        if any(step_ratios(r, "queued_us") for r in result["step"]):
            lines += [
                "", "Queued: µs per layer with the steps launched before one sync (the GPU's "
                "time per step where the host launches ahead of it, as a serving loop that "
                "schedules the next step while the GPU runs this one); ratio over the faster "
                "torch graph queued.", "",
                "| b | " + " | ".join(label for _, label in STEP_VARIANTS)
                + " | scan ratio | unrolled ratio |", "| " + " | ".join(["---"] * 7) + " |"]
            for r in result["step"]:
                ratios = step_ratios(r, "queued_us")
                lines.append("| " + " | ".join(
                    [str(r["b"])] + [_fmt(r.get(name + "_queued_us")) for name, _ in STEP_VARIANTS]
                    + [_fmt(ratios.get(name), ".3f") for name in JAX_STEPS]) + " |")
    return "\n".join(lines + _unguarded_section(result)) + "\n"


def _unguarded_section(result):
    """The step points measured with --unguarded: the unrolled step against the same step of
    bare decodes, measured in the same run."""
    rows = [r for r in result["step"] if "unguarded_cost" in r]
    if not rows:
        return []
    bare = ("FlashMLA's custom call" if result["meta"]["implementation"] == "custom_call"
            else "the sparse reference (the custom call is CUDA only)")
    bars = ", ".join(f"+{100 * bar:g}% at b={b} over {layers} layers"
                     for (b, layers), bar in PROTECTION_BARS.items())
    lines = ["", UNGUARDED_TITLE, "",
             "The unrolled step (its layers' indices masked once, `mask_indices`, each layer's "
             f"`sparse_mla_decode` reading its row) against the same step with {bare} in place "
             "of `sparse_mla_decode` on the raw indices (no mask, no checks; the bench's "
             "indices are all in range), both through AlternatingStep. Measured in the same "
             "run, µs per layer (GPU span per layer in brackets). Cost: the median over the "
             "run's steps of the ratio of the two steps' times, a step of each per turn, their "
             "order alternating. Bar: "
             f"{bars}. Identical: the two steps' outs bit for bit.", "",
             "| b | context | h_q | s_q | L | caches | unguarded | sparse_mla_decode | cost "
             "| bar met | identical |", "| " + " | ".join(["---"] * 11) + " |"]
    for r in rows:
        lines.append("| " + " | ".join(
            [str(r[k]) for k in ("b", "context", "h_q", "s_q", "layers", "layer_caches")]
            + [f"{_fmt(r.get(name + '_us'))} ({_fmt(r.get(name + '_gpu_us'))})"
               for name in ("jax_unrolled_unguarded", "jax_unrolled")]
            + [f"{100 * r['unguarded_cost']:+.2f}%", _yes(protection_bar_met(r)),
               _yes(r["unguarded_identical"])]) + " |")
    return lines


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    calls = [r for r in result["per_call"] if r["h_q"] == max(x["h_q"] for x in result["per_call"])
             and r["s_q"] == 1] if result["per_call"] else []
    fig, (per_call, step) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, context in enumerate(sorted({r["context"] for r in calls})):
        points = sorted((r for r in calls if r["context"] == context), key=lambda r: r["b"])
        for impl, style in (("sparse", "o-"), ("torch", "s--"), ("dense", "^:")):
            shown = [(r["b"], r["impls"][impl]) for r in points if impl in r["impls"]]
            if shown:
                per_call.plot([b for b, _ in shown],
                              [t.get("device_us", t["us"]) for _, t in shown], style,
                              color=f"C{k}", markersize=3, label=f"{impl}, context {context}")
    per_call.set_title(f"one call, h_q={calls[0]['h_q']}, s_q=1" if calls else "one call")
    per_call.set_ylabel("µs per call (device time where measured)")
    for name, label in STEP_VARIANTS:
        shown = sorted((r["b"], r[name + "_us"]) for r in result["step"] if name + "_us" in r)
        if shown:
            step.plot(*zip(*shown), "o-", markersize=3, label=label)
    step.set_title(f"{result['meta']['layers']}-layer step")
    step.set_ylabel("µs per layer")
    for ax in (per_call, step):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        if ax.has_data():
            ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)  # the report is written after every point


def write_report(result, prefix):
    write_json(result, prefix + ".json")
    with open(prefix + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, prefix + ".png")


def merge(parts):
    """One result of parts: the first's meta; a point (by label) in a later part replaces the
    earlier one's; not_run less what a part measured."""
    merged = dict(parts[0])
    for key in ("per_call", "step"):
        latest = {}
        for part in parts:
            latest.update((r["label"], r) for r in part[key])
        merged[key] = list(latest.values())
    measured = {r["label"] for key in ("per_call", "step") for r in merged[key]}
    merged["not_run"] = sorted({label for part in parts for label in part["not_run"]} - measured)
    return merged


def _load(path):
    with open(path) as f:
        return json.load(f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge", nargs="+", required=True, metavar="PATH",
                        help="OUT prefix, then the parts' JSON files")
    out, *paths = parser.parse_args().merge
    write_report(merge([_load(path) for path in paths]), out)
