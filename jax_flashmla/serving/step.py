"""A model's decode step called the way XLA's command buffers replay fastest: AlternatingStep
and its compiler options for a step written as a loop; and the layout of the lse FlashMLA
writes."""
import jax
from jax.experimental import serialize_executable
from jax.experimental.layout import Format, Layout

from jax_flashmla.kernels import custom_calls


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

    A step whose layers are a loop (lax.scan, fori_loop) is jitted with
    `compiler_options=AlternatingStep.LOOP_COMPILER_OPTIONS`: XLA's default command-buffer
    types (jax 0.11) plus WHILE, and command buffers however few their commands, so that the
    loop runs as one CUDA graph instead of launching each layer's kernels and custom calls from
    the host; and a loop of known trip count recorded iteration by iteration into that graph
    rather than as a CUDA conditional node around its body, which ran slower on the GPU. A step
    written out layer by layer is captured with XLA's defaults.
    """

    LOOP_COMPILER_OPTIONS = {
        "xla_gpu_enable_command_buffer":
            "FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL,CONDITIONAL,DYNAMIC_SLICE_FUSION,WHILE",
        "xla_gpu_graph_min_graph_size": 1,
        "xla_gpu_command_buffer_unroll_loops": True,
    }

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


def lse_format(s_q, sharding):
    """The jax Format under which a jitted function returns mla_decode's lse as FlashMLA wrote it.

    For s_q > 1 the decode writes lse (batch, h_q, s_q) with s_q outside h_q, and XLA
    transposes it to row-major where it is read; returning it with this format
    (jax.jit(..., out_shardings=...)) hands that memory out untouched, as FlashMLA's torch op
    returns its lse view. The values are the same either way.

    Args:
      s_q: query tokens per request.
      sharding: a concrete sharding of lse (jax.sharding.SingleDeviceSharding, NamedSharding).
    """
    minor_to_major = custom_calls.lse_minor_to_major(s_q) or (2, 1, 0)
    return Format(Layout(major_to_minor=tuple(reversed(minor_to_major))), sharding)
