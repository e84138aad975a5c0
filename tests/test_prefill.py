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
from jax_flashmla.ops import prefill
from prefill_cases import SENTINEL, call, make_case, oracle, rows_of

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
GAPS = [2, 0, 5, 1, 0, 7]  # padding rows before each request, with query_starts given


@pytest.mark.parametrize("fp8_cache", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("gaps", [None, GAPS], ids=["packed", "gaps"])
def test_ragged_batch_matches_float64_oracle(fp8_cache, gaps):
    case = make_case(np.random.default_rng(0), **RAGGED, gaps=gaps, fp8_cache=fp8_cache)
    t = case["q"].shape[0]
    out, lse = call(jax.jit(jf.mla_prefill, static_argnames=("max_prefix_tokens",
                                                             "softmax_scale")),
                    case, softmax_scale=SCALE)
    assert out.shape == (t, 2, 48) and out.dtype == jnp.bfloat16
    assert lse.shape == (2, t) and lse.dtype == jnp.float32
    check_against_oracle(case, out, lse)


def test_one_request_off_row_zero():
    """One request whose rows start past row 0, over a prefix."""
    case = make_case(np.random.default_rng(7), [100], [70], gaps=[9], tail=5)
    check_against_oracle(case, *call(jf.mla_prefill, case, softmax_scale=SCALE))


def test_long_prompt_matches_oracle():
    """A new prompt of 3000 tokens (no cache) and a 2000-token chunk over 1000 cached ones."""
    rng = np.random.default_rng(1)
    prompt = make_case(rng, [0], [3000], tail=0, heads=1)
    out, lse = call(jf.mla_prefill, prompt | dict(kv_cache=None, block_table=None,
                                                  prefix_lens=None, max_prefix_tokens=0),
                    softmax_scale=SCALE)
    check_against_oracle(prompt, out, lse)
    chunk = make_case(rng, [1000], [2000], heads=1)
    check_against_oracle(chunk, *call(jf.mla_prefill, chunk, softmax_scale=SCALE))


def test_chunks_merge_to_the_whole():
    """A prompt attended in two chunks (the second over the first, read from the cache) gives
    what the prompt gives at once, out within bf16 rounding, lse as well."""
    rng = np.random.default_rng(2)
    n, split = 300, 130
    whole = make_case(rng, [0], [n], tail=0)
    q, kv = whole["q"], whole["kv"]
    pages = jnp.arange(5, dtype=jnp.int32)[None]
    cache = jnp.zeros((5, 64, 1, 576), jnp.bfloat16)
    cache = jf.write_kv(cache, jf.token_slots(pages, jnp.arange(split, dtype=jnp.int32)[None]),
                        kv=kv[None, :split])
    kwargs = dict(w_uk=whole["w_uk"], w_uv=whole["w_uv"], softmax_scale=SCALE)
    at_once = jf.mla_prefill(q, kv, **kwargs)
    first = jf.mla_prefill(q[:split], kv[:split], **kwargs)
    second = jf.mla_prefill(q[split:], kv[split:], cache, pages, jnp.asarray([split], jnp.int32),
                            jnp.asarray([n - split], jnp.int32), max_prefix_tokens=192, **kwargs)
    for got, want in zip((jnp.concatenate([first[0], second[0]], 0),
                          jnp.concatenate([first[1], second[1]], 1)), at_once):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=1e-2, rtol=1e-2)


def _traced_with(monkeypatch, **settings):
    """mla_prefill traced with these module settings (read while tracing: the op's compiled
    cache is cleared before and after)."""
    for name, value in settings.items():
        monkeypatch.setattr(prefill, name, value)
    prefill._prefill.clear_cache()
    yield
    monkeypatch.undo()
    prefill._prefill.clear_cache()


@pytest.fixture
def slices_of_128_keys(monkeypatch):
    """mla_prefill's prefix slices of 128 keys at 2 heads in bf16."""
    yield from _traced_with(monkeypatch, PREFIX_SLICE_BYTES=128 * 2 * (96 + 96) * 2)


def test_one_prefix_on_a_longer_axis():
    """One request's prefix on an axis longer than it (max_prefix_tokens bucketed, as a
    serving loop passes it): at prefixes of a page, a page and a row, and most of the axis,
    the answer is the oracle's. Pages past the prefix hold NaN and the table sentinels there:
    nothing past the prefix may be read."""
    rng = np.random.default_rng(9)
    for prefix in (64, 65, 1000):
        case = make_case(rng, [prefix], [40], heads=1) | dict(max_prefix_tokens=1024)
        check_against_oracle(case, *call(jf.mla_prefill, case, softmax_scale=SCALE))


@pytest.fixture
def parts_of_64_to_256_keys(monkeypatch):
    """One request's prefix parts of 256 keys (slices of 256 keys at 2 heads, v of 48), then
    128 and 64, and a last part of 64."""
    yield from _traced_with(monkeypatch, PREFIX_SLICE_BYTES=256 * 2 * (96 + 48) * 2,
                            PREFIX_PART_KEYS=64)


@pytest.mark.parametrize("prefix", [0, 65, 300, 1000, 1024])
def test_one_prefix_in_parts(parts_of_64_to_256_keys, prefix):
    """One request's prefix on an axis of 1024 keys, in the parts it fills: none (0), the
    64-key part and a masked last one (65), a 256-key top and the last (300), three tops, the
    128 and 64 parts and the last (1000), the whole axis at once (1024). Pages past the prefix
    hold NaN, the table sentinels: the answer is the oracle's."""
    case = make_case(np.random.default_rng(11), [prefix], [40]) | dict(max_prefix_tokens=1024)
    check_against_oracle(case, *call(jf.mla_prefill, case, softmax_scale=SCALE))


def test_several_prefixes_in_slices(slices_of_128_keys):
    """Several requests' prefixes attended in slices of 128 keys on an axis 512 keys longer
    than they reach (slices with parts of several prefixes, and slices past them all): the
    answer is the oracle's."""
    case = make_case(np.random.default_rng(10), **RAGGED, gaps=GAPS)
    case["max_prefix_tokens"] += 512
    check_against_oracle(case, *call(jf.mla_prefill, case, softmax_scale=SCALE))


# A bad value of request 4 (query_starts given, so that no other request moves): (argument,
# index, value, the value_checks error).
BAD = {"prefix past max_prefix_tokens": ("prefix_lens", 4, 2000, r"prefix_lens\[4\] = 2000 "),
       "negative prefix": ("prefix_lens", 4, -1, r"prefix_lens\[4\] = -1 "),
       "rows past the tokens": ("query_lens", 4, 1000, r"query_lens\[4\] = 1000 "),
       "negative query_len": ("query_lens", 4, -3, r"query_lens\[4\] = -3 "),
       "negative start": ("query_starts", 4, -2, r"query_starts\[4\] = -2:"),
       "overlapping rows": ("query_starts", 4, 200, r"query_starts\[4\] = 200 is before"),
       "page out of range": ("block_table", (4, 0), 10_000, r"block_table\[4, 0\] = 10000 "),
       "negative page": ("block_table", (4, 1), -5, r"block_table\[4, 1\] = -5 ")}


def check_bad_value(bad, **sizes):
    """Request 4, given the bad value, comes out empty, the others as without it. Returns
    the case with the bad value."""
    case = make_case(np.random.default_rng(3), **RAGGED, gaps=GAPS, **sizes)
    good_out, good_lse = call(jf.mla_prefill, case, softmax_scale=SCALE)
    first, n = rows_of(case)[4]
    name, index, value, _ = BAD[bad]
    case[name] = case[name].at[index].set(value)
    out, lse = call(jf.mla_prefill, case, softmax_scale=SCALE)
    mine = np.arange(out.shape[0])[first:first + n]
    assert np.all(np.asarray(out)[mine] == 0) and np.all(np.isposinf(np.asarray(lse)[:, mine]))
    others = np.setdiff1d(np.arange(out.shape[0]), mine)
    np.testing.assert_array_equal(np.asarray(out)[others], np.asarray(good_out)[others])
    np.testing.assert_array_equal(np.asarray(lse)[:, others], np.asarray(good_lse)[:, others])
    return case


@pytest.mark.parametrize("bad", BAD)
def test_bad_values_give_that_request_an_empty_answer(bad):
    case = check_bad_value(bad)
    err, _ = checked_call(case)
    with pytest.raises(checkify.JaxRuntimeError, match=BAD[bad][3]):
        err.throw()


def test_prefixes_past_the_capacity_empty_the_requests_they_reach():
    """With max_prefix_tokens below the prefixes' pages, the requests whose prefix ends past
    it are answered empty, those before them as the oracle says."""
    case = make_case(np.random.default_rng(8), [100, 200, 50, 10], [5, 6, 7, 8])
    # Prefixes from a page each: [0, 100), [128, 328), [384, 434), [448, 458).
    case["max_prefix_tokens"] = 384
    out, lse = call(jf.mla_prefill, case, softmax_scale=SCALE)
    want_out, want_lse = oracle(case, SCALE)
    np.testing.assert_allclose(np.asarray(out, np.float64)[:11], want_out[:11], atol=OUT_TOL)
    np.testing.assert_allclose(np.asarray(lse)[:, :11], want_lse[:, :11], atol=LSE_TOL)
    assert np.all(np.asarray(out)[11:] == 0) and np.all(np.isposinf(np.asarray(lse)[:, 11:]))
    err, _ = checked_call(case)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"prefix_lens\[2\] = 50 from position 384 .* past "
                             r"max_prefix_tokens = 384"):
        err.throw()


def checked_call(case):
    """mla_prefill traced under value_checks(), jitted and checkified: (error, result)."""
    static = {"max_prefix_tokens": case["max_prefix_tokens"]}
    with jf.value_checks():
        fn = jax.jit(checkify.checkify(
            lambda c: call(jf.mla_prefill, c | static, softmax_scale=SCALE)))
        return fn({k: v for k, v in case.items() if k not in static})


def test_value_checks_pass_good_values_and_sentinels():
    case = make_case(np.random.default_rng(4), **RAGGED, gaps=GAPS)
    assert int(np.asarray(case["block_table"]).max()) == SENTINEL  # past the prefix pages
    err, _ = checked_call(case)
    err.throw()


def test_argument_errors_name_the_argument():
    case = make_case(np.random.default_rng(5), [10], [5])
    with pytest.raises(ValueError, match="kv must have shape"):
        call(jf.mla_prefill, case | dict(kv=case["kv"][:4]), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="q must have rank 3"):
        call(jf.mla_prefill, case | dict(q=case["q"][None]), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="max_prefix_tokens must be a non-negative int"):
        call(jf.mla_prefill, case | dict(max_prefix_tokens=-64), softmax_scale=SCALE)
    with pytest.raises(ValueError, match="needs kv_cache, block_table and prefix_lens"):
        call(jf.mla_prefill, case | dict(kv_cache=None), softmax_scale=SCALE)
    with pytest.raises(ValueError, match=r"block_table must have 1 rows"):
        call(jf.mla_prefill, case | dict(block_table=jnp.tile(case["block_table"], (2, 1))),
             softmax_scale=SCALE)
    with pytest.raises(ValueError, match=r"prefix_lens must have shape \(1,\) like query_lens"):
        call(jf.mla_prefill, case | dict(prefix_lens=jnp.zeros((2,), jnp.int32)),
             softmax_scale=SCALE)
    with pytest.raises(ValueError, match="query_lens is needed with prefix_lens"):
        call(jf.mla_prefill, case | dict(query_lens=None), softmax_scale=SCALE)
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
    case = make_case(np.random.default_rng(6), [prefix], [t], tail=0, heads=heads)
    names = ("q", "kv", "kv_cache", "block_table", "prefix_lens", "query_lens", "w_uk", "w_uv")
    fn = jax.jit(lambda *a: jf.mla_prefill(*a[:6], w_uk=a[6], w_uv=a[7], softmax_scale=SCALE,
                                           max_prefix_tokens=case["max_prefix_tokens"]))
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
