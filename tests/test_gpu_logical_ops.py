"""On a machine of two GPUs or more: the sparse decode, the sparse prefill and the indexer's
selection on their custom calls (FlashMLA's kernels, jax_flashmla's own), split along batch or
rows over two GPUs: each GPU's results are, bit for bit, the op's on its rows alone on one GPU,
each call runs its kernel once per GPU, and no collective moves anything."""
import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_flashmla.ops.indexer import IndexQuery, index_scores
from jax_flashmla.sparse import indexer_decode, sparse_mla_decode, sparse_mla_prefill
from test_logical_ops import (_indexer_problem, _sparse_decode_problem,
                              _sparse_prefill_problem)

pytestmark = pytest.mark.gpu(count=2)


def _sparse_decode(q, cache, indices, sink):
    return sparse_mla_decode(q, cache, indices, attn_sink=sink, implementation="custom_call")


def _sparse_prefill(q, kv, indices, sink):
    return sparse_mla_prefill(q, kv, indices, attn_sink=sink, implementation="custom_call")


def _indexer_decode(query, cache, block_table, lengths):
    query = IndexQuery(query.values[:, None], query.weights[:, None])
    return indexer_decode(query, cache, block_table, lengths, topk=32,
                          implementation="custom_call")


def _index_scores(query, cache, block_table, lengths):
    return index_scores(query, cache, block_table, lengths, implementation="custom_call")


# (the op on a problem, the problem, the custom call's target, the results' axes along rows)
OPS = {
    "sparse_decode": (_sparse_decode, _sparse_decode_problem, "jax_flashmla_mla_sparse_decode",
                      (0, 0)),
    "sparse_prefill": (_sparse_prefill, _sparse_prefill_problem,
                       "jax_flashmla_mla_sparse_prefill", (0, 1)),
    "indexer_decode": (_indexer_decode, _indexer_problem, "jax_flashmla_index_topk", (0,)),
    "index_scores": (_index_scores, _indexer_problem, "jax_flashmla_index_topk", (0,)),
}


@pytest.mark.parametrize("name", OPS)
def test_split_over_two_gpus_equals_each_gpus_rows_alone(name):
    op, problem, target, axes = OPS[name]
    gpus = [d for d in jax.devices() if d.platform == "gpu"][:2]
    mesh = Mesh(np.array(gpus), ("x",))
    args = problem()
    split = (True, False, True, True) if name.startswith("index") else (True, False, True, False)
    spread = [jax.tree.map(lambda x, s=s: jax.device_put(x, NamedSharding(
        mesh, P("x" if s else None))), a) for a, s in zip(args, split)]
    compiled = jax.jit(op).lower(*spread).compile()
    got = jax.tree.leaves(compiled(*spread))
    rows = jax.tree.leaves(args[0])[0].shape[0] // 2
    for i in range(2):
        local = [jax.tree.map(lambda x, s=s: x[i * rows:(i + 1) * rows] if s else x, a)
                 for a, s in zip(args, split)]
        want = jax.tree.leaves(jax.jit(op)(*jax.device_put(local, gpus[0])))
        for g, w, axis in zip(got, want, axes):
            np.testing.assert_array_equal(
                np.asarray(jax.lax.slice_in_dim(g, i * rows, (i + 1) * rows, axis=axis)),
                np.asarray(w))
    hlo = compiled.as_text()
    assert len(re.findall(rf'custom_call_target="{target}"', hlo)) == 1, hlo
    assert not re.search(r"all-gather|all-reduce|all-to-all|collective-permute", hlo)
