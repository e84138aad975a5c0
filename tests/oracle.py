"""Shared by the tests: FlashMLA-style decode inputs, a float64 dense oracle, and FlashMLA's
own accuracy criteria (tests/flash_mla's check_is_allclose: per element abs or rel, plus a
cosine-difference bound)."""
import jax
import jax.numpy as jnp
import numpy as np

PAGE = 64
# Large page indices in block-table slots past a request's last page: a kernel or reference
# that reads them would fault or pick up garbage.
SENTINEL_PAGE = 2**31 - 64


def make_decode_inputs(rng, *, batch, s_q, h_q, mean_sk, varlen, dtype, zero_lengths=0,
                       extra_pages=2):
    """Random inputs in FlashMLA's test style: (q, kv_cache) as JAX arrays of dtype, made on
    the default device, and (block_table, seq_lens) as NumPy int32. Pages are a random
    permutation of the pool; pages no request uses and rows past each request's length hold
    NaN; unused block-table slots hold a huge sentinel."""
    if varlen:
        seq_lens = np.clip(rng.normal(mean_sk, mean_sk / 2, batch), s_q, 2 * mean_sk).astype(np.int32)
    else:
        seq_lens = np.full(batch, mean_sk, np.int32)
    seq_lens[rng.permutation(batch)[:zero_lengths]] = 0
    max_pages = max(1, int(-(-seq_lens.max() // PAGE)))
    num_pages = batch * max_pages + extra_pages
    perm = rng.permutation(num_pages).astype(np.int32)
    block_table = np.full((batch, max_pages), SENTINEL_PAGE, np.int32)
    rows_in_page = np.zeros(num_pages, np.int32)  # rows of each page that hold a real token
    for i, n in enumerate(seq_lens):
        pages = -(-int(n) // PAGE)
        block_table[i, :pages] = perm[i * max_pages: i * max_pages + pages]
        rows_in_page[block_table[i, :pages]] = np.minimum(PAGE, n - PAGE * np.arange(pages))
    key_q, key_kv = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    # FlashMLA's tests draw standard normals / 10 clipped to [-1, 1]; its tolerances assume
    # values of that scale.
    q = jnp.clip(jax.random.normal(key_q, (batch, s_q, h_q, 576)) / 10, -1, 1).astype(dtype)
    kv = jnp.clip(jax.random.normal(key_kv, (num_pages, PAGE, 1, 576)) / 10, -1, 1).astype(dtype)
    real = jnp.arange(PAGE)[None, :] < jnp.asarray(rows_in_page)[:, None]
    kv = jnp.where(real[:, :, None, None], kv, jnp.nan)
    return q, kv, block_table, seq_lens


def request_attention_f64(q, keys, length, *, softmax_scale, causal=True, head_dim_v=512):
    """Float64 attention of one request: q (s_q, h_q, 576) over the first `length` rows of
    keys (>= length, 576), bottom-right causal. Returns (out (s_q, h_q, dv), lse (h_q, s_q))."""
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    s_q, h_q, _ = q.shape
    out, lse = np.zeros((s_q, h_q, head_dim_v)), np.full((h_q, s_q), np.inf)
    for t in range(s_q):
        seen = keys[:max(length - s_q + t + 1, 0) if causal else length]
        if len(seen):
            scores = q[t] @ seen.T * softmax_scale  # (h_q, keys seen)
            top = scores.max(-1, keepdims=True)
            weights = np.exp(scores - top)
            out[t] = weights @ seen[:, :head_dim_v] / weights.sum(-1, keepdims=True)
            lse[:, t] = top[:, 0] + np.log(weights.sum(-1))
    return out, lse


def dense_attention_f64(q, kv, block_table, seq_lens, *, softmax_scale, causal, head_dim_v=512):
    """Naive float64 MLA attention over the paged cache: (out (b, s_q, h_q, dv), lse (b, h_q, s_q))."""
    kv = np.asarray(kv, np.float64)
    results = []
    for i, n in enumerate(np.asarray(seq_lens)):
        pages = np.asarray(block_table)[i, : -(-int(n) // PAGE)]
        keys = kv[pages, :, 0, :].reshape(-1, kv.shape[-1])[:n]
        results.append(request_attention_f64(q[i], keys, int(n), softmax_scale=softmax_scale,
                                             causal=causal, head_dim_v=head_dim_v))
    return np.stack([r[0] for r in results]), np.stack([r[1] for r in results])


def assert_flashmla_close(name, actual, expected, *, abs_tol, rel_tol, cos_diff_tol=None):
    """FlashMLA's criterion: every element within abs_tol or rel_tol * |expected|; inf/NaN at
    the same places; and 1 - cosine similarity below cos_diff_tol."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    finite = np.isfinite(expected)
    np.testing.assert_array_equal(np.isfinite(actual), finite, err_msg=f"{name}: inf/NaN positions")
    np.testing.assert_array_equal(actual[~finite], expected[~finite], err_msg=f"{name}: non-finite values")
    a, e = actual[finite], expected[finite]
    diff = np.abs(a - e)
    bad = (diff > abs_tol) & (diff > rel_tol * np.abs(e))
    assert not bad.any(), (f"{name}: {bad.sum()} of {bad.size} elements off; worst abs "
                           f"{diff.max():.3g} at expected {e[np.argmax(diff)]:.4g}")
    if cos_diff_tol is not None and a.size:
        denom = max((a * a).sum() + (e * e).sum(), 1e-12)
        cos_diff = 1 - 2 * (a * e).sum() / denom
        assert cos_diff < cos_diff_tol, f"{name}: cosine difference {cos_diff:.3g} >= {cos_diff_tol}"


# FlashMLA's tolerances (tests/test_flash_mla_decoding.py) for out and lse.
OUT_TOL = dict(abs_tol=8e-4, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
LSE_TOL = dict(abs_tol=1e-6, rel_tol=8.01 / 65536)
