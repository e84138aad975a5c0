"""Decode context parallelism across processes, as a multi-host deployment runs it.

Run bare, the script starts --num-processes copies of itself on this machine and waits for
them; each copy, or each process of a real deployment, runs it with its own --process-id (one
process per GPU on GPUs; on CPU each process takes --local-devices devices). jax.distributed
joins them; one mesh axis, "dcp", spans every device of every process. A batch of prompts
(seeded) is written through dcp_write_kv, each token into the cache of the one device that
holds its position (round-robin), so that no process holds another's tokens; then one decode
step through dcp_mla_decode merges the devices' partial attention through their LSEs. Each
process checks the merged result against the pure-JAX reference of the whole cache on one of
its own devices.

    python examples/dcp_across_processes.py                # 2 processes on this machine
    python examples/dcp_across_processes.py --process-id 0 --num-processes 2 &
    python examples/dcp_across_processes.py --process-id 1 --num-processes 2
"""
import argparse
import os
import socket
import subprocess
import sys


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default, and the epilog's command lines as they are written."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="\n\n".join(__doc__.split("\n\n")[:2]),
                                epilog="suggested command lines:\n" + __doc__.split("\n\n")[2],
                                formatter_class=HelpFormatter)
    p.add_argument("--process-id", type=int,
                   help="this process's index; unset: start every process here and wait")
    p.add_argument("--num-processes", type=int, default=2, help="processes in all")
    p.add_argument("--coordinator", help="host:port of process 0's coordination service "
                   "(unset: localhost with a free port when run bare, else localhost:12321)")
    p.add_argument("--local-devices", type=int, default=2,
                   help="CPU devices per process (on GPUs: the process's visible GPUs)")
    p.add_argument("--batch", type=int, default=3, help="requests")
    p.add_argument("--prompt", type=int, default=300, help="tokens per prompt")
    p.add_argument("--heads", type=int, default=16, help="query heads")
    args = p.parse_args(argv)
    if args.num_processes < 1:
        p.error("--num-processes must be >= 1")
    if args.process_id is not None and not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id must be in [0, --num-processes = {args.num_processes})")
    for name in ("local_devices", "batch", "prompt", "heads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(args):
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count="
                                       f"{args.local_devices}")
    import jax

    # Collectives between CPU processes (GPUs use NCCL); set before the backends start.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jax_flashmla as jf
    from jax_flashmla import context_parallel as cp

    mesh = Mesh(np.array(jax.devices()), ("dcp",))
    n, batch, prompt = mesh.shape["dcp"], args.batch, args.prompt
    sharded = NamedSharding(mesh, P("dcp"))
    replicated = NamedSharding(mesh, P())
    local_pages = -(-(-(-prompt // n)) // 64)  # pages a device needs per request
    key = jax.random.key(0)  # the same inputs in every process
    rows = jax.jit(lambda: jax.random.normal(key, (batch, prompt, 576), jnp.bfloat16) / 10,
                   out_shardings=replicated)()
    q = jax.jit(lambda: jax.random.normal(jax.random.fold_in(key, 1),
                                          (batch, 1, args.heads, 576), jnp.bfloat16) / 10,
                out_shardings=replicated)()
    # Each device's pages and its block table over them; its requests' local lengths.
    cache = jax.jit(lambda: jnp.zeros((n * batch * local_pages, 64, 1, 576), jnp.bfloat16),
                    out_shardings=sharded)()
    tables = jax.jit(lambda: jnp.broadcast_to(
        jnp.arange(batch * local_pages, dtype=jnp.int32).reshape(batch, local_pages),
        (n, batch, local_pages)), out_shardings=sharded)()
    seq_lens = jnp.full((batch,), prompt, jnp.int32)
    lens = jax.jit(lambda: jnp.stack([cp.local_lengths(seq_lens, r, n, layout="round_robin")
                                      for r in range(n)]), out_shardings=sharded)()
    positions = jax.jit(lambda: jnp.broadcast_to(jnp.arange(prompt, dtype=jnp.int32),
                                                 (batch, prompt)), out_shardings=replicated)()

    @jax.jit
    def step(cache, tables, lens, positions, rows, q):
        cache = jf.context_parallel.dcp_write_kv(cache, tables, positions, mesh=mesh, axis="dcp",
                                layout="round_robin", kv=rows)
        return jf.context_parallel.dcp_mla_decode(q, cache, tables, lens, mesh=mesh, axis="dcp",
                                 implementation="custom_call")

    out, lse = step(cache, tables, lens, positions, rows, q)
    # The whole cache on one local device: request i's tokens in pages i * P ... in order.
    device = jax.local_devices()[0]
    local = lambda x: jax.device_put(np.asarray(x.addressable_data(0)), device)  # noqa: E731
    full_pages = -(-prompt // 64)
    padded = jnp.pad(local(rows), ((0, 0), (0, full_pages * 64 - prompt), (0, 0)))
    full_cache = padded.reshape(batch * full_pages, 64, 1, 576)
    full_table = jnp.arange(batch * full_pages, dtype=jnp.int32).reshape(batch, full_pages)
    ref_out, ref_lse = jf.mla_decode(local(q), full_cache, full_table,
                                     jax.device_put(seq_lens, device), implementation="reference")
    out_error = float(jnp.max(jnp.abs(local(out).astype(jnp.float32)
                                      - ref_out.astype(jnp.float32))))
    lse_error = float(jnp.max(jnp.abs(local(lse) - ref_lse)))
    ok = out_error < 2e-2 and lse_error < 1e-3
    print(f"process {args.process_id} of {args.num_processes}: {n} devices, out max error "
          f"{out_error:.2e}, lse max error {lse_error:.2e}: {'match' if ok else 'MISMATCH'}",
          flush=True)
    jax.distributed.shutdown()
    return ok


def launch(args):
    """Every process of the run on this machine, as children; True when all of them match."""
    if args.coordinator is None:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            args.coordinator = f"localhost:{s.getsockname()[1]}"
    shared = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
              if name != "process_id"]
    runs = [subprocess.Popen([sys.executable, __file__, *shared, f"--process-id={i}"])
            for i in range(args.num_processes)]
    try:
        return all(run.wait() == 0 for run in runs)
    finally:  # a process whose peer failed would wait for it
        for run in runs:
            run.kill()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.process_id is None:
        raise SystemExit(0 if launch(arguments) else 1)
    if arguments.coordinator is None:
        arguments.coordinator = "localhost:12321"
    raise SystemExit(0 if main(arguments) else 1)
