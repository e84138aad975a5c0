"""Shared by the tests: FlashMLA-style decode inputs, a float64 dense oracle and FlashMLA's
own accuracy criteria (tests/flash_mla's check_is_allclose: per element abs or rel, plus a
cosine-difference bound); FlashMLA's torch ops called directly on JAX's buffers, arguments
filled by name from each op's schema as the bridge fills them; and the FP8, cache and
sharding problems and HLO readers that several test files use; the benchmarks run tiny."""
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_flashmla as jf
from jax_flashmla import context_parallel as cp
from jax_flashmla.caches import fp8
from jax_flashmla.kernels import library as kernels

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


def sparse_attention_f64(q, rows, valid, scale, sink):
    """float64 attention of each query (n, h, d) over its valid rows (n, keys, d), d 576
    (V3.2: V is a row's first 512) or 512 (V4: V is the row), with a sink per head (or None)
    in each softmax's denominator. Returns out (n, h, 512) and lse (n, h), +inf where a query
    has no valid row (its out 0)."""
    n, h, _ = q.shape
    out, lse = np.zeros((n, h, 512)), np.full((n, h), np.inf)
    for i in range(n):
        keys = rows[i][valid[i]].astype(np.float64)
        if len(keys) == 0:
            continue
        s = q[i].astype(np.float64) @ keys.T * scale
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        denominator = p.sum(-1) + (0 if sink is None else np.exp(sink - m[:, 0]))
        out[i] = p @ keys[:, :512] / denominator[:, None]
        lse[i] = m[:, 0] + np.log(p.sum(-1))
    return out, lse


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
# The sparse ops' out and lse against another evaluation (the reference against float64, the
# kernels against the reference): out in bf16 from float32 arithmetic, a few bf16 ulps of the
# largest value; lse in float32.
SPARSE_OUT_TOL = dict(rtol=2e-2, atol=2e-2)
SPARSE_LSE_TOL = dict(rtol=1e-5, atol=1e-4)


def torch_view(torch, x):
    """A torch view of a JAX array; FP8 goes through uint8, which every DLPack version has."""
    if x.dtype == jnp.float8_e4m3fn:
        return torch.from_dlpack(jax.lax.bitcast_convert_type(x, jnp.uint8)).view(
            torch.float8_e4m3fn)
    return torch.from_dlpack(x)


def call_by_name(op, values):
    """Calls a FlashMLA op with its arguments filled by name from its schema."""
    return op(*kernels.arguments_by_name(op, values))


def torch_ops(fp8=False):
    """(torch, metadata op, decode op) of the loaded kernel library."""
    import torch

    ops = kernels.ensure_cuda_targets()
    names = (ops.metadata_fp8, ops.decode_fp8) if fp8 else (ops.metadata, ops.decode)
    resolve = lambda name: getattr(getattr(torch.ops, name.split("::")[0]), name.split("::")[1])
    return torch, resolve(names[0]), resolve(names[1])


def torch_decode(q, kv, block_table, seq_lens, *, softmax_scale, k_scale=None):
    """(out, lse) of FlashMLA's metadata and decode ops called from torch, as NumPy arrays;
    with k_scale, the FP8 ops on an FP8 q and cache (no request of length 0)."""
    fp8 = k_scale is not None
    torch, metadata_op, decode_op = torch_ops(fp8)
    _, s_q, h_q, _ = q.shape
    t = lambda x: torch_view(torch, x)
    tsl = t(seq_lens)
    md, splits = call_by_name(metadata_op, dict(
        seqlens_k=tsl, num_q_tokens_per_head_k=s_q * h_q, num_heads_per_head_k=s_q * h_q,
        h_k=1, num_heads_k=1, h_q=h_q, is_fp8_kvcache=False))[:2]
    descale = t(jnp.asarray(k_scale, jnp.float32).reshape(1)) if fp8 else None
    out, lse = call_by_name(decode_op, dict(
        q=t(q), kv_cache=t(kv), kcache=t(kv), head_size_v=512, seqlens_k=tsl,
        block_table=t(block_table), softmax_scale=softmax_scale, is_causal=True,
        tile_scheduler_metadata=md, num_splits=splits, is_fp8=False, descale_q=descale,
        descale_k=descale))[:2]
    torch.cuda.synchronize()
    return out.float().cpu().numpy(), lse.cpu().numpy()


# FP8: data of scale 0.1, some of it saturating e4m3 at this scale.
K_SCALE = np.float32(1 / 400)


def fp8_kernel_tables(hlo):
    """For each FP8 decode of a compiled module's text, the name of the value it reads as its
    kernel_block_table and the opcode that makes it ("fusion", or "get-tuple-element" in a
    loop body whose loop state carries it)."""
    defs = dict(re.findall(r"^\s*(?:ROOT )?(%[\w.\-]+) = .*? ([a-z\-]+)\(", hlo, re.M))
    tables = []
    for line in hlo.splitlines():
        if 'custom_call_target="jax_flashmla_mla_decode_fp8"' in line:
            operands = line[line.index("custom-call(") + len("custom-call("):]
            name = re.findall(r"%[\w.\-]+", operands)[2]  # q, kv_cache, the table
            tables.append((name, defs.get(name)))
    return tables


def fp8_inputs(seed, *, batch=4, s_q=1, h_q=16, mean_sk=130, zero_lengths=1):
    """bf16 q, an FP8 cache quantized with K_SCALE (NaN rows stay NaN), block table, lengths."""
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(seed), batch=batch, s_q=s_q, h_q=h_q,
                                       mean_sk=mean_sk, varlen=True, dtype=jnp.float32,
                                       zero_lengths=zero_lengths)
    return (q.astype(jnp.bfloat16), fp8.quantize(kv, jnp.float32(K_SCALE)), jnp.asarray(bt),
            jnp.asarray(sl))

FP8_LAYERS = 3


def fp8_layers():
    """FP8 queries of FP8_LAYERS layers stacked, the cache, block table (sentinels past each
    request's pages, a request of length 0) and lengths."""
    q, kv8, bt, sl = fp8_inputs(16)
    scale = jnp.float32(K_SCALE)
    return jnp.stack([fp8.quantize(q * (i + 1), scale) for i in range(FP8_LAYERS)]), kv8, bt, sl


def fp8_layer(q, kv, bt, sl):
    return jf.mla_decode(q, kv, bt, sl, k_scale=jnp.float32(K_SCALE), implementation="custom_call")


def entry_computation(hlo):
    entry = hlo[hlo.index("\nENTRY"):]
    return entry[:entry.index("\n}")]


def scan_over_fp8_layers():
    """A jitted step as a model's: the metadata once, then lax.scan over the layers; every
    argument a jit argument. Asserts each layer equals a call of its own and that a request
    of length 0 was there; returns the compiled module's text."""
    qs, kv8, bt, sl = fp8_layers()

    @jax.jit
    def step(qs, kv, bt, sl):
        md = jf.get_mla_metadata(sl, block_table=bt, num_pages=kv.shape[0],
                                 num_heads_q=qs.shape[3], fp8=True, implementation="custom_call")
        layer = lambda carry, q: (carry, jf.mla_decode(q, kv, bt, sl, metadata=md,
                                                       k_scale=jnp.float32(K_SCALE),
                                                       implementation="custom_call"))
        return jax.lax.scan(layer, 0, qs)[1]

    hlo = step.lower(qs, kv8, bt, sl).compile().as_text()
    out, lse = step(qs, kv8, bt, sl)
    one = jax.jit(fp8_layer)
    for i in range(FP8_LAYERS):
        one_out, one_lse = one(qs[i], kv8, bt, sl)
        np.testing.assert_array_equal(np.asarray(out[i], np.float32),
                                      np.asarray(one_out, np.float32))
        np.testing.assert_array_equal(np.asarray(lse[i]), np.asarray(one_lse))
    assert np.isposinf(np.asarray(lse)).any()  # the request of length 0 was there
    return hlo


# Request 0 is decoded in one split, request 1 in several, request 3 is empty.
NAN_LENGTHS = (40, 2000, 300, 0)


@functools.cache  # its arrays are immutable: made once per shape, shared by the tests
def nan_problem(s_q, fp8_cache, h_q=16):
    """bf16 q, a bf16 cache (or FP8, quantized with K_SCALE) whose rows past each request's
    length hold NaN, the block table and the lengths NAN_LENGTHS: a clean problem to put one
    NaN into."""
    q, kv, bt, _ = make_decode_inputs(np.random.default_rng(3), batch=len(NAN_LENGTHS), s_q=s_q,
                                      h_q=h_q, mean_sk=max(NAN_LENGTHS), varlen=False,
                                      dtype=jnp.float32)
    rows = np.arange(PAGE)
    for r, n in enumerate(NAN_LENGTHS):
        for j, page in enumerate(bt[r]):
            kv = kv.at[page, rows >= n - PAGE * j].set(jnp.nan)
    kv = fp8.quantize(kv, jnp.float32(K_SCALE)) if fp8_cache else kv.astype(jnp.bfloat16)
    return (q.astype(jnp.bfloat16), kv, jnp.asarray(bt), jnp.asarray(NAN_LENGTHS, jnp.int32))


def with_nan_in_key(kv, bt, request, token, column):
    """kv with a NaN in `column` of the row holding `token` of `request`."""
    page, row = int(bt[request, token // PAGE]), token % PAGE
    return kv.at[page, row, 0, column].set(jnp.asarray(jnp.nan, kv.dtype))


def cache_shaped_buffers(hlo_text, shape):
    """(dtype, opcode, name) of every unfused instruction producing an array of `shape`.

    Instructions inside fusions make no buffers of their own, so fused computations (those a
    fusion `calls=`) are skipped; every other instruction is a buffer or an alias of one.
    """
    fused = set(re.findall(r"kind=k\w+, calls=%([\w.-]+)", hlo_text))
    dims = ",".join(str(d) for d in shape)
    pattern = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[" + dims + r"\]\{[^}]*\} ([\w-]+)\(")
    found = []
    for computation in hlo_text.split("\n\n"):
        header = re.search(r"^(?:ENTRY )?%([\w.-]+) ", computation, re.M)
        if header is None or header.group(1) in fused:
            continue
        for line in computation.splitlines():
            match = pattern.match(line)
            if match:
                found.append((match.group(2), match.group(3), match.group(1)))
    return found


def sharding_problem(seed, batch=8, h_q=32, mean_sk=150):
    q, kv, bt, sl = make_decode_inputs(np.random.default_rng(seed), batch=batch, s_q=1, h_q=h_q,
                                       mean_sk=mean_sk, varlen=True, dtype=jnp.bfloat16,
                                       zero_lengths=1)
    return q, kv, jnp.asarray(bt), jnp.asarray(sl)


def split_for_dcp(kv, bt, sl, n, layout, tokens_per_device):
    """Each device's pages, block table and lengths for a global paged problem."""
    kv, bt, sl = np.asarray(kv, np.float32), np.asarray(bt), np.asarray(sl)
    batch = len(sl)
    local_lens = np.stack([np.asarray(cp.local_lengths(sl, r, n, layout=layout,
                                                       tokens_per_device=tokens_per_device))
                           for r in range(n)])
    max_pages = max(1, int(-(-local_lens.max() // 64)))
    pages = np.zeros((n, batch * max_pages, 64, 1, 576), np.float32)
    tables = np.full((n, batch, max_pages), -1, np.int32)
    for i in range(batch):
        tokens = kv[bt[i, : -(-int(sl[i]) // 64)]].reshape(-1, 576)[: sl[i]]
        for r in range(n):
            local = np.asarray(cp.local_positions(np.arange(sl[i]), r, n, layout=layout,
                                                  tokens_per_device=tokens_per_device))
            mine = tokens[local >= 0]
            assert len(mine) == local_lens[r, i] and np.all(np.diff(local[local >= 0]) == 1)
            for j in range(-(-len(mine) // 64)):
                tables[r, i, j] = i * max_pages + j
                chunk = mine[64 * j: 64 * j + 64]
                pages[r, i * max_pages + j, : len(chunk), 0] = chunk
    return (jnp.asarray(pages.reshape(-1, 64, 1, 576), jnp.bfloat16), jnp.asarray(tables),
            jnp.asarray(local_lens))


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_tiny_benchmark(script, prefix, *arguments):
    """Runs benchmarks/<script> --tiny --out prefix [arguments] in a child process; its JSON
    report."""
    run = subprocess.run([sys.executable, str(BENCHMARKS / script), "--tiny", "--out",
                          str(prefix), *arguments], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(prefix.with_suffix(".json").read_text())


def fp8_checkpoint(sd, scale_dtype, quantized=lambda key: True):
    """sd's Linear weights (its 2-d ".weight" tensors whose keys `quantized` takes) as DeepSeek's
    FP8 checkpoints store them: e4m3 values and "<name>_scale_inv", a scale per 128 x 128
    block (amax / 448, rounded up to a power of two where the scales are ue8m0), in
    scale_dtype. Returns (the checkpoint, each quantized weight as dequantized, float64)."""
    import torch
    out, want = {}, {}
    for key, w in sd.items():
        if w.ndim != 2 or not key.endswith(".weight") or not quantized(key):
            out[key] = w
            continue
        rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
        amax = torch.zeros(rows, cols)
        for i in range(rows):
            for j in range(cols):
                amax[i, j] = w[128 * i:128 * (i + 1), 128 * j:128 * (j + 1)].abs().max()
        scale = amax.clamp(min=1e-4) / 448
        if scale_dtype == torch.float8_e8m0fnu:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        scale = scale.to(scale_dtype)
        full = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
        full = full[:w.shape[0], :w.shape[1]]
        values = (w.float() / full).to(torch.float8_e4m3fn)
        out[key], out[key + "_scale_inv"] = values, scale
        want[key] = values.double() * full.double()
    return out, want
