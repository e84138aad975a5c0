"""The grid's inputs at one (batch, mean s_k, lengths): a paged bf16 cache (and its FP8
quantization), block tables over it in several random page orders, per-layer caches for a
step, and queries, as FlashMLA's own tests make them (bench_grid.py)."""
import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla.caches import fp8

from torch_side import FP8

PAGE = 64
D_QK, D_V = 576, 512


class Workload:
    """One cache of bf16 pages for (batch, mean s_k, varlen), shared by every (h_q, s_q), and
    `rotations` block tables over it, each a different random page order; the same cache in
    FP8 when asked for, with one per-tensor scale (amax / 448, as a static k scale)."""

    def __init__(self, batch, mean_s_k, varlen, min_len, rotations, seed):
        rng = np.random.default_rng(seed)
        if varlen:  # as FlashMLA's test: max(normal(mean, mean / 2), s_q)
            lens = np.maximum(rng.normal(mean_s_k, mean_s_k / 2, batch), min_len)
        else:
            lens = np.full(batch, mean_s_k)
        self.seq_lens_np = lens.astype(np.int32)
        pages = -(-self.seq_lens_np // PAGE)
        num_pages, width = int(pages.sum()), int(pages.max())
        self.block_tables = []
        for _ in range(rotations):
            order = rng.permutation(num_pages).astype(np.int32)
            table = np.zeros((batch, width), np.int32)  # slots past a request's pages: never read
            for i, chunk in enumerate(np.split(order, np.cumsum(pages)[:-1])):
                table[i, :len(chunk)] = chunk
            self.block_tables.append(jnp.asarray(table))
        # FlashMLA's tests' data scale: normal / 10, clipped to [-1, 1].
        self.key = jax.random.key(seed)
        kv = jax.random.normal(self.key, (num_pages, PAGE, 1, D_QK), jnp.bfloat16) / 10
        self.kv = jax.block_until_ready(jnp.clip(kv, -1, 1))
        self.k_scale = (jnp.max(jnp.abs(self.kv)).astype(jnp.float32) / fp8.FP8_MAX)
        self._kv_fp8 = None
        self._layer_caches = {}
        self.seq_lens = jnp.asarray(self.seq_lens_np)
        self.batch, self.mean_s_k, self.varlen = batch, mean_s_k, varlen
        self.sum_s_k = int(self.seq_lens_np.sum())

    def cache(self, dtype):
        if dtype != FP8:
            return self.kv
        if self._kv_fp8 is None:
            self._kv_fp8 = jax.block_until_ready(jax.jit(fp8.quantize)(self.kv, self.k_scale))
        return self._kv_fp8

    def layer_caches(self, dtype, count):
        """`count` caches for a step's layers over block_tables[0]: the cache with its pages
        rolled by a different offset each, so that no layer reads what the one before left
        in the L2."""
        if dtype not in self._layer_caches:
            cache, pages = self.cache(dtype), self.kv.shape[0]
            self._layer_caches[dtype] = [
                jax.block_until_ready(jnp.roll(cache, j * pages // count, axis=0))
                for j in range(count)]
        return self._layer_caches[dtype]

    def queries(self, h_q, s_q, rotations):
        keys = jax.random.split(jax.random.fold_in(self.key, h_q * 8 + s_q), rotations)
        shape = (self.batch, s_q, h_q, D_QK)
        return [jnp.clip(jax.random.normal(k, shape, jnp.bfloat16) / 10, -1, 1) for k in keys]

    def reference_bytes(self, h_q, s_q):
        """A rough peak of the reference's temporaries: gathered and masked keys (bf16), float32
        values, and ~4 float32 score-sized arrays (scores, mask, exp, weights)."""
        tokens = self.batch * self.block_tables[0].shape[1] * PAGE
        return tokens * (2 * D_QK * 2 + D_QK * 4 + D_V * 4 + 4 * h_q * s_q * 4)
