"""bench_v4.py's results as a markdown report and a plot: the 43-layer step's µs per layer
against b beside torch's CUDA graphs (with the indexer, with random picks, the decodes alone),
the decode's cost by head count, the prefill against torch's."""
from results_io import save_png

STEP_VARIANTS = (("jax", "jax_flashmla"), ("torch_graph", "torch graph"),
                 ("torch_graph_shared", "torch graph, shared schedule"))
# bench_v4's step parts: (result key, what its rows are, plot line style)
STEP_PARTS = (("indexer", "Step with the indexer", "-"), ("step", "Step, random picks", "--"),
              ("decode", "Decodes alone", ":"))


def _yes(value):
    return "" if value is None else ("yes" if value else "no")


def step_table(records, selections=False):
    """selections: a column for whether the last CSA layer's selection equals torch's."""
    extra = " selection identical |" if selections else ""
    rows = ["| b | " + " | ".join(label for _, label in STEP_VARIANTS)
            + " | ratio | bar | queued: " + " | queued: ".join(l for _, l in STEP_VARIANTS)
            + " | queued ratio | out identical |" + extra + " windows identical |",
            "| --- " * (2 * len(STEP_VARIANTS) + 6 + selections) + "|"]
    for r in records:
        cells = [str(r.get(f"{name}_us", "")) for name, _ in STEP_VARIANTS]
        queued = [str(r.get(f"{name}_queued_us", "")) for name, _ in STEP_VARIANTS]
        best = r.get("torch_best")
        chosen = f" {_yes(r.get(f'{best}_selection_identical'))} |" if selections else ""
        rows.append(f"| {r['b']} | " + " | ".join(cells)
                    + f" | {r.get('ratio', '')} | {r.get('bar', '')} | " + " | ".join(queued)
                    + f" | {r.get('queued_ratio', '')} | {_yes(r.get(f'{best}_out_identical'))}"
                    + f" |{chosen} {_yes(r.get('windows_identical'))} |")
    return rows


def heads_table(result):
    names = sorted({n for r in result["heads"] for n in r["us"]},
                   key=lambda n: (n.split("_")[0], int(n.split("_h")[1])))
    rows = ["| b | " + " | ".join(names) + " | " + " | ".join(
        f"{n} / jax_h64" for n in names) + " |", "| --- " * (2 * len(names) + 1) + "|"]
    for r in result["heads"]:
        rows.append(f"| {r['b']} | " + " | ".join(str(r["us"].get(n, "")) for n in names)
                    + " | " + " | ".join(str(r.get("cost_vs_h64", {}).get(n, ""))
                                         for n in names) + " |")
    return rows


def prefill_table(result):
    rows = ["| tokens | keys | h_q | topk | jax µs | torch µs | speed vs torch (median, "
            "range) | bar | jax, no command buffers µs | host µs to issue: jax, torch | device "
            "µs: jax, torch | device speed vs torch |", "| --- " * 12 + "|"]
    both = lambda sides: f"{sides.get('jax', '')}, {sides.get('torch', '')}" if sides else ""
    for r in result["prefill"]:
        speed = r.get("speed_vs_torch")
        shown = "" if speed is None else f"{speed[0]} ({speed[1]}–{speed[2]})"
        rows.append(f"| {r['tokens']} | {r['keys']} | {r['h_q']} | {r['topk']} | "
                    f"{r['us'].get('jax', '')} | {r['us'].get('torch', '')} | {shown} | "
                    f"{r.get('bar', '')} | {r['us'].get('jax_thunks', '')} | "
                    f"{both(r.get('host_us'))} | "
                    f"{both(r.get('device_us'))} | {r.get('device_speed_vs_torch', '')} |")
    return rows


def prefill_kernel_lines(result):
    """Each prefill point's kernels, µs a call, by side."""
    lines = []
    for r in result["prefill"]:
        for name, kernels in r.get("kernels_us", {}).items():
            lines.append(f"- h_q {r['h_q']}, topk {r['topk']}, {name}: " + "; ".join(
                f"`{kernel}` {us}" for kernel, us in kernels.items()))
        if "device_time_failed" in r:
            lines.append(f"- h_q {r['h_q']}, topk {r['topk']}: no device time "
                         f"({r['device_time_failed']})")
    return lines


def summary_lines(result):
    """The step with the indexer against the bars first (the product's step), then the
    other parts."""
    lines = []
    judged = [r for r in result.get("indexer", []) if "ratio" in r]
    if judged:
        lines.append("- The step with the indexer against the bars (1.15 at b = 1, 1.05 at "
                     "b >= 16):" + ",".join(f" b={r['b']} {r['ratio']} "
                                f"({'met' if r['ratio'] <= r['bar'] else 'not met'})"
                                for r in judged) + ".")
    for key, what, _ in STEP_PARTS:
        for r in result.get(key, []):
            if "ratio" not in r:
                continue
            best = r["torch_best"]
            selection = (f"; selection identical: {_yes(r.get(best + '_selection_identical'))}"
                         if key == "indexer" else "")
            lines.append(f"- {what} b={r['b']}: {r['jax_us']} µs a layer against "
                         f"{r[best + '_us']} ({best}), ratio {r['ratio']} "
                         f"(bar {r['bar']}: {'met' if r['ratio'] <= r['bar'] else 'not met'}); "
                         f"queued {r['queued_ratio']}; out identical: "
                         f"{_yes(r.get(best + '_out_identical'))}{selection}.")
    for r in result["prefill"]:
        if "speed_vs_torch" in r:
            speed = r["speed_vs_torch"][0]
            us = r["us"]
            thunks = (f"; without command buffers {round(us['torch'] / us['jax_thunks'], 4)}x"
                      if "jax_thunks" in us and "torch" in us else "")
            device = (f"; device time {r['device_speed_vs_torch']}x"
                      if "device_speed_vs_torch" in r else "")
            lines.append(f"- Prefill h_q {r['h_q']} topk {r['topk']}: {speed}x torch's speed "
                         f"(bar 0.95: {'met' if speed >= 0.95 else 'not met'}){thunks}{device}.")
    for r in result["heads"]:
        cost = r.get("cost_vs_h64", {})
        if "jax_h16" not in cost:
            continue
        lines.append(f"- Heads b={r['b']}: 16 heads cost {cost.get('jax_h16')}x and 32 heads "
                     f"{cost.get('jax_h32')}x the 64-head call (padded to 64).")
    if result["not_run"]:
        lines.append(f"- Not run (deadline): {', '.join(result['not_run'])}.")
    return lines


def write_report(result, out):
    meta = result["meta"]
    text = [f"# DeepSeek-V4's attention kernels ({meta['device']}, jax {meta['jax']})", "",
            "From benchmarks/bench_v4.py (its docstring says what each figure is). "
            f"Layer types: {meta['layer_types']}; context {meta['context']}; "
            f"h_q {meta['h_q']}.", "", "## Summary", "", *summary_lines(result), "",
            "## The step with the indexer, µs per layer", "",
            "Each CSA layer selects its 512 entries by V4's indexer (64 index heads); "
            "selection identical: the last CSA layer's, jax's against torch's. Wall clock of "
            "the median synced step / layers; queued: all steps launched before one sync. "
            "Ratio: jax_flashmla over the faster torch graph.", "",
            *step_table(result.get("indexer", []), selections=True), "",
            "## The step with random picks, µs per layer", "",
            "Each CSA layer reads 512 entries picked at random, no indexer.", "",
            *step_table(result["step"]), "",
            "## The decodes alone (no window writes, random picks), µs per layer", "",
            *step_table(result["decode"]), "", "## The decode by head count, µs per call", "",
            *heads_table(result), "", "## The prefill, µs per call", "",
            *prefill_table(result), "", *prefill_kernel_lines(result), ""]
    with open(out + ".md", "w") as f:
        f.write("\n".join(text))
    if not any(result.get(key) for key, _, _ in STEP_PARTS):
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, what, style in STEP_PARTS:
        for name, label in STEP_VARIANTS:
            points = [(r["b"], r[f"{name}_us"]) for r in result.get(key, [])
                      if f"{name}_us" in r]
            if points:
                ax.plot(*zip(*points), style, marker="o", label=f"{label}: {what.lower()}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch")
    ax.set_ylabel("µs per layer (synced step / layers)")
    ax.set_title(f"V4 decode step, {meta['layers']} layers, {meta['device']}")
    ax.legend()
    fig.tight_layout()
    save_png(fig, out + ".png")
    plt.close(fig)
