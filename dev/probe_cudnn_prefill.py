"""What jax's cuDNN flash attention does with MLA's prefill shapes on this GPU.

Checks, against a float32 reference:
  - jax.nn.dot_product_attention(implementation="cudnn") with v zero-padded to 192;
  - the packed (ragged) layout of jax's cuDNN wrapper: one batch row holding several requests
    as segments (q_offsets / kv_offsets), q/k head dim 192 with v 128, both without a mask
    (the new tokens over their prefix) and causal (the new tokens over themselves), with the
    softmax statistics (where in the returned array each segment's LSE lands);
  - segments of length 0 (a request with no prefix; padding);
and times the packed form at a new prompt and at a chunk over a prefix.

  python dev/probe_cudnn_prefill.py [--quick]
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo as fa


def reference(q, k, v, q_lens, kv_lens, q_starts, kv_starts, causal, scale):
    """Per-segment float32 attention: out (T, N, Hv), lse (T, N); 0 / -inf for no key."""
    q, k, v = (np.asarray(x, np.float32) for x in (q, k, v))
    out = np.zeros(q.shape[:2] + (v.shape[-1],), np.float32)
    lse = np.full(q.shape[:2], -np.inf, np.float32)
    for ql, kl, qs, ks in zip(q_lens, kv_lens, q_starts, kv_starts):
        if ql == 0 or kl == 0:
            continue
        s = np.einsum("tnh,snh->nts", q[qs:qs + ql], k[ks:ks + kl]) * scale
        if causal:
            s = np.where(np.arange(kl)[None, None, :] <= np.arange(ql)[None, :, None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        tot = p.sum(-1, keepdims=True)
        out[qs:qs + ql] = np.einsum("nts,snh->tnh", p / tot, v[ks:ks + kl])
        lse[qs:qs + ql] = (m + np.log(tot))[..., 0].T
    return out, lse


def packed_call(q, k, v, q_lens, kv_lens, q_starts, kv_starts, causal, scale):
    m = len(q_lens)
    as2 = lambda x: jnp.asarray(np.asarray(x, np.int32)[None])  # noqa: E731
    mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    return fa.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=as2(q_lens), kv_seqlen=as2(kv_lens),
        q_offsets=as2(list(q_starts) + [-1]), kv_offsets=as2(list(kv_starts) + [-1]),
        scale=scale, mask_type=mask, return_residual=True), m


def check_packed(rng, n, causal, q_lens, kv_lens, label, v_width=128):
    t, s = sum(q_lens) + 16, sum(kv_lens) + 16  # a padded tail beyond the segments
    q_starts = np.concatenate([[0], np.cumsum(q_lens)[:-1]]).astype(int)
    kv_starts = np.concatenate([[0], np.cumsum(kv_lens)[:-1]]).astype(int)
    q = jnp.asarray(rng.standard_normal((t, n, 192)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((s, n, 192)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((s, n, v_width)), jnp.bfloat16)
    scale = 192 ** -0.5
    try:
        (out, stats), m = packed_call(q, k, v, q_lens, kv_lens, q_starts, kv_starts, causal, scale)
    except Exception as e:  # noqa: BLE001 - a probe reports what failed
        print(f"{label}: FAILED {type(e).__name__}: {str(e)[:400]}")
        return
    ref_out, ref_lse = reference(q, k, v, q_lens, kv_lens, q_starts, kv_starts, causal, scale)
    out = np.asarray(out[0], np.float32)
    stats = np.asarray(stats, np.float32)
    print(f"{label}: out {out.shape} stats {stats.shape}")
    for i, (ql, kl, qs) in enumerate(zip(q_lens, kv_lens, q_starts)):
        seg = slice(qs, qs + ql)
        err = np.abs(out[seg] - ref_out[seg]).max() if ql else 0.0
        where = []
        for row in range(stats.shape[0]):
            for off in range(stats.shape[2] - ql + 1):
                cand = stats[row, :, off:off + ql].T
                if ql and kl and cand.shape == ref_lse[seg].shape and np.allclose(
                        cand, ref_lse[seg], atol=2e-2):
                    where.append(f"row {row} at {off}")
        sample = stats[:, 0, qs] if ql else None
        print(f"  seg {i} q_len {ql} kv_len {kl}: max|out-ref| {err:.3g}, finite out "
              f"{np.isfinite(out[seg]).all()}, lse found {where or 'nowhere'}, "
              f"stats[:,0,{qs}] {sample}")
    tail = out[sum(q_lens):]
    print(f"  tail rows: max|out| {np.abs(tail).max():.3g}, finite {np.isfinite(tail).all()}")


def time_fn(fn, *args, reps=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(reps):
        r = fn(*args)
    jax.block_until_ready(r)
    return (time.perf_counter() - start) / reps * 1e3


def timing(rng, n, t, prefix):
    q = jnp.asarray(rng.standard_normal((t, n, 192)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((prefix + t, n, 192)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((prefix + t, n, 128)), jnp.bfloat16)
    scale = 192 ** -0.5

    @jax.jit
    def packed(q, k, v):
        outs = []
        one = lambda x: jnp.asarray([[x]], jnp.int32)  # noqa: E731
        if prefix:
            outs.append(fa.dot_product_attention(
                q[None], k[None, :prefix], v[None, :prefix], q_seqlen=one(t), kv_seqlen=one(prefix),
                q_offsets=jnp.asarray([[0, -1]], jnp.int32),
                kv_offsets=jnp.asarray([[0, -1]], jnp.int32), scale=scale,
                mask_type=fa.MaskType.PADDING, return_residual=True))
        outs.append(fa.dot_product_attention(
            q[None], k[None, prefix:], v[None, prefix:], q_seqlen=one(t), kv_seqlen=one(t),
            q_offsets=jnp.asarray([[0, -1]], jnp.int32),
            kv_offsets=jnp.asarray([[0, -1]], jnp.int32), scale=scale,
            mask_type=fa.MaskType.PADDING_CAUSAL, return_residual=True))
        return outs

    @jax.jit
    def public(q, k, v):
        vp = jnp.pad(v, ((0, 0), (0, 0), (0, 64)))
        outs = []
        if prefix:
            outs.append(jax.nn.dot_product_attention(q[None], k[None, :prefix], vp[None, :prefix],
                                                     scale=scale, implementation="cudnn",
                                                     return_residual=True))
        outs.append(jax.nn.dot_product_attention(q[None], k[None, prefix:], vp[None, prefix:],
                                                 scale=scale, is_causal=True,
                                                 implementation="cudnn", return_residual=True))
        return outs

    flops = t * (prefix + t / 2) * n * 2 * (192 + 128)
    for name, fn in (("packed v128", packed), ("public v192", public)):
        try:
            ms = time_fn(fn, q, k, v)
            print(f"time {name}: T {t} prefix {prefix} h {n}: {ms:.3f} ms, "
                  f"{flops / ms / 1e9:.0f} TFLOPS")
        except Exception as e:  # noqa: BLE001
            print(f"time {name}: T {t} prefix {prefix}: FAILED {type(e).__name__}: {str(e)[:300]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print("jax", jax.__version__, "cudnn", fa.check_cudnn_version(), "masks",
          [m.name for m in fa.MaskType])
    rng = np.random.default_rng(0)
    for causal in (False, True):
        check_packed(rng, 4, causal, [5, 70, 130], [9, 64, 200], f"packed causal={causal}")
        check_packed(rng, 4, causal, [5, 0, 33], [0, 7, 40], f"packed zeros causal={causal}")
    check_packed(rng, 4, True, [300], [300], "one segment causal")
    # v as wide as q/k, so that the wrapper's offsets (scaled by q's N * H) are v's too.
    for causal in (False, True):
        check_packed(rng, 4, causal, [5, 70, 130], [9, 64, 200], f"v192 causal={causal}", 192)
        check_packed(rng, 4, causal, [5, 0, 33, 1], [0, 7, 40, 1], f"v192 zeros causal={causal}",
                     192)
    if args.quick:
        return
    for n, t, prefix in ((128, 16384, 0), (128, 2048, 32768), (16, 2048, 32768),
                         (128, 512, 32768)):
        timing(rng, n, t, prefix)


if __name__ == "__main__":
    main()
