"""What FlashMLA's sparse kernels (sgl_kernel::sparse_decode_fwd, sparse_prefill_fwd) do, called
from torch on this GPU, against jax_flashmla's pure-JAX sparse reference:

  - out and lse for plain indices, invalid ones (-1, past the cache), duplicates, topk_length,
    attn_sink (which lse convention), a query with no valid index, NaN in unread and in read
    rows;
  - what the ops return beyond out and lse, and every allocation each makes (size and order),
    from torch's memory history: what a custom call must hand them as XLA buffers;
  - sparse prefill's lse base;
  - the decode's schedule: what sparse_decode_fwd makes for itself against
    get_mla_decoding_metadata with topk (over any lengths) and against the dense schedule of
    requests of topk keys, and the decode given each of them.

  python dev/probe_sparse.py --out probe_sparse.json
"""
import argparse
import json
import os

import numpy as np
import torch

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashmla import kernels  # noqa: E402
from jax_flashmla.sparse import quantize_tokens  # noqa: E402
from jax_flashmla.sparse.reference import (sparse_decode_reference,  # noqa: E402
                                           sparse_prefill_reference)

SCALE = 0.1


def op(name):
    return getattr(torch.ops.sgl_kernel, name)


def t(x):
    return torch.from_numpy(np.asarray(x)).cuda()


def allocations(fn):
    """(fn's result, [bytes of each allocation fn made, in order])."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    result = fn()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    sizes = [e["size"] for trace in snapshot["device_traces"] for e in trace
             if e["action"] == "alloc"]
    return result, sizes


def compare(name, got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    both_inf = np.isinf(got) & np.isinf(want) & (np.sign(got) == np.sign(want))
    nan_got, nan_want = np.isnan(got), np.isnan(want)
    finite = ~(both_inf | nan_got | nan_want)
    diff = np.abs(got - want)[finite]
    return {"what": name, "max_abs": float(diff.max()) if diff.size else 0.0,
            "rel_l2": float(np.linalg.norm(diff) / (np.linalg.norm(want[finite]) + 1e-30)),
            "nan_got": int(nan_got.sum()), "nan_want": int(nan_want.sum()),
            "nan_same": bool(np.array_equal(nan_got, nan_want)),
            "inf_got": int(np.isinf(got).sum()), "inf_want": int(np.isinf(want).sum())}


def decode_case(rng, b, s_q, h_q, topk, pages, *, length=False, sink=False, nan=None):
    rows = rng.normal(0, 0.3, (pages, 64, 1, 576)).astype(np.float32)
    tokens = np.array(quantize_tokens(jnp.asarray(rows)))  # writable: the NaN cases poke it
    indices = rng.integers(0, pages * 64, (b, s_q, topk)).astype(np.int32)
    indices[0, 0, ::5] = -1
    indices[-1, -1, 3] = pages * 64 + 10
    indices[0, -1, 9] = indices[0, -1, 10]
    indices[min(1, b - 1), 0, :] = -1  # a query with no valid index
    if nan == "unread":
        unread = np.setdiff1d(np.arange(pages * 64), indices.ravel())
        tokens.reshape(-1, 656)[unread[:8]] = 0xFF
    if nan == "read":
        tokens.reshape(-1, 656)[indices[0, 0, 1], 7] = 0x7F  # e4m3 NaN
    q = rng.normal(0, 1, (b, s_q, h_q, 576)).astype(np.float32)
    q_bf = jnp.asarray(q, jnp.bfloat16)
    topk_length = rng.integers(0, topk + 1, (b,)).astype(np.int32) if length else None
    attn_sink = rng.normal(0, 2, (h_q,)).astype(np.float32) if sink else None
    ref_out, ref_lse = sparse_decode_reference(
        q_bf, jnp.asarray(tokens), jnp.asarray(indices), softmax_scale=SCALE,
        topk_length=None if topk_length is None else jnp.asarray(topk_length),
        attn_sink=None if attn_sink is None else jnp.asarray(attn_sink))
    kv = t(tokens).view(torch.float8_e4m3fn)
    tq = t(np.asarray(q_bf.astype(jnp.float32))).to(torch.bfloat16)
    args = (tq, kv, t(indices), None if topk_length is None else t(topk_length),
            None if attn_sink is None else t(attn_sink), None, None, None, None, None, 512,
            SCALE)
    (result, sizes) = allocations(lambda: op("sparse_decode_fwd")(*args))
    out, lse = result[0], result[1]
    record = {"b": b, "s_q": s_q, "h_q": h_q, "topk": topk, "length": length, "sink": sink,
              "nan": nan, "allocations": sizes,
              "returned": [None if r is None else [list(r.shape), str(r.dtype)] for r in result],
              "out": compare("out", out.float().cpu().numpy(), ref_out.astype(jnp.float32)),
              "lse": compare("lse", lse.cpu().numpy(), ref_lse)}
    empty = min(1, b - 1)
    record["empty_query"] = {"out_abs_max": float(out[empty, 0].abs().max()),
                             "lse": lse[empty, :, 0].cpu().numpy()[:4].tolist()}
    if sink:
        # The other convention: the sink inside the log-sum-exp.
        alt = np.logaddexp(np.asarray(ref_lse), attn_sink[None, :, None])
        record["lse_with_sink_inside"] = compare("lse", lse.cpu().numpy(), alt)
    return record


def schedule_case(rng, b, s_q, h_q, topk, pages=64):
    """Whether the schedules that could be shared equal the one the op makes for itself."""
    tokens = np.array(quantize_tokens(jnp.asarray(
        rng.normal(0, 0.3, (pages, 64, 1, 576)).astype(np.float32))))
    indices = t(rng.integers(-1, pages * 64, (b, s_q, topk)).astype(np.int32))
    q = t(rng.normal(0, 1, (b, s_q, h_q, 576)).astype(np.float32)).to(torch.bfloat16)
    kv = t(tokens).view(torch.float8_e4m3fn)

    def decode(md):
        md = md or (None, None)
        return op("sparse_decode_fwd")(q, kv, indices, None, None, md[0], md[1], None, None,
                                       None, 512, SCALE)

    own = decode(None)
    lengths = t(rng.integers(0, 100000, (b,)).astype(np.int32))
    candidates = {
        "topk_random_lengths": lambda: op("get_mla_decoding_metadata")(
            lengths, s_q * h_q, 1, h_q, True, topk),
        "topk_zero_lengths": lambda: op("get_mla_decoding_metadata")(
            torch.zeros_like(lengths), s_q * h_q, 1, h_q, True, topk),
        "dense_lengths_topk": lambda: op("get_mla_decoding_metadata")(
            torch.full_like(lengths, topk), s_q * h_q, 1, h_q, False, None),
    }
    record = {"b": b, "s_q": s_q, "h_q": h_q, "topk": topk,
              "own": [list(own[2].shape), own[2][:2].tolist(), own[3].tolist()[:8]]}
    for name, make in candidates.items():
        try:
            md = make()
            out, lse = decode(md)[:2]
            record[name] = {
                "shape": list(md[0].shape),
                "metadata_equal_first_5": bool(torch.equal(md[0][:, :5], own[2][:, :5])),
                "metadata_equal": bool(torch.equal(md[0], own[2])),
                "num_splits_equal": bool(torch.equal(md[1], own[3])),
                "out_equal": bool(torch.equal(out, own[0])),
                "lse_equal": bool(torch.equal(lse, own[1]))}
        except Exception as e:  # noqa: BLE001 - a refusal is what is probed
            record[name] = {"error": str(e)[:300]}
    return record


def prefill_case(rng, s_q, h_q, topk, keys, *, length=False, sink=False):
    kv = rng.normal(0, 0.3, (keys, 576)).astype(np.float32)
    kv_bf = jnp.asarray(kv, jnp.bfloat16)
    q_bf = jnp.asarray(rng.normal(0, 1, (s_q, h_q, 576)), jnp.bfloat16)
    indices = rng.integers(0, keys, (s_q, topk)).astype(np.int32)
    indices[0, ::4] = -1
    indices[1, :] = -1
    topk_length = rng.integers(1, topk + 1, (s_q,)).astype(np.int32) if length else None
    attn_sink = rng.normal(0, 2, (h_q,)).astype(np.float32) if sink else None
    ref_out, ref_lse = sparse_prefill_reference(
        q_bf, kv_bf, jnp.asarray(indices), softmax_scale=SCALE,
        topk_length=None if topk_length is None else jnp.asarray(topk_length),
        attn_sink=None if attn_sink is None else jnp.asarray(attn_sink))
    to_t = lambda x: t(np.asarray(x.astype(jnp.float32))).to(torch.bfloat16)
    args = (to_t(q_bf), to_t(kv_bf)[:, None, :], t(indices)[:, None, :], SCALE, 512,
            None if attn_sink is None else t(attn_sink),
            None if topk_length is None else t(topk_length))
    (result, sizes) = allocations(lambda: op("sparse_prefill_fwd")(*args))
    record = {"s_q": s_q, "h_q": h_q, "topk": topk, "length": length, "sink": sink,
              "allocations": sizes,
              "returned": [[list(r.shape), str(r.dtype)] for r in result],
              "out": compare("out", result[0].float().cpu().numpy(),
                             ref_out.astype(jnp.float32))}
    lse = result[2].cpu().numpy().T  # (h_q, s_q)
    record["lse_natural"] = compare("lse", lse, ref_lse)
    record["lse_base2"] = compare("lse", lse, np.asarray(ref_lse) / np.log(2))
    record["empty_query"] = {"out_abs_max": float(result[0][1].abs().max()),
                             "lse": result[2][1].cpu().numpy()[:4].tolist(),
                             "max_logits": result[1][1].cpu().numpy()[:4].tolist()}
    return record


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="probe_sparse.json")
    args = parser.parse_args()
    kernels.load_kernels()
    rng = np.random.default_rng(0)
    report = {"decode": [], "prefill": [], "schedule": [], "schemas": {
        name: str(op(name).default._schema) for name in ("sparse_decode_fwd",
                                                          "sparse_prefill_fwd")}}
    def attempt(kind, fn, **kwargs):
        try:
            report[kind].append(fn(rng, **kwargs))
        except Exception as e:  # noqa: BLE001 - what the kernel refuses is what is probed
            report[kind].append({**kwargs, "allocations": [], "error": str(e)[:300]})

    for kwargs in [dict(), dict(length=True), dict(sink=True), dict(nan="unread"),
                   dict(nan="read")]:
        for b, s_q, h_q in [(3, 1, 64), (5, 2, 128)]:
            attempt("decode", decode_case, b=b, s_q=s_q, h_q=h_q, topk=128, pages=20, **kwargs)
    attempt("decode", decode_case, b=128, s_q=1, h_q=128, topk=2048, pages=2048)
    for kwargs in [dict(), dict(length=True), dict(sink=True)]:
        attempt("prefill", prefill_case, s_q=70, h_q=64, topk=128, keys=500, **kwargs)
    for b, s_q, h_q, topk in [(1, 1, 64, 2048), (7, 2, 128, 512), (128, 1, 128, 2048),
                              (33, 2, 64, 128)]:
        attempt("schedule", schedule_case, b=b, s_q=s_q, h_q=h_q, topk=topk)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for kind in ("decode", "prefill", "schedule"):
        for r in report[kind]:
            shown = {k: v for k, v in r.items() if k != "allocations"}
            print(kind, json.dumps(shown), "allocations:", r.get("allocations", [])[:12])
    print("done")


if __name__ == "__main__":
    main()
