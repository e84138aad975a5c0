"""Shared by the GPU tests: FlashMLA's torch ops called directly on JAX's buffers (torch views
through DLPack), with arguments filled by name from each op's schema, as the bridge fills
them."""
import jax
import jax.numpy as jnp

from jax_flashmla import kernels


def torch_view(torch, x):
    """A torch view of a JAX array; FP8 goes through uint8, which every DLPack version has."""
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(
            torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def call_by_name(op, values):
    """Calls a FlashMLA op with its arguments filled by name from its schema."""
    args = []
    for arg in op.default._schema.arguments:
        if arg.name in values:
            args.append(values[arg.name])
        elif arg.default_value is not None or arg.type.kind() == "OptionalType":
            args.append(arg.default_value)
        else:
            raise KeyError(arg.name)
    return op(*args)


def torch_ops(fp8=False):
    """(torch, metadata op, decode op) of the loaded kernel library."""
    import torch

    ops = kernels.ensure_cuda_targets()
    names = (ops.metadata_fp8, ops.decode_fp8) if fp8 else (ops.metadata, ops.decode)
    resolve = lambda name: getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1])
    return torch, resolve(names[0]), resolve(names[1])


def torch_decode(q, kv, block_table, seq_lens, *, softmax_scale, k_scale=None):
    """(out, lse) of FlashMLA's metadata and decode ops called from torch, as NumPy arrays;
    with k_scale, the FP8 ops on an FP8 q and cache (no request of length 0)."""
    fp8 = k_scale is not None
    torch, metadata_op, decode_op = torch_ops(fp8)
    _, s_q, h_q, _ = q.shape
    t = lambda x: torch_view(torch, x)
    tsl = t(seq_lens)
    md, splits = call_by_name(metadata_op, dict(
        seqlens_k=tsl, num_q_tokens_per_head_k=s_q * h_q, num_heads_per_head_k=s_q * h_q,
        h_k=1, num_heads_k=1, h_q=h_q, is_fp8_kvcache=False))[:2]
    descale = t(jnp.asarray(k_scale, jnp.float32).reshape(1)) if fp8 else None
    out, lse = call_by_name(decode_op, dict(
        q=t(q), kv_cache=t(kv), kcache=t(kv), head_size_v=512, seqlens_k=tsl,
        block_table=t(block_table), softmax_scale=softmax_scale, is_causal=True,
        tile_scheduler_metadata=md, num_splits=splits, is_fp8=False, descale_q=descale,
        descale_k=descale))[:2]
    torch.cuda.synchronize()
    return out.float().cpu().numpy(), lse.cpu().numpy()
