"""What the prefix's decompression would cost in cuBLAS forms XLA's dots cannot express.

Times, from torch on one GPU, the latent rows (S, 576) decompressed into keys (S, h, 192) and
values (S, h, 128):
  xla-form   what mla_prefill's einsums compute: the rows times W_UK with an identity on the
             rope columns (576 x h*192), and times W_UV padded with zeros (576 x h*128);
  per-head   k_nope of each head by its own matmul written straight into the keys' columns
             (ldc h*192), the rope columns copied in, v from the 512 latent columns (lda 576);
  batched    the same k_nope as one strided-batched matmul over the heads (the rows broadcast).
Also says which causal alignment jax's cuDNN attention uses when queries and keys differ in
number (top-left: query i sees keys <= i; bottom-right: keys <= i + S - T): bottom-right would
let one call attend new tokens to a prefix and to themselves.
  python dev/probe_decompress.py [--keys 32768] [--heads 16] [--out FILE]
"""
import argparse
import json

import torch


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def decompression(s, h, results):
    dev, dt = "cuda", torch.bfloat16
    rows = torch.randn(s, 576, device=dev, dtype=dt)
    w_uk = torch.randn(512, h, 128, device=dev, dtype=dt) / 20
    w_uv = torch.randn(512, h, 128, device=dev, dtype=dt) / 20
    eye = torch.eye(64, device=dev, dtype=dt)[:, None, :].expand(64, h, 64)
    w_k = torch.cat([torch.cat([w_uk, torch.zeros(512, h, 64, device=dev, dtype=dt)], -1),
                     torch.cat([torch.zeros(64, h, 128, device=dev, dtype=dt), eye], -1)])
    w_v = torch.cat([w_uv, torch.zeros(64, h, 128, device=dev, dtype=dt)])
    keys = torch.empty(s, h, 192, device=dev, dtype=dt)
    values = torch.empty(s, h, 128, device=dev, dtype=dt)
    latent = rows[:, :512]

    def xla_form():
        torch.mm(rows, w_k.view(576, -1), out=keys.view(s, -1))
        torch.mm(rows, w_v.view(576, -1), out=values.view(s, -1))

    def rope():
        keys[:, :, 128:] = rows[:, None, 512:]

    def v_latent():
        torch.mm(latent, w_uv.view(512, -1), out=values.view(s, -1))

    def k_per_head():
        for j in range(h):
            torch.mm(latent, w_uk[:, j], out=keys[:, j, :128])

    def per_head():
        k_per_head()
        rope()
        v_latent()

    def batched():
        # (h, s, 128) views with strides (192, h*192, 1): no copy if torch takes them as they are.
        out = keys.as_strided((h, s, 128), (192, h * 192, 1))
        torch.bmm(latent.unsqueeze(0).expand(h, s, 512), w_uk.permute(1, 0, 2), out=out)
        rope()
        v_latent()

    reference = torch.einsum("sc,chd->shd", rows.float(), w_k.float())
    for name, fn in (("xla-form", xla_form), ("per-head", per_head), ("batched", batched)):
        keys.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        err = ((keys.float() - reference).norm() / reference.norm()).item()
        results[f"{name} us"] = timed(fn)
        results[f"{name} rel err"] = err
    results["rope copy us"] = timed(rope)
    results["v from latent us"] = timed(v_latent)
    results["k per head us"] = timed(k_per_head)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        batched()
        torch.cuda.synchronize()
    results["batched kernels"] = [e.name[:90] for e in prof.events()
                                  if e.device_type == torch.autograd.DeviceType.CUDA]


def cudnn_alignment(results):
    import jax
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as fa
    t, s, h, d = 128, 384, 2, 64
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, s, h, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, s, h, d), jnp.bfloat16)
    scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * 0.125
    row, col = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    # Whole lengths, then padded ones (the first q_len queries over the first kv_len keys).
    for q_len, kv_len in ((t, s), (100, 300)):
        mask = fa.MaskType.CAUSAL if q_len == t else fa.MaskType.PADDING_CAUSAL
        lens = {} if q_len == t else dict(q_seqlen=jnp.array([q_len], jnp.int32),
                                          kv_seqlen=jnp.array([kv_len], jnp.int32))
        out = fa.dot_product_attention(q, k, v, scale=0.125, mask_type=mask, qkv_layout="BTNH",
                                       **lens)[:, :q_len]
        for name, shift in (("top-left", 0), ("bottom-right", kv_len - q_len)):
            visible = (col <= row + shift) & (col < kv_len)
            p = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
            ref = jnp.einsum("bhts,bshd->bthd", p, v.astype(jnp.float32))[:, :q_len]
            results[f"cudnn {mask.name} {q_len}x{kv_len} vs {name} max err"] = float(
                jnp.abs(out - ref).max())


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {"keys": args.keys, "heads": args.heads}
    decompression(args.keys, args.heads, results)
    try:
        cudnn_alignment(results)
    except Exception as e:  # noqa: BLE001 - reported, the timings stand
        results["cudnn alignment error"] = repr(e)[:400]
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
