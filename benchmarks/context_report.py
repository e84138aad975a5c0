"""bench_context.py's results as JSON, a markdown report and a plot: per family and b the layer's
decode time and its cache bytes per token against the context, and how each grows between the
two longest contexts measured (the slope of log time, or log bytes, over log context); and the
indexer calls' device time against their HBM floor, with the bar they are held to."""
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
# The indexer points: the call each times.
INDEXER_CALLS = dict(v32_indexer="indexer_decode (V3.2)", v4_indexer="v4_indexer_select (V4)")
# Peak HBM bandwidth in bytes/s by the device's name (jax's device_kind): an indexer point's
# floor is its index keys' bytes over it.
HBM_BYTES_PER_S = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}
# The product's bar: an indexer call at >= BAR_ENTRIES keys a request and b >= BAR_BATCH takes
# at most BAR times its floor in device time.
BAR, BAR_ENTRIES, BAR_BATCH = 1.6, 65536, 16


def label(family, b, context):
    return f"{family}/b{b}/ctx{context}"


def indexer_label(family, b, entries):
    return f"{family}/b{b}/entries{entries}"


def _label(r):
    if r["family"] in INDEXER_CALLS:
        return indexer_label(r["family"], r["b"], r["entries"])
    return label(r["family"], r["b"], r["context"])


def _layers(points):
    return [r for r in points if r["family"] in READS]


def _indexers(points):
    return [r for r in points if r["family"] in INDEXER_CALLS]


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
    rows, points = [], _layers(result["points"])
    families = list(dict.fromkeys(r["family"] for r in points))
    batches = sorted({r["b"] for r in points})
    for family in families:
        for b in batches + [None]:
            here = sorted((r for r in points if r["family"] == family
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
    last = {r["family"]: r for r in sorted(_layers(result["points"]), key=lambda r: r["context"])}
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


def floors(result):
    """label -> dict(family, b, entries, floor_us, ratio, bar) of each indexer point measured:
    floor_us its index keys' bytes over the device's peak bandwidth (None on a device
    HBM_BYTES_PER_S does not name), ratio its device time over that (None without either), bar
    whether ratio <= BAR where the point is held to the bar (None where not, or no ratio)."""
    bandwidth = HBM_BYTES_PER_S.get(result["meta"]["device"])
    rows = {}
    for r in _indexers(result["points"]):
        if "us" not in r:
            continue
        floor = r["index_bytes"] / bandwidth * 1e6 if bandwidth else None
        ratio = r["device_us"] / floor if floor and "device_us" in r else None
        held = r["entries"] >= BAR_ENTRIES and r["b"] >= BAR_BATCH and ratio is not None
        rows[_label(r)] = dict(family=r["family"], b=r["b"], entries=r["entries"],
                               floor_us=floor, ratio=ratio, bar=ratio <= BAR if held else None)
    return rows


def bar_lines(result):
    """The summary's bar lines: per indexer call, whether its points held to the bar meet it."""
    device, floor = result["meta"]["device"], floors(result)
    if not floor:
        return []
    if device not in HBM_BYTES_PER_S:
        return [f"- No HBM floor: {device} is not in context_report.HBM_BYTES_PER_S (peak "
                f"bandwidth by device name), so no ratio to it and no bar judged."]
    lines = []
    for family, call in INDEXER_CALLS.items():
        judged = sorted((row for row in floor.values()
                         if row["family"] == family and row["bar"] is not None),
                        key=lambda row: row["ratio"])
        if not judged:
            continue
        met = sum(row["bar"] for row in judged)
        best, worst = judged[0], judged[-1]
        lines.append(f"- {call}: bar {BAR}× its floor (device time, >= {BAR_ENTRIES} keys a "
                     f"request, b >= {BAR_BATCH}) {'met' if met == len(judged) else 'NOT met'}: "
                     f"within it at {met} of {len(judged)} points, ×{best['ratio']:.2f} (b="
                     f"{best['b']}, {best['entries']} keys) to ×{worst['ratio']:.2f} (b="
                     f"{worst['b']}, {worst['entries']} keys).")
    return lines


def point_line(r):
    if "skipped" in r:
        return f"{_label(r)}: skipped: {r['skipped']}"
    if r["family"] in INDEXER_CALLS:
        return (f"{_label(r)}: {r['us']:.1f} µs/call (device {_fmt(r.get('device_us'))}; "
                f"scoring {_fmt(r.get('scoring_us'))}, top-k {_fmt(r.get('topk_us'))}), "
                f"{r['copies']} copies, {r['point_s']} s")
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


def indexer_table(result):
    rows = ["| call | b | entries | µs (wall) | µs (device) | scoring µs | top-k µs | rest µs | "
            f"floor µs | × floor | bar {BAR} | selected all |", "| --- " * 12 + "|"]
    floor = floors(result)
    measured = sorted((r for r in _indexers(result["points"]) if "us" in r),
                      key=lambda r: (r["family"], r["b"], r["entries"]))
    for r in measured:
        f = floor[_label(r)]
        parts = [r.get(k) for k in ("device_us", "scoring_us", "topk_us")]
        rest = parts[0] - parts[1] - parts[2] if None not in parts else None
        rows.append(f"| {r['family']} | {r['b']} | {r['entries']} | {_fmt(r['us'])} | "
                    f"{' | '.join(_fmt(p) for p in parts)} | {_fmt(rest)} | "
                    f"{_fmt(f['floor_us'])} | {_fmt(f['ratio'], '.2f')} | {_yes(f['bar'])} | "
                    f"{_yes(r.get('selected_all'))} |")
    return rows


def gaps(result):
    """Lines on what a run left out: points skipped or failed, times not measured, not run."""
    lines = []
    for r in result["points"]:
        if "skipped" in r:
            lines.append(f"- Skipped {_label(r)}: {r['skipped']}.")
        elif "device_time_failed" in r:
            lines.append(f"- {_label(r)}: no device time ({r['device_time_failed']}).")
        elif "kernel_split_failed" in r:
            lines.append(f"- {_label(r)}: no kernel split ({r['kernel_split_failed']}).")
    lines += [f"- Failed at {name}: {why}" for name, why in result["failed"].items()]
    if result["not_run"]:
        lines.append(f"- Not run (deadline): {', '.join(result['not_run'])}.")
    return lines


def markdown(result):
    meta = result["meta"]
    layers, indexers = _layers(result["points"]), _indexers(result["points"])
    title = ("Per-layer decode against the context" if layers
             else "The indexer calls against their HBM floor")
    what = ("one layer's attention ops for one new token a request, over caches holding the "
            "context; " if layers else "")
    lines = [f"# {title} ({meta['device']}, jax {meta['jax']})", "",
             "From benchmarks/bench_context.py (its docstring says what each figure is): "
             f"{what}decodes {meta['implementation']}, indexers "
             f"{meta['indexer_implementation']}; {meta['date']}."]
    if layers:
        lines += ["", "## How each grows", "", *growth_lines(result)]
    if indexers:
        calls = "; ".join(f"{family} {call}" for family, call in INDEXER_CALLS.items())
        lines += ["", "## The indexer against its HBM floor", "",
                  f"The call alone ({calls}), {meta['index_heads']} index heads, top "
                  f"{meta['v32_topk']} (V3.2) and {meta['csa_topk']} (V4), one new token a "
                  "request. The floor: the index keys' bytes (132 an entry) over the device's "
                  "peak HBM bandwidth. Scoring and top-k: the custom call's two kernels (the "
                  "top-k's time beside the scoring's, where its launch overlaps it, not "
                  "counted); the rest: XLA's own kernels and the gaps between them.", "",
                  *bar_lines(result)]
    left_out = gaps(result)
    if left_out:
        lines += ["", "## Left out", "", *left_out]
    if layers:
        families = list(dict.fromkeys(r["family"] for r in layers))
        layers.sort(key=lambda r: (families.index(r["family"]), r["b"], r["context"]))
        lines += ["", "## The points", "", *table(layers)]
    if indexers:
        lines += ["", "## The indexer points", "", *indexer_table(result)]
    return "\n".join(lines + [""])


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points = [r for r in _layers(result["points"]) if "us" in r]
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
    """OUT.json (with the growth figures), OUT.md (with the indexers' floors) and (with png
    and a layer measured) OUT.png."""
    write_json(dict(result, growth=growth(result)), out + ".json")
    with open(out + ".md", "w") as f:
        f.write(markdown(result))
    if png and any("us" in r for r in _layers(result["points"])):
        plot(result, out + ".png")
