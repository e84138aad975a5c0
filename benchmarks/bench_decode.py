"""mla_decode under jit against FlashMLA's torch op called directly, on the GPU machine.

Reports, as JSON (--out) and a table on stdout:
  - time per call at b=128, s_k=4096, s_q=1, h_q in {16, 128} (metadata computed once, outside
    the timed region, as in a model) and the ratio jax / torch: over batches of --calls calls,
    and as the slope of a batch's time over its length (timing.fit_in_turns), which leaves out
    what each batch pays once (its first dispatch and final sync, reported apart);
  - the host's dispatch pace per call (jax and torch), which tells a GPU-bound loop from a
    host-bound one;
  - jax's own cost per one-op jitted call, with no custom call involved: a jitted device copy
    as long as the h_q=16 decode against torch's copy_ (the floor under the ratio above);
  - host overhead per call: a jitted chain of many decodes at a tiny shape against a loop of
    torch calls, and the dispatch cost of one jitted call;
  - GPU memory torch's allocator takes during one jax call (FlashMLA's split-KV buffers live
    outside XLA's pool; its results are allocated in XLA's buffers), and how many results
    landed in place.
Every variant is timed the same way (benchmarks/timing.py): N calls back to back, then a sync,
wall clock, the variants in turns within each repeat; ratios are medians of per-repeat ratios.

    python benchmarks/bench_decode.py --out benchmarks/results/decode_h200.json
"""
import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf

from timing import device_copy, fit_in_turns, in_turns, paired_ratios
from torch_side import TorchSide


def _inputs(batch, s_k, h_q, s_q, seed=0):
    pages_per_req = -(-s_k // 64)
    key_q, key_kv = jax.random.split(jax.random.key(seed))
    q = jax.random.normal(key_q, (batch, s_q, h_q, 576), jnp.float32).astype(jnp.bfloat16)
    kv = jax.random.normal(key_kv, (batch * pages_per_req, 64, 1, 576), jnp.float32).astype(jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(batch * pages_per_req).astype(np.int32)
    bt = jnp.asarray(perm.reshape(batch, pages_per_req))
    sl = jnp.full((batch,), s_k, jnp.int32)
    return q, kv, bt, sl


def bench_call_ratio(side, batch, s_k, h_q, s_q, calls, layers):
    """One jitted decode per call, and a jitted step of `layers` decodes (a model's layers,
    sharing one metadata), against the same number of torch calls."""
    torch = side.torch
    q, kv, bt, sl = _inputs(batch, s_k, h_q, s_q)
    # One array per layer: slicing a stacked array inside the step would add copies.
    q_layers = [q * (1 + i / layers) for i in range(layers)]
    md = jax.block_until_ready(jf.get_mla_metadata(sl, num_heads_q=h_q, num_q_tokens=s_q))
    decode = jax.jit(lambda q, kv, bt, sl, md: jf.mla_decode(q, kv, bt, sl, metadata=md))
    step = jax.jit(lambda qs, kv, bt, sl, md: [jf.mla_decode(qs[i], kv, bt, sl, metadata=md)
                                               for i in range(layers)])
    torch_call = side.decode_call(kv, sl, q, bt, h_q, s_q)
    # The step's torch counterpart: the same calls on the same queries.
    torch_layer_calls = [side.decode_call(kv, sl, ql, bt, h_q, s_q) for ql in q_layers]

    def torch_step():
        for call in torch_layer_calls:
            result = call()
        return result

    def torch_step_kept():
        """As the jitted step, which returns all 8 outputs: each call's results stay alive
        until the step's end (FlashMLA's kernel is slower when out is not the block just
        freed, benchmarks/NOTES.md session 4)."""
        return [call() for call in torch_layer_calls][-1]

    # The op plus two copy_ calls into other buffers, all in torch: what the bridge cost when
    # it copied both results (sessions 1 and 2).
    out_buf = torch.empty((batch, s_q, h_q, 512), dtype=torch.bfloat16, device="cuda")
    lse_buf = torch.empty((batch, h_q, s_q), dtype=torch.float32, device="cuda")

    def torch_call_and_copies():
        out, lse = torch_call()[:2]
        out_buf.copy_(out)
        lse_buf.copy_(lse)

    jax_sync = jax.block_until_ready
    torch_sync = side.sync
    # The host's pace alone: N jitted calls dispatched with no sync until the end. Below the
    # GPU's time per call, the jax row above is GPU-bound and any gap to torch is on the GPU.
    dispatch_s = dispatch_pace(lambda: decode(q, kv, bt, sl, md), jax_sync, calls)
    torch_dispatch_s = dispatch_pace(torch_call, torch_sync, calls)
    samples = in_turns(dict(
        jax=(lambda: decode(q, kv, bt, sl, md), jax_sync, calls, 1),
        torch=(torch_call, torch_sync, calls, 1),
        torch_with_copies=(torch_call_and_copies, torch_sync, calls, 1),
        jax_step=(lambda: step(q_layers, kv, bt, sl, md), jax_sync, calls // layers, layers),
        torch_step=(torch_step, torch_sync, calls // layers, layers),
        torch_step_kept=(torch_step_kept, torch_sync, calls // layers, layers)),
        repeats=7, warmup=10)
    fits = fit_in_turns(dict(jax=(lambda: decode(q, kv, bt, sl, md), jax_sync, calls, 1),
                             torch=(torch_call, torch_sync, calls, 1)), repeats=7, warmup=10)
    ms = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    ratio = paired_ratios(samples["jax"], samples["torch"])
    fitted = fitted_summary(fits)
    step_ratio = paired_ratios(samples["jax_step"], samples["torch_step"])
    step_ratio_kept = paired_ratios(samples["jax_step"], samples["torch_step_kept"])
    # Memory torch's allocator takes during one jax call: none, since FlashMLA's results and
    # split-KV accumulators are XLA's buffers.
    jax.block_until_ready(decode(q, kv, bt, sl, md))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    jax.block_until_ready(decode(q, kv, bt, sl, md))
    torch.cuda.synchronize()
    peak_extra = torch.cuda.max_memory_allocated() - base
    kv_bytes = batch * s_k * 576 * 2
    io_bytes = 2 * (batch * s_k * 576 + batch * s_q * h_q * 576 + batch * s_q * h_q * 512)
    flops = 2 * s_q * batch * s_k * h_q * (576 + 512)
    jax_s = ms["jax"] / 1e3
    return dict(batch=batch, s_k=s_k, h_q=h_q, s_q=s_q, layers=layers, ms=ms,
                ratio=ratio[0], ratio_range=ratio[1:], fitted=fitted, step_ratio=step_ratio[0],
                step_ratio_range=step_ratio[1:], step_ratio_results_kept=step_ratio_kept[0],
                step_ratio_results_kept_range=step_ratio_kept[1:],
                jax_gbps=io_bytes / jax_s / 1e9,
                jax_tflops=flops / jax_s / 1e12, jax_dispatch_us=dispatch_s * 1e6,
                torch_dispatch_us=torch_dispatch_s * 1e6,
                torch_gbps=io_bytes / ms["torch"] * 1e3 / 1e9,
                kv_cache_mb=kv_bytes / 2**20, torch_alloc_per_call_mb=peak_extra / 2**20)


def fitted_summary(fits):
    """fit_in_turns' jax and torch: µs per call (slope) and per batch (intercept), and the
    ratio of the slopes (median of the per-repeat ratios, and the range)."""
    ratio = paired_ratios(fits["jax"][0], fits["torch"][0])
    summary = dict(ratio=ratio[0], ratio_range=ratio[1:])
    for name, (per_call, per_batch) in fits.items():
        summary[f"{name}_us_per_call"] = statistics.median(per_call) * 1e6
        summary[f"{name}_us_per_batch"] = statistics.median(per_batch) * 1e6
    return summary


def dispatch_pace(call, sync, calls):
    """Seconds of host time per call while `calls` calls are issued back to back, before the
    final sync (the median of 5 such batches; a first call compiles)."""
    sync(call())
    paces = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            result = call()
        paces.append((time.perf_counter() - start) / calls)
        sync(result)
    return statistics.median(paces)


def bench_execution_floor(side, calls, mib=288):
    """What jax adds to any one-op jitted call on the GPU, with no custom call involved: a
    jitted device copy (mib MiB read and written, about as long as the h_q=16 decode) against
    torch's copy_ of the same buffers, per call, timed like the decodes."""
    torch = side.torch
    xs = [jax.random.normal(jax.random.key(i), (mib * 2**19,), jnp.bfloat16) for i in range(2)]
    src = [torch.from_dlpack(x) for x in xs]
    dst = torch.empty_like(src[0])
    turn = itertools.count()  # alternates the source buffer, so the L2 keeps nothing
    variants = dict(
        jax=(lambda: device_copy(xs[next(turn) % 2]), jax.block_until_ready, calls, 1),
        torch=(lambda: dst.copy_(src[next(turn) % 2]), side.sync, calls, 1))
    samples = in_turns(variants, repeats=7, warmup=10)
    ratio = paired_ratios(samples["jax"], samples["torch"])
    return dict(mib=mib, jax_us=statistics.median(samples["jax"]) * 1e6,
                torch_us=statistics.median(samples["torch"]) * 1e6, ratio=ratio[0],
                ratio_range=ratio[1:],
                fitted=fitted_summary(fit_in_turns(variants, repeats=7, warmup=10)))


def bench_host_overhead(side, chain, calls):
    """A tiny decode (b=1, s_k=64, h_q=16) where host work, not the GPU, sets the pace."""
    h_q, s_q = 16, 1
    q, kv, bt, sl = _inputs(1, 64, h_q, s_q)
    md = jax.block_until_ready(jf.get_mla_metadata(sl, num_heads_q=h_q))

    @jax.jit
    def chained(q, kv, bt, sl, md):
        # Each decode feeds the next, so XLA cannot merge or drop any of them.
        for _ in range(chain):
            out, _ = jf.mla_decode(q, kv, bt, sl, metadata=md)
            q = q.at[..., :512].add(out * 1e-3)
        return q

    single = jax.jit(lambda q, kv, bt, sl, md: jf.mla_decode(q, kv, bt, sl, metadata=md))
    torch_call = side.decode_call(kv, sl, q, bt, h_q, s_q)
    samples = in_turns(dict(
        chain=(lambda: chained(q, kv, bt, sl, md), jax.block_until_ready, calls // chain + 1,
               chain),
        single=(lambda: single(q, kv, bt, sl, md), jax.block_until_ready, calls, 1),
        torch=(torch_call, side.sync, calls, 1)), repeats=7, warmup=10)
    chain_s, single_s, torch_s = (statistics.median(samples[k]) for k in ("chain", "single",
                                                                          "torch"))
    return dict(jax_in_jit_chain_us=chain_s * 1e6, jax_one_jit_call_us=single_s * 1e6,
                torch_loop_us=torch_s * 1e6, chain=chain)


def fit_text(fitted):
    return (f"jax {fitted['jax_us_per_call']:.1f} us + {fitted['jax_us_per_batch']:.0f} us per "
            f"batch, torch {fitted['torch_us_per_call']:.1f} us + "
            f"{fitted['torch_us_per_batch']:.0f} us per batch, ratio {fitted['ratio']:.4f} "
            f"[{fitted['ratio_range'][0]:.4f}, {fitted['ratio_range'][1]:.4f}]")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--h-q", type=int, nargs="+", default=[16, 128])
    parser.add_argument("--runs", type=int, default=2,
                        help="runs per h_q: the spread between runs is the noise floor")
    parser.add_argument("--no-host", action="store_true", help="skip the host-overhead part")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the jitted copy against torch's (jax's own per-call cost)")
    args = parser.parse_args()
    side = TorchSide()
    results = dict(device=jax.devices()[0].device_kind, kernel_library=side.info["kernel_library"],
                   decode_op=side.info["decode_op"], calls=[], host=None,
                   execution_floor=None)
    for h_q in args.h_q:
        for _ in range(args.runs):
            r = bench_call_ratio(side, 128, 4096, h_q, 1, args.calls, layers=8)
            results["calls"].append(r)
            ms = r["ms"]
            print(f"b=128 s_k=4096 h_q={h_q:3d} s_q=1 (ms per decode): jax {ms['jax']:.4f}, "
                  f"torch {ms['torch']:.4f} (+2 copies {ms['torch_with_copies']:.4f}), ratio "
                  f"{r['ratio']:.4f} [{r['ratio_range'][0]:.4f}, {r['ratio_range'][1]:.4f}]; "
                  f"fitted per call {fit_text(r['fitted'])}; "
                  f"8-decode step {ms['jax_step']:.4f} vs torch {ms['torch_step']:.4f}, ratio "
                  f"{r['step_ratio']:.4f} [{r['step_ratio_range'][0]:.4f}, "
                  f"{r['step_ratio_range'][1]:.4f}], vs torch keeping its results "
                  f"{ms['torch_step_kept']:.4f}, ratio {r['step_ratio_results_kept']:.4f}; "
                  f"{r['jax_gbps']:.0f} GB/s "
                  f"{r['jax_tflops']:.0f} TFLOPS; torch alloc/call "
                  f"{r['torch_alloc_per_call_mb']:.1f} MiB; host dispatch per call "
                  f"jax {r['jax_dispatch_us']:.1f} us, torch {r['torch_dispatch_us']:.1f} us",
                  flush=True)
    if not args.no_floor:
        results["execution_floor"] = bench_execution_floor(side, args.calls)
        print("one jitted copy against torch's copy_, per call:",
              json.dumps(results["execution_floor"]), flush=True)
    if not args.no_host:
        results["host"] = bench_host_overhead(side, chain=50, calls=2000)
        print("host overhead per call (b=1, s_k=64, h_q=16):",
              json.dumps(results["host"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
