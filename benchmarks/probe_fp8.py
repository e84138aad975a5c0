"""Which inputs FlashMLA's dense FP8 decode (fwd_kvcache_mla_fp8) handles, on the GPU machine.

The FP8 bit-identity test passed with fixed lengths and faulted with variable ones, whose
inputs carry FlashMLA's test hazards: NaN in cache rows past a request's length, huge page
indices in unused block-table slots, zero-length requests. Each case turns hazards on over
clean variable-length inputs (one at a time, then in pairs, then all) and runs in its own
process, so that a fault ends only that case. Stages: jax_flashmla's FP8 path (empty requests
guarded by its own custom call, see ffi/fp8_guard.h) against float64 attention over the dequantized
values; the torch op on the same guarded inputs, which must equal it bit for bit; the torch op
on the raw inputs, last, since FlashMLA's kernel may fault there.

    python benchmarks/probe_fp8.py --out fp8_probe.json
"""
import argparse
import json
import os
import subprocess
import sys

# name: (variable lengths, NaN rows, sentinel slots, zero-length requests, h_q, s_q)
CASES = {
    "fixed": (False, False, False, False, 16, 1),
    "varlen": (True, False, False, False, 16, 1),
    "varlen_nan_rows": (True, True, False, False, 16, 1),
    "varlen_sentinel_slots": (True, False, True, False, 16, 1),
    "varlen_zero_lengths": (True, False, False, True, 16, 1),
    # Seen on 2026-11-30 (session 2): the five above pass, the test's inputs (all hazards)
    # fault. Which pair does it?
    "varlen_zero_lengths_sentinel_slots": (True, False, True, True, 16, 1),
    "varlen_zero_lengths_nan_rows": (True, True, False, True, 16, 1),
    "varlen_all_hazards": (True, True, True, True, 16, 1),
    "varlen_all_hazards_s_q2_h_q128": (True, True, True, True, 128, 2),
}
K_SCALE = 1 / 400


def run_case(case, batch=64, mean_sk=2048):
    """Prints one JSON line per stage, so that a fault in a later stage keeps the earlier ones:
    jax_flashmla's FP8 path (which guards empty requests), the torch op on the same guarded
    inputs, then the torch op on the raw inputs (which may fault: FlashMLA's own behaviour)."""
    varlen, nan_rows, sentinel_slots, zero_lengths, h_q, s_q = CASES[case]
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    "tests"))
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jax_flashmla as jf
    from jax_flashmla import fp8
    from oracle import SENTINEL_PAGE, dense_attention_f64, make_decode_inputs
    from torch_side import TorchSide

    q, kv, bt, sl = make_decode_inputs(
        np.random.default_rng(0), batch=batch, s_q=s_q, h_q=h_q, mean_sk=mean_sk,
        varlen=varlen, dtype=jnp.float32, zero_lengths=4 if zero_lengths else 0)
    if not nan_rows:
        kv = jnp.nan_to_num(kv, nan=0.0)
    if not sentinel_slots:
        bt = np.where(bt == SENTINEL_PAGE, 0, bt)
    scale = jnp.float32(K_SCALE)
    q = q.astype(jnp.bfloat16)
    q8, kv8 = fp8.quantize(q, scale), fp8.quantize(kv, scale)
    bt, sl = jnp.asarray(bt), jnp.asarray(sl)

    out, lse = (np.asarray(x, np.float32) for x in jax.block_until_ready(
        jax.jit(lambda *a: jf.mla_decode(*a[:4], k_scale=a[4]))(q, kv8, bt, sl, scale)))
    deq = lambda x: np.asarray(x.astype(jnp.float32), np.float64) * K_SCALE
    exact_out, exact_lse = dense_attention_f64(deq(q8), deq(kv8), np.asarray(bt), np.asarray(sl),
                                               softmax_scale=576 ** -0.5, causal=True)
    print(json.dumps(dict(stage="jax_flashmla", out_nan=int(np.isnan(out).sum()),
                          inf_lse_as_expected=bool(np.array_equal(np.isinf(lse),
                                                                  np.isinf(exact_lse))),
                          max_abs_err=float(np.nanmax(np.abs(out - exact_out))))), flush=True)

    side = TorchSide()

    def torch_op(block_table, seq_lens):
        """The FP8 op from torch, q quantized with the same scale, on these lengths."""
        t_out, t_lse = side.decode_call(kv8, seq_lens, q, block_table, h_q, s_q,
                                        k_scale=scale)()[:2]
        side.sync()
        return t_out.float().cpu().numpy(), t_lse.cpu().numpy()

    guarded_bt, guarded_sl, empty = fp8.guard_empty_requests(bt, sl)
    t_out, t_lse = torch_op(guarded_bt, guarded_sl)
    empty = np.asarray(empty)
    t_out[empty], t_lse[empty] = 0, np.inf
    print(json.dumps(dict(stage="torch_guarded", jax_equals_torch=bool(
        np.array_equal(out, t_out, equal_nan=True) and np.array_equal(lse, t_lse,
                                                                      equal_nan=True)))),
          flush=True)
    raw_out, raw_lse = torch_op(bt, sl)
    print(json.dumps(dict(stage="torch_raw", out_nan=int(np.isnan(raw_out).sum()),
                          equals_guarded=bool(np.array_equal(raw_out, t_out, equal_nan=True)))),
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=CASES, help="run one case in this process")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.case:
        run_case(args.case)
        return
    results = {}
    for case in CASES:
        try:
            proc = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True,
                                  text=True, timeout=120)
            stages = [json.loads(line) for line in proc.stdout.splitlines()
                      if line.startswith('{"stage"')]
            results[case] = dict(returncode=proc.returncode, stages=stages)
            if proc.returncode != 0:
                results[case]["stderr_tail"] = proc.stderr[-1500:]
        except subprocess.TimeoutExpired:
            results[case] = dict(returncode=None, timeout_s=120)
        print(case, json.dumps({k: v for k, v in results[case].items() if k != "stderr_tail"}),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
