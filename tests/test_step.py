"""AlternatingStep: the same results as the compiled step it wraps, call after call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf


def _decode_step(cache, q, block_table, seq_lens, slots):
    """Write each request's new row, decode, and make the next q from the out."""
    md = jf.get_mla_metadata(seq_lens, block_table=block_table, num_pages=cache.shape[0],
                             num_heads_q=q.shape[2])
    cache = jf.write_kv(cache, slots, kv=q[:, :, 0])
    out, lse = jf.mla_decode(q, cache, block_table, seq_lens, metadata=md)
    return cache, jnp.concatenate([out.astype(q.dtype), q[..., 512:]], axis=-1), lse


def test_calls_equal_the_compiled_steps_and_run_two_executables():
    rng = np.random.default_rng(0)
    seq_lens = jnp.asarray([70, 128], jnp.int32)
    block_table = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    slots = jf.token_slots(block_table, (seq_lens - 1)[:, None])
    cache = jnp.asarray(rng.normal(0, 0.1, (4, 64, 1, 576)), jnp.bfloat16)
    q = jnp.asarray(rng.normal(0, 0.1, (2, 1, 16, 576)), jnp.bfloat16)
    compiled = jax.jit(_decode_step, donate_argnums=0).lower(
        cache, q, block_table, seq_lens, slots).compile()
    step = jf.serving.AlternatingStep(compiled)
    mine, theirs = (cache.copy(), q), (cache.copy(), q)
    for _ in range(3):  # both copies run, the first twice
        *mine, lse = step(*mine, block_table, seq_lens, slots)
        *theirs, expected_lse = compiled(*theirs, block_table, seq_lens, slots)
        for got, want in zip([*mine, lse], [*theirs, expected_lse]):
            np.testing.assert_array_equal(np.asarray(got, np.float32),
                                          np.asarray(want, np.float32))
    first, second = (c.runtime_executable() for c in step._copies)
    assert first is not second


def test_it_takes_a_compiled_step_only():
    with pytest.raises(TypeError, match="jax.stages.Compiled.*got function"):
        jf.serving.AlternatingStep(_decode_step)



def test_a_step_closing_over_arrays_is_refused_with_the_way_out(monkeypatch):
    """JAX refuses to serialize an executable with closed-over constants (NotImplementedError,
    stood in for here: this jax embeds small ones in the program instead)."""
    from jax.experimental import serialize_executable

    def refuse(compiled):
        raise NotImplementedError("serialize_executables with const_args")
    monkeypatch.setattr(serialize_executable, "serialize", refuse)
    compiled = jax.jit(lambda x: x + 1).lower(jnp.zeros((2,), jnp.int32)).compile()
    with pytest.raises(ValueError, match="closes over arrays.*pass them as arguments.*const_args"):
        jf.serving.AlternatingStep(compiled)
