"""jax_flashmla.mla_prefill against cuDNN's flash attention and the old einsum prefill.

Points, batch 1, DeepSeek-V3's sizes (q/k head dim 128 + 64, v 128, 576-wide cache rows in
pages of 64, softmax_scale 192**-0.5), h_q in {16, 128}:
  new     a prompt of T tokens, T in {1024, ..., 131072} (bf16: no cache is read);
  extend  a chunk of T in {512, 2048, 8192} new tokens over a cached prefix of S in
          {4096, 32768, 122880} tokens, the cache bf16 or float8_e4m3fn with a k_scale.
Per point, compiled ahead, then timed in turns within each repeat (benchmarks/timing.py):
  mla_prefill  the op jitted, all it does included: the new rows and the prefix's pages
               (through a shuffled block table; dequantized when FP8) decompressed through
               W_UK / W_UV, the attention, the LSE merges; implementation=None (cuDNN on a
               Hopper GPU, its pure-JAX attention elsewhere);
  cudnn        cuDNN's flash attention (jax's wrapper) on q, k, v already decompressed: one
               causal call for a new prompt; for extend the chunk over the prefix (no mask) and
               over itself (causal), merged through the LSEs. Absent without cuDNN (CPU);
  einsum       the old prefill: the whole (h, T, S + T) float32 score matrix, softmax, then
               v, on the same decompressed keys; skipped past --einsum-budget-gb;
  absorbed     extend in the absorbed form: q_nope through W_UK, mla_decode with s_q = T
               (causal: the chunk's rows written after the prefix, FlashMLA's kernel on a
               Hopper GPU), its latent out through W_UV; where FlashMLA's decode takes T * h
               query rows (at most 132 tiles of 64).
TFLOPS count the attention's own work (FLOPS below); memory is each compiled executable's
memory_analysis(): argument + output + temp bytes. mla_prefill's out is also checked against
cuDNN's (and the einsum's): a cross-check, not a timing. With --capacity-pad N, mla_prefill's
max_prefix_tokens at an extend point is S + N, as a serving loop that buckets its prefixes
passes it: the prefix axis longer than the prefix.

    python benchmarks/bench_prefill.py --deadline-s 390 --out benchmarks/results/prefill_h200
    python benchmarks/bench_prefill.py --small --out /tmp/prefill_small   # CPU, seconds
    python benchmarks/bench_prefill.py --redraw benchmarks/results/prefill_h200  # md + png
    python benchmarks/bench_prefill.py --capacity-pad 8192 --points 'extend/*' --out /tmp/padded
"""
import argparse
import datetime
import fnmatch
import functools
import json
import os
import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla.caches import fp8
from jax_flashmla.ops import prefill

from results_io import save_png, write_json
from timing import compiler_option, time_in_turns

D_NOPE, D_ROPE, D_V, RANK, PAGE = 128, 64, 128, 512, 64
D_QK, WIDTH = D_NOPE + D_ROPE, RANK + D_ROPE
SCALE = D_QK ** -0.5
FP8 = "float8_e4m3fn"
FLOPS = "T * (S + T / 2) * h * 2 * (192 + 128)"
IMPLS = ("mla_prefill", "cudnn", "einsum", "absorbed")
# mla_prefill's out matches another's when they differ by at most this fraction of the
# other's largest |out|: bf16 outputs computed along different paths (key order, splits,
# merges) are a few bf16 ulps (2**-8 relative) apart.
OUT_TOLERANCE = 2 ** -6
GRIDS = dict(  # new-prompt T, extend chunk T, extend prefix S, heads
    full=dict(new=(1024, 4096, 16384, 65536, 131072), chunks=(64, 512, 2048, 8192),
              prefixes=(4096, 32768, 122880), heads=(16, 128)),
    quick=dict(new=(1024, 16384), chunks=(2048,), prefixes=(4096, 122880), heads=(16, 128)),
    small=dict(new=(64, 256), chunks=(64,), prefixes=(128,), heads=(2,)))
# target_ms, repeats, max_calls: a call of the largest points lasts ~1 s, so 3 repeats.
TIMINGS = dict(full=(100.0, 3, 1000), small=(2.0, 2, 20))


class Point(NamedTuple):
    kind: str  # "new" or "extend"
    tokens: int  # T: the new tokens
    prefix: int  # S: cached tokens before them (0 for a new prompt)
    heads: int
    cache: str  # the prefix cache's dtype

    @property
    def label(self):
        dtype = "fp8" if self.cache == FP8 else "bf16"
        return f"{self.kind}/T{self.tokens}/S{self.prefix}/h{self.heads}/{dtype}"

    @property
    def flops(self):
        return self.tokens * (self.prefix + self.tokens / 2) * self.heads * 2 * (D_QK + D_V)

    @property
    def einsum_bytes(self):
        """The einsum's float32 scores, about three times over (scores, exp, weights)."""
        return self.heads * self.tokens * (self.prefix + self.tokens) * 4 * 3


def grid_points(sizes):
    """New prompts by T, then extend by prefix and chunk; FP8 only where a prefix is read."""
    points = [Point("new", t, 0, h, "bfloat16") for t in sizes["new"] for h in sizes["heads"]]
    points += [Point("extend", t, s, h, dtype) for s in sizes["prefixes"]
               for t in sizes["chunks"] for h in sizes["heads"] for dtype in ("bfloat16", FP8)]
    return points


# -- inputs and the two baselines ------------------------------------------------------------

def make_inputs(p, seed=0):
    """mla_prefill's arguments. Unit-scale q, latent rows and keys (weights N(0, 1/512)), so
    that scores have a spread of about 1, as a trained model's do, rather than near-uniform
    attention that would hide differences."""
    keys = jax.random.split(jax.random.key(seed), 5)
    bf16 = jnp.bfloat16
    q = jax.random.normal(keys[0], (1, p.tokens, p.heads, D_QK), bf16)
    kv = jax.random.normal(keys[1], (1, p.tokens, WIDTH), bf16)
    w_uk, w_uv = (jax.random.normal(k, (RANK, p.heads, d), bf16) * bf16(RANK ** -0.5)
                  for k, d in ((keys[2], D_NOPE), (keys[3], D_V)))
    cache = table = k_scale = None
    if p.prefix:
        pages = p.prefix // PAGE
        cache = jax.random.normal(keys[4], (pages, PAGE, 1, WIDTH), bf16)
        if p.cache == FP8:
            k_scale = jnp.max(jnp.abs(cache)).astype(jnp.float32) / fp8.FP8_MAX
            cache = jax.jit(fp8.quantize)(cache, k_scale)
        # The prefix's pages in a random order, as a serving cache hands them out.
        order = np.random.default_rng(seed).permutation(pages).astype(np.int32)
        table = jnp.asarray(order[None])
    lens = jnp.asarray([p.prefix], jnp.int32), jnp.asarray([p.tokens], jnp.int32)
    return (q, kv, cache, table, *lens, w_uk, w_uv, k_scale)


def prefill_op(q, kv, cache, table, prefix_lens, query_lens, w_uk, w_uv, k_scale, *,
               max_prefix_tokens):
    """mla_prefill of the one request, out and lse with the baselines' batch axis."""
    out, lse = jf.mla_prefill(q[0], kv[0], cache, table, prefix_lens, query_lens, w_uk=w_uk,
                              w_uv=w_uv, softmax_scale=SCALE,
                              max_prefix_tokens=max_prefix_tokens, k_scale=k_scale)
    return out[None], lse[None]


@functools.partial(jax.jit, static_argnames="prefix")
def decompress(kv, cache, table, k_scale, w_uk, w_uv, *, prefix):
    """(k_new, v_new, k_prefix, v_prefix), (1, n, h, 192 / 128) bf16, made as mla_prefill
    makes them (float32 accumulation, rounded to bf16), so that the baselines see the keys
    and values the op sees; prefix None for a new prompt."""
    def expand(rows):
        latent, k_pe = rows[..., :RANK], rows[..., RANK:]
        k = jnp.einsum("bsc,chd->bshd", latent, w_uk, preferred_element_type=jnp.float32)
        v = jnp.einsum("bsc,chd->bshd", latent, w_uv, preferred_element_type=jnp.float32)
        k_pe = jnp.broadcast_to(k_pe[:, :, None], k.shape[:3] + (D_ROPE,))
        return jnp.concatenate([k.astype(rows.dtype), k_pe], -1), v.astype(rows.dtype)

    if not prefix:
        return (*expand(kv), None, None)
    rows = cache[table[0], :, 0].reshape(1, -1, WIDTH)[:, :prefix]
    rows = (fp8.dequantize(rows, k_scale) if k_scale is not None else rows).astype(kv.dtype)
    return (*expand(kv), *expand(rows))


def absorbed_inputs(inputs, p):
    """mla_decode's cache and block table with the chunk's rows in pages after the prefix's,
    its seq_lens (prefix + chunk), and the rest of the absorbed form's arguments."""
    q, kv, cache, table, _, _, w_uk, w_uv, k_scale = inputs
    rows = kv.reshape(p.tokens // PAGE, PAGE, 1, WIDTH)
    rows = fp8.quantize(rows, k_scale) if k_scale is not None else rows
    full_table = jnp.concatenate([table, cache.shape[0] + jnp.arange(
        rows.shape[0], dtype=jnp.int32)[None]], axis=1)
    seq_lens = jnp.asarray([p.prefix + p.tokens], jnp.int32)
    return (q, jnp.concatenate([cache, rows]), full_table, seq_lens, w_uk, w_uv, k_scale)


def absorbed_prefill(q, cache, table, seq_lens, w_uk, w_uv, k_scale):
    """The chunk over its prefix and itself in the latent space, through mla_decode."""
    q_latent = jnp.einsum("bthd,chd->bthc", q[..., :D_NOPE], w_uk)
    q = jnp.concatenate([q_latent, q[..., D_NOPE:]], axis=-1)
    out, lse = jf.mla_decode(q, cache, table, seq_lens, softmax_scale=SCALE, causal=True,
                             k_scale=k_scale)
    return jnp.einsum("bthc,chd->bthd", out, w_uv), lse


def absorbed_fits(p):
    """FlashMLA's decode schedules at most one tile of 64 query rows per SM (132 on Hopper)."""
    return p.kind == "extend" and p.tokens * p.heads <= 132 * 64


def cudnn_prefill(q, k_new, v_new, k_pre, v_pre):
    """cuDNN's flash attention called as ragged_attention.cudnn_attention calls it for one
    request holding every row (without padding masks, its fastest form): (out, lse)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    def attend(k, v, mask):
        out, lse = fa.dot_product_attention(q, k, v, scale=SCALE, mask_type=mask,
                                            qkv_layout="BTNH", return_residual=True)
        return out, lse.astype(jnp.float32)

    out, lse = attend(k_new, v_new, fa.MaskType.CAUSAL)
    if k_pre is None:
        return out, lse
    pre_out, pre_lse = attend(k_pre, v_pre, fa.MaskType.NO_MASK)
    return jf.context_parallel.merge_attention_states(jnp.stack([out, pre_out]),
                                                      jnp.stack([lse, pre_lse]))


def einsum_prefill(q, k_new, v_new, k_pre, v_pre):
    """The old dense prefill: every score in float32, bottom-right causal (query i, at
    position S + i, sees keys [0, S + i]), softmax, weights in q's dtype times v."""
    k = k_new if k_pre is None else jnp.concatenate([k_pre, k_new], axis=1)
    v = v_new if v_pre is None else jnp.concatenate([v_pre, v_new], axis=1)
    t, s = q.shape[1], k.shape[1]
    scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32) * SCALE
    visible = jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + (s - t)
    weights = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1).astype(q.dtype)
    out = jnp.einsum("bhts,bshd->bthd", weights, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype), None


@jax.jit
def max_abs_diff(a, b):
    """(max |a - b|, max |b|) in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return jnp.max(jnp.abs(a - b)), jnp.max(jnp.abs(b))


# -- one point -------------------------------------------------------------------------------

def run_point(p, args, cudnn_here):
    record = dict(label=p.label, kind=p.kind, tokens=p.tokens, prefix=p.prefix, heads=p.heads,
                  cache_dtype=p.cache, flops=p.flops, impls={}, skipped={}, checks={})
    capacity = p.prefix + (args.capacity_pad if p.prefix else 0)
    if capacity:
        record["max_prefix_tokens"] = capacity
    inputs = make_inputs(p)
    q, kv, cache, table, _, _, w_uk, w_uv, k_scale = inputs
    dense = (q, *decompress(kv, cache, table, k_scale, w_uk, w_uv, prefix=p.prefix))
    wanted = dict(mla_prefill=(functools.partial(prefill_op, max_prefix_tokens=capacity),
                               inputs),
                  cudnn=(cudnn_prefill, dense), einsum=(einsum_prefill, dense))
    if absorbed_fits(p):
        wanted["absorbed"] = (absorbed_prefill, absorbed_inputs(inputs, p))
    if not cudnn_here:
        del wanted["cudnn"]
        record["skipped"]["cudnn"] = "no cuDNN flash attention here (cuDNN >= 9.10, Hopper)"
    if p.einsum_bytes > args.einsum_budget_gb * 1e9:
        del wanted["einsum"]
        record["skipped"]["einsum"] = (f"its scores would take ~{p.einsum_bytes / 1e9:.3g} GB, "
                                       f"over --einsum-budget-gb {args.einsum_budget_gb:g}")
    variants = {}
    for name, (fn, fn_args) in wanted.items():
        # Compiled ahead, so that memory_analysis() reads the very executable that is timed.
        started = time.perf_counter()
        try:
            compiled = jax.jit(fn, compiler_options=args.xla_options or None).lower(
                *fn_args).compile()
        except Exception as e:  # noqa: BLE001 - one failing variant should not cost the point
            record["skipped"][name] = f"failed to compile: {type(e).__name__}: {str(e)[:300]}"
            continue
        m = compiled.memory_analysis()
        record["impls"][name] = dict(
            compile_s=time.perf_counter() - started, temp_size_in_bytes=m.temp_size_in_bytes,
            executable_bytes=m.argument_size_in_bytes + m.output_size_in_bytes
            + m.temp_size_in_bytes)
        variants[name] = (lambda i, c=compiled, a=fn_args: c(*a), jax.block_until_ready)
    timed, failed = time_in_turns(variants, target_ms=args.target_ms, repeats=args.repeats,
                                  max_calls=args.max_calls, fitted=())
    for name, e in failed.items():
        del record["impls"][name]
        record["skipped"][name] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    for name, t in timed.items():
        seconds = statistics.median(t["samples"])
        record["impls"][name].update(ms=seconds * 1e3, tflops=p.flops / seconds / 1e12,
                                     calls=t["calls"],
                                     repeats_ms=[s * 1e3 for s in t["samples"]])
    # A correctness cross-check on the first calls' results, not a timing.
    if "mla_prefill" in timed:
        out, lse = timed["mla_prefill"]["first"]
        record["checks"]["lse_finite"] = bool(jnp.all(jnp.isfinite(lse)))
        for name in ("cudnn", "einsum", "absorbed"):
            if name in timed:
                diff, scale = (float(x) for x in max_abs_diff(out, timed[name]["first"][0]))
                record["checks"][f"max_abs_diff_vs_{name}"] = diff
                record["checks"][f"max_abs_{name}"] = scale
                if name != "absorbed":  # FP8 quantizes q there: a looser match, recorded only
                    record["checks"][f"matches_{name}"] = bool(
                        diff <= OUT_TOLERANCE * scale and record["checks"]["lse_finite"])
    return record


# -- the report ------------------------------------------------------------------------------

def _cell(r, key, fmt):
    return format(r[key], fmt) if r and key in r else "-"


def markdown(results):
    meta = results["meta"]
    lines = [f"# mla_prefill: new prompts and extend ({meta['device']})", "",
             f"{meta['date']}; jax {meta['jax']}, cuDNN {meta['cudnn'] or '-'}; mla_prefill runs "
             f"`{meta['prefill_implementation']}`. Median of {meta['repeats']} repeats of "
             f"~{meta['target_ms']:g} ms, the implementations in turns"
             + "".join(f", each jitted with {k}={v}" for k, v in
                       (meta.get("xla_options") or {}).items())
             + (f"; mla_prefill's max_prefix_tokens at an extend point is S + "
                f"{meta['capacity_pad']} (a bucketed prefix axis)" if meta.get("capacity_pad")
                else "") + ". TFLOPS: "
             f"{meta['flops']}, S the prefix (0 for a new prompt). cuDNN and einsum take keys and "
             "values already decompressed; mla_prefill decompresses them from the 576-wide rows "
             "and reads the prefix from the paged cache. Ratio: mla_prefill's TFLOPS over "
             "cuDNN's. GB: mla_prefill's executable (arguments + outputs + temporaries), "
             "temporaries alone in brackets. |Δout|: mla_prefill's out against cuDNN's (the "
             "einsum's without cuDNN). absorbed: the absorbed form through mla_decode, where "
             "it takes T * h query rows.", "",
             "| kind | T | prefix | h | cache | mla_prefill ms | TFLOPS | cuDNN ms | TFLOPS "
             "| ratio | einsum ms | absorbed ms | TFLOPS | GB | \\|Δout\\| |",
             "|" + " --- |" * 15]
    for p in results["points"]:
        op, base, einsum, absorbed = (p["impls"].get(name) for name in IMPLS)
        checks = p["checks"]
        diff = checks.get("max_abs_diff_vs_cudnn", checks.get("max_abs_diff_vs_einsum"))
        lines.append("| " + " | ".join([
            p["kind"], str(p["tokens"]), str(p["prefix"]), str(p["heads"]),
            "fp8" if p["cache_dtype"] == FP8 else "bf16",
            _cell(op, "ms", ".3f"), _cell(op, "tflops", ".1f"),
            _cell(base, "ms", ".3f"), _cell(base, "tflops", ".1f"),
            f"{base['ms'] / op['ms']:.2f}" if "ms" in (op or {}) and "ms" in (base or {}) else "-",
            "skipped" if "einsum" in p["skipped"] else _cell(einsum, "ms", ".3f"),
            _cell(absorbed, "ms", ".3f"), _cell(absorbed, "tflops", ".1f"),
            f"{op['executable_bytes'] / 1e9:.3g} ({op['temp_size_in_bytes'] / 1e9:.3g})"
            if op else "-", "-" if diff is None else f"{diff:.3g}"]) + " |")
    if results["not_run"]:
        lines += ["", f"Not run (deadline): {', '.join(results['not_run'])}."]
    for label, why in results.get("failed", {}).items():
        lines += ["", f"Failed: {label}: {why}"]
    return "\n".join(lines) + "\n"


def plot(results, path):
    """A row per h: TFLOPS against T (new prompts), against the chunk per prefix (extend),
    and executable GB against T (new prompts), where a linear growth has slope 1."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is missing: no plot (--redraw draws it from the JSON)", flush=True)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = results["points"]
    style = dict(mla_prefill="o-", cudnn="s--", einsum="^:", absorbed="d-.")
    heads = sorted({p["heads"] for p in points})
    if not heads:
        return
    fig, axes = plt.subplots(len(heads), 3, figsize=(15, 3.8 * len(heads)), squeeze=False)

    def line(ax, rows, impl, key, fmt, scale=1.0, **kw):
        xy = [(p["tokens"], p["impls"][impl][key] * scale) for p in rows
              if key in p["impls"].get(impl, {})]
        if xy:
            ax.plot(*zip(*xy), fmt, markersize=4, **kw)

    for (ax_new, ax_ext, ax_mem), h in zip(axes, heads):
        rows = lambda kind, **kv: [p for p in points if p["kind"] == kind and p["heads"] == h  # noqa: E731
                                   and all(p[k] == v for k, v in kv.items())]
        for impl in IMPLS:
            if impl in ("mla_prefill", "cudnn"):
                line(ax_new, rows("new"), impl, "tflops", style[impl], label=impl)
            line(ax_mem, rows("new"), impl, "executable_bytes", style[impl], 1e-9, label=impl)
        for i, s in enumerate(sorted({p["prefix"] for p in rows("extend")})):
            for impl, dtype, fmt, name in (("mla_prefill", "bfloat16", "o-", "mla_prefill"),
                                           ("mla_prefill", FP8, "x:", "mla_prefill fp8"),
                                           ("cudnn", "bfloat16", "s--", "cuDNN"),
                                           ("absorbed", "bfloat16", "d-.", "absorbed")):
                line(ax_ext, rows("extend", prefix=s, cache_dtype=dtype), impl, "tflops", fmt,
                     color=f"C{i}", label=f"{name} S={s}")
        for ax, title, xlabel, ylabel in (
                (ax_new, "new prompts", "T (tokens)", "TFLOPS"),
                (ax_ext, "extend: a chunk over a prefix", "chunk (tokens)", "TFLOPS"),
                (ax_mem, "new prompts: executable memory", "T (tokens)", "GB")):
            ax.set(title=f"{title}, h={h}", xlabel=xlabel, ylabel=ylabel, xscale="log")
            if ylabel == "GB":
                ax.set_yscale("log")
            if ax.lines:
                ax.legend(fontsize=7)
    fig.tight_layout()
    save_png(fig, path)
    plt.close(fig)


def write_report(results, out, with_plot=True):
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    write_json(results, out + ".json")
    with open(out + ".md", "w") as f:
        f.write(markdown(results))
    if with_plot:
        plot(results, out + ".png")


def point_line(r):
    parts = [f"{name} {i['ms']:.3f} ms {i['tflops']:.1f} TFLOPS "
             f"{i['executable_bytes'] / 1e9:.3g} GB" for name, i in r["impls"].items() if "ms" in i]
    parts += [f"{name} skipped ({why[:80]})" for name, why in r["skipped"].items()]
    parts += [f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
              for k, v in r["checks"].items()]
    return f"{r['label']}: " + "; ".join(parts)


# -- main ------------------------------------------------------------------------------------

def main(argv=None):
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/prefill",
                        help="writes OUT.json, OUT.md (after every point) and OUT.png")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--small", action="store_true", help="tiny sizes, for CPU (seconds)")
    mode.add_argument("--quick", action="store_true", help="a subset of the full grid")
    mode.add_argument("--redraw", metavar="OUT", help="rewrite OUT.md and OUT.png from OUT.json")
    parser.add_argument("--points", nargs="+", metavar="GLOB",
                        help="only points whose label (e.g. extend/T512/S4096/h16/fp8) matches")
    parser.add_argument("--deadline-s", "--deadline", type=float, default=None,
                        help="start no new point after this many seconds; results still written")
    parser.add_argument("--target-ms", type=float, help="length of one timed repeat")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--max-calls", type=int, help="calls per repeat at most")
    parser.add_argument("--einsum-budget-gb", type=float, default=40.0,
                        help="skip the einsum where its score matrices would exceed this")
    parser.add_argument("--capacity-pad", type=int, default=0, metavar="N",
                        help="mla_prefill's max_prefix_tokens is the prefix + N at extend points "
                             "(a multiple of 64): a bucketed prefix axis")
    parser.add_argument("--xla-option", action="append", default=[], metavar="NAME=VALUE",
                        help="a compiler option for every implementation's jit, e.g. "
                             "xla_gpu_command_buffer_scheduling_mode=CONCURRENT")
    args = parser.parse_args(argv)
    args.xla_options = dict(compiler_option(text) for text in args.xla_option)
    if args.capacity_pad < 0 or args.capacity_pad % PAGE:
        parser.error(f"--capacity-pad must be a non-negative multiple of {PAGE}; got "
                     f"{args.capacity_pad}")
    if args.redraw:
        with open(args.redraw + ".json") as f:
            write_report(json.load(f), args.redraw)
        return
    for key, value in zip(("target_ms", "repeats", "max_calls"),
                          TIMINGS["small" if args.small else "full"]):
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    points = grid_points(GRIDS["small" if args.small else "quick" if args.quick else "full"])
    if args.points:
        points = [p for p in points if any(fnmatch.fnmatch(p.label, g) for g in args.points)]
    cudnn_here = prefill.cudnn_usable()
    meta = dict(device=jax.devices()[0].device_kind, backend=jax.default_backend(),
                jax=jax.__version__, cudnn=None,
                prefill_implementation=prefill.resolve_implementation(None,
                                                                      jnp.dtype(jnp.bfloat16)),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                flops=FLOPS, out_tolerance=OUT_TOLERANCE, einsum_budget_gb=args.einsum_budget_gb,
                target_ms=args.target_ms, repeats=args.repeats, max_calls=args.max_calls,
                xla_options=args.xla_options, capacity_pad=args.capacity_pad,
                timing="compiled ahead, then N calls and one sync, the implementations in turns "
                       "(timing.time_in_turns), median of the repeats")
    if cudnn_here:
        from jax._src.cudnn import fused_attention_stablehlo as fa
        meta["cudnn"] = fa.check_cudnn_version()
    results = dict(meta=meta, points=[], not_run=[], failed={})
    print(f"{meta['device']}, jax {meta['jax']}, cuDNN {meta['cudnn']}, mla_prefill runs "
          f"{meta['prefill_implementation']}: {len(points)} points", flush=True)
    for i, p in enumerate(points):
        if args.deadline_s is not None and time.perf_counter() - started > args.deadline_s:
            results["not_run"].append(p.label)
            print(f"not run (deadline): {p.label}", flush=True)
            continue
        try:
            results["points"].append(run_point(p, args, cudnn_here))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory making the inputs
            results["failed"][p.label] = f"{type(e).__name__}: {str(e)[:300]}"
            print(f"failed: {p.label}: {results['failed'][p.label]}", flush=True)
            continue
        print(f"[{i + 1}/{len(points)} {time.perf_counter() - started:.0f}s] "
              f"{point_line(results['points'][-1])}", flush=True)
        write_report(results, args.out, with_plot=False)  # a killed run keeps what it measured
    write_report(results, args.out)
    print(f"wrote {args.out}.json, .md, .png in {time.perf_counter() - started:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
