"""Probe what the compiled FlashMLA torch ops accept, on the GPU machine.

Prints op schemas, which metadata columns the scheduler writes, supported head counts,
query lengths, dtypes and batch sizes. Its findings feed jax_flashmla/validation.py; the
output of each run is summarised in benchmarks/NOTES.md.

    python benchmarks/probe_kernels.py KERNEL_LIBRARY [FLASH_MLA_SITE_DIR]
"""
import sys

import torch

lib = sys.argv[1]
torch.ops.load_library(lib)
ns = torch.ops.sgl_kernel
for name in ["get_mla_decoding_metadata", "fwd_kvcache_mla", "fwd_kvcache_mla_fp8",
             "get_mla_decoding_metadata_dense_fp8"]:
    print("schema", getattr(ns, name).default._schema)

if len(sys.argv) > 2:
    sys.path.insert(0, sys.argv[2])
    import flash_mla  # noqa: F401
    print("flash_mla module", flash_mla.__file__, [n for n in dir(flash_mla) if not n.startswith("_")])
    for qual in torch._C._dispatch_get_all_op_names():
        if qual.startswith("flash_mla"):
            op = torch._C._dispatch_find_schema_or_throw(qual, "")
            print("flash_mla op", qual, torch._C._get_schema(qual, ""))

dev = "cuda"


def metadata(seqlens, s_q, h_q):
    return ns.get_mla_decoding_metadata(seqlens, s_q * h_q, 1, h_q, False, None)


# Which metadata columns does the scheduler write? Fill the allocator's cached block with a
# sentinel, free it, and see which columns keep the sentinel.
seqlens = torch.randint(1, 8192, (128,), dtype=torch.int32, device=dev)
for sentinel in (-12345, 777):
    for _ in range(3):
        md, nsplit = metadata(seqlens, 1, 128)
        shape = md.shape
        del md, nsplit
        junk = torch.full(shape, sentinel, dtype=torch.int32, device=dev)
        del junk
    md, nsplit = metadata(seqlens, 1, 128)
    col_has_sentinel = (md == sentinel).any(0).tolist()
    print("metadata shape", tuple(md.shape), "sentinel", sentinel, "columns keeping it", col_has_sentinel)
    print("metadata rows 0..2", md[:3].tolist(), "num_splits[:5]", nsplit[:5].tolist())


def try_decode(b, s_q, h_q, dtype, s_k=256):
    q = torch.randn(b, s_q, h_q, 576, dtype=dtype, device=dev)
    pages = (s_k + 63) // 64
    kv = torch.randn(b * pages, 64, 1, 576, dtype=dtype, device=dev)
    bt = torch.arange(b * pages, dtype=torch.int32, device=dev).view(b, pages)
    sl = torch.full((b,), s_k, dtype=torch.int32, device=dev)
    md, nsplit = metadata(sl, s_q, h_q)
    res = ns.fwd_kvcache_mla(q, kv, 512, sl, bt, 576 ** -0.5, True, md, nsplit, False,
                             None, None, None, None, None, None)
    torch.cuda.synchronize()
    out, lse = res[0], res[1]
    return (tuple(md.shape), tuple(out.shape), out.stride(), tuple(lse.shape), lse.stride(),
            len(res))


for dtype in (torch.bfloat16, torch.float16):
    for h_q in (1, 8, 16, 24, 32, 64, 96, 128, 256):
        for s_q in (1, 2, 3, 4, 8):
            try:
                r = try_decode(4, s_q, h_q, dtype)
                print("ok", dtype, "h_q", h_q, "s_q", s_q, r)
            except Exception as e:  # noqa: BLE001 - we are probing what the op rejects
                print("fail", dtype, "h_q", h_q, "s_q", s_q, str(e).splitlines()[0][:200])

for b in (1024, 4096, 4097, 8192, 16384, 65536):
    try:
        sl = torch.full((b,), 64, dtype=torch.int32, device=dev)
        md, nsplit = metadata(sl, 1, 128)
        torch.cuda.synchronize()
        print("metadata ok b", b, tuple(md.shape), int(nsplit[-1]))
    except Exception as e:  # noqa: BLE001
        print("metadata fail b", b, str(e).splitlines()[0][:200])

sl = torch.zeros(4, dtype=torch.int32, device=dev)
q = torch.randn(4, 1, 16, 576, dtype=torch.bfloat16, device=dev)
kv = torch.randn(4, 64, 1, 576, dtype=torch.bfloat16, device=dev)
bt = torch.arange(4, dtype=torch.int32, device=dev).view(4, 1)
md, nsplit = metadata(sl, 1, 16)
out, lse = ns.fwd_kvcache_mla(q, kv, 512, sl, bt, 576 ** -0.5, True, md, nsplit, False,
                              None, None, None, None, None, None)[:2]
print("zero length: out max", out.abs().max().item(), "lse", lse.flatten()[:4].tolist())
print("sm count", torch.cuda.get_device_properties(0).multi_processor_count)
