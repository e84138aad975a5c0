"""mla_prefill against a float64 oracle, its bad-value rules and its memory, on any machine.

The implementation under test is the one `implementation=None` picks (cuDNN on a Hopper GPU,
else the blockwise pure-JAX attention); tests/test_gpu_prefill.py runs both on the GPU.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_flashmla as jf
from prefill_cases import SENTINEL, call, make_case, oracle

SCALE = 96 ** -0.5
# bf16 inputs, keys and values rounded to bf16 after decompression: out within 2e-2, lse 1e-2.
OUT_TOL, LSE_TOL = 2e-2, 1e-2


def check_against_oracle(case, out, lse):
    want_out, want_lse = oracle(case, SCALE)
    np.testing.assert_allclose(np.asarray(out, np.float64), want_out, atol=OUT_TOL, rtol=OUT_TOL)
    finite = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], want_lse[finite], atol=LSE_TOL,
                               rtol=LSE_TOL)


RAGGED = dict(prefix_lens=[0, 1, 63, 64, 65, 1500], query_lens=[150, 1, 64, 0, 37, 130])


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16", "fp8"])
def test_ragged_batch_matches_float64_oracle(fp8_cache):
    case = make_case(np.random.default_rng(0), **RAGGED, t=160, fp8_cache=fp8_cache)
    out, lse = call(jax.jit(jf.mla_prefill, static_argnames=("max_prefix", "softmax_scale")),
                    case, softmax_scale=SCALE)
    assert out.shape == (6, 160, 2, 48) and out.dtype == jnp.bfloat16
    assert lse.shape == (6, 2, 160) and lse.dtype == jnp.float32
    check_against_oracle(case, out, lse)
    assert np.all(np.asarray(out)[3] == 0) and np.all(np.isinf(np.asarray(lse)[3]))


def test_long_prompt_matches_oracle():
    """A new prompt of 3000 tokens (no cache) and a 2000-token chunk over 1000 cached ones."""
    rng = np.random.default_rng(1)
    prompt = make_case(rng, [0], [3000], 3000, heads=1)
    out, lse = call(jf.mla_prefill, prompt | dict(kv_cache=None, block_table=None, max_prefix=0),
                    softmax_scale=SCALE)
    check_against_oracle(prompt, out, lse)
    chunk = make_case(rng, [1000], [2000], 2000, heads=1)
    check_against_oracle(chunk, *call(jf.mla_prefill, chunk, softmax_scale=SCALE))


def test_chunks_merge_to_the_whole():
    """A prompt attended in two chunks (the second over the first, read from the cache) gives
    what the prompt gives at once, out within bf16 rounding, lse as well."""
    rng = np.random.default_rng(2)
    n, split = 300, 130
    whole = make_case(rng, [0], [n], n)
    q, kv = whole["q"], whole["kv"]
    pages = jnp.arange(5, dtype=jnp.int32)[None]
    cache = jnp.zeros((5, 64, 1, 576), jnp.bfloat16)
    cache = jf.write_kv(cache, jf.token_slots(pages, jnp.arange(split, dtype=jnp.int32)[None]),
                        kv=kv[:, :split])
    kwargs = dict(w_uk=whole["w_uk"], w_uv=whole["w_uv"], softmax_scale=SCALE)
    at_once = jf.mla_prefill(q, kv, **kwargs)
    first = jf.mla_prefill(q[:, :split], kv[:, :split], **kwargs)
    second = jf.mla_prefill(q[:, split:], kv[:, split:], cache, pages,
                            jnp.asarray([split], jnp.int32), max_prefix=192, **kwargs)
    for got, want in zip((jnp.concatenate([first[0], second[0]], 1),
                          jnp.concatenate([first[1], second[1]], 2)), at_once):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=1e-2, rtol=1e-2)


BAD = {"prefix past max_prefix": ("prefix_lens", 4, 2000),
       "negative prefix": ("prefix_lens", 4, -1),
       "query_len past t": ("query_lens", 4, 161), "negative query_len": ("query_lens", 4, -3),
       "page out of range": ("block_table", (4, 0), 10_000),
       "negative page": ("block_table", (5, 7), -5)}


def check_bad_value(bad, **sizes):
    """The request given the bad value comes out empty, the others as without it. Returns
    the case with the bad value and the request's row."""
    case = make_case(np.random.default_rng(3), **RAGGED, t=160, **sizes)
    good_out, good_lse = call(jf.mla_prefill, case, softmax_scale=SCALE)
    name, index, value = BAD[bad]
    case[name] = case[name].at[index].set(value)
    out, lse = call(jf.mla_prefill, case, softmax_scale=SCALE)
    row = index if isinstance(index, int) else index[0]
    assert np.all(np.asarray(out)[row] == 0) and np.all(np.isposinf(np.asarray(lse)[row]))
    others = [r for r in range(6) if r != row]
    np.testing.assert_array_equal(np.asarray(out)[others], np.asarray(good_out)[others])
    np.testing.assert_array_equal(np.asarray(lse)[others], np.asarray(good_lse)[others])
    return case, row


@pytest.mark.parametrize("bad", BAD)
def test_bad_values_give_that_request_an_empty_answer(bad):
    case, row = check_bad_value(bad)
    name, _, value = BAD[bad]
    err, (out, _) = checked_call(case)
    with pytest.raises(checkify.JaxRuntimeError, match=rf"{name}\[{row}.* {value} "):
        err.throw()
    assert np.all(np.asarray(out)[row] == 0)


def checked_call(case):
    """mla_prefill traced under value_checks(), jitted and checkified: (error, result)."""
    static = {"max_prefix": case["max_prefix"]}
    with jf.value_checks():
        fn = jax.jit(checkify.checkify(
            lambda c: call(jf.mla_prefill, c | static, softmax_scale=SCALE)))
        return fn({k: v for k, v in case.items() if k not in static})


def test_value_checks_pass_good_values_and_sentinels():
    case = make_case(np.random.default_rng(4), **RAGGED, t=160)
    assert int(np.asarray(case["block_table"]).max()) == SENTINEL  # past the prefix pages
    err, _ = checked_call(case)
    err.throw()


def test_argument_errors_name_the_argument():
    case = make_case(np.random.default_rng(5), [10], [5], 8)
    with pytest.raises(ValueError, match="kv must have shape"):
        call(jf.mla_prefill, case | dict(kv=case["kv"][:, :4]), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="max_prefix must be a non-negative int"):
        call(jf.mla_prefill, case | dict(max_prefix=-64), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="needs kv_cache, block_table and prefix_lens"):
        call(jf.mla_prefill, case | dict(kv_cache=None), softmax_scale=SCALE)
    with pytest.raises(ValueError, match=r"block_table must have shape \(1, >= 2\)"):
        call(jf.mla_prefill, case | dict(max_prefix=128), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="k_scale goes with a float8_e4m3fn kv_cache"):
        call(jf.mla_prefill, case | dict(k_scale=jnp.float32(1)), softmax_scale=SCALE)
    with pytest.raises(TypeError, match="prefix_lens must be int32"):
        call(jf.mla_prefill, case | dict(prefix_lens=case["prefix_lens"].astype(jnp.int16)),
             softmax_scale=SCALE)
    with pytest.raises(ValueError, match="implementation must be None or one of"):
        call(jf.mla_prefill, case, softmax_scale=SCALE, implementation="flash")
    with pytest.raises(TypeError, match="softmax_scale"):
        call(jf.mla_prefill, case, softmax_scale=jnp.float32(0.1))


def memory_bytes(t, prefix, heads=2):
    """Temporary bytes of the compiled mla_prefill for one request of t new tokens."""
    case = make_case(np.random.default_rng(6), [prefix], [t], t, heads=heads)
    names = ("q", "kv", "kv_cache", "block_table", "prefix_lens", "query_lens", "w_uk", "w_uv")
    fn = jax.jit(lambda *a: jf.mla_prefill(*a[:6], w_uk=a[6], w_uv=a[7], softmax_scale=SCALE,
                                           max_prefix=case["max_prefix"]))
    stats = fn.lower(*(case[n] for n in names)).compile().memory_analysis()
    return stats.temp_size_in_bytes


def test_memory_grows_linearly_with_tokens():
    """No (tokens x keys) array: doubling the new tokens, or the prefix, at most doubles the
    compiled temporaries (plus slack; a quadratic array would quadruple them), and they stay
    well below the (heads, tokens, tokens) float32 scores."""
    sizes = [memory_bytes(t, 64) for t in (2048, 4096, 8192)]
    assert sizes[1] <= 2.2 * sizes[0] and sizes[2] <= 2.2 * sizes[1], sizes
    assert sizes[2] < 8192 * 8192 * 4 * 2 / 2, sizes
    prefixes = [memory_bytes(512, p) for p in (4096, 8192)]
    assert prefixes[1] <= 2.2 * prefixes[0], prefixes
