"""bench_step.py's step with FlashMLA's torch ops, as SGLang runs decode: one cache tensor per
layer and one block table; per layer an indexed write of the new rows, the decode, and the
next layer's q and new rows' latent made from its out; the metadata once per step. Captured in a CUDA graph and replayed
(SGLang's decode), and run eagerly."""
import jax
import jax.numpy as jnp

from jax_flashmla import kernels

from torch_side import FP8, TorchSide

D_QK, D_V = 576, 512


class TorchStep:
    def __init__(self):
        self.side = TorchSide(kernels.ensure_cuda_targets())
        self.torch = self.side.torch
        self.info = self.side.info

    def _view(self, x):
        return self.torch.from_dlpack(x)

    def _quantize(self, x, scale):
        """jax_flashmla.fp8.quantize in torch: x * (1 / scale) in float32, clamped, rounded."""
        torch = self.torch
        return (x.float() * (1.0 / scale)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    def steps(self, p):
        """({"torch_graph": run, "torch_eager": run}, the last step's out as a JAX-comparable
        array) for a bench_step.Point; its caches are torch's own (copies of the point's)."""
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
        metadata_args = self.side.by_name(metadata_op, dict(
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
                args = self.side.by_name(decode_op, dict(
                    q=self._quantize(q, scale) if fp8 else q, kv_cache=caches[layer],
                    kcache=caches[layer], head_size_v=D_V, seqlens_k=seq_lens,
                    block_table=block_table, softmax_scale=p.softmax_scale, is_causal=True,
                    tile_scheduler_metadata=None, num_splits=None, is_fp8=False,
                    descale_q=scale, descale_k=scale))
                args[slot_md], args[slot_splits] = md
                out = decode_op(*args)[0]
                q, latent = torch.cat([out, rope[layer]], dim=-1), out[:, :, 0, :]
            return q[..., :D_V]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up off the default stream, as capture wants
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_out = step()

        def replay():
            graph.replay()
            torch.cuda.synchronize()

        def eager():
            step()
            torch.cuda.synchronize()

        def last_out():
            return jax.device_get(jnp.asarray(graph_out.float().cpu().numpy()))

        return {"torch_graph": replay, "torch_eager": eager}, last_out
