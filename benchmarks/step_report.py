"""bench_step.py's results as JSON, a markdown table and a plot (µs per layer against b).

  python benchmarks/step_report.py --merge OUT PART.json [PART.json ...]
joins parts that ran separately into OUT.{json,md,png}; a point measured in a later part
replaces the earlier part's."""
import argparse
import json

from results_io import save_png, write_json

VARIANTS = (("jax_scan", "jax_flashmla, stacked, lax.scan"),
            ("jax_scan_alternating", "jax_flashmla, stacked, lax.scan, AlternatingStep"),
            ("jax_unrolled", "jax_flashmla, stacked, unrolled"),
            ("jax_unrolled_alternating", "jax_flashmla, stacked, unrolled, AlternatingStep"),
            ("jax_per_layer", "jax_flashmla, a cache per layer"),
            ("torch_graph", "torch, CUDA graph"),
            ("torch_eager", "torch, eager"))
BAR_SHORT, BAR_LONG, LONG_STEP_US = 1.15, 1.05, 2000
SAFETY_TITLE = "## The cost of out-of-range protection and of value checks in the step"
# bench_step.py's (plain layout, the same with a protection, the protection's name).
SAFETY_PAIRS = (("unrolled_unguarded_alternating", "unrolled_alternating", "range checks"),
                ("unrolled", "unrolled_checked", "value_checks()"))


def bar(record):
    """The ratio to the torch graph that the point must meet: 1.05 where the graph's whole
    step takes at least 2 ms, 1.15 where it is shorter."""
    graph_step = record["torch_graph_us"] * record["layers"]
    return BAR_LONG if graph_step >= LONG_STEP_US else BAR_SHORT


def _ratio(record, key):
    value = record.get(key + "_us")
    return "-" if value is None else f"{value / record['torch_graph_us']:.3f}"


def _fmt(value):
    return "-" if value is None else f"{value:.1f}"


def markdown(result):
    rows = ("each layer's new rows are the step's inputs (--rows-from-inputs)"
            if result.get("rows_from_inputs") else "each layer's new rows made from the layer "
            "before")
    options = result.get("xla_options") or "none"
    sync = {"host_queue": "popping the slice of its last out that it pushed to a "
                          "jax_flashmla.serving.HostQueue (as a serving loop reads its sampled "
                          "tokens)",
            "block": "popping its HostQueue push and jax.block_until_ready on its out",
            None: "jax.block_until_ready on its out"}[result.get("sync")]
    lines = [f"# A model's decode step, µs per layer ({result['device']}, jax {result['jax']})",
             "", f"Step: {rows}; XLA options beyond each layout's: {options}; the scan "
             f"{result.get('scan_unroll', 1)} layers an iteration (lax.scan's unroll). The host "
             f"waits for each jitted step by {sync}; for the torch step by "
             "torch.cuda.synchronize.", "",
             "Wall clock of the median step / layers (GPU span per layer in brackets). `alt.`: "
             "the same compiled step called through jax_flashmla.serving.AlternatingStep. Ratio: "
             "jax_flashmla's stacked layouts through AlternatingStep against the torch CUDA "
             "graph; bar 1.05 where the graph's step takes >= 2 ms, else 1.15. `trivial` is the "
             "per-layer step with a fusion in place of each decode (what JAX costs for that "
             "many arrays).", "",
             "| b | s_k | h_q | s_q | cache | L | scan | scan, alt. | unrolled | unrolled, alt. "
             "| per layer | trivial | torch graph | torch eager | scan ratio | unrolled ratio "
             "| bar | out identical |",
             "| " + " | ".join(["---"] * 18) + " |"]
    for r in result["raw"]:
        cells = [str(r[k]) for k in ("b", "s_k", "h_q", "s_q")]
        cells += ["fp8" if r["dtype"] == "float8_e4m3fn" else "bf16", str(r["layers"])]
        for key, _ in VARIANTS[:5]:
            cells.append(f"{_fmt(r.get(key + '_us'))} ({_fmt(r.get(key + '_gpu_us'))})")
        cells.append(_fmt(r.get("jax_per_layer_trivial_us")))
        for key, _ in VARIANTS[5:]:
            cells.append(f"{_fmt(r.get(key + '_us'))} ({_fmt(r.get(key + '_gpu_us'))})")
        if "torch_graph_us" in r:
            identical = all(r[k] for k in r if k.endswith("_out_identical"))
            cells += [_ratio(r, "jax_scan_alternating"), _ratio(r, "jax_unrolled_alternating"),
                      f"{bar(r):.2f}", "yes" if identical else "NO"]
        else:
            cells += ["-", "-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + _queued_section(result["raw"])
                     + _safety_section(result["raw"])) + "\n"


QUEUED_TITLE = "## Steps queued: the GPU's time per step"
QUEUED = (("torch_graph", "torch graph"), ("jax_scan_alternating", "scan, alt."),
          ("jax_unrolled_alternating", "unrolled, alt."))


def _queued_section(raw):
    """µs per layer with all of a run's steps launched before one sync, and what a sync after
    each step adds to that, per step."""
    rows = [r for r in raw if all(key + "_queued_us" in r for key, _ in QUEUED)]
    if not rows:
        return []
    lines = ["", QUEUED_TITLE, "",
             "The same steps with all of a run's steps launched before one sync (the median of "
             "three runs), µs per layer: where the host launches a step faster than the GPU "
             "runs it, the GPU's time per step. `sync adds`: the synced step's wall clock less "
             "this, µs per step: the host's time before the GPU starts and after it ends.", "",
             "| b | s_k | h_q | s_q | cache | L | " + " | ".join(c for _, c in QUEUED)
             + " | unrolled ratio | " + " | ".join(f"sync adds, {c}" for _, c in QUEUED) + " |",
             "| " + " | ".join(["---"] * (7 + 2 * len(QUEUED))) + " |"]
    for r in rows:
        cells = [str(r[k]) for k in ("b", "s_k", "h_q", "s_q")]
        cells += ["fp8" if r["dtype"] == "float8_e4m3fn" else "bf16", str(r["layers"])]
        cells += [_fmt(r[key + "_queued_us"]) for key, _ in QUEUED]
        cells.append(f"{r['jax_unrolled_alternating_queued_us'] / r['torch_graph_queued_us']:.3f}")
        cells += [f"{(r[key + '_us'] - r[key + '_queued_us']) * r['layers']:.0f}"
                  for key, _ in QUEUED]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _safety_section(raw):
    """The points measured with --unguarded or --value-checks: the unrolled step with and
    without each, measured in the same run."""
    rows = [(r, plain, safe, name) for r in raw for plain, safe, name in SAFETY_PAIRS
            if f"jax_{plain}_us" in r and f"jax_{safe}_us" in r]
    if not rows:
        return []
    lines = ["", SAFETY_TITLE, "",
             "The unrolled step against the same step with the bare decode custom call in "
             "place of `mla_decode`, on the step's lengths and table as they are (no range "
             "check: out-of-range requests are not decoded empty, a stale metadata is not "
             "poisoned; both through AlternatingStep), and traced under `value_checks()` "
             "(checkified, the error thrown after each step; both called directly). Measured "
             "in the same run, µs per layer (GPU span per layer in brackets). Cost: the median over the run's steps of "
             "the ratio of the two steps' times, a step of each per turn.", "",
             "| b | s_k | h_q | s_q | L | protection | without | with | cost | out identical |",
             "| " + " | ".join(["---"] * 10) + " |"]
    for r, plain, safe, name in rows:
        identical = r.get(safe + "_out_identical", r["layouts_agree"])
        lines.append("| " + " | ".join(
            [str(r[k]) for k in ("b", "s_k", "h_q", "s_q", "layers")] + [name]
            + [f"{_fmt(r[f'jax_{key}_us'])} ({_fmt(r.get(f'jax_{key}_gpu_us'))})"
               for key in (plain, safe)]
            + [f"{100 * r[safe + '_cost']:+.2f}%",
               "yes" if identical else "NO"]) + " |")
    return lines


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["raw"] if r["s_q"] == 1 and r["dtype"] == "bfloat16"]
    s_ks, h_qs = sorted({r["s_k"] for r in rows}), sorted({r["h_q"] for r in rows})
    if not rows:
        return
    # A row of panels per h_q, a column per s_k.
    fig, axes = plt.subplots(len(h_qs), len(s_ks), figsize=(4.2 * len(s_ks), 3.4 * len(h_qs)),
                             squeeze=False)
    for ax, (h_q, s_k) in zip(axes.flat, [(h, s) for h in h_qs for s in s_ks]):
        points = sorted((r for r in rows if (r["s_k"], r["h_q"]) == (s_k, h_q)),
                        key=lambda r: r["b"])
        if not points:
            ax.set_visible(False)
            continue
        for key, label in VARIANTS:
            if all(key + "_us" in r for r in points):
                ax.plot([r["b"] for r in points], [r[key + "_us"] for r in points], "o-",
                        label=label, markersize=3)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"s_k={s_k}, h_q={h_q}, bf16")
        ax.set_xlabel("batch")
        ax.set_ylabel("µs per layer")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4,
               fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_png(fig, path)
    plt.close(fig)  # bench_step writes the report after every point


def write_report(result, prefix):
    write_json(result, prefix + ".json")  # without "records": records_by_layout(raw) has them
    with open(prefix + ".md", "w") as f:
        f.write(markdown(result))
    plot(result, prefix + ".png")


def merge(parts):
    """One result of parts; a point (b, s_k, h_q, s_q, dtype) in a later part replaces its
    records in the earlier ones. "records" (bench_step.records_by_layout of "raw") only where
    every part has them: the committed results hold "raw" alone."""
    merged = dict(parts[0])
    point = lambda r: (r["s_k"], r["dtype"], r["s_q"], r["h_q"], r["b"])
    for key in ("records", "raw"):
        if not all(key in part for part in parts):
            merged.pop(key, None)
            continue
        latest = {}
        for part in parts:
            by_point = {}
            for r in part[key]:
                by_point.setdefault(point(r), []).append(r)
            latest.update(by_point)
        merged[key] = [r for p in sorted(latest) for r in latest[p]]
    return merged


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge", nargs="+", required=True, metavar="PATH",
                        help="OUT prefix, then the parts' JSON files")
    args = parser.parse_args()
    parts = []
    for path in args.merge[1:]:
        with open(path) as f:
            parts.append(json.load(f))
    write_report(merge(parts), args.merge[0])
