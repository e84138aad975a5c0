"""A model's decode step called the way XLA's command buffers replay fastest."""
import jax
from jax.experimental import serialize_executable


class AlternatingStep:
    """A compiled step loaded twice, its calls running the two copies in turn.

    compiled: a `jax.stages.Compiled` (`jax.jit(step, donate_argnums=...).lower(*args)
    .compile()`). Calls take and return what `compiled` does, with the same shapes, dtypes and
    shardings; donation works as it does there. The two copies are the same executable, so
    results are bit-identical to calling `compiled` alone. Its devices must be this process's,
    and its arrays its arguments (JAX cannot serialize an executable with closed-over
    constants).

    Use it for a step called over and over (a serving loop's decode step): XLA replays the
    step's kernels as CUDA graphs and re-records every command whose buffers moved since that
    executable last ran, and the temporaries of consecutive executions of one executable were
    seen at two alternating addresses, so every call re-recorded nearly every command. Each of
    two copies called in turn finds its buffers where it left them.
    """

    def __init__(self, compiled):
        if not isinstance(compiled, jax.stages.Compiled):
            raise TypeError("compiled must be a jax.stages.Compiled (jax.jit(f).lower(*args)"
                            f".compile()), got {type(compiled).__name__}")
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        except NotImplementedError as e:  # what JAX raises for closed-over constants
            raise ValueError("AlternatingStep: the compiled step closes over arrays (JAX cannot "
                             "load such an executable twice); pass them as arguments of the "
                             f"jitted function instead ({e})") from None
        devices = compiled.runtime_executable().local_devices()
        self._copies = (compiled, serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, execution_devices=devices))
        self._turn = 0

    def __call__(self, *args, **kwargs):
        self._turn ^= 1
        return self._copies[self._turn](*args, **kwargs)
