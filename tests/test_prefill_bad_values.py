"""mla_prefill on bad values: starts and lengths whose int32 sums would wrap, a NaN in one
request's rows, a prefix longer than its block-table row, and arguments whose errors must name
them. A bad request is answered empty, every other as in the batch without it, and
value_checks() names the argument, the request and the value.

On CPU the cases run through the "reference" path; the `gpu` ones run them through cuDNN too
("custom_call"), over bf16 and FP8 caches.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_flashmla as jf
from jax_flashmla.ops import prefill
from prefill_cases import call, make_case, rows_of, without
from test_prefill import SCALE, checked_call

INT32_MAX = 2**31 - 1
# Three requests with padding rows between them: rows [1, 21), [23, 53), [56, 81) of 84.
THREE = dict(prefix_lens=[10, 70, 5], query_lens=[20, 30, 25], gaps=[1, 2, 3])
LATENT = 7  # a latent column of a cache row
# cuDNN's path at DeepSeek's head sizes, as tests/test_gpu_prefill.py runs it.
SIZES = {"reference": {}, "custom_call": dict(heads=16, nope=128, v_dim=128)}


@pytest.fixture(params=["reference", pytest.param("custom_call", marks=pytest.mark.gpu)])
def implementation(request):
    return request.param


@pytest.fixture(params=[False, True], ids=["bf16", "fp8"])
def fp8_cache(request):
    return request.param


def three(implementation, fp8_cache, **changes):
    case = make_case(np.random.default_rng(0), **THREE, fp8_cache=fp8_cache,
                     **SIZES[implementation])
    return case | changes


def run(case, implementation):
    out, lse = call(jf.mla_prefill, case, softmax_scale=SCALE, implementation=implementation)
    return np.asarray(out, np.float32), np.asarray(lse)


def assert_empty(out, lse, rows):
    assert np.all(out[rows] == 0) and np.all(np.isposinf(lse[:, rows]))


def assert_same(got, want, rows):
    """out and lse bit for bit on these rows."""
    np.testing.assert_array_equal(got[0][rows], want[0][rows])
    np.testing.assert_array_equal(got[1][:, rows], want[1][:, rows])


def request_rows(case, r):
    first, n = rows_of(case)[r]
    return np.arange(first, first + n)


# A bad value of request 1 whose sum with another wrapped int32: (argument, value, what
# value_checks() says).
WRAPS = {"start near INT32_MAX": ("query_starts", 2**31 - 10,
                                  r"query_lens\[1\] = 30 with query_starts\[1\] = 2147483638: "
                                  r"rows outside \[0, 84\)"),
         "length INT32_MAX": ("query_lens", INT32_MAX,
                              r"query_lens\[1\] = 2147483647 with query_starts\[1\] = 23: "
                              r"rows outside \[0, 84\)")}


@pytest.mark.parametrize("bad", WRAPS)
def test_wrapping_values_give_that_request_an_empty_answer(implementation, fp8_cache, bad):
    """Request 1 is answered empty; requests 0 and 2 as in the batch without request 1."""
    case = three(implementation, fp8_cache)
    name, value, _ = WRAPS[bad]
    out, lse = run(case | {name: case[name].at[1].set(value)}, implementation)
    assert_empty(out, lse, request_rows(case, 1))
    others = np.concatenate([request_rows(case, 0), request_rows(case, 2)])
    assert_same((out, lse), run(without(case, 1), implementation), others)


@pytest.mark.parametrize("bad", WRAPS)
def test_value_checks_name_wrapping_values(bad):
    case = three("reference", False)
    name, value, message = WRAPS[bad]
    err, _ = checked_call(case | {name: case[name].at[1].set(value)})
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()


def packed_past_int32(implementation, fp8_cache):
    """Packed requests of 20, 1, 1, 7 and 25 rows; given 20, INT32_MAX, INT32_MAX, 7 and 25,
    request 4's start wraps to row 25, within q."""
    case = make_case(np.random.default_rng(1), [10, 0, 0, 0, 5], [20, 1, 1, 7, 25],
                     fp8_cache=fp8_cache, **SIZES[implementation])
    return case, case | dict(query_lens=case["query_lens"].at[1:3].set(INT32_MAX))


def test_packed_lengths_past_int32_push_the_later_requests_out(implementation, fp8_cache):
    """Request 1's rows leave q, and every later request's start with them: all come out
    empty, request 0 as without them."""
    case, bad = packed_past_int32(implementation, fp8_cache)
    out, lse = run(bad, implementation)
    mine = request_rows(case, 0)
    assert_empty(out, lse, np.arange(mine[-1] + 1, out.shape[0]))
    assert_same((out, lse), run(case, implementation), mine)
    err, _ = checked_call(bad)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"query_lens\[1\] = 2147483647 from row 20, packed after"):
        err.throw()


@pytest.mark.parametrize("cap", [2**30, 2**31 - 1])
def test_starts_past_the_axis_never_wrap_back_into_it(cap):
    """Where lengths may sum past int32 (prefixes of 2**30 keys each on an axis of 2**30, too
    big to attend here), a start past cap stays at least cap; those below it are exact."""
    lens = jnp.asarray([cap // 2, cap // 2, cap, cap, cap, 64, 0], jnp.int32)
    starts = np.asarray(prefill._starts(lens, cap))
    np.testing.assert_array_equal(starts[:3], [0, cap // 2, cap // 2 * 2])
    assert np.all(starts[3:] >= cap), starts


@pytest.mark.parametrize("where", ["prefix row", "new row"])
def test_a_nan_stays_in_its_request(implementation, fp8_cache, where):
    """A NaN in a row of request 0 (a cache row of its prefix, or its 6th new row): the
    queries that see that key get NaN, the other requests what they get without it. The
    "reference" path keeps it to exactly those queries: request 0's rows before its 6th new one
    are as without it too."""
    case = three(implementation, fp8_cache)
    mine = request_rows(case, 0)
    if where == "prefix row":
        page = int(case["block_table"][0, 0])
        poisoned = case | dict(kv_cache=case["kv_cache"].at[page, 3, 0, LATENT].set(jnp.nan))
        seen = mine
    else:
        poisoned = case | dict(kv=case["kv"].at[mine[5], LATENT].set(jnp.nan))
        seen = mine[5:]
    out, lse = run(poisoned, implementation)
    assert np.all(np.isnan(out[seen]).any(axis=(1, 2)))
    clean = run(case, implementation)
    unseen = np.setdiff1d(np.arange(out.shape[0]), seen if implementation == "reference" else mine)
    assert_same((out, lse), clean, unseen)
    if implementation == "reference":
        assert np.all(np.isnan(out[seen]))


def test_a_prefix_past_its_table_row_is_empty_and_named(implementation, fp8_cache):
    """Request 1's prefix of 200 keys fits max_prefix_tokens (512) but not its block-table
    row (3 pages of the cache, 192 keys): it is answered empty, the others as without it, and
    value_checks() names it."""
    case = three(implementation, fp8_cache, max_prefix_tokens=512)
    assert case["block_table"].shape[1] == 3
    bad = case | dict(prefix_lens=case["prefix_lens"].at[1].set(200),
                      block_table=case["block_table"].at[1, 2].set(0))
    out, lse = run(bad, implementation)
    assert_empty(out, lse, request_rows(case, 1))
    others = np.concatenate([request_rows(case, 0), request_rows(case, 2)])
    assert_same((out, lse), run(without(case, 1), implementation), others)
    err, _ = checked_call(bad)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"prefix_lens\[1\] = 200 needs more pages than block_table's "
                             r"rows hold \(3 of 64 tokens\)"):
        err.throw()


# -- errors naming the argument at fault ----------------------------------------------------

def test_a_decode_q_is_blamed_on_q():
    """q of the decode's 576 columns (absorbed) against kv's 576-wide rows: q is at fault,
    and no rope dim is made up from it."""
    case = three("reference", False)
    q = jnp.zeros((*case["q"].shape[:2], 576), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"^mla_prefill: q must have shape \(84, 2, 96\): "
                                         r"qk_nope_head_dim 32 .* the 64-d rope key .* got "
                                         r"\(84, 2, 576\) \(a 576-wide q is the decode's") as e:
        call(jf.mla_prefill, case | dict(q=q), softmax_scale=SCALE)
    assert "448" not in str(e.value)


def test_a_kv_of_the_wrong_width_is_blamed_on_kv():
    case = three("reference", False)
    with pytest.raises(ValueError, match=r"^mla_prefill: kv must have shape \(84, 576\) .* "
                                         r"got \(84, 600\)"):
        call(jf.mla_prefill, case | dict(kv=jnp.zeros((84, 600), jnp.bfloat16)),
             softmax_scale=SCALE)


def test_max_prefix_tokens_past_int32_is_named():
    case = three("reference", False)
    with pytest.raises(ValueError, match=r"max_prefix_tokens must be .* below 2\*\*31 .* "
                                         r"got 2147483648"):
        call(jf.mla_prefill, case | dict(max_prefix_tokens=2**31), softmax_scale=SCALE)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN may run on a GPU")
def test_cudnn_off_the_gpu_names_implementation():
    case = three("reference", False)
    with pytest.raises(ValueError, match=r"^mla_prefill: implementation='custom_call' \(cuDNN's "
                                         r"flash attention\) needs a Hopper GPU as JAX's "
                                         r"default backend; got cpu; pass "
                                         r"implementation='reference' or None$"):
        call(jf.mla_prefill, case, softmax_scale=SCALE, implementation="custom_call")


def test_cudnn_with_float32_q_names_implementation():
    case = make_case(np.random.default_rng(0), **THREE, dtype=jnp.float32)
    with pytest.raises(TypeError, match=r"implementation='custom_call' takes bfloat16 or "
                                        r"float16 q; got float32; pass "
                                        r"implementation='reference' or None$"):
        call(jf.mla_prefill, case, softmax_scale=SCALE, implementation="custom_call")


@pytest.mark.gpu
def test_cudnn_with_a_head_dim_it_cannot_take_names_implementation():
    """q's head dim 100 (not a multiple of 8): "custom_call" is refused by name, None takes
    "reference"."""
    case = make_case(np.random.default_rng(2), **THREE, nope=36)
    with pytest.raises(ValueError, match=r"implementation='custom_call' needs q's head dim a "
                                         r"multiple of 8 up to 256; got 100; pass "
                                         r"implementation='reference' or None$"):
        call(jf.mla_prefill, case, softmax_scale=SCALE, implementation="custom_call")
    assert_same(run(case, None), run(case, "reference"), np.arange(case["q"].shape[0]))
