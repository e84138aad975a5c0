"""What a NaN in q or in the cache does to each implementation's out and lse: FlashMLA on the
GPU ("custom_call" there), the C++ model ("custom_call" on CPU) and the reference.

Four requests (tests/helpers.py's NAN_LENGTHS), h_q 16; request 1 is split over several SM
parts and request 0 is one split. Each case puts one NaN into a clean problem (whose unused
rows already hold NaN, as in FlashMLA's tests); per request it prints how many (query, head)
rows of out hold a NaN or are all zero, the classes of lse, and whether the request equals
the clean run.

  python dev/probe_nan.py --out nan.json [--implementation reference]
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jax_flashmla as jf  # noqa: E402
from helpers import K_SCALE, NAN_LENGTHS, nan_problem, with_nan_in_key  # noqa: E402

H_Q = 16
LAST = tuple(n - 1 for n in NAN_LENGTHS)


CASES = {
    # name: (s_q, what changes); q is (b, s_q, h, 576), head 3 poisoned where q is
    "clean": (1, lambda q, kv, bt: (q, kv)),
    "q_req0_head3": (1, lambda q, kv, bt: (q.at[0, 0, 3, 10].set(jnp.nan), kv)),
    "q_req1_head3": (1, lambda q, kv, bt: (q.at[1, 0, 3, 10].set(jnp.nan), kv)),
    "q_rope_req0_head3": (1, lambda q, kv, bt: (q.at[0, 0, 3, 540].set(jnp.nan), kv)),
    "kv_latent_req0_tok5": (1, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 0, 5, 7))),
    "kv_rope_req0_tok5": (1, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 0, 5, 540))),
    "kv_latent_req1_tok5": (1, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 1, 5, 7))),
    "kv_latent_req1_last": (1, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 1, LAST[1], 7))),
    "kv_rope_req1_last": (1, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 1, LAST[1], 540))),
    "s_q2_clean": (2, lambda q, kv, bt: (q, kv)),
    # The last key of a request is hidden from query 0 by the causal mask when s_q = 2.
    "s_q2_kv_latent_req0_last": (2, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 0, LAST[0], 7))),
    "s_q2_kv_rope_req0_last": (2, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 0, LAST[0], 540))),
    "s_q2_kv_latent_req1_last": (2, lambda q, kv, bt: (q, with_nan_in_key(kv, bt, 1, LAST[1], 7))),
}


def lse_class(x):
    return "nan" if np.isnan(x) else "+inf" if x == np.inf else "-inf" if x == -np.inf else "fin"


def summary(out, lse, clean_out, clean_lse):
    """Per request: out rows with a NaN / all zero, lse classes, bit-equal to the clean run."""
    out, clean_out = np.asarray(out, np.float32), np.asarray(clean_out, np.float32)
    lse, clean_lse = np.asarray(lse), np.asarray(clean_lse)
    rows = []
    for r in range(out.shape[0]):
        o = out[r]  # (s_q, h, 512)
        classes = {}
        for c in map(lse_class, lse[r].ravel()):
            classes[c] = classes.get(c, 0) + 1
        per_row_nan = np.isnan(o).any(-1)  # (s_q, h)
        rows.append(dict(
            request=r,
            out_nan_rows=[[int(t), int(h)] for t, h in zip(*np.nonzero(per_row_nan))],
            out_nan_elements=int(np.isnan(o).sum()),
            out_zero_rows=int((o == 0).all(-1).sum()),
            lse=classes,
            lse_by_query_head=[[lse_class(v) for v in hs] for hs in lse[r]],  # (h, s_q)
            same_as_clean=bool(np.array_equal(o, clean_out[r], equal_nan=True)
                               and np.array_equal(lse[r], clean_lse[r], equal_nan=True))))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="nan.json", help="JSON written here (default nan.json)")
    ap.add_argument("--implementation", default="custom_call",
                    help="mla_decode's implementation (default custom_call)")
    args = ap.parse_args()
    results = []
    for fp8 in (False, True):
        k_scale = jnp.float32(K_SCALE) if fp8 else None

        @jax.jit
        def decode(q, kv, bt, sl):
            md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=H_Q,
                                     num_q_tokens=q.shape[1], fp8=fp8,
                                     implementation=args.implementation)
            out, lse = jf.mla_decode(q, kv, bt, sl, metadata=md, softmax_scale=0.1,
                                     k_scale=k_scale, implementation=args.implementation)
            return out, lse, md.num_splits

        clean = {}
        for name, (s_q, change) in CASES.items():
            q, kv, bt, sl = nan_problem(s_q, fp8, h_q=H_Q)
            if s_q not in clean:
                clean[s_q] = decode(q, kv, bt, sl)
            out, lse, splits = decode(*change(q, kv, bt), bt, sl)
            rec = dict(case=name, fp8=fp8, implementation=args.implementation,
                       backend=jax.default_backend(),
                       num_splits=None if splits is None else np.asarray(splits).tolist(),
                       requests=summary(out, lse, *clean[s_q][:2]))
            results.append(rec)
            print(name, "fp8" if fp8 else "bf16", "splits", rec["num_splits"])
            for r in rec["requests"]:
                print(f"  req{r['request']} same={r['same_as_clean']} "
                      f"nan_rows={r['out_nan_rows'][:6]} nan_el={r['out_nan_elements']} "
                      f"zero_rows={r['out_zero_rows']} lse={r['lse']}")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
