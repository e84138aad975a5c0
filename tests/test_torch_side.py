"""benchmarks/torch_side.py fills FlashMLA's torch ops by schema name: here against stand-in
ops registered (for any device) with the schemas of sglang-kernel 0.4.6 (bf16 and FP8 decode,
both schedulers), which record what they were given."""
import os
import sys
import types

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from torch_side import FP8, TorchSide  # noqa: E402

from jax_flashmla.caches import fp8  # noqa: E402

SCHEMAS = {
    "get_mla_decoding_metadata": "(Tensor seqlens_k, int num_q_tokens_per_head_k, int h_k, "
                                 "int? h_q, bool is_fp8_kvcache, int? topk) -> Tensor[]",
    "fwd_kvcache_mla": "(Tensor q, Tensor kv_cache, int head_size_v, Tensor seqlens_k, "
                       "Tensor block_table, float softmax_scale, bool is_causal, "
                       "Tensor tile_scheduler_metadata, Tensor num_splits, bool is_fp8, "
                       "Tensor? indices, Tensor? attn_sink, Tensor? extra_k_cache, "
                       "Tensor? extra_indices_in_kvcache, Tensor? topk_length, "
                       "Tensor? extra_topk_length) -> Tensor[]",
    "get_mla_decoding_metadata_dense_fp8": "(Tensor seqlens_k, int num_heads_per_head_k, "
                                           "int num_heads_k) -> Tensor[]",
    "fwd_kvcache_mla_fp8": "(Tensor q, Tensor kcache, int head_size_v, Tensor seqlens_k, "
                           "Tensor block_table, float softmax_scale, bool is_causal, "
                           "Tensor tile_scheduler_metadata, Tensor num_splits, "
                           "Tensor? descale_q, Tensor? descale_k) -> Tensor[]",
}
CALLS = []


@pytest.fixture(scope="module")
def side():
    library = torch.library.Library("jf_stand_in", "DEF")
    for name, schema in SCHEMAS.items():
        library.define(name + schema)

        def record(*args, _name=name):
            CALLS.append((_name, args))
            return [torch.full((2,), len(CALLS)), torch.zeros(3)]
        library.impl(name, record, "CompositeExplicitAutograd")
    yield TorchSide(types.SimpleNamespace(
        library=types.SimpleNamespace(path="stand-in"),
        metadata="jf_stand_in::get_mla_decoding_metadata", decode="jf_stand_in::fwd_kvcache_mla",
        metadata_fp8="jf_stand_in::get_mla_decoding_metadata_dense_fp8",
        decode_fp8="jf_stand_in::fwd_kvcache_mla_fp8"))
    del library


def _inputs(dtype):
    q = jnp.ones((2, 1, 16, 576), jnp.bfloat16)
    cache = jnp.ones((4, 64, 1, 576), jnp.bfloat16)
    k_scale = jnp.float32(0.5)
    if dtype == FP8:
        cache = fp8.quantize(cache, k_scale)
    return q, cache, k_scale, jnp.array([64, 100], jnp.int32), jnp.array([[0, 1], [2, 3]],
                                                                        jnp.int32)


def test_bf16_decode_is_filled_by_name(side):
    q, cache, _, seq_lens, block_table = _inputs("bfloat16")
    CALLS.clear()
    call = side.decode_call(cache, seq_lens, q, block_table, h_q=16, s_q=1)
    name, args = CALLS[0]
    assert name == "get_mla_decoding_metadata" and args[1:] == (16, 1, 16, False, None)
    call()
    name, args = CALLS[1]
    assert name == "fwd_kvcache_mla" and len(args) == 16
    assert args[2] == 512 and args[5] == pytest.approx(576 ** -0.5) and args[6] is True
    assert args[9] is False and args[10:] == (None,) * 6
    assert args[0].dtype == torch.bfloat16 and tuple(args[1].shape) == (4, 64, 1, 576)
    assert args[7][0].item() == 1  # the metadata op's results, in their slots
    np.testing.assert_array_equal(args[4].cpu().numpy(), np.asarray(block_table))


def test_fp8_decode_gets_quantized_q_and_the_descales(side):
    q, cache, k_scale, seq_lens, block_table = _inputs(FP8)
    CALLS.clear()
    side.decode_call(cache, seq_lens, q, block_table, h_q=16, s_q=1, k_scale=k_scale)()
    (md_name, md_args), (name, args) = CALLS
    assert md_name == "get_mla_decoding_metadata_dense_fp8" and md_args[1:] == (16, 1)
    assert name == "fwd_kvcache_mla_fp8" and len(args) == 11
    assert args[0].dtype == torch.float8_e4m3fn and args[1].dtype == torch.float8_e4m3fn
    # q of ones over a scale of 0.5: 2.0 in e4m3.
    assert args[0].float().unique().cpu().tolist() == [2.0]
    assert args[9].cpu().tolist() == [0.5] and args[10].cpu().tolist() == [0.5]


def test_a_cache_dtype_without_ops_is_refused(side):
    q, cache, _, seq_lens, block_table = _inputs("bfloat16")
    with pytest.raises(RuntimeError, match="no decode for a float16 cache"):
        side.decode_call(cache.astype(jnp.float16), seq_lens, q, block_table, h_q=16, s_q=1)
