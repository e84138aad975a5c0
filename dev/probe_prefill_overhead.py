"""Where mla_prefill's time goes beyond cuDNN's, at a chunk over a cached prefix.

Times, each jitted alone, at T new tokens over a prefix of S (paged, bf16):
  - mla_prefill (cudnn), whole;
  - the prefix's gather and decompression alone, in two forms:
      rows:   mla_prefill's: k and v each one einsum of the 576-wide rows (W_UK with an
              identity on the rope columns, W_UV with zeros there): no concatenation pass;
      concat: k_nope and v from the latent columns, then the rope key concatenated;
  - cuDNN's two calls (prefix, then causal) on k and v already decompressed, merged;
  - mla_prefill with each decompression form.
With --kernels, mla_prefill's kernels (count and µs a call, from the profiler) with each
decompression form, and with mla_prefill's without command buffers (each kernel launched
from the host) and under the CONCURRENT command-buffer scheduling (independent kernels of the
graph free to overlap).

With --bench-inputs, bench_prefill.py's inputs (unit-scale data) in place of the probe's, and
with --kernels bench_prefill.py's own executable of mla_prefill beside the forms; with
--weights-as-args, W_UK and W_UV arguments of the jitted call (as in a model and in
bench_prefill.py), not constants of it.

  python dev/probe_prefill_overhead.py [--heads 16 128] [--tokens 2048] [--prefix 32768]
                                       [--kernels] [--bench-inputs] [--weights-as-args]
                                       [--hlo-out DIR]
"""
import argparse
import functools
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla import prefill, ragged_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

RANK, ROPE, NOPE, V = 512, 64, 128, 128


def decompress_concat(rows, w_uk, w_uv):
    """k_nope and v from the latent columns, the rope key then concatenated to k_nope."""
    latent, k_pe = rows[:, :RANK], rows[:, RANK:]
    k_nope = jnp.einsum("sc,chd->shd", latent, w_uk)
    v = jnp.einsum("sc,chd->shd", latent, w_uv)
    k_pe = jnp.broadcast_to(k_pe[:, None, :], (k_pe.shape[0], w_uk.shape[1], ROPE))
    return jnp.concatenate([k_nope, k_pe], axis=-1), v


def decompress_rows(rows, w_uk, w_uv, decompress=prefill._decompress,
                    row_weights=prefill._row_weights):
    """mla_prefill's: k and v each one matmul of the whole rows (its functions bound here,
    before compiled() swaps them)."""
    return decompress(rows, *row_weights(w_uk, w_uv, ROPE))


FORMS = {"rows": decompress_rows, "concat": decompress_concat}


def time_ms(fn, *args, reps=20):
    jax.block_until_ready(fn(*args))
    best = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            r = fn(*args)
        jax.block_until_ready(r)
        best.append((time.perf_counter() - start) / reps * 1e3)
    return float(np.median(best))


def kernel_tables(h, t, fns, calls=3):
    """Each of fns' mla_prefill calls ({name: (fn, its args)}) kernel by kernel
    (probe_sparse_step.profile)."""
    from probe_sparse_step import profile, show
    runs = {name: lambda fn=fn, args=args: jax.block_until_ready([fn(*args)
                                                                 for _ in range(calls)])
            for name, (fn, args) in fns.items()}
    show(f"h {h} T {t}", "call", profile(runs, calls))


def probe(h, t, s, kernels, bench_inputs, weights_as_args, hlo_out=None):
    bf = jnp.bfloat16
    if bench_inputs:
        import bench_prefill
        bench_args = bench_prefill.make_inputs(bench_prefill.Point("extend", t, s, h, "bfloat16"))
        q, kv, cache, table, _, _, w_uk, w_uv, _ = bench_args
        q, kv = q[0], kv[0]
    else:
        rng = np.random.default_rng(0)
        pages = s // 64
        cache = jnp.asarray(rng.standard_normal((pages, 64, 1, RANK + ROPE)) * 0.1, bf)
        table = jnp.asarray(rng.permutation(pages)[None].astype(np.int32))
        q = jnp.asarray(rng.standard_normal((t, h, NOPE + ROPE)), bf)
        kv = jnp.asarray(rng.standard_normal((t, RANK + ROPE)) * 0.1, bf)
        w_uk = jnp.asarray(rng.standard_normal((RANK, h, NOPE)) * 0.05, bf)
        w_uv = jnp.asarray(rng.standard_normal((RANK, h, V)) * 0.05, bf)
    plen, qlen = jnp.asarray([s], jnp.int32), jnp.asarray([t], jnp.int32)
    prefix = ragged_attention.Segments(jnp.zeros((1,), jnp.int32), plen)
    new = ragged_attention.Segments(jnp.zeros((1,), jnp.int32), qlen)
    scale = 192 ** -0.5
    flops = t * (s + t / 2) * h * 2 * (NOPE + ROPE + V)
    report = lambda name, ms: print(  # noqa: E731
        f"h {h} T {t} S {s} {name:28s} {ms:8.3f} ms  {flops / ms / 1e9:6.1f} TFLOPS*")

    def compiled(form, **options):
        saved = prefill._decompress, prefill._row_weights
        # The form takes the weights as they are and makes k and v itself.
        prefill._decompress, prefill._row_weights = FORMS[form], lambda w_uk, w_uv, _: (
            w_uk, w_uv)
        jax.clear_caches()  # _prefill is jitted: a trace of another form would be reused
        try:
            if weights_as_args:  # as a model passes its weights
                fn = lambda q, kv, c, bt, pl, ql, w_uk, w_uv: prefill.mla_prefill(  # noqa: E731
                    q, kv, c, bt, pl, ql, w_uk=w_uk, w_uv=w_uv, softmax_scale=scale,
                    max_prefix_tokens=s, implementation="cudnn")
                exe = jax.jit(fn, compiler_options=options).lower(
                    q, kv, cache, table, plen, qlen, w_uk, w_uv).compile()
                call = lambda *a: exe(*a, w_uk, w_uv)  # noqa: E731
                call.executable = exe
                return call
            return jax.jit(lambda *a: prefill.mla_prefill(
                *a, w_uk=w_uk, w_uv=w_uv, softmax_scale=scale, max_prefix_tokens=s,
                implementation="cudnn"), compiler_options=options).lower(
                    q, kv, cache, table, plen, qlen).compile()
        finally:
            prefill._decompress, prefill._row_weights = saved

    run = lambda form: time_ms(compiled(form), q, kv, cache, table, plen, qlen)  # noqa: E731
    if kernels:
        args = (q, kv, cache, table, plen, qlen)
        fns = {form: (compiled(form), args) for form in FORMS}
        fns["rows, no command buffers"] = (
            compiled("rows", xla_gpu_graph_min_graph_size=1 << 20), args)
        fns["rows, concurrent"] = (compiled(
            "rows", xla_gpu_command_buffer_scheduling_mode="CONCURRENT"), args)
        if bench_inputs:  # bench_prefill.py's own executable of mla_prefill
            op = functools.partial(bench_prefill.prefill_op, max_prefix_tokens=s)
            fns["bench_prefill's"] = (jax.jit(op).lower(*bench_args).compile(), bench_args)
        for name, (fn, fn_args) in fns.items():
            report(f"mla_prefill {name}", time_ms(fn, *fn_args))
            if hlo_out:
                text = getattr(fn, "executable", fn).as_text()
                # Letters, digits and _ only: names with commas or quotes do not travel back.
                plain = re.sub("[^A-Za-z0-9]+", "_", name)
                with open(os.path.join(hlo_out, f"h{h}_{plain}.hlo"), "w") as f:
                    f.write(text)
        kernel_tables(h, t, fns)
        return

    for form in FORMS:
        report(f"mla_prefill decompress={form}", run(form))
        gather = jax.jit(lambda c, bt, form=form: FORMS[form](
            prefill._prefix_rows(c, bt, prefix, 0, s, None, bf), w_uk, w_uv))
        report(f"gather+decompress {form}", time_ms(gather, cache, table))

    k, v = jax.jit(lambda c, bt: decompress_rows(
        prefill._prefix_rows(c, bt, prefix, 0, s, None, bf), w_uk, w_uv))(cache, table)
    ks, vs = decompress_rows(kv, w_uk, w_uv)

    @jax.jit
    def cudnn_only(q, k, v, ks, vs):
        attend = ragged_attention.cudnn_attention
        a = attend(q, k, v, new, prefix, causal=False, scale=scale)
        b = attend(q, ks, vs, new, new, causal=True, scale=scale)
        return ragged_attention.merge(*a, *b)

    report("cudnn two calls + merge", time_ms(cudnn_only, q, k, v, ks, vs))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--prefix", type=int, default=32768)
    parser.add_argument("--kernels", action="store_true")
    parser.add_argument("--bench-inputs", action="store_true")
    parser.add_argument("--weights-as-args", action="store_true")
    parser.add_argument("--hlo-out", default=None,
                        help="with --kernels, each executable's optimized HLO into this folder")
    args = parser.parse_args()
    if args.hlo_out:
        os.makedirs(args.hlo_out, exist_ok=True)
    for h in args.heads:
        probe(h, args.tokens, args.prefix, args.kernels, args.bench_inputs,
              args.weights_as_args, args.hlo_out)


if __name__ == "__main__":
    main()
