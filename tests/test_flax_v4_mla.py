"""DeepSeek-V4's attention layer (jax_flashmla.flax.V4Attention) against HF
transformers' DeepseekV4Attention on CPU, per layer type (sliding, HCA, CSA): a batch of prompts
of different lengths (HF one request at a time, with its own cache), whole or in chunks, then
decode steps that wrap the window ring and complete compressed entries; the window and the
compressors' states carried in the cache matter.

CSA: our indexer scores FP8 queries and keys, HF's exact ones, so the selections are HF's up
to near-ties, by tests/v4_ties.py's rule (checked on every call: every entry scoring above the
k-th best exact score by more than twice the row's largest FP8 score error is selected, none
below it by more). HF's calls attend to our selections (v4_attention_hf), so that outputs
compare where near-ties went another way. The entries and index keys stored are HF's to
e4m3's rounding: relative L2 within FP8_ENTRY_TOL an entry (2**-4 a value, half a unit in
e4m3's last place, plus room for values below its normals).

Tolerances, by the dtype of what the attention reads (a token's relative L2 error against
HF's, |ours - HF| / |HF| over hidden, at most TOKEN_TOL[dtype][0], on average over the tokens
TOKEN_TOL[dtype][1]):
  - "bfloat16": prefill attends over the prompts' rows as computed, through FlashMLA's sparse
    prefill (its reference here), which takes q and the rows in bf16 and gives bf16: each
    rounded to bf16's 8 significant bits (2**-9 ~ 0.002 relative, at most) where HF stays in
    float32. The three roundings, and the scores' errors through the softmax, leave a token a
    few times 2**-9 off (~0.003 on average, ~0.008 at worst here);
  - "float8": decode reads K=V rows stored as FP8 (e4m3 with ue8m0 scales per 64 dims, RoPE
    dims in bf16), and its query and output pass through bf16 (FlashMLA's decode contract);
    V4's FP8 storage is known to move HF's outputs by ~0.033, at most ~0.072 on a token.
    Prompts fed in chunks read the earlier chunks' rows from the cache as FP8 too: their
    tokens' outputs differ from the prompt fed at once within the same tolerance.
"""
import dataclasses

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import fp8_checkpoint
from v4_attention_hf import CSA, HCA, HIDDEN, LAYER_TYPES, SLIDING, HFLayers, config, torch
from v4_ties import assert_selections_up_to_ties

from jax_flashmla.caches.compressor_state import CompressorState
from jax_flashmla.caches.index_keys import read_index_keys
from jax_flashmla.caches.v4 import V4KVCache, gather_rows
from jax_flashmla.flax import V4Attention, V4Config, load_attention_weights
from jax_flashmla.flax.v4_weights import DEEPSEEK_NAMES, v4_parameter, v4_parameter_names
from jax_flashmla.ops.indexer import HADAMARD, IndexQuery, index_scores
from jax_flashmla.ops.v4_indexer import v4_index_query, visible_entries

TOKEN_TOL = {"bfloat16": (0.02, 0.006), "float8": (0.1, 0.05)}  # (a token's, the mean)
# Two runs of the bf16 path that differ in float32 sums alone (index rows of other widths):
# their attention outputs differ by a bf16 rounding at most.
BF16_ROUNDING = 2.0 ** -8
FP8_ENTRY_TOL = 0.07
KINDS = {"sliding": SLIDING, "hca": HCA}
STEPS = 24
# The sliding and HCA tests share one cache capacity, and their calls one width (the chunks
# padded to the prompts'), so that each kind compiles one prefill, one extend and one decode:
# those compiles are most of the tests' time, and neither size is what they test.
MAX_TOKENS = 256
SEQ_LEN = 150
ROTATION = HADAMARD.astype(np.float64) / np.sqrt(128)  # the indexer's keys are stored rotated


def _tokens(seed, n):
    return np.random.default_rng(seed).normal(size=(n, HIDDEN)).astype(np.float32)


def _layer(hf, index):
    """Our layer of HF's layer `index`, its weights loaded from HF's state dict."""
    layer = V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[index], rngs=nnx.Rngs(0))
    return load_attention_weights(layer, hf.state_dict(index), prefix="self_attn.")


@nnx.jit
def _prefill(layer, x, cache, lengths):
    return layer.prefill(x, cache, lengths=lengths)


@nnx.jit
def _extend(layer, x, cache, lengths):
    return layer.extend(x, cache, lengths=lengths)


@nnx.jit
def _decode(layer, x, cache, active):
    return layer.decode(x, cache, active=active)


@nnx.jit
def _select(layer, x, cache, lengths):
    """The CSA layer's selections of new tokens x (b, s, hidden) (select_entries') and our FP8
    index scores behind them: (b, s, entry capacity) float32, -inf past each token's visible
    entries."""
    selection, cache = layer.select_entries(x, cache, lengths=lengths)
    b, s, _ = x.shape
    start = cache.num_tokens
    positions = start[:, None] + jnp.arange(s, dtype=jnp.int32)
    query = v4_index_query(layer.indexer.indexer_weights(), x, layer.q_a_norm(layer.q_a_proj(x)),
                           positions, jnp.asarray(layer.inv_freq), layer.attention_factor)
    rows = IndexQuery(*(a.reshape(b * s, *a.shape[2:]) for a in query))
    visible = visible_entries(start, lengths, s, layer.ratio).reshape(-1)
    tables = jnp.repeat(cache.compressed_table, s, axis=0)
    return selection.entries, index_scores(rows, cache.index_keys, tables,
                                           visible).reshape(b, s, -1)


@jax.jit
def _stored_entries(cache):
    """Each request's compressed entries as stored, dequantized, (b, entry capacity, 512)
    float32, and in a CSA layer its index keys, (b, entry capacity, 128) (else None); garbage
    past the request's entries."""
    ids = jnp.arange(cache.entry_capacity, dtype=jnp.int32)
    slots = jnp.maximum(cache.entry_slots(jnp.broadcast_to(ids, cache.compressed_table.shape[:1]
                                                           + ids.shape)), 0)
    if cache.index_keys is None:
        return gather_rows(cache.compressed.data, slots), None
    values, scales = read_index_keys(cache.index_keys.data, slots)
    return (gather_rows(cache.compressed.data, slots),
            values.astype(jnp.float32) * scales[..., None])


def _entry_errors(held, stored):
    """{"compressed entries", and in a CSA layer "index keys": (count,)}: each of a request's
    entries as stored (its rows of _stored_entries', numpy) against HF's (held: its cache
    layer's compressed_kv; the index keys rotated), relative L2."""
    count = 0 if held["compressor"] is None else held["compressor"].shape[1]
    errors = {}
    for name, hf_name, got in zip(("compressed entries", "index keys"), ("compressor", "indexer"),
                                  stored):
        if got is None or not count:
            continue
        want = held[hf_name][0].double().numpy()
        want = want @ ROTATION if hf_name == "indexer" else want
        errors[name] = _relative_errors(np.asarray(got[:count], np.float64), want)
    return errors


def _relative_errors(ours, want):
    """Each token's |ours - want| / |want| (L2 over hidden)."""
    return np.linalg.norm(ours - want, axis=-1) / np.linalg.norm(want, axis=-1)


def _assert_within(errors, dtype):
    """Tokens' relative errors (an array of _relative_errors') within TOKEN_TOL[dtype] (module
    doc)."""
    most, mean = TOKEN_TOL[dtype]
    assert errors.max() < most, (dtype, errors.max())
    assert errors.mean() < mean, (dtype, errors.mean())


class Run:
    """A batch of requests fed to our layer and, a request at a time, to HF's. Request b's
    tokens come from its own stream, so runs of one seed feed the same tokens however they
    chunk them."""

    def __init__(self, hf, index, prompt_lengths, max_tokens, seed=0):
        self.hf, self.index = hf, index
        self.layer = _layer(hf, index)
        self.cache = self.layer.init_cache(len(prompt_lengths), max_tokens)
        self.requests = [hf.request() for _ in prompt_lengths]
        self.lengths = list(prompt_lengths)
        self.rng = np.random.default_rng(seed)  # the padding's
        self.streams = [_tokens(1000 * seed + b, max_tokens) for b in range(len(prompt_lengths))]
        self.fed = [0] * len(prompt_lengths)
        self.with_hf = True  # False: ours alone from here on (HF's outputs None)

    def _next_tokens(self, lengths, seq_len):
        """(batch, seq_len, hidden): each request's next lengths[b] tokens, then noise."""
        x = self.rng.normal(size=(len(lengths), seq_len, HIDDEN)).astype(np.float32)
        for b, n in enumerate(lengths):
            x[b, :n] = self.streams[b][self.fed[b]:self.fed[b] + n]
            self.fed[b] += n
        return x

    def _call(self, ours, x, lengths):
        """ours(layer, x, cache) -> (out, cache) on new tokens x, request b's first lengths[b]
        rows; returns (our out float64, HF's outputs: a (lengths[b], hidden) array a request)."""
        out, self.cache = ours(self.layer, jnp.asarray(x), self.cache)
        if not self.with_hf:
            return np.asarray(out, np.float64), None
        want = [self.hf.feed(r, x[b, :n], layer=self.index)[self.index] if n
                else np.zeros((0, HIDDEN)) for b, (r, n) in enumerate(zip(self.requests, lengths))]
        return np.asarray(out, np.float64), want

    def prefill(self, lengths=None, form=_prefill, seq_len=None):
        """Feeds each request `lengths` new tokens (default the prompt lengths) padded with
        noise to seq_len (default the longest), through form (_prefill or _extend); returns
        (ours, HF's), each a list of (n, hidden) float64 arrays."""
        lengths = self.lengths if lengths is None else lengths
        s = seq_len or max(1, max(lengths))
        x = self._next_tokens(lengths, s)
        as_lengths = jnp.asarray(lengths, jnp.int32)
        out, want = self._call(lambda layer, x, cache: form(layer, x, cache, as_lengths), x,
                               lengths)
        ours = [out[b, :n] for b, n in enumerate(lengths)]
        assert not np.any(out[np.arange(s)[None] >= np.asarray(lengths)[:, None]])
        return ours, want

    def step(self, active=None):
        """One decode step of the active requests (default all); returns (ours, HF's), each
        (active requests, hidden) float64. Idle rows must come out 0."""
        active = np.ones(len(self.lengths), bool) if active is None else np.asarray(active)
        x = self._next_tokens(active.astype(int), 1)
        out, want = self._call(
            lambda layer, x, cache: _decode(layer, x, cache, jnp.asarray(active)), x,
            active.astype(int))
        out = out[:, 0]
        assert not np.any(out[~active])
        return out[active], None if want is None else np.stack([w[0] for w in want if len(w)])


class CSARun(Run):
    """A Run of the CSA layer, HF attending to our selections, each call checked (module doc):
    the stored entries and index keys against HF's, then the selections against HF's exact
    scores by the tie rule. rows and differing count the tokens checked and those whose
    selections are not HF's own (near-ties)."""

    def __init__(self, hf, prompt_lengths, max_tokens, seed=0):
        super().__init__(hf, CSA, prompt_lengths, max_tokens, seed)
        self.rows = self.differing = 0
        self.selections = [[] for _ in prompt_lengths]  # each call's (n, topk) a request

    def _call(self, ours, x, lengths):
        if not self.with_hf:
            return super()._call(ours, x, lengths)
        start = np.asarray(self.cache.num_tokens)
        x_j = jnp.asarray(x)
        entries, fp8 = _select(self.layer, x_j, self.cache, jnp.asarray(lengths, jnp.int32))
        entries, fp8 = np.asarray(entries), np.asarray(fp8, np.float64)
        out, self.cache = ours(self.layer, x_j, self.cache)
        stored = _stored_entries(self.cache)
        want = []
        for b, n in enumerate(lengths):
            want.append(self.hf.feed(self.requests[b], x[b, :n], selected=entries[b, :n],
                                     layer=CSA)[CSA] if n else np.zeros((0, HIDDEN)))
            if not n:
                continue
            self._check_entries(b, stored)
            call = self.hf.indexer_call
            count = call["scores"].shape[-1]
            visible = (int(start[b]) + np.arange(n) + 1) // self.layer.ratio
            exact = np.where(np.arange(count) < visible[:, None], call["scores"], -np.inf)
            self.differing += assert_selections_up_to_ties(
                entries[b, :n], call["selected"], exact, fp8[b, :n, :count],
                self.layer.config.index_topk)
            self.rows += n
            self.selections[b].append(entries[b, :n])
        return out, want

    def _check_entries(self, b, stored):
        """Request b's compressed entries and index keys as stored against HF's."""
        held = self.requests[b]["cache"].layers[CSA].compressed_kv
        for name, error in _entry_errors(held, [a[b] for a in stored]).items():
            assert error.max() < FP8_ENTRY_TOL, f"request {b}'s {name} stray from HF's: {error}"


@pytest.fixture(scope="module")
def hf():
    return HFLayers(config())


def test_ropes_are_hfs(hf):
    cfg = V4Config.from_hf(hf.cfg)
    for layer_type, kind in ((LAYER_TYPES[SLIDING], "main"), (LAYER_TYPES[HCA], "compress"),
                             (LAYER_TYPES[CSA], "compress")):
        inv_freq, factor = cfg.rope(layer_type)
        np.testing.assert_allclose(inv_freq, getattr(hf.rotary, f"{kind}_inv_freq").numpy(),
                                   rtol=1e-6)
        assert factor == getattr(hf.rotary, f"{kind}_attention_scaling")


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_of_a_batch_equals_hf(hf, kind):
    # Past the window (150 > 128), between, and one token; HCA's ratio is 16.
    run = Run(hf, KINDS[kind], [150, 37, 1], max_tokens=MAX_TOKENS)
    ours, want = run.prefill()
    _assert_within(np.concatenate([_relative_errors(o, w) for o, w in zip(ours, want)]),
                   "bfloat16")
    np.testing.assert_array_equal(run.cache.num_tokens, run.lengths)


@pytest.mark.parametrize("kind", list(KINDS))
def test_decode_steps_equal_hf(hf, kind):
    # 120 + 24 wraps the 128-token ring during decode; 150 has wrapped it already; 5 stays
    # short of one HCA window until step 11.
    run = Run(hf, KINDS[kind], [120, 150, 5], max_tokens=MAX_TOKENS, seed=1)
    run.prefill()
    errors = []
    for _ in range(STEPS):
        ours, want = run.step()
        errors.append(_relative_errors(ours, want))
    _assert_within(np.concatenate(errors), "float8")
    np.testing.assert_array_equal(run.cache.num_tokens, np.asarray(run.lengths) + STEPS)


@pytest.mark.parametrize("kind", list(KINDS))
def test_extend_from_nothing_is_prefill(hf, kind):
    runs = [Run(hf, KINDS[kind], [150, 37, 1], max_tokens=MAX_TOKENS) for _ in range(2)]
    (prefilled, _), (extended, _) = runs[0].prefill(), runs[1].prefill(form=_extend)
    errors = np.concatenate([_relative_errors(a, b) for a, b in zip(prefilled, extended)])
    assert errors.max() < BF16_ROUNDING, errors.max()
    for got, want in zip(jax.tree.leaves(runs[0].cache), jax.tree.leaves(runs[1].cache)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", list(KINDS))
def test_chunks_then_decode_equal_hf(hf, kind):
    """Prompts fed in chunks of different sizes a request (a request idle in a chunk: length
    0), each chunk over the cache the earlier ones left, then decode steps."""
    run = Run(hf, KINDS[kind], [37, 5, 0], max_tokens=MAX_TOKENS, seed=3)
    errors = []
    for lengths in ([37, 5, 0], [100, 0, 130], [1, 140, 17], [64, 3, 0]):
        ours, want = run.prefill(lengths, form=_extend, seq_len=SEQ_LEN)
        errors += [_relative_errors(o, w) for o, w in zip(ours, want) if len(w)]
    for step in range(8):  # the last request idle every other step
        errors.append(_relative_errors(*run.step([True, True, step % 2 == 0])))
    _assert_within(np.concatenate(errors), "float8")
    np.testing.assert_array_equal(run.cache.num_tokens, [210, 156, 151])


@pytest.mark.parametrize("dropped", ["window", "compressor"])
def test_decode_needs_what_the_cache_carries(hf, dropped):
    """The same run with the window's rows wiped after prefill strays from HF beyond the FP8
    tolerance; with the compressor's unfinished window wiped, the entry it completes next is
    not HF's: both are read."""
    # 40 tokens: 8 wait in the compressor's unfinished window; step 8 completes an entry.
    run = Run(hf, HCA, [40], max_tokens=64, seed=2)
    run.prefill()
    if dropped == "window":
        wiped = dict(window=V4KVCache.create(run.cache.window.data.shape[0]))
    else:
        state = run.cache.compressor
        wiped = dict(compressor=CompressorState(
            window_kv=jnp.zeros_like(state.window_kv),
            window_gate=jnp.zeros_like(state.window_gate), overlap_kv=None, overlap_gate=None,
            num_tokens=state.num_tokens))
    run.cache = dataclasses.replace(run.cache, **wiped)
    errors = np.concatenate([_relative_errors(*run.step()) for _ in range(10)])
    if dropped == "window":
        assert errors.max() > TOKEN_TOL["float8"][0], errors
    else:
        stored = [None if a is None else np.asarray(a[0]) for a in _stored_entries(run.cache)]
        errors = _entry_errors(run.requests[0]["cache"].layers[HCA].compressed_kv, stored)
        assert errors["compressed entries"][:2].max() < FP8_ENTRY_TOL, errors
        assert errors["compressed entries"][2] > FP8_ENTRY_TOL, errors


def test_hca_at_v4s_ratio():
    """HCA at ratio 128: a prompt of 250 (one entry, 122 tokens waiting), then decode steps
    that complete the second entry at token 256."""
    run = Run(HFLayers(config(hca_ratio=128)), HCA, [250, 3], max_tokens=300, seed=4)
    ours, want = run.prefill()
    _assert_within(np.concatenate([_relative_errors(o, w) for o, w in zip(ours, want)]),
                   "bfloat16")
    errors = np.concatenate([_relative_errors(*run.step()) for _ in range(10)])
    assert errors.max() < TOKEN_TOL["float8"][0], errors.max()
    assert int(run.cache.compressor.entry_count[0]) == 2


# CSA: per call, each request's new tokens (0: it sits the call out); each request gets
# chunks of 1, 3, 37 and 129 tokens in some order, crossing entry and window boundaries.
CSA_CHUNKS = [(1, 37, 129), (3, 1, 0), (37, 3, 1), (129, 129, 3)]
CSA_PROMPTS = [sum(chunk) for chunk in zip(*CSA_CHUNKS)]  # 170, 170, 133
CSA_STEPS = 22
CSA_ACTIVE = [[True, True, step % 2 == 0] for step in range(CSA_STEPS)]  # the last idles
CSA_MAX_TOKENS = 200


@pytest.fixture(scope="module")
def csa_runs(hf):
    """The same three CSA requests fed their prompts in chunks (extend, each call padded to 129
    tokens) or at once (prefill), then CSA_STEPS decode steps (CSA_ACTIVE); every call checked
    (CSARun) but the at-once run's steps, which must be the chunked run's. {"chunks"|"at_once":
    {"run", "prompt": (ours, HF's) a (n, hidden) array a request, "cache": the cache after the
    prompts, "steps": (ours, HF's or None), each step's (active requests, hidden) arrays}}."""
    runs = {}
    for form in ("chunks", "at_once"):
        run = CSARun(hf, CSA_PROMPTS, CSA_MAX_TOKENS, seed=5)
        if form == "chunks":
            calls = [run.prefill(list(chunk), form=_extend, seq_len=129) for chunk in CSA_CHUNKS]
            prompt = tuple([np.concatenate([call[side][b] for call in calls]) for b in range(3)]
                           for side in range(2))
        else:
            prompt = run.prefill()
            run.with_hf = False
        cache = run.cache
        ours, want = zip(*[run.step(active) for active in CSA_ACTIVE])
        runs[form] = dict(run=run, prompt=prompt, cache=cache,
                          steps=(np.concatenate(ours),
                                 None if want[0] is None else np.concatenate(want)))
    return runs


def test_csa_prefill_of_a_batch_equals_hf(csa_runs):
    ours, want = csa_runs["at_once"]["prompt"]
    _assert_within(np.concatenate([_relative_errors(o, w) for o, w in zip(ours, want)]),
                   "bfloat16")


def test_csa_chunks_equal_hf(csa_runs):
    ours, want = csa_runs["chunks"]["prompt"]
    _assert_within(np.concatenate([_relative_errors(o, w) for o, w in zip(ours, want)]),
                   "float8")


def test_csa_decode_steps_equal_hf(csa_runs):
    run = csa_runs["chunks"]["run"]
    _assert_within(_relative_errors(*csa_runs["chunks"]["steps"]), "float8")
    np.testing.assert_array_equal(run.cache.num_tokens,
                                  np.asarray(CSA_PROMPTS) + np.sum(CSA_ACTIVE, axis=0))


def test_csa_selections_are_hfs_up_to_ties(csa_runs):
    """CSARun held every token to the tie rule; here: every token was checked, and most
    picked HF's own entries (33 of 192 tokens differed in the indexer's own test)."""
    chunks, at_once = csa_runs["chunks"]["run"], csa_runs["at_once"]["run"]
    assert chunks.rows == sum(CSA_PROMPTS) + np.sum(CSA_ACTIVE)
    assert at_once.rows == sum(CSA_PROMPTS)
    for run in (chunks, at_once):
        assert run.differing < run.rows / 4, (run.differing, run.rows)


def test_csa_chunking_does_not_matter(csa_runs):
    """The prompts in chunks, then decode steps, against the prompts at once: the same
    selections, the same cache after the prompts, the same decode steps; the prompts' outputs
    within the FP8 tolerance (the chunks read earlier chunks' rows as FP8)."""
    chunks, at_once = csa_runs["chunks"], csa_runs["at_once"]
    for b, n in enumerate(CSA_PROMPTS):  # the chunked run's go on with its steps'
        np.testing.assert_array_equal(np.concatenate(chunks["run"].selections[b])[:n],
                                      np.concatenate(at_once["run"].selections[b]))
    errors = np.concatenate([_relative_errors(c, a) for c, a in zip(chunks["prompt"][0],
                                                                    at_once["prompt"][0])])
    assert errors.max() < TOKEN_TOL["float8"][0], errors.max()
    for got, want in zip(jax.tree.leaves(chunks["cache"]), jax.tree.leaves(at_once["cache"])):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(chunks["steps"][0], at_once["steps"][0], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dropped, strays", [("compressor", "compressed entries"),
                                             ("index_compressor", "index keys")])
def test_csa_decode_needs_the_compressors_states(hf, dropped, strays):
    """The CSA compressor's overlap, or the whole state of the indexer's compressor (its
    unfinished window and overlap), wiped after the prompts: the entries completed next stray
    from HF's, which the checks of every call catch."""
    # 62 and 150 tokens: 2 wait in each one's unfinished window; step 2 completes an entry.
    run = CSARun(hf, [62, 150, 5], CSA_MAX_TOKENS, seed=6)
    run.prefill(seq_len=max(CSA_PROMPTS))  # the shapes that csa_runs compiled
    state = getattr(run.cache, dropped)
    zeros = {name: jnp.zeros_like(getattr(state, name)) for name in
             (("overlap_kv", "overlap_gate") if dropped == "compressor" else
              ("window_kv", "window_gate", "overlap_kv", "overlap_gate"))}
    run.cache = dataclasses.replace(run.cache,
                                    **{dropped: dataclasses.replace(state, **zeros)})
    with pytest.raises(AssertionError, match=strays):
        for _ in range(4):
            run.step()


def test_csa_needs_a_128_wide_indexer(hf):
    config = dataclasses.replace(V4Config.from_hf(hf.cfg), index_head_dim=64)
    with pytest.raises(ValueError, match="index_head_dim 128"):
        V4Attention(config, LAYER_TYPES[CSA], rngs=nnx.Rngs(0))
    layer = _layer(hf, HCA)
    with pytest.raises(ValueError, match="layer_type must be"):
        layer.select_entries(jnp.zeros((1, 1, HIDDEN)), layer.init_cache(1, 64))


@pytest.mark.parametrize("form", ["prefill", "extend"])
def test_the_implementation_must_be_known(hf, form):
    layer = _layer(hf, SLIDING)
    with pytest.raises(ValueError, match="implementation must be None or one of .*'cuda'"):
        getattr(layer, form)(jnp.zeros((1, 2, HIDDEN)), layer.init_cache(1, 64),
                             implementation="cuda")


def test_load_attention_weights_loads_every_layer_type(hf, tmp_path):
    """load_attention_weights fills a V4Attention of each type with exactly HF's tensors, each
    in its parameter (a Linear's transposed), from a state dict or a safetensors file alike."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    for index in (SLIDING, HCA, CSA):
        weights = hf.state_dict(index)
        assert sorted("self_attn." + n for n in v4_parameter_names(_layer(hf, index))) == sorted(
            weights)
        path = tmp_path / f"layer{index}.safetensors"
        safetensors_torch.save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
        from_dict = _layer(hf, index)
        from_file = load_attention_weights(
            V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[index], rngs=nnx.Rngs(1)), path,
            prefix="self_attn.")
        for name in v4_parameter_names(from_dict):
            param, transposed = v4_parameter(from_dict, name)
            want = weights["self_attn." + name].detach().float().numpy()
            np.testing.assert_array_equal(np.asarray(param[...], np.float32),
                                          want.T if transposed else want)
            np.testing.assert_array_equal(v4_parameter(from_file, name)[0][...], param[...])


def test_weights_must_fit(hf):
    layer = V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[HCA], rngs=nnx.Rngs(0))
    weights = hf.state_dict(HCA)
    with pytest.raises(KeyError, match="compressor.position_bias"):
        load_attention_weights(layer, {k: v for k, v in weights.items()
                                       if "position_bias" not in k}, prefix="self_attn.")
    with pytest.raises(ValueError, match="sinks"):
        load_attention_weights(layer, {**weights, "self_attn.sinks": np.zeros(3)},
                               prefix="self_attn.")
    # A CSA layer reads its indexer's six tensors too, the scorer's among them.
    layer = V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[CSA], rngs=nnx.Rngs(0))
    weights = hf.state_dict(CSA)
    assert sum(".indexer." in name for name in weights) == 6
    with pytest.raises(KeyError, match="compressor.indexer.scorer.weights_proj.weight"):
        load_attention_weights(layer, {k: v for k, v in weights.items()
                                       if "scorer" not in k}, prefix="self_attn.")
    with pytest.raises(ValueError, match="compressor.indexer.q_b_proj.weight"):
        load_attention_weights(
            layer, {**weights, "self_attn.compressor.indexer.q_b_proj.weight": np.zeros((3, 16))},
            prefix="self_attn.")


def test_an_fp8_checkpoint_loads_dequantized(hf):
    """A CSA layer from a checkpoint stored as DeepSeek-V4-Flash's: its Linear weights e4m3
    with ue8m0 scales per 128 x 128 block, the compressor's and the indexer's kv, gate and
    head-weight projections bf16 without scales (HF's _keep_in_fp32_modules); each parameter
    is its weight dequantized, the others HF's tensors."""
    bf16 = ("compressor.kv_proj", "compressor.gate_proj", "indexer.kv_proj",
            "indexer.gate_proj", "weights_proj")
    weights, want = fp8_checkpoint(
        hf.state_dict(CSA), torch.float8_e8m0fnu,
        quantized=lambda key: not any(name in key for name in bf16))
    assert {k.removeprefix("self_attn.") for k in want} == {
        "q_a_proj.weight", "q_b_proj.weight", "kv_proj.weight", "o_a_proj.weight",
        "o_b_proj.weight", "compressor.indexer.q_b_proj.weight"}
    layer = load_attention_weights(
        V4Attention(V4Config.from_hf(hf.cfg), LAYER_TYPES[CSA], rngs=nnx.Rngs(0)), weights,
        prefix="self_attn.")
    for name in v4_parameter_names(layer):
        param, transposed = v4_parameter(layer, name)
        key = "self_attn." + name
        expected = (want[key] if key in want else weights[key].double()).float().numpy()
        np.testing.assert_array_equal(np.asarray(param[...], np.float32),
                                      expected.T if transposed else expected)


def test_deepseeks_names_are_those_hf_renames(hf):
    """v4_weights.DEEPSEEK_NAMES covers a CSA layer's tensors, and HF's loader renames each
    DeepSeek name (and a weight's ".scale") to the HF name it stands for."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [t for t in get_checkpoint_conversion_mapping("deepseek_v4")
                 if type(t) is WeightRenaming]
    # HF's FP8 quantizer adds this one for checkpoints that ship their scales as ".scale".
    renamings.append(WeightRenaming(source_patterns=r"^(.+)\.scale",
                                    target_patterns=r"\1.weight_scale_inv"))
    layer = _layer(hf, CSA)
    assert sorted(DEEPSEEK_NAMES) == sorted(v4_parameter_names(layer))
    for name, own in DEEPSEEK_NAMES.items():
        assert apply_renamings("layers.3.attn." + own, renamings) == "layers.3.self_attn." + name
        if own.endswith(".weight"):
            assert apply_renamings("layers.3.attn." + own.removesuffix("weight") + "scale",
                                   renamings) == "layers.3.self_attn." + name + "_scale_inv"


def test_a_checkpoint_under_deepseeks_names_loads_as_under_hfs(hf, tmp_path):
    """A CSA layer from a safetensors file under DeepSeek's own names, its FP8 weights' ue8m0
    scales as "<module>.scale", equals the layer from the same tensors under HF's names."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    hf_weights, _ = fp8_checkpoint(hf.state_dict(CSA), torch.float8_e8m0fnu)
    own = {}
    for name, key in DEEPSEEK_NAMES.items():
        own["layers.3.attn." + key] = hf_weights["self_attn." + name]
        if "self_attn." + name + "_scale_inv" in hf_weights:
            own["layers.3.attn." + key.removesuffix("weight") + "scale"] = hf_weights[
                "self_attn." + name + "_scale_inv"]
    safetensors_torch.save_file(own, str(tmp_path / "model.safetensors"))
    config = V4Config.from_hf(hf.cfg)
    from_hf = load_attention_weights(V4Attention(config, LAYER_TYPES[CSA], rngs=nnx.Rngs(0)),
                                     hf_weights, prefix="self_attn.")
    from_own = load_attention_weights(V4Attention(config, LAYER_TYPES[CSA], rngs=nnx.Rngs(1)),
                                      tmp_path, prefix="layers.3.attn.", names="deepseek")
    for name in v4_parameter_names(from_hf):
        np.testing.assert_array_equal(v4_parameter(from_own, name)[0][...],
                                      v4_parameter(from_hf, name)[0][...])
    with pytest.raises(KeyError, match="layers.3.attn.wq_a.weight"):
        load_attention_weights(from_own, {}, prefix="layers.3.attn.", names="deepseek")
    with pytest.raises(ValueError, match="names must be 'hf' or 'deepseek'; got 'HF'"):
        load_attention_weights(from_own, own, names="HF")
