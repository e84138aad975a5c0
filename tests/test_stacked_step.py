"""A decode step over one stacked cache, as a model holds its layers' caches: all layers' pages
in one (L * P, 64, 1, 576) array, layer l's at l * P onwards and its block table the step's plus
l * P. Written out layer by layer or as a lax.scan, with the cache donated, each layer's write
and decode work in place: the compiled module holds no copy of the cache. The same custom
calls run on CPU (the C++ target) and on the GPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashmla as jf

LAYERS, PAGES, BATCH, H_Q = 3, 8, 2, 16


def _inputs():
    rng = np.random.default_rng(0)
    stack = jnp.asarray(rng.normal(0, 0.1, (LAYERS * PAGES, 64, 1, 576)), jnp.bfloat16)
    block_table = jnp.asarray(rng.permutation(PAGES).reshape(BATCH, PAGES // BATCH), jnp.int32)
    seq_lens = jnp.asarray([200, 77], jnp.int32)
    q = jnp.asarray(rng.normal(0, 0.1, (BATCH, 1, H_Q, 576)), jnp.bfloat16)
    rope = jnp.asarray(rng.normal(0, 0.1, (LAYERS, BATCH, 1, H_Q, 64)), jnp.bfloat16)
    return stack, block_table, seq_lens, q, rope


def _layer(stack, layer, q, block_table, seq_lens, md):
    """Layer `layer`: its new rows come from q (as a model's come from the hidden state the
    layer before produced), so the write follows the decode before it."""
    slots = jf.token_slots(block_table, seq_lens[:, None] - 1) + layer * PAGES * 64
    stack = jf.write_kv(stack, slots, kv=q[:, :, 0, :])
    out, _ = jf.mla_decode(q, stack, block_table + layer * PAGES, seq_lens, metadata=md,
                           implementation="custom_call")
    return stack, out


def _next_q(out, rope):
    return jnp.concatenate([out, rope], axis=-1)


def unrolled(stack, block_table, seq_lens, q, rope):
    md = jf.get_mla_metadata(seq_lens, block_table=block_table, num_pages=PAGES, num_heads_q=H_Q,
                             implementation="custom_call")
    for layer in range(LAYERS):
        stack, out = _layer(stack, layer, q, block_table, seq_lens, md)
        q = _next_q(out, rope[layer])
    return stack, out


def scanned(stack, block_table, seq_lens, q, rope):
    md = jf.get_mla_metadata(seq_lens, block_table=block_table, num_pages=PAGES, num_heads_q=H_Q,
                             implementation="custom_call")

    def body(carry, xs):
        stack, q = carry
        layer, rope_l = xs
        stack, out = _layer(stack, layer, q, block_table, seq_lens, md)
        return (stack, _next_q(out, rope_l)), out

    (stack, _), outs = jax.lax.scan(body, (stack, q), (jnp.arange(LAYERS), rope))
    return stack, outs[-1]


@pytest.mark.parametrize("step", [unrolled, scanned], ids=["unrolled", "scan"])
def test_the_stacked_cache_is_written_and_read_in_place(step):
    args = _inputs()
    compiled = jax.jit(step, donate_argnums=0).lower(*args).compile()
    stack_shape = f"bf16[{LAYERS * PAGES},64,1,576]"
    copies = [line for line in compiled.as_text().splitlines()
              if stack_shape in line and " copy(" in line]
    assert copies == [], copies


def test_unrolled_and_scanned_steps_agree_with_layers_on_their_own_caches():
    stack, block_table, seq_lens, q, rope = _inputs()
    expected_stack, expected_out = jax.jit(unrolled)(stack, block_table, seq_lens, q, rope)
    scan_stack, scan_out = jax.jit(scanned)(stack, block_table, seq_lens, q, rope)
    np.testing.assert_array_equal(np.asarray(scan_out, np.float32),
                                  np.asarray(expected_out, np.float32))
    np.testing.assert_array_equal(np.asarray(scan_stack, np.float32),
                                  np.asarray(expected_stack, np.float32))
    # The same layers on caches of their own, through the step's block table.
    caches = [stack[layer * PAGES:(layer + 1) * PAGES] for layer in range(LAYERS)]
    md = jf.get_mla_metadata(seq_lens, block_table=block_table, num_pages=PAGES, num_heads_q=H_Q,
                             implementation="custom_call")
    for layer in range(LAYERS):
        slots = jf.token_slots(block_table, seq_lens[:, None] - 1)
        caches[layer] = jf.write_kv(caches[layer], slots, kv=q[:, :, 0, :])
        out, _ = jf.mla_decode(q, caches[layer], block_table, seq_lens, metadata=md,
                               implementation="custom_call")
        q = _next_q(out, rope[layer])
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(expected_out, np.float32))
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(caches), np.float32),
                                  np.asarray(expected_stack, np.float32))
