"""sparse_mla_prefill's custom call (jax_flashmla_mla_sparse_prefill) on a Hopper GPU, one stage
at a time, against sgl_kernel::sparse_prefill_fwd called from torch on the same inputs, at
dev/probe_sparse.py's sizes by default (h_q 64, 70 tokens, 500 keys, topk 128).

Each stage prints a line when it starts and when it is done, flushed, so that a crash names
its stage; faulthandler prints every thread's Python stack on a fatal signal, and a watchdog
prints them and exits if the whole probe hangs. The stages: the kernel library's load; the op
from torch (with the sizes and order of its allocations, which the custom call lends XLA's
buffers to, and which allocation each returned tensor is); the lowering and compilation of
the bare custom call; its first call; the comparison of its out, max_logits and base-2 lse
with torch's, bit for bit; then sparse_mla_prefill itself, whose lse is torch's base-2 lse
times ln 2. Exits 1 on a mismatch, 2 when the library has no sparse prefill.

  JAX_FLASHMLA_KERNEL_LIBRARY=... python3 dev/probe_sparse_prefill_call.py
  cuda-gdb -batch -ex run -ex bt --args python3 dev/probe_sparse_prefill_call.py
"""
import argparse
import contextlib
import faulthandler
import functools
import os
import sys
import time

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")  # leaves torch room
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashmla import custom_calls, kernels  # noqa: E402
from jax_flashmla.sparse import sparse_mla_prefill  # noqa: E402

SCALE = 0.1


@contextlib.contextmanager
def stage(name):
    print(f"stage {name}: start", flush=True)
    start = time.perf_counter()
    yield
    print(f"stage {name}: done ({time.perf_counter() - start:.2f} s)", flush=True)


def bits(x):
    """x as float32 bit patterns (bfloat16 widens exactly), for comparing NaN and inf too."""
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def same(name, got, want):
    equal = bits(got) == bits(want)
    with np.errstate(invalid="ignore"):  # inf - inf where the infinities differ
        diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))[~equal]
    print(f"  {name}: {'bit-identical' if equal.all() else 'MISMATCH'} "
          f"({(~equal).sum()} of {equal.size} differ, max |diff| "
          f"{np.nanmax(diff) if diff.size else 0.0})", flush=True)
    return bool(equal.all())


def inputs(args):
    """The user's (q, kv, indices, sink), and the kernel's: heads padded with zeros to 64 or
    128, invalid indices -1, topk padded with -1 to a multiple of 128 (as the op makes them)."""
    rng = np.random.default_rng(args.seed)
    q = jnp.asarray(rng.normal(0, 1, (args.tokens, args.h_q, 576)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(0, 0.3, (args.keys, 576)), jnp.bfloat16)
    indices = rng.integers(-3, args.keys + 3, (args.tokens, args.topk)).astype(np.int32)
    indices[1] = -1  # a query with no valid index
    sink = jnp.asarray(rng.normal(0, 2, args.h_q), jnp.float32) if args.sink else None
    heads = 64 if args.h_q <= 64 else 128
    kernel_indices = np.where((indices >= 0) & (indices < args.keys), indices, -1)
    kernel_indices = np.pad(kernel_indices, ((0, 0), (0, -args.topk % 128)), constant_values=-1)
    kernel = (jnp.pad(q, ((0, 0), (0, heads - args.h_q), (0, 0))), kv[:, None, :],
              jnp.asarray(kernel_indices)[:, None, :],
              jnp.pad(jnp.zeros(args.h_q, jnp.float32) if sink is None else sink,
                      (0, heads - args.h_q)))
    return (q, kv, jnp.asarray(indices), sink), kernel


def torch_op(op, kernel, with_sink):
    """(out, max_logits, lse) from torch, as NumPy, after printing the op's allocations."""
    import torch

    q, kv, indices, sink = (torch.from_dlpack(x) for x in kernel)  # the same buffers
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1000)
    result = op(q, kv, indices, SCALE, 512, sink if with_sink else None, None)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    allocs = [(e["addr"], e["size"]) for trace in snapshot["device_traces"] for e in trace
              if e["action"] == "alloc"]
    print(f"  allocations (bytes, in order): {[size for _, size in allocs]}", flush=True)
    for name, t in zip(("out", "max_logits", "lse"), result):
        which = [i for i, (addr, _) in enumerate(allocs) if addr == t.data_ptr()]
        print(f"  returned {name} {tuple(t.shape)} {t.dtype}: allocation {which}", flush=True)
    return tuple(t.float().cpu().numpy() for t in result[:3])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--h-q", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=70)
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--sink", action="store_true", help="pass an attn_sink")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--xla-first", action="store_true",
                        help="call the custom call before the op from torch (the GPU test's "
                             "order)")
    parser.add_argument("--watchdog-s", type=float, default=240,
                        help="print every thread's stack and exit after this long")
    args = parser.parse_args()
    faulthandler.enable(all_threads=True)
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, CUDA_LAUNCH_BLOCKING="
          f"{os.environ.get('CUDA_LAUNCH_BLOCKING')}, sizes {vars(args)}", flush=True)

    with stage("kernel load"):
        ops = kernels.ensure_cuda_targets()
        import torch

        print(f"  {ops.library.path}: sparse_prefill={ops.sparse_prefill}, torch "
              f"{torch.__version__}", flush=True)
        if ops.sparse_prefill is None:
            print("  the kernel library has no sparse_prefill_fwd", flush=True)
            sys.exit(2)
        op = getattr(torch.ops.sgl_kernel, ops.sparse_prefill.split("::")[1])
        print(f"  schema: {op.default._schema}", flush=True)
    user, kernel = inputs(args)
    if not args.xla_first:
        with stage("torch op direct"):
            want = torch_op(op, kernel, args.sink)

    def bare(q, kv, indices, attn_sink):
        return custom_calls.SPARSE_PREFILL(q=q, kv=kv, indices=indices, attn_sink=attn_sink,
                                           softmax_scale=SCALE, with_sink=args.sink)

    with stage("jit lowering of the custom call"):
        lowered = jax.jit(bare).lower(*kernel)
        text = lowered.as_text()
        print(f"  custom call in the module: {'jax_flashmla_mla_sparse_prefill' in text}",
              flush=True)
        compiled = lowered.compile()
    with stage("first call"):
        got = jax.block_until_ready(compiled(*kernel))
    if args.xla_first:
        with stage("torch op direct"):
            want = torch_op(op, kernel, args.sink)

    with stage("compare the custom call with torch"):
        t_out, t_max_logits, t_lse = want
        out, lse_base2, max_logits = got
        ok = same("out", out, t_out)
        ok &= same("max_logits", max_logits, t_max_logits)
        ok &= same("lse (base 2)", lse_base2, t_lse)
    with stage("sparse_mla_prefill (the op)"):
        q, kv, indices, sink = user
        prefill = jax.jit(functools.partial(sparse_mla_prefill, softmax_scale=SCALE,
                                            implementation="custom_call"))
        out, lse = jax.block_until_ready(prefill(q, kv, indices, attn_sink=sink))
        ok &= same("out", out, t_out[:, :args.h_q])
        ok &= same("lse (natural = base 2 * ln 2)", lse,
                   (t_lse[:, :args.h_q] * np.float32(np.log(2))).T)
    faulthandler.cancel_dump_traceback_later()
    print("all bit-identical" if ok else "MISMATCH", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
