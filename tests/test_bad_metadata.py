"""The C++ target on metadata that does not fit the decode's inputs: every field out of range,
and metadata made for other lengths, is an XLA error naming what is wrong, never a crash nor
attention over part of the keys."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf
from jax_flashmla.ops.decode import MLAMetadata
from helpers import make_decode_inputs

BEGIN_REQ, END_REQ, BEGIN_BLOCK, END_BLOCK, BEGIN_SPLIT = range(5)


# The C++ model's checks: on a GPU, FlashMLA's kernel would take these schedules as they are
# and read outside its buffers, poisoning the process's CUDA context.
pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture(scope="module")
def step():
    with jax.default_device(jax.devices("cpu")[0]):
        return _step()


def _step():
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(0), batch=3, s_q=1, h_q=16,
                                       mean_sk=300, varlen=True, dtype=jnp.bfloat16)
    bt, sl = jnp.asarray(bt), jnp.asarray(sl)
    return q, kv, bt, sl, jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0],
                                              num_heads_q=16, implementation="custom_call")


def _decode(step, tile_md=None, num_splits=None):
    q, kv, bt, sl, md = step
    md = md._replace(
        tile_scheduler_metadata=md.tile_scheduler_metadata if tile_md is None else tile_md,
        num_splits=md.num_splits if num_splits is None else num_splits)
    return jax.block_until_ready(jf.mla_decode(q, kv, bt, sl, metadata=md,
                                               implementation="custom_call"))


@pytest.mark.parametrize("field,value,message", [
    (BEGIN_REQ, -1, "row 0 names requests outside the batch"),
    (BEGIN_REQ, 99, "row 0 names requests outside the batch"),
    (END_REQ, 99, "row 0 names requests outside the batch"),
    (BEGIN_BLOCK, -5, r"request 0, blocks -5 to"),
    (END_BLOCK, -5, "does not match num_splits and seq_lens"),
    (END_BLOCK, 1000, "does not match num_splits and seq_lens"),
    (BEGIN_SPLIT, -3, "does not match num_splits and seq_lens"),
    (BEGIN_SPLIT, 50, "does not match num_splits and seq_lens"),
])
def test_a_scheduler_field_out_of_range_is_an_error(step, field, value, message):
    tile_md = np.asarray(step[4].tile_scheduler_metadata).copy()
    tile_md[0, field] = value
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _decode(step, tile_md=jnp.asarray(tile_md))


@pytest.mark.parametrize("index,value,message", [
    (1, -4, "not a non-decreasing prefix sum"),
    (0, 2, "splits from 2"),
    (-1, 10**6, "at most batch \\+ num_sm_parts = 135"),
])
def test_num_splits_out_of_range_is_an_error(step, index, value, message):
    num_splits = np.asarray(step[4].num_splits).copy()
    num_splits[index] = value
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _decode(step, num_splits=jnp.asarray(num_splits))


def test_metadata_for_shorter_lengths_is_an_error(step):
    q, kv, bt, sl, _ = step
    shorter = jf.get_mla_metadata(sl - 100, block_table=bt, num_pages=kv.shape[0],
                                  num_heads_q=16, implementation="custom_call")
    with pytest.raises(jax.errors.JaxRuntimeError,
                       match=r"covers 4 of the 5 blocks of request 0 .*these seq_lens"):
        _decode(step, shorter.tile_scheduler_metadata, shorter.num_splits)
    _decode(step)  # the step's own metadata still decodes


def test_a_metadata_is_made_by_get_mla_metadata_alone(step):
    """The kernels trust a metadata's lengths and schedule: none is built from arrays or
    changed, while get_mla_metadata's crosses jit as it was."""
    q, kv, bt, sl, md = step
    with pytest.raises(TypeError, match="MLAMetadata is made by get_mla_metadata; it cannot be "
                                        "built from arrays"):
        MLAMetadata(sl * 1000, md.tile_scheduler_metadata, md.num_splits, 16, 1, 8, False)
    with pytest.raises(AttributeError, match="immutable"):
        md.seq_lens = sl * 1000
    through = jax.jit(lambda m: m)(md)
    assert isinstance(through, MLAMetadata) and through.max_pages == md.max_pages
    np.testing.assert_array_equal(through.tile_scheduler_metadata, md.tile_scheduler_metadata)
