"""DeepSeek-V4's compressors (jax_flashmla.ops.compressor) against HF transformers' layers on
CPU: HCA's, CSA's and the CSA indexer's, a prompt at once, in chunks that cross windows, then
single-token steps; chunking and batching change nothing; the state carried between calls is
what HF's cache layer keeps, and dropping it shows; bad lengths complete nothing.

Tolerances:
  - against HF, float32 1e-5: the same arithmetic, but torch's and XLA's matmuls, exp and cos
    round differently (observed differences below 1e-6). float64 too: HF takes the softmax,
    the RMSNorm and RoPE's cos and sin in float32 whatever the dtype (and so does compress),
    so a float64 model is checked for its dtypes (a float64 state, its biased gates float64),
    not for more digits;
    bfloat16 3e-2 (a few bf16 ulps: a projection one ulp off moves the pooled row that much);
  - ours against ours (chunked against whole, batched against alone), float32 4e-6, a few
    ulps of values of order 1: the arithmetic per entry is the same, but XLA:CPU evaluates
    exp and one-row matmuls by a different code path for a different array shape.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from v4_compressor_hf import CSA, HCA, HIDDEN, HFLayers, config

from jax_flashmla.caches.compressor_state import CompressorState
from jax_flashmla.ops.compressor import compress, initial_state, max_entries, visible_entries

KINDS = {"hca": (HCA, False), "csa": (CSA, False), "indexer": (CSA, True)}
HF_TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "float64": dict(rtol=1e-5, atol=1e-5),
          "bfloat16": dict(rtol=3e-2, atol=3e-2)}
SAME_TOL = dict(rtol=4e-6, atol=4e-6)
CHUNKS = (1, 3, 37, 129)
STEPS = 22

# The state is donated: every call's old state is dead after it.
_compress = jax.jit(compress, donate_argnums=1)


@pytest.fixture(params=["float32", "float64"])
def dtype(request):
    """Runs the test in float32 and in float64 (JAX's 64-bit mode on for it)."""
    with jax.enable_x64(request.param == "float64"):
        yield request.param


def _tokens(seed, n):
    return np.random.default_rng(seed).normal(size=(n, HIDDEN)).astype(np.float32)


class Ours:
    """Requests fed through compress, their entries gathered by index as a cache would."""

    def __init__(self, hf, kind, batch_size, dtype):
        self.weights = hf.weights(*KINDS[kind])
        self.dtype = jnp.dtype(dtype)
        self.state = initial_state(self.weights, batch_size, self.dtype)
        self.inv_freq = jnp.asarray(hf.inv_freq)
        self.rows = [[] for _ in range(batch_size)]
        self.pad_rng = np.random.default_rng(99)

    def feed(self, xs, seq_len=None, lengths=None):
        """xs: a request's new tokens (n, hidden) each, padded with noise to seq_len. Returns
        each request's new entries (count, head_dim) float64."""
        lengths = [len(x) for x in xs] if lengths is None else lengths
        seq_len = seq_len or max(1, max(len(x) for x in xs))
        batch = self.pad_rng.normal(size=(len(xs), seq_len, HIDDEN)).astype(np.float32)
        for b, x in enumerate(xs):
            batch[b, :len(x)] = x
        out, self.state = _compress(self.weights, self.state, jnp.asarray(batch, self.dtype),
                                    jnp.asarray(lengths, jnp.int32), self.inv_freq)
        assert out.entries.shape == (len(xs), max_entries(self.weights.ratio, seq_len),
                                     self.weights.head_dim)
        new = []
        for b, (ids, entries) in enumerate(zip(np.asarray(out.entry_ids),
                                               np.asarray(out.entries.astype(jnp.float32)))):
            count = int((ids >= 0).sum())
            np.testing.assert_array_equal(ids[:count], len(self.rows[b]) + np.arange(count))
            assert (ids[count:] == -1).all() and (entries[count:] == 0).all()
            self.rows[b].extend(entries[:count].astype(np.float64))
            new.append(entries[:count].astype(np.float64))
        return new

    def entries(self, b):
        return np.array(self.rows[b]).reshape(-1, self.weights.head_dim)


def _assert_state_is_hfs(ours, b, hf_state, tol):
    """Request b's state holds what HF's cache layer keeps: the unfinished window's kv and
    gate (zeros after it) and CSA's overlap."""
    state = jax.tree.map(lambda a: np.asarray(a[b].astype(jnp.float32), np.float64),
                         ours.state)
    waiting = int(state.num_tokens) % ours.weights.ratio
    buf_kv, buf_gate, overlap_kv, overlap_gate = hf_state
    for got, want in ((state.window_kv, buf_kv), (state.window_gate, buf_gate)):
        np.testing.assert_allclose(got[:waiting], want, **tol)
        assert (got[waiting:] == 0).all()
    if ours.weights.overlap and overlap_kv is not None:
        np.testing.assert_allclose(state.overlap_kv, overlap_kv, **tol)
        np.testing.assert_allclose(state.overlap_gate, overlap_gate, **tol)


def _run_against_hf(hf, kind, dtype, chunks, seed=0, tol=None):
    """Feeds one request to HF and to compress chunk by chunk; checks each call's entries and
    the state after it. Returns Ours."""
    tol = tol or HF_TOL[dtype]
    x = _tokens(seed, sum(chunks))
    ours, request, start = Ours(hf, kind, 1, dtype), hf.request(), 0
    for n in chunks:
        want = hf.feed(request, x[start:start + n])[KINDS[kind]]
        ours.feed([x[start:start + n]])
        start += n
        assert ours.entries(0).shape == want.shape
        np.testing.assert_allclose(ours.entries(0), want, **tol)
        _assert_state_is_hfs(ours, 0, hf.state(request, *KINDS[kind]), tol)
    return ours


@pytest.mark.parametrize("kind", list(KINDS))
def test_prompt_at_once_equals_hf(kind, dtype):
    ours = _run_against_hf(HFLayers(config(), dtype), kind, dtype, [150])
    assert len(ours.entries(0)) == 150 // ours.weights.ratio


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunks_then_steps_equal_hf(kind):
    hf = HFLayers(config())
    ours = _run_against_hf(hf, kind, "float32", CHUNKS + (1,) * STEPS)
    assert len(ours.entries(0)) == (sum(CHUNKS) + STEPS) // ours.weights.ratio


def test_hca_at_v4s_ratio_equals_hf():
    """HCA at ratio 128: chunks that cross the first window's end, then steps that close the
    second."""
    hf = HFLayers(config(hca_ratio=128))
    ours = _run_against_hf(hf, "hca", "float32", CHUNKS + (86,) + (1,) * STEPS)
    assert len(ours.entries(0)) == 2


@pytest.mark.parametrize("kind", list(KINDS))
def test_bfloat16_equals_hf(kind):
    _run_against_hf(HFLayers(config(), "bfloat16"), kind, "bfloat16", (70, 37, 1, 1, 1))


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunking_does_not_matter(kind):
    hf = HFLayers(config())
    x = _tokens(1, sum(CHUNKS) + STEPS)
    whole = Ours(hf, kind, 1, "float32")
    whole.feed([x])
    chunked, start = Ours(hf, kind, 1, "float32"), 0
    for n in CHUNKS + (1,) * STEPS:
        chunked.feed([x[start:start + n]])
        start += n
    np.testing.assert_allclose(chunked.entries(0), whole.entries(0), **SAME_TOL)
    assert int(chunked.state.num_tokens[0]) == int(whole.state.num_tokens[0]) == len(x)
    for got, want in zip(jax.tree.leaves(chunked.state), jax.tree.leaves(whole.state)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), **SAME_TOL)


# Per call, each request's new tokens (0: it sits the call out).
RAGGED = [(37, 5, 129, 0), (1, 64, 3, 17), (0, 1, 1, 40), (1, 1, 1, 1), (9, 30, 0, 3)]


@pytest.mark.parametrize("kind", list(KINDS))
def test_ragged_batch_equals_each_request_alone(kind):
    hf = HFLayers(config())
    xs = [_tokens(10 + b, sum(call[b] for call in RAGGED)) for b in range(4)]
    batch, starts = Ours(hf, kind, 4, "float32"), [0] * 4
    for call in RAGGED:
        batch.feed([xs[b][starts[b]:starts[b] + n] for b, n in enumerate(call)])
        starts = [s + n for s, n in zip(starts, call)]
    for b in range(4):
        alone, request, start = Ours(hf, kind, 1, "float32"), hf.request(), 0
        for n in (call[b] for call in RAGGED if call[b]):
            alone.feed([xs[b][start:start + n]], seq_len=max(map(max, RAGGED)))
            want = hf.feed(request, xs[b][start:start + n])[KINDS[kind]]
            start += n
        np.testing.assert_allclose(batch.entries(b), alone.entries(0), **SAME_TOL)
        np.testing.assert_allclose(batch.entries(b), want, **HF_TOL["float32"])
        _assert_state_is_hfs(batch, b, hf.state(request, *KINDS[kind]), HF_TOL["float32"])


@pytest.mark.parametrize("kind, dropped", [("csa", "overlap"), ("indexer", "overlap"),
                                           ("csa", "window"), ("hca", "window")])
def test_dropping_the_state_shows(kind, dropped):
    """The comparison with HF sees the state: zeroing CSA's overlap, or the unfinished
    window's projections, between calls gives entries HF does not (with it kept they are
    HF's, test_chunks_then_steps_equal_hf)."""
    hf = HFLayers(config())
    x = _tokens(2, 150)
    ours, request = Ours(hf, kind, 1, "float32"), hf.request()
    fields = ("overlap_kv", "overlap_gate") if dropped == "overlap" \
        else ("window_kv", "window_gate")
    for start, n in ((0, 37), (37, 113)):
        ours.feed([x[start:start + n]])
        want = hf.feed(request, x[start:start + n])[KINDS[kind]]
        ours.state = CompressorState(**{
            f: jnp.zeros_like(v) if f in fields else v
            for f, v in vars(ours.state).items()})
    np.testing.assert_allclose(ours.entries(0)[:37 // ours.weights.ratio],
                               want[:37 // ours.weights.ratio], **HF_TOL["float32"])
    assert not np.allclose(ours.entries(0), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["hca", "csa"])
def test_bad_lengths_complete_nothing(kind):
    """A length below 0 or above seq_len counts as 0: no entry, the request's state as it
    was; the batch's other requests go on as alone."""
    hf = HFLayers(config())
    x = _tokens(3, 64)
    seq_len = 32
    ours = Ours(hf, kind, 4, "float32")
    ours.feed([x[:7]] * 4)  # tokens waiting, and for CSA an overlap
    before = jax.tree.map(np.array, ours.state)
    new = ours.feed([x[7:39]] * 4, seq_len=seq_len,
                    lengths=[-1, seq_len + 1, seq_len, np.iinfo(np.int32).min])
    alone = Ours(hf, kind, 1, "float32")
    alone.feed([x[:7]])
    np.testing.assert_allclose(new[2], alone.feed([x[7:39]])[0], **SAME_TOL)
    assert len(new[2]) == 39 // ours.weights.ratio - 7 // ours.weights.ratio > 0
    after = jax.tree.map(np.asarray, ours.state)
    for b in (0, 1, 3):
        assert len(new[b]) == 0
        for got, want in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
            np.testing.assert_array_equal(got[b], want[b])


def test_visible_entries_are_hfs_mask():
    """Query p reads entry j iff j < (p + 1) // r: HF's HCA block bias over a prompt."""
    torch = pytest.importorskip("torch")
    hf = HFLayers(config())
    ratio, n = hf.cfg.compress_rates["heavily_compressed_attention"], 70
    positions = torch.arange(n)[None]
    hidden = torch.as_tensor(_tokens(4, n))[None]
    with torch.no_grad():
        entries, bias = hf.layers[HCA].compressor(hidden, None, positions, None, HCA)
    seen = (bias[0, 0] == 0).sum(-1).numpy()
    want = np.minimum(visible_entries(np.arange(n), ratio), entries.shape[2])
    np.testing.assert_array_equal(seen, want)
    assert seen[ratio - 2] == 0 and seen[ratio - 1] == 1


def test_state_must_fit_the_weights_and_x():
    hf = HFLayers(config())
    hca, csa = hf.weights(HCA), hf.weights(CSA)
    x, lengths = jnp.zeros((2, 4, HIDDEN)), jnp.array([4, 4])
    for weights, state in ((csa, initial_state(hca, 2, jnp.float32)),
                           (hca, initial_state(hca, 3, jnp.float32)),
                           (hca, CompressorState.create(2, 16, 64, False, jnp.bfloat16))):
        with pytest.raises(ValueError, match="state does not fit"):
            compress(weights, state, x, lengths, jnp.asarray(hf.inv_freq))


def test_the_donated_state_is_updated_in_place():
    hf = HFLayers(config())
    weights = hf.weights(CSA)
    state = initial_state(weights, 2, jnp.float32)
    args = (weights, state, jnp.zeros((2, 5, HIDDEN)), jnp.array([5, 3]),
            jnp.asarray(hf.inv_freq))
    header = _compress.lower(*args).compile().as_text().split("entry_computation_layout")[0]
    assert header.count("-alias)") == len(jax.tree.leaves(state)) == 5


def test_the_projections_run_at_float32s_precision():
    """compress's two projections ask for precision HIGHEST: XLA's default for a float32 dot
    on a GPU takes TF32 passes, which put the entries 1e-4 off HF's float32 matmuls."""
    hf = HFLayers(config())
    weights = hf.weights(*KINDS["csa"])
    lowered = jax.jit(compress).lower(weights, initial_state(weights, 1, jnp.float32),
                                      jnp.zeros((1, 8, HIDDEN), jnp.float32),
                                      jnp.asarray([8], jnp.int32), jnp.asarray(hf.inv_freq))
    dots = [line for line in lowered.as_text().splitlines() if "dot_general" in line]
    assert len(dots) == 2 and all("precision = [HIGHEST, HIGHEST]" in line for line in dots)
