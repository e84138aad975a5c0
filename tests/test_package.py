"""The package's public surface: a short list of names, each documented, and its namespaces
reachable as attributes."""
import inspect

import jax_flashmla as jf


def test_the_top_level_is_short_and_documented():
    assert len(jf.__all__) <= 14, jf.__all__
    for name in jf.__all__:
        assert inspect.getdoc(getattr(jf, name)), name


def test_namespaces_are_attributes():
    assert jf.flax.MultiHeadLatentAttention.__module__ == "jax_flashmla.flax.mla"
    assert jf.serving.HostQueue and jf.serving.AlternatingStep
    assert jf.serving.AlternatingStep.LOOP_COMPILER_OPTIONS["xla_gpu_command_buffer_unroll_loops"]
    # The errors a serving loop catches are its classes' own, builtin ones beneath.
    assert issubclass(jf.serving.PageAllocator.OutOfPagesError, RuntimeError)
    assert issubclass(jf.serving.HostQueue.OverrunError, RuntimeError)
