"""FlashMLA's torch ops called directly on JAX's buffers, as a torch model would: the
comparison point of bench_grid.py (TorchSide) and bench_step.py (TorchStep). Arguments are
filled by name from each op's schema, as the bridge does, since the schemas differ between
kernel releases."""
import gc

import jax
import jax.numpy as jnp

from jax_flashmla.caches import fp8
from jax_flashmla.kernels import library as kernels

FP8 = "float8_e4m3fn"
D_QK, D_V = 576, 512


def captured(torch, step):
    """(replay, out): step() captured in a torch CUDA graph, warmed up off the default stream
    as capture wants."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # A capture failed once at the start of a point under the default mode. The CUDA calls
    # that JAX makes meanwhile (freeing the last point's arrays and executables, on its own
    # threads or from a garbage collection here) must not invalidate it.
    gc.disable()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = step()
    finally:
        gc.enable()
    return graph.replay, out


class TorchSide:
    def __init__(self, ops=None):
        """ops: the op names (kernels.ensure_cuda_targets(), which loads them, by default)."""
        ops = ops or kernels.ensure_cuda_targets()
        import torch

        self.torch = torch
        resolve = lambda name: getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1])
        # dtype of the cache -> (metadata op, decode op)
        self.ops = dict(bfloat16=(resolve(ops.metadata), resolve(ops.decode)))
        if ops.decode_fp8 and ops.metadata_fp8:
            self.ops[FP8] = (resolve(ops.metadata_fp8), resolve(ops.decode_fp8))
        # decode op -> where its schema takes (tile_scheduler_metadata, num_splits)
        self.metadata_slots = {}
        for _, decode_op in self.ops.values():
            names = [a.name for a in decode_op.default._schema.arguments]
            self.metadata_slots[decode_op] = (names.index("tile_scheduler_metadata"),
                                              names.index("num_splits"))
        self.info = dict(torch=torch.__version__, kernel_library=ops.library.path,
                         decode_op=ops.decode, metadata_op=ops.metadata,
                         decode_op_fp8=ops.decode_fp8, metadata_op_fp8=ops.metadata_fp8)

    def sync(self, _=None):
        self.torch.cuda.synchronize()

    def view(self, x):
        """A torch tensor over a JAX array's buffer; FP8 through uint8, which DLPack carries."""
        if x.dtype == jnp.float8_e4m3fn:
            return self.torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(
                self.torch.float8_e4m3fn)
        return self.torch.from_dlpack(x)

    def prepare(self, cache, k_scale, seq_lens, qs, block_tables, h_q, s_q, d_v):
        """(metadata op, its arguments, decode op, its arguments per (q, block_table) with the
        metadata slots to fill). For an FP8 cache, q is quantized here with k_scale, outside
        anything timed, and k_scale is both descales. Built once, so that the timed loops do
        no more than a model's."""
        dtype = jnp.dtype(cache.dtype).name
        if dtype not in self.ops:
            raise RuntimeError(f"the kernel library has no decode for a {dtype} cache")
        metadata_op, decode_op = self.ops[dtype]
        t = self.view
        tsl = t(seq_lens)
        metadata_args = kernels.arguments_by_name(metadata_op, dict(
            seqlens_k=tsl, num_q_tokens_per_head_k=s_q * h_q, num_heads_per_head_k=s_q * h_q,
            h_k=1, num_heads_k=1, h_q=h_q, is_fp8_kvcache=False))
        descale = None
        if dtype == FP8:
            qs = [jax.block_until_ready(fp8.quantize(q, k_scale)) for q in qs]
            descale = t(k_scale.reshape(1))
        tkv = t(cache)
        decode_args = [kernels.arguments_by_name(decode_op, dict(
            q=t(q), kv_cache=tkv, kcache=tkv, head_size_v=d_v, seqlens_k=tsl, block_table=t(bt),
            softmax_scale=q.shape[-1] ** -0.5, is_causal=True, tile_scheduler_metadata=None,
            num_splits=None, is_fp8=False, descale_q=descale, descale_k=descale))
            for q, bt in zip(qs, block_tables)]
        return metadata_op, metadata_args, decode_op, decode_args

    def decode_with(self, decode_op, args, metadata):
        """args, in place, with the metadata op's (tile_scheduler_metadata, num_splits)."""
        slot_metadata, slot_splits = self.metadata_slots[decode_op]
        args[slot_metadata], args[slot_splits] = metadata
        return args

    def decode_call(self, cache, seq_lens, q, block_table, h_q, s_q, d_v=512, k_scale=None):
        """A call of the decode op on these buffers, without arguments; its metadata is
        computed here, once, outside anything timed."""
        metadata_op, metadata_args, decode_op, (args,) = self.prepare(
            cache, k_scale, seq_lens, [q], [block_table], h_q, s_q, d_v)
        args = self.decode_with(decode_op, args, metadata_op(*metadata_args)[:2])
        return lambda: decode_op(*args)



class TorchStep:
    """bench_step.py's step with FlashMLA's torch ops, as SGLang runs decode: one cache tensor
    per layer and one block table; per layer an indexed write of the new rows, the decode, and
    the next layer's q and new rows' latent made from its out; the metadata once per step.
    Captured in a CUDA graph and replayed (SGLang's decode), and run eagerly."""

    def __init__(self):
        self.side = TorchSide(kernels.ensure_cuda_targets())
        self.torch = self.side.torch
        self.info = self.side.info

    def _view(self, x):
        return self.torch.from_dlpack(x)

    def _quantize(self, x, scale):
        """jax_flashmla.caches.fp8.quantize in torch: x * (1 / scale) in float32, clamped, rounded."""
        torch = self.torch
        return (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def steps(self, p):
        """({"torch_graph": (launch, sync), "torch_eager": (launch, sync)}, the last step's out
        as a JAX-comparable array) for a bench_step.Point; its caches are torch's own (copies
        of the point's)."""
        torch = self.torch
        fp8 = p.dtype == FP8
        metadata_op, decode_op = self.side.ops[p.dtype]
        as_bytes = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8) if fp8 else x
        base = self._view(as_bytes(p.base))
        caches = [torch.roll(base, layer, 0) for layer in range(p.layers)]
        if fp8:
            caches = [c.view(torch.float8_e4m3fn) for c in caches]
        block_table, seq_lens = self._view(p.block_table), self._view(p.seq_lens)
        slots = self._view(p.slots).reshape(-1).long()
        rows, rope = self._view(p.rows), self._view(p.rope)
        q0 = self._view(p.q0)
        scale = self._view(p.k_scale.reshape(1)) if fp8 else None
        metadata_args = kernels.arguments_by_name(metadata_op, dict(
            seqlens_k=seq_lens, num_q_tokens_per_head_k=p.s_q * p.h_q,
            num_heads_per_head_k=p.s_q * p.h_q, h_k=1, num_heads_k=1, h_q=p.h_q,
            is_fp8_kvcache=False))
        slot_md, slot_splits = self.side.metadata_slots[decode_op]

        def step():
            md = metadata_op(*metadata_args)[:2]
            q, latent = q0, rows[0][..., :D_V]
            for layer in range(p.layers):
                new = (rows[layer] if p.rows_from_inputs else
                       torch.cat([latent, rows[layer][..., D_V:]], dim=-1)).reshape(-1, D_QK)
                if fp8:
                    flat = caches[layer].view(torch.uint8).view(-1, D_QK)
                    flat[slots] = self._quantize(new, scale).view(torch.uint8)
                else:
                    caches[layer].view(-1, D_QK)[slots] = new
                args = kernels.arguments_by_name(decode_op, dict(
                    q=self._quantize(q, scale) if fp8 else q, kv_cache=caches[layer],
                    kcache=caches[layer], head_size_v=D_V, seqlens_k=seq_lens,
                    block_table=block_table, softmax_scale=p.softmax_scale, is_causal=True,
                    tile_scheduler_metadata=None, num_splits=None, is_fp8=False,
                    descale_q=scale, descale_k=scale))
                args[slot_md], args[slot_splits] = md
                out = decode_op(*args)[0]
                q, latent = torch.cat([out, rope[layer]], dim=-1), out[:, :, 0, :]
            return q[..., :D_V]

        replay, graph_out = captured(torch, step)

        def last_out():
            return jax.device_get(jnp.asarray(graph_out.float().cpu().numpy()))

        sync = torch.cuda.synchronize
        return {"torch_graph": (replay, sync), "torch_eager": (step, sync)}, last_out
