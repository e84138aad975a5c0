"""The package's public surface: a short list of names, each documented, and its namespaces
reachable as attributes."""
import inspect

import jax_flashmla as jf


def test_the_top_level_is_short_and_documented():
    assert len(jf.__all__) <= 14, jf.__all__
    for name in jf.__all__:
        assert inspect.getdoc(getattr(jf, name)), name


def test_the_public_names_are_few_and_documented():
    """Every __all__ together: the top level's and its namespaces'."""
    namespaces = [getattr(jf, name) for name in jf.__all__ if inspect.ismodule(getattr(jf, name))]
    assert sorted(ns.__name__ for ns in namespaces) == [
        "jax_flashmla.flax", "jax_flashmla.ops.context_parallel", "jax_flashmla.serving",
        "jax_flashmla.sparse"]
    names = [(jf.__name__, name) for name in jf.__all__]
    names += [(ns.__name__, name) for ns in namespaces for name in ns.__all__]
    assert len(names) <= 45, names
    for namespace in namespaces:
        for name in namespace.__all__:
            assert inspect.getdoc(getattr(namespace, name)), (namespace.__name__, name)


def test_namespaces_are_attributes():
    assert jf.flax.MultiHeadLatentAttention.__module__ == "jax_flashmla.flax.mla"
    assert jf.serving.HostQueue and jf.serving.AlternatingStep
    assert jf.serving.AlternatingStep.LOOP_COMPILER_OPTIONS["xla_gpu_command_buffer_unroll_loops"]
    # The errors a serving loop catches are its classes' own, builtin ones beneath.
    assert issubclass(jf.serving.PageAllocator.OutOfPagesError, RuntimeError)
    assert issubclass(jf.serving.HostQueue.OverrunError, RuntimeError)
