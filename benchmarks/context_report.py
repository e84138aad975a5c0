"""bench_context.py's results as JSON, a markdown report and a plot: per family and b the layer's
decode time and its cache bytes per token against the context, and how each grows between the
two longest contexts measured (the slope of log time, or log bytes, over log context)."""
import math

from results_io import save_png, write_json
from sparse_report import _fmt, _yes

# What each family's layer reads at a context of n tokens: why its time grows as it does.
READS = dict(
    dense_bf16="reads all n tokens' bf16 rows",
    dense_fp8="reads all n tokens' FP8 rows",
    v32="scores all n index keys, then reads its top {v32_topk} tokens",
    v4_hca="reads all n / 128 entries and the 128-token window",
    v4_csa="scores n / 4 entries' index keys, then reads its top {csa_topk} and the window",
    v4_sliding="reads the 128-token window alone, whatever n")


def label(family, b, context):
    return f"{family}/b{b}/ctx{context}"


def _label(r):
    return label(r["family"], r["b"], r["context"])


def _time(record):
    """The point's time per call: the device's where measured, else the wall clock's."""
    return record.get("device_us", record.get("us"))


def trend(slope):
    """Words for a slope of log y over log context."""
    for bound, words in ((1.2, "grows faster than linearly"), (0.8, "grows ~linearly"),
                         (0.2, "grows sublinearly"), (-0.2, "flat"), (-0.8, "falls")):
        if slope >= bound:
            return words
    return "falls ~1/context (a fixed cost spread over more tokens)"


def _slope(a, b, key):
    return math.log(b[key] / a[key]) / math.log(b["context"] / a["context"])


def growth(result):
    """Per family and b (and per family for the bytes, which b does not change), between the
    two longest contexts measured: dict(family, b (None for bytes), what, contexts, values,
    slope, trend)."""
    rows = []
    families = list(dict.fromkeys(r["family"] for r in result["points"]))
    batches = sorted({r["b"] for r in result["points"]})
    for family in families:
        for b in batches + [None]:
            here = sorted((r for r in result["points"] if r["family"] == family
                           and (b is None or r["b"] == b) and "us" in r),
                          key=lambda r: r["context"])
            if b is None:  # the bytes: one point a context
                here = list({r["context"]: r for r in here}.values())
            if len(here) < 2:
                continue
            first, last = here[-2:]
            key = "bytes_per_token" if b is None else (
                "device_us" if "device_us" in first and "device_us" in last else "us")
            slope = _slope(first, last, key)
            rows.append(dict(family=family, b=b, what=key, contexts=[first["context"],
                                                                     last["context"]],
                             values=[first[key], last[key]], slope=round(slope, 3),
                             trend=trend(slope)))
    return rows


def _bytes_why(r):
    """A point's bytes a token split into what grows with the context and what a request holds
    whatever its context."""
    fixed = r["window_bytes"] + r["state_bytes"]
    grows = r["pages_bytes_per_token"] - r["window_bytes"] / r["context"]
    if not fixed:
        return f"{grows:.2f} B a token, nothing fixed"
    return (f"{grows:.2f} B a token plus a fixed {fixed:,} B a request (window ring "
            f"{r['window_bytes']:,}, compressor states {r['state_bytes']:,})")


def growth_lines(result):
    meta, lines = result["meta"], []
    last = {r["family"]: r for r in sorted(result["points"], key=lambda r: r["context"])}
    for g in growth(result):
        (c0, c1), (v0, v1) = g["contexts"], g["values"]
        if g["b"] is None:
            who, unit, why = g["family"], "B/token", _bytes_why(last[g["family"]])
        else:
            who, why = f"{g['family']}, b={g['b']}", READS[g["family"]].format(**meta)
            unit = "µs (device)" if g["what"] == "device_us" else "µs (wall clock)"
        lines.append(f"- {who}: {v0:.2f} → {v1:.2f} {unit} from {c0} to {c1} tokens "
                     f"(×{v1 / v0:.3g}, slope {g['slope']:.2f}): {g['trend']}; {why}.")
    return lines


def point_line(r):
    if "skipped" in r:
        return f"{_label(r)}: skipped: {r['skipped']}"
    return (f"{_label(r)}: {r['us']:.1f} µs/call (device {_fmt(r.get('device_us'))}), "
            f"{r['bytes_per_token']:.1f} B/token (arrays {r['measured_bytes_per_token']:.1f}), "
            f"{r['copies']} copies, {r['point_s']} s")


def table(points):
    rows = ["| family | b | context | heads | µs a call (wall) | µs a call (device) | B/token "
            "(pages and states) | pages B/token (layout) | pages B/token (arrays) | window "
            "B/request | state B/request | copies | out finite |", "| --- " * 13 + "|"]
    for r in points:
        rows.append(
            f"| {r['family']} | {r['b']} | {r['context']} | {r['heads']} | {_fmt(r.get('us'))} "
            f"| {_fmt(r.get('device_us'))} | {r['bytes_per_token']:.2f} | "
            f"{r['pages_bytes_per_token']:.2f} | {_fmt(r.get('measured_bytes_per_token'), '.2f')}"
            f" | {r['window_bytes']} | {r['state_bytes']} | {r['copies']} | "
            f"{_yes(r.get('out_finite'))} |")
    return rows


def markdown(result):
    meta = result["meta"]
    lines = [f"# Per-layer decode against the context ({meta['device']}, jax {meta['jax']})", "",
             "From benchmarks/bench_context.py (its docstring says what each figure is): one "
             "layer's attention ops for one new token a request, over caches holding the "
             f"context; decodes {meta['implementation']}, indexers "
             f"{meta['indexer_implementation']}; {meta['date']}.", "",
             "## How each grows", "", *growth_lines(result)]
    for r in result["points"]:
        if "skipped" in r:
            lines.append(f"- Skipped {_label(r)}: {r['skipped']}.")
        elif "device_time_failed" in r:
            lines.append(f"- {_label(r)}: no device time ({r['device_time_failed']}).")
    lines += [f"- Failed at {name}: {why}" for name, why in result["failed"].items()]
    if result["not_run"]:
        lines.append(f"- Not run (deadline): {', '.join(result['not_run'])}.")
    families = list(dict.fromkeys(r["family"] for r in result["points"]))
    points = sorted(result["points"],
                    key=lambda r: (families.index(r["family"]), r["b"], r["context"]))
    return "\n".join(lines + ["", "## The points", "", *table(points), ""])


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = [r for r in result["points"] if "us" in r]
    families = list(dict.fromkeys(r["family"] for r in points))
    batches = sorted({r["b"] for r in points})
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.5, 3.4))
    for i, family in enumerate(families):
        colour = f"C{i}"
        for b, style in zip(batches, ("-", "--", ":")):
            here = sorted((r["context"], _time(r)) for r in points
                          if r["family"] == family and r["b"] == b)
            if here:
                    left.plot(*zip(*here), style, marker="o", color=colour,
                          label=f"{family} b={b}")
        here = sorted({r["context"]: r["bytes_per_token"] for r in points
                       if r["family"] == family}.items())
        right.plot(*zip(*here), marker="o", color=colour, label=family)
    for ax, ylabel in ((left, "µs a layer-call (device, else wall clock)"),
                       (right, "cache bytes per token per layer")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=6, ncol=2, loc="upper left")
    fig.suptitle(f"One layer's decode against the context, {result['meta']['device']}")
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def write_report(result, out, png=True):
    """OUT.json (with the growth figures), OUT.md and (with png) OUT.png."""
    write_json(dict(result, growth=growth(result)), out + ".json")
    with open(out + ".md", "w") as f:
        f.write(markdown(result))
    if png and any("us" in r for r in result["points"]):
        plot(result, out + ".png")
