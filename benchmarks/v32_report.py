"""bench_v32_decode.py's results as JSON, a markdown report and a plot: per point the V3.2 step
(indexer + sparse decode), the indexer alone and the dense step, µs per layer; V3.2 / dense, the
indexer's share, and the bar.

  python benchmarks/v32_report.py --merge OUT PART.json [PART.json ...]
joins parts that ran separately into OUT.{json,md,png}; a point measured in a later part
replaces the earlier part's."""
import argparse

import sparse_report
from grid_report import _stats
from results_io import save_png, write_json
from sparse_report import _fmt, _load, _yes
from timing import paired_ratios

# At context BAR_CONTEXT and b = BAR_B: the V3.2 step per layer at most BAR x the dense one's.
BAR, BAR_CONTEXT, BAR_B = 0.4, 131072, 16
# The steps in the report's order; a record holds f"{name}_us", f"{name}_us_repeats" (µs per
# layer of each turn) and, on a GPU, f"{name}_gpu_us" of each.
STEPS = ("v32", "indexer_only", "dense")
LABELS = dict(v32="V3.2 (indexer + sparse)", indexer_only="indexer only", dense="dense bf16")


def _paired(record, numerator, denominator):
    """The median over turns of numerator's step time over denominator's (a step of each per
    turn), or None where either was not timed."""
    ours, theirs = (record.get(f"{name}_us_repeats") for name in (numerator, denominator))
    return None if not ours or not theirs else paired_ratios(ours, theirs)[0]


def _gpu(record, numerator, denominator):
    """numerator's GPU span per layer over denominator's, or None without both."""
    ours, theirs = (record.get(f"{name}_gpu_us") for name in (numerator, denominator))
    return None if ours is None or not theirs else ours / theirs


def ratios(record):
    """V3.2's step over the dense one's and the indexer's share of V3.2's (the indexer-only
    step over V3.2's), by wall clock (medians of per-turn ratios) and by the GPU's span."""
    return dict(v32_over_dense=_paired(record, "v32", "dense"),
                indexer_share=_paired(record, "indexer_only", "v32"),
                v32_over_dense_gpu=_gpu(record, "v32", "dense"),
                indexer_share_gpu=_gpu(record, "indexer_only", "v32"))


def bar_met(record):
    """Whether the point meets the bar (V3.2 / dense by wall clock at most BAR); None at any
    other point than (BAR_CONTEXT, BAR_B), or without the ratio."""
    if (record["context"], record["b"]) != (BAR_CONTEXT, BAR_B) \
            or record.get("v32_over_dense") is None:
        return None
    return record["v32_over_dense"] <= BAR


def _time(record, name):
    """'wall (GPU span)' µs per layer of one step."""
    return f"{_fmt(record.get(name + '_us'))} ({_fmt(record.get(name + '_gpu_us'))})"


def _pair(record, key):
    """'wall (GPU span)' of a ratio."""
    return f"{_fmt(record.get(key), '.3f')} ({_fmt(record.get(key + '_gpu'), '.3f')})"


def point_line(record):
    """One progress line."""
    return (f"{record['label']}: " + ", ".join(f"{name} {_time(record, name)}" for name in STEPS)
            + f" µs/layer; v32/dense {_pair(record, 'v32_over_dense')}; indexer share "
            f"{_pair(record, 'indexer_share')}; {record['point_s']} s")


def summary_lines(result):
    """The run's findings, one markdown bullet each."""
    points, lines = result["step"], []
    for context in sorted({r["context"] for r in points}):
        here = [r for r in points if r["context"] == context]
        lines.append(f"- Context {context}: V3.2 / dense per layer by wall clock "
                     f"{_stats(r.get('v32_over_dense') for r in here)}, by GPU span "
                     f"{_stats(r.get('v32_over_dense_gpu') for r in here)}; the indexer's "
                     f"share of the V3.2 step {_stats(r.get('indexer_share') for r in here)} "
                     f"(GPU span {_stats(r.get('indexer_share_gpu') for r in here)}).")
    at_bar = [r for r in points if bar_met(r) is not None]
    for r in at_bar:
        lines.append(f"- The bar, at context {BAR_CONTEXT} and b={BAR_B}: V3.2 / dense "
                     f"{r['v32_over_dense']:.3f} by wall clock (GPU span "
                     f"{_fmt(r.get('v32_over_dense_gpu'), '.3f')}) against <= {BAR}: "
                     f"{'met' if bar_met(r) else 'NOT met'}.")
    if not at_bar:
        lines.append(f"- The bar (context {BAR_CONTEXT}, b={BAR_B}): not measured in this run.")
    if any(not r["outs_finite"] for r in points):
        lines.append("- Non-finite outs at: " + ", ".join(
            r["label"] for r in points if not r["outs_finite"]) + ".")
    for label, error in result["failed"].items():
        lines.append(f"- Failed at {label}: {error}")
    if result["not_run"]:
        lines.append(f"- Not run (deadline): {', '.join(result['not_run'])}.")
    return lines


def markdown(result):
    meta = result["meta"]
    lines = [
        f"# DeepSeek-V3.2's decode step against the dense MLA decode, {meta['device']}, "
        f"jax {meta['jax']}", "",
        f"{meta['date']}; {meta['layers']} layers a step under lax.scan "
        f"({meta['scan_unroll']} an iteration), each step called through AlternatingStep and "
        f"synced by its HostQueue; the indexer ({meta['index_heads']} heads, top "
        f"{meta['topk']}) running {meta.get('indexer_implementation', 'reference')}, "
        f"sparse_mla_decode running "
        f"{meta['sparse_implementation']}, mla_decode its custom call; {meta['steps']} turns, "
        "a step of each per turn.", "", "## Summary", "", *summary_lines(result)]
    if result["step"]:
        lines += [
            "", "## Per point, µs per layer", "",
            "Wall clock of the median step / layers (the GPU's span per layer in brackets). "
            "V3.2: per layer the indexer over the index-key cache, then the sparse decode over "
            "the tokens it picked; indexer only: the same with a fusion in place of the sparse "
            "decode; dense: mla_decode over the whole context in bf16. Ratios: medians of "
            "per-turn ratios (GPU span's ratio in brackets); the indexer's share is the "
            f"indexer-only step over V3.2's. Bar: V3.2 / dense <= {BAR} by wall clock at "
            f"context {BAR_CONTEXT}, b={BAR_B}. `caches`: distinct layer caches of the dense "
            "step, of the V3.2 steps (layer l reads cache l mod that many).", "",
            "| b | context | h_q | s_q | L | caches | " + " | ".join(LABELS[n] for n in STEPS)
            + " | V3.2 / dense | indexer share | bar met | outs finite |",
            "| " + " | ".join(["---"] * 13) + " |"]
        for r in result["step"]:
            lines.append("| " + " | ".join(
                [str(r[k]) for k in ("b", "context", "h_q", "s_q", "layers")]
                + [f"{r['dense_caches']}, {r['v32_caches']}"]
                + [_time(r, name) for name in STEPS]
                + [_pair(r, "v32_over_dense"), _pair(r, "indexer_share"), _yes(bar_met(r)),
                   _yes(r["outs_finite"])]) + " |")
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["step"]
    fig, (times, ratio) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k, context in enumerate(sorted({r["context"] for r in points})):
        here = sorted((r for r in points if r["context"] == context), key=lambda r: r["b"])
        for name, style in zip(STEPS, ("o-", "s--", "^:")):
            times.plot([r["b"] for r in here], [r[name + "_us"] for r in here], style,
                       color=f"C{k}", markersize=3, label=f"{LABELS[name]}, context {context}")
        shown = [(r["b"], r["v32_over_dense"]) for r in here if r["v32_over_dense"] is not None]
        if shown:
            ratio.plot(*zip(*shown), "o-", color=f"C{k}", markersize=3,
                       label=f"context {context}")
    ratio.axhline(BAR, color="grey", linestyle="--", linewidth=1,
                  label=f"bar at {BAR_CONTEXT}, b={BAR_B}")
    times.set_title(f"{result['meta']['layers']}-layer step")
    times.set_ylabel("µs per layer (wall clock)")
    times.set_yscale("log")
    ratio.set_title("V3.2 / dense")
    ratio.set_ylabel("per-turn ratio, median")
    for ax in (times, ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
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
    """sparse_report.merge's rule over the step points: the first part's meta; a point (by
    label) in a later part replaces the earlier one's; not_run and failed less what a part
    measured."""
    merged = sparse_report.merge([dict(part, per_call=[]) for part in parts])
    del merged["per_call"]
    measured = {r["label"] for r in merged["step"]}
    merged["failed"] = {label: error for part in parts for label, error in part["failed"].items()
                        if label not in measured}
    return merged


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge", nargs="+", required=True, metavar="PATH",
                        help="OUT prefix, then the parts' JSON files")
    out, *paths = parser.parse_args().merge
    write_report(merge([_load(path) for path in paths]), out)
