"""Whether the FlashMLA library runs DeepSeek-V4's ("MODEL1") sparse decode and its sparse
prefill at d_qk 512, and how far from a float64 reference: FlashMLA's torch ops called from
torch on the GPU, before any of jax_flashmla. Prints a JSON line per case and writes them all.

    python3 dev/probe_model1.py FLASHMLA_OPS_SO OUT.json   (device_check.sh mode model1-probe)

The MODEL1 FP8 cache, per page of 64 tokens: 64 rows of 576 bytes (448 e4m3 no-RoPE values,
64 bf16 RoPE values), then 64 rows of 8 bytes (7 ue8m0 scales, one per 64 dims, and a pad
byte), the page padded to a multiple of 576 bytes; the kernel takes a (pages, 64, 1, 584) view
of it with the page's stride.
"""
import json
import math
import sys
import traceback

import torch

LIB, OUT = sys.argv[1], sys.argv[2]
torch.ops.load_library(LIB)
ops = torch.ops.sgl_kernel
dev = "cuda"
report = {"schemas": [str(s) for s in torch._C._jit_get_all_schemas()
                      if "sgl_kernel::sparse" in str(s) or "decoding_metadata" in str(s)],
          "gpu": torch.cuda.get_device_name(), "cases": []}
for s in report["schemas"]:
    print(s)

PAGE, D, NOPE, TILE, NT = 64, 512, 448, 64, 7
PAGE_BYTES = (PAGE * (NOPE + 128 + NT + 1) + 575) // 576 * 576  # 37440


def quantize(k):
    """k (pages, 64, 512) bf16 -> (pages, PAGE_BYTES) uint8 in MODEL1's layout."""
    n = k.shape[0]
    out = torch.zeros(n, PAGE_BYTES, dtype=torch.uint8, device=k.device)
    data = out[:, :PAGE * 576].view(n, PAGE, 576)
    scales = out[:, PAGE * 576:PAGE * 584].view(n, PAGE, 8)
    nope = k[..., :NOPE].float().view(n, PAGE, NT, TILE)
    s = torch.pow(2, torch.clamp_min(nope.abs().amax(-1) / 448.0, 1e-4).log2().ceil())
    q8 = (nope / s[..., None]).to(torch.float8_e4m3fn).view(n, PAGE, NOPE)
    data[..., :NOPE] = q8.view(torch.uint8)
    data[..., NOPE:] = k[..., NOPE:].contiguous().view(torch.uint8)
    scales[..., :NT] = s.to(torch.float8_e8m0fnu).view(torch.uint8)
    return out


def dequantize(raw):
    """(pages, PAGE_BYTES) uint8 -> (pages*64, 512) float64, as the kernel multiplies (bf16)."""
    n = raw.shape[0]
    data = raw[:, :PAGE * 576].view(n, PAGE, 576)
    scales = raw[:, PAGE * 576:PAGE * 584].view(n, PAGE, 8)[..., :NT].contiguous()
    s = scales.view(torch.float8_e8m0fnu).to(torch.bfloat16)
    nope = data[..., :NOPE].contiguous().view(torch.float8_e4m3fn).to(torch.bfloat16)
    nope = (nope.view(n, PAGE, NT, TILE) * s[..., None]).view(n, PAGE, NOPE)
    rope = data[..., NOPE:].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], -1).double().view(n * PAGE, D)


def kernel_view(raw):
    return raw.view(torch.float8_e4m3fn).as_strided(
        (raw.shape[0], PAGE, 1, NOPE + 128 + NT + 1), (PAGE_BYTES, NOPE + 128 + NT + 1,
                                                        NOPE + 128 + NT + 1, 1))


def make_indices(b, s_q, topk, num_slots, gen, invalid_frac=0.2):
    idx = torch.randint(0, num_slots, (b, s_q, topk), generator=gen, dtype=torch.int32)
    bad = torch.rand((b, s_q, topk), generator=gen) < invalid_frac
    idx[bad] = -1
    return idx


def reference(q, rows_and_masks, scale, sink):
    """float64: q (b, s_q, h, 512); rows (b, s_q, n, 512) with valid masks (b, s_q, n)."""
    rows = torch.cat([r for r, _ in rows_and_masks], 2)
    valid = torch.cat([m for _, m in rows_and_masks], 2)
    logits = torch.einsum("bshd,bsnd->bshn", q.double(), rows) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], -math.inf)
    lse = torch.logsumexp(logits, -1)  # (b, s_q, h)
    p = torch.exp(logits - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bshn,bsnd->bshd", p, rows)
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.double()[None, None, :])[..., None]
    lonely = torch.isneginf(lse)
    out[lonely] = 0.0
    lse = lse.masked_fill(lonely, math.inf)
    return out, lse


def gather(table, idx, lengths):
    b, s_q, topk = idx.shape
    valid = idx >= 0
    if lengths is not None:
        valid &= torch.arange(topk, device=idx.device)[None, None, :] < lengths[:, None, None]
    rows = table[idx.clamp_min(0).long()]
    return rows.masked_fill(~valid[..., None], 0.0), valid


def decode_case(b, s_q, h_q, topk, extra_topk, with_len, with_extra_len, sink_kind, seed):
    gen = torch.Generator().manual_seed(seed)
    name = (f"decode b{b} s_q{s_q} h{h_q} topk{topk} extra{extra_topk} len{int(with_len)}"
            f" xlen{int(with_extra_len)} sink:{sink_kind}")
    pages, xpages = 7, 3
    k = (torch.randn(pages, PAGE, D, generator=gen) / 4).bfloat16().to(dev)
    raw = quantize(k)
    q = (torch.randn(b, s_q, h_q, D, generator=gen) / 4).bfloat16().to(dev)
    idx = make_indices(b, s_q, topk, pages * PAGE, gen).to(dev)
    idx[0] = -1  # a request with no valid main key
    lens = torch.randint(0, topk + 1, (b,), generator=gen, dtype=torch.int32).to(dev) \
        if with_len else None
    sink = None
    if sink_kind != "none":
        sink = torch.randn(h_q, generator=gen).float().to(dev)
        if sink_kind == "inf":
            sink[0], sink[1] = math.inf, -math.inf
    args = dict(xkv=None, xidx=None, xlens=None)
    parts = [gather(dequantize(raw), idx, lens)]
    if extra_topk:
        xk = (torch.randn(xpages, PAGE, D, generator=gen) / 4).bfloat16().to(dev)
        xraw = quantize(xk)
        xidx = make_indices(b, s_q, extra_topk, xpages * PAGE, gen).to(dev)
        if b > 1:
            xidx[1] = -1  # request 1 has no window key, request 0 no compressed one
        xlens = torch.randint(0, extra_topk + 1, (b,), generator=gen,
                              dtype=torch.int32).to(dev) if with_extra_len else None
        args = dict(xkv=kernel_view(xraw), xidx=xidx, xlens=xlens)
        parts.append(gather(dequantize(xraw), xidx, xlens))
    scale = D ** -0.5
    res = ops.sparse_decode_fwd(q, kernel_view(raw), idx, lens, sink, None, None,
                                args["xkv"], args["xidx"], args["xlens"], 512, scale)
    out, lse, sched, splits = res
    torch.cuda.synchronize()
    again = ops.sparse_decode_fwd(q, kernel_view(raw), idx, lens, sink, sched, splits,
                                  args["xkv"], args["xidx"], args["xlens"], 512, scale)
    ref_out, ref_lse = reference(q, parts, scale, sink)
    lse_bhs = lse.double()
    if lse_bhs.shape == (b, h_q, s_q):
        lse_bhs = lse_bhs.transpose(1, 2)
    finite = torch.isfinite(ref_lse)
    rel = ((out.double() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    case = dict(
        name=name, out_shape=list(out.shape), lse_shape=list(lse.shape),
        lse_strides=list(lse.stride()),
        sched_shape=list(sched.shape) if sched is not None else None,
        splits_shape=list(splits.shape) if splits is not None else None,
        out_rel_l2=rel, out_max_abs=(out.double() - ref_out).abs().max().item(),
        lse_natural_err=(lse_bhs[finite] - ref_lse[finite]).abs().max().item()
        if finite.any() else None,
        lse_base2_err=(lse_bhs[finite] * math.log(2) - ref_lse[finite]).abs().max().item()
        if finite.any() else None,
        lse_inf_where_lonely=bool(torch.equal(torch.isposinf(lse_bhs), ~finite)),
        out_zero_where_lonely=bool((out[~finite] == 0).all().item()) if (~finite).any()
        else None,
        reuse_schedule_identical=bool(torch.equal(again[0], out) and
                                      torch.equal(again[1], lse)),
        nan_out=bool(out.isnan().any().item()))
    if sink_kind == "inf":
        case["out_head0_zero(sink+inf)"] = bool((out[:, :, 0] == 0).all().item())
    print(json.dumps(case))
    report["cases"].append(case)


def prefill_case(s_q, h_q, s_kv, topk, with_sink, with_len, seed):
    gen = torch.Generator().manual_seed(seed)
    name = f"prefill s_q{s_q} h{h_q} s_kv{s_kv} topk{topk} sink{int(with_sink)} len{int(with_len)}"
    q = (torch.randn(s_q, h_q, D, generator=gen) / 4).bfloat16().to(dev)
    kv = (torch.randn(s_kv, 1, D, generator=gen) / 4).bfloat16().to(dev)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=gen, dtype=torch.int32)
    idx[torch.rand(s_q, 1, topk, generator=gen) < 0.2] = -1
    idx[0] = -1
    idx = idx.to(dev)
    sink = torch.randn(h_q, generator=gen).float().to(dev) if with_sink else None
    lens = torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=torch.int32).to(dev) \
        if with_len else None
    scale = D ** -0.5
    res = ops.sparse_prefill_fwd(q, kv, idx, scale, 512, sink, lens)
    out, lse = res[0], res[2]  # res[1]: the max logits
    rows, valid = gather(kv[:, 0].double(), idx[:, 0][None], None)
    if with_len:
        valid &= torch.arange(topk, device=dev)[None, None, :] < lens[None, :, None]
        rows = rows.masked_fill(~valid[..., None], 0.0)
    ref_out, ref_lse = reference(q[None], [(rows, valid)], scale, sink)
    ref_out, ref_lse = ref_out[0], ref_lse[0]
    finite = torch.isfinite(ref_lse)
    rel = ((out.double() - ref_out).norm() / ref_out.norm()).item()
    case = dict(name=name, n_results=len(res), out_shape=list(out.shape),
                lse_shape=list(lse.shape), out_rel_l2=rel,
                lse_natural_err=(lse.double()[finite] - ref_lse[finite]).abs().max().item(),
                lse_base2_err=(lse.double()[finite] * math.log(2)
                               - ref_lse[finite]).abs().max().item(),
                lonely_lse=lse[~finite][:2].tolist() if (~finite).any() else None,
                out_zero_where_lonely=bool((out[~finite] == 0).all().item()))
    print(json.dumps(case))
    report["cases"].append(case)


cases = [
    (3, 1, 64, 128, 128, True, True, "finite"), (3, 2, 128, 128, 128, True, True, "inf"),
    (5, 1, 128, 512, 128, True, True, "finite"), (2, 2, 64, 64, 0, False, False, "none"),
    (7, 1, 64, 128, 128, False, False, "inf"), (67, 2, 64, 512, 128, True, False, "finite"),
    (131, 1, 128, 512, 128, True, True, "finite"),
]
for i, c in enumerate(cases):
    try:
        decode_case(*c, seed=i)
    except Exception as e:  # a case the kernel refuses: record and go on
        traceback.print_exc()
        report["cases"].append(dict(name=str(c), error=repr(e)[:500]))
for i, c in enumerate([(64, 64, 1000, 512, True, True), (130, 128, 4096, 512, True, False),
                       (64, 128, 300, 128, False, True)]):
    try:
        prefill_case(*c, seed=100 + i)
    except Exception as e:
        traceback.print_exc()
        report["cases"].append(dict(name=str(c), error=repr(e)[:500]))
json.dump(report, open(OUT, "w"), indent=1)
