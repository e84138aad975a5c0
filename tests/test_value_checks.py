"""jax_flashmla.value_checks(): each bad value a scheduler can compute is a checkify error
naming the argument, the request and the value; with the checks off the step holds none."""
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_flashmla as jf
from jax_flashmla.base import checks
from jax_flashmla.caches import fp8
from helpers import make_decode_inputs

IMPLEMENTATIONS = ["custom_call", "reference"]


@pytest.fixture(scope="module")
def inputs():
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(0), batch=3, s_q=1, h_q=16,
                                       mean_sk=300, varlen=True, dtype=jnp.bfloat16)
    return q, kv, jnp.asarray(bt), jnp.asarray(sl)


def _checked(fn, *args):
    with jf.value_checks():
        err, result = jax.jit(checkify.checkify(fn))(*args)
    return err, result


def _step(implementation):
    def step(q, kv, bt, sl, md_lens):
        md = jf.get_mla_metadata(md_lens, block_table=bt, num_pages=kv.shape[0], num_heads_q=16,
                                 implementation=implementation)
        return jf.mla_decode(q, kv, bt, sl, metadata=md, implementation=implementation)
    return step


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_good_values_pass_and_give_the_unchecked_results(inputs, implementation):
    q, kv, bt, sl = inputs
    err, (out, lse) = _checked(_step(implementation), q, kv, bt, sl, sl)
    err.throw()
    plain_out, plain_lse = jax.jit(_step(implementation))(q, kv, bt, sl, sl)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(plain_lse))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_length_past_the_block_table_is_named(inputs, implementation):
    q, kv, bt, sl = inputs
    bad = sl.at[1].set(bt.shape[1] * 64 + 1)
    err, _ = _checked(_step(implementation), q, kv, bt, bad, bad)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"get_mla_metadata: seq_lens\[1\] = {bt.shape[1] * 64 + 1} is outside "
                             rf"\[0, max_pages \* 64 = {bt.shape[1] * 64}\]"):
        err.throw()


def test_a_negative_length_is_named_by_the_metadata(inputs):
    q, kv, bt, sl = inputs
    bad = sl.at[2].set(-3)
    err, _ = _checked(lambda s: jf.get_mla_metadata(s, block_table=bt, num_pages=kv.shape[0],
                                                    num_heads_q=16,
                                                    implementation="custom_call").num_splits, bad)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"get_mla_metadata: seq_lens\[2\] = -3 is outside \[0, "):
        err.throw()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("page", [-1, 10**6])
def test_a_block_table_entry_outside_the_cache_is_named(inputs, implementation, page):
    q, kv, bt, sl = inputs
    bad = bt.at[0, 1].set(page)  # request 0 reads 2 or more pages
    assert int(sl[0]) > 64
    err, _ = _checked(_step(implementation), q, kv, bad, sl, sl)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"block_table\[0, 1\] = {page} is not a page of the cache "
                             rf"\(num_pages = {kv.shape[0]}\), and request 0 reads it"):
        err.throw()


def test_entries_a_request_does_not_read_are_not_checked(inputs):
    q, kv, bt, sl = inputs
    unread = np.asarray(bt).copy()
    unread[0, -(-int(sl[0]) // 64):] = -1  # past request 0's pages
    err, _ = _checked(_step("custom_call"), q, kv, jnp.asarray(unread), sl, sl)
    err.throw()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_metadata_of_other_lengths_is_named(inputs, implementation):
    q, kv, bt, sl = inputs
    err, _ = _checked(_step(implementation), q, kv, bt, sl, sl.at[2].add(-5))
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"mla_decode: seq_lens\[2\] = {int(sl[2])}, but the metadata was "
                             rf"made for {int(sl[2]) - 5} \(get_mla_metadata of another step\?\)"):
        err.throw()


def test_a_schedule_not_of_the_metadatas_lengths_is_named(inputs):
    q, kv, bt, sl = inputs

    def step(q, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0], num_heads_q=16,
                                 implementation="custom_call")
        other = jf.get_mla_metadata(sl - 100, block_table=bt, num_pages=kv.shape[0],
                                    num_heads_q=16, implementation="custom_call")
        md = md._replace(tile_scheduler_metadata=other.tile_scheduler_metadata,
                         num_splits=other.num_splits)
        return jf.mla_decode(q, kv, bt, sl, metadata=md, implementation="custom_call")

    err, _ = _checked(step, q, kv, bt, jnp.maximum(sl, 100))
    with pytest.raises(checkify.JaxRuntimeError,
                       match="mla_decode: metadata.tile_scheduler_metadata is not what "
                             "get_mla_metadata makes for the metadata's seq_lens"):
        err.throw()


def test_fp8_metadata_of_another_block_table_is_no_error(inputs):
    """The FP8 kernel reads the decode's own table: a metadata made with another table of
    the same lengths is no mistake, and the answer is the decode's table's."""
    q, kv, bt, sl = inputs
    scale = jnp.float32(1 / 400)
    kv8 = fp8.quantize(kv, scale)
    sl = sl.at[1].set(0)  # the kernel's table differs in this request's first slot

    def step(q, kv8, bt, md_bt, sl):
        md = jf.get_mla_metadata(sl, block_table=md_bt, num_pages=kv8.shape[0], num_heads_q=16,
                                 fp8=True, implementation="custom_call")
        return jf.mla_decode(q, kv8, bt, sl, metadata=md, k_scale=scale,
                             implementation="custom_call")

    err, (out, lse) = _checked(step, q, kv8, bt, (bt + 1) % kv8.shape[0], sl)
    err.throw()
    own_out, own_lse = jax.jit(step)(q, kv8, bt, bt, sl)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(own_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(own_lse))


@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_fp8_scale_is_named(inputs, value):
    _, kv, bt, sl = inputs
    cache = jnp.zeros((4, 64, 1, 576), jnp.float8_e4m3fn)
    err, _ = _checked(lambda s: jf.write_kv(cache, jnp.asarray([3], jnp.int32),
                                            kv=jnp.ones((1, 576), jnp.bfloat16), scale=s),
                      jnp.float32(value))
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"write_kv: scale = \S+ must be positive and finite"):
        err.throw()


def test_off_by_default_the_step_holds_no_check(inputs):
    q, kv, bt, sl = inputs
    plain = jax.jit(_step("custom_call")).lower(q, kv, bt, sl, sl).as_text()
    with jf.value_checks(False):
        off = jax.jit(_step("custom_call")).lower(q, kv, bt, sl, sl).as_text()
    assert plain == off
    with jf.value_checks():
        on = jax.jit(checkify.checkify(_step("custom_call"))).lower(q, kv, bt, sl, sl).as_text()
    # The given metadata and the one it is checked against.
    assert on.count("jax_flashmla_mla_metadata") == 2


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_bad_request_is_decoded_empty_and_changes_no_other(inputs, implementation):
    q, kv, bt, sl = inputs
    bad = bt.at[1, 0].set(-7)
    err, (out, lse) = _checked(_step(implementation), q, kv, bad, sl, sl)
    with pytest.raises(checkify.JaxRuntimeError, match=r"block_table\[1, 0\] = -7"):
        err.throw()
    assert not np.asarray(out[1], np.float32).any() and np.isinf(np.asarray(lse[1])).all()
    empty = sl.at[1].set(0)
    ok_out, ok_lse = jax.jit(_step(implementation))(q, kv, bt, empty, empty)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ok_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ok_lse))


def _example(doc):
    """The code of a docstring: its paragraphs indented by 4 or more, dedented."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return textwrap.dedent("\n".join(p for p in paragraphs
                                     if all(line.startswith("    ") for line in p.splitlines())))


@pytest.mark.parametrize("doc", [checks.__doc__, jf.value_checks.__doc__],
                         ids=["module", "value_checks"])
def test_the_documented_example_checks_the_step_it_runs(inputs, doc):
    """The example as written, on a step whose metadata is another step's: its error is set
    and names the value (jit traces at the first call, which must be inside the block)."""
    q, kv, bt, sl = inputs
    stale = jf.get_mla_metadata(sl.at[2].add(-5), block_table=bt, num_pages=kv.shape[0],
                                num_heads_q=16, implementation="custom_call")

    def step(q, kv, bt, sl, md):
        return jf.mla_decode(q, kv, bt, sl, metadata=md, implementation="custom_call")

    namespace = dict(jax=jax, jf=jf, jax_flashmla=jf, checkify=checkify, step=step,
                     args=(q, kv, bt, sl, stale))
    with pytest.raises(checkify.JaxRuntimeError,
                       match=rf"mla_decode: seq_lens\[2\] = {int(sl[2])}, but the metadata was "
                             rf"made for {int(sl[2]) - 5}"):
        exec(_example(doc), namespace)
    assert namespace["err"].get() is not None


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("own,message", [
    (70, r"mla_decode: seq_lens\[1\] = 70, but the metadata was made for 300 "),
    (300, r"mla_decode: seq_lens\[1\] = 300 is outside \[0, max_pages \* 64 = 256\]"),
])
def test_a_metadata_of_a_wider_table_is_named_by_the_decodes_own_length(implementation, own,
                                                                        message):
    """A metadata made for (200, 300) over 5 pages, a decode over 4 of them: the error names the
    decode's length (and the metadata's), and the decode runs (request 1 NaN)."""
    rng = np.random.default_rng(5)
    kv = jnp.asarray(rng.normal(0, 0.1, (12, 64, 1, 576)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(0, 0.1, (2, 1, 16, 576)), jnp.bfloat16)
    wide = jnp.arange(10, dtype=jnp.int32).reshape(2, 5)

    def step(q, kv, sl):
        md = jf.get_mla_metadata(jnp.asarray([200, 300], jnp.int32), block_table=wide,
                                 num_pages=12, num_heads_q=16, implementation=implementation)
        return jf.mla_decode(q, kv, wide[:, :4], sl, metadata=md, implementation=implementation)

    err, (out, _) = _checked(step, q, kv, jnp.asarray([200, own], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()
    assert np.isnan(np.asarray(out[1], np.float32)).all()
    assert not np.isnan(np.asarray(out[0], np.float32)).any()
