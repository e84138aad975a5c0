"""Where a replayed decode step's time beyond its GPU work goes: the host's time to hand a
step of L layers to the GPU (dispatch: until the call returns) and until it is done (wall:
until synced), without a profiler, for XLA's command buffer and for CUDA graphs of FlashMLA's
decode op built the ways torch and XLA build them.

XLA (bench_step.py's unrolled stacked step, called through AlternatingStep):
  xla_decode    bench_step.py's step: per layer write_kv, mla_decode, the next q
  xla_trivial   the same with a fusion in place of each mla_decode (no custom call)
  xla_trivial_xN  xla_trivial over its layers N times in a row: N=2 makes a graph of about
                as many kernel nodes as xla_decode's, to tell what XLA costs for a graph of
                that size from what the custom calls add
  xla_thunks    xla_decode with command buffers off (each thunk launched on its own)
  xla_metadata  xla_trivial with FlashMLA's metadata custom call per layer (1 operand, 2
                results, 5 attributes; the decode's: 6, 4 and 3): what XLA costs for a custom
                call in a command buffer
  xla_scan_unrollU  bench_step.py's scanned step, U layers per iteration of its loop
                (lax.scan's unroll), with jax_flashmla.serving.LOOP_STEP_COMPILER_OPTIONS
torch_step      bench_step.py's torch step (per layer the indexed write of the rows, the decode,
                the next q) captured in a CUDA graph and replayed, as bench_step times it
CUDA graphs of the decode op alone, L calls on one cache (FlashMLA from torch):
  graph_flat      L decodes captured in one torch CUDA graph (torch's way)
  graph_children  each decode captured in a graph of its own, the L graphs added as child
                  nodes of one graph in a chain (XLA's way for a traced custom call)
  graph_children_priority  that graph instantiated with CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_
                  PRIORITY, as XLA instantiates its graphs
Each: the median over --steps of µs per step for dispatch and wall, µs per step with --steps
launched before one sync (queued), and the GPU span per step from a profile (first kernel's
start to last kernel's end); for the XLA variants a hash of the last out, to compare runs
under other XLA_FLAGS, and with --host-events the host's events of a step by name from a
profile at XLA's most detailed tracer level (µs and count per step), to see
which of XLA's per-execution work grows with the custom calls; with --graph-inspect and
--relaunch each variant's graphs launched again outside XLA (dev/graph_inspect.c): XLA's own
execs in the ways XLA's launches differ from a loop's, and the graph rebuilt without its
child graphs or parts of its nodes, to tell what costs the launch its time; with
--driver-trace each variant's driver calls per step on a timeline, without CUPTI
(dev/driver_trace.c, dev/driver_timeline.py). --sync host_queue waits for the XLA variants
by popping what each step pushed to a jax_flashmla.serving.HostQueue.

  python dev/probe_launch.py --points "1,4096,16;16,4096,16" --out launch.json
"""
import argparse
import hashlib
import json
import os
import statistics
import sys
import time

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_step  # noqa: E402  (sets XLA_FLAGS and the allocator as bench_step.py runs)
import jax_flashmla as jf  # noqa: E402
from probe_step_host import host_profile, unrolled  # noqa: E402


def xla_variants(p, names, sync="block"):
    """{name: (launch(), sync(), last out())} for the XLA variants among names. sync "block":
    jax.block_until_ready on the step's out; "host_queue": each step pushes a slice of its out
    to a jax_flashmla.serving.HostQueue (as bench_step.py's steps do) and sync pops it."""
    t = p.tables()
    args = (p.rows, p.rope, p.q0, t)
    queues = {}

    def pushing(name, step):
        if sync != "host_queue":
            return step
        queues[name] = bench_step.result_queue(p)
        return bench_step.pushing_step(step, queues[name], lambda out: out)

    decode_step = unrolled(p)

    def fusion_step(custom_call=lambda layer, q, t: q, repeats=1):
        """Per layer write_kv and a fusion in place of the decode making the next q;
        custom_call(layer, q, t) adds a custom call's result to q before that fusion."""
        def step(stack, rows, rope, q, t):
            latent = rows[0, ..., :bench_step.D_V]
            for layer in (l % p.layers for l in range(repeats * p.layers)):
                new = jnp.concatenate([latent, rows[layer][..., bench_step.D_V:]], axis=-1)
                stack = jf.write_kv(stack, t["slots"] + layer * p.pages * bench_step.PAGE,
                                    kv=new)
                q = custom_call(layer, q, t)
                q, latent = bench_step._next(q[..., :bench_step.D_V] * 0.5, rope[layer])
            return stack, q[..., :bench_step.D_V]
        return step

    # Lengths of their own per layer, so that XLA does not merge the layers' custom calls.
    def metadata(layer, q, t):
        md = jf.get_mla_metadata(t["seq_lens"] + layer, block_table=t["block_table"],
                                 num_pages=p.pages, num_heads_q=p.h_q,
                                 implementation="custom_call")
        return q + md.num_splits[0].astype(q.dtype)

    def jit(name, f, options=None):
        return lambda: jax.jit(pushing(name, f), donate_argnums=0, compiler_options=options)
    variants = {"xla_decode": jit("xla_decode", decode_step),
                "xla_trivial": jit("xla_trivial", fusion_step()),
                "xla_metadata": jit("xla_metadata", fusion_step(metadata)),
                "xla_thunks": jit("xla_thunks", decode_step,
                                  {"xla_gpu_graph_min_graph_size": 1 << 20})}
    for name in names:
        if name.startswith("xla_scan_unroll"):  # jitted by bench_step (pushing), donating
            unroll = int(name[len("xla_scan_unroll"):])
            variants[name] = lambda u=unroll, name=name: bench_step.jax_steps(
                p, scan_unroll=u, queues=queues.setdefault(name, {}))["scan"][0]
        elif name.startswith("xla_trivial_x"):
            repeats = int(name[len("xla_trivial_x"):])
            variants[name] = jit(name, fusion_step(repeats=repeats))
    made = {}
    for name, jitted in variants.items():
        if name not in names:
            continue
        state = {"stack": p.stacked_cache()}
        compiled = jitted().lower(state["stack"], *args).compile()
        step = jf.serving.AlternatingStep(compiled)
        queue = queues.get(name)
        state["queue"] = queue["scan"] if isinstance(queue, dict) else queue
        state["unpopped"] = 0

        def launch(step=step, state=state):
            state["stack"], state["out"] = step(state["stack"], *args)
            state["unpopped"] += 1

        def wait(state=state):  # for every step launched
            if state["queue"] is None:
                jax.block_until_ready(state["out"])
                return
            for _ in range(state["unpopped"]):
                state["queue"].pop()
            state["unpopped"] = 0

        made[name] = (launch, wait, lambda state=state: state["out"])
    return made


def graph_variants(p):
    """{name: (launch(), sync())} for CUDA graphs of L decode-op calls on layer 0's cache."""
    import torch
    from cuda.bindings import driver
    from torch_side import TorchSide

    side = TorchSide()
    cache = p.stacked_cache()[:p.pages]
    call = side.decode_call(cache, p.seq_lens, p.q0, p.block_table, p.h_q, p.s_q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    flat = torch.cuda.CUDAGraph()
    with torch.cuda.graph(flat, capture_error_mode="thread_local"):
        for _ in range(p.layers):
            call()
    children = []
    for _ in range(p.layers):
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g, pool=flat.pool(), capture_error_mode="thread_local"):
            call()
        children.append(g)

    def check(result):
        err, *rest = result
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {err}")
        return rest[0] if len(rest) == 1 else rest

    def chain_of(graphs, flags=0):
        parent = check(driver.cuGraphCreate(0))
        last = None
        for g in graphs:
            deps = [] if last is None else [last]
            last = check(driver.cuGraphAddChildGraphNode(parent, deps, len(deps), g))
        return check(driver.cuGraphInstantiate(parent, flags))

    raw = [driver.CUgraph(g.raw_cuda_graph()) for g in children]
    chained = chain_of(raw)
    by_priority = chain_of(raw, driver.CUgraphInstantiate_flags
                           .CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY)
    torch_stream = torch.cuda.current_stream()
    cu_stream = driver.CUstream(torch_stream.cuda_stream)
    sync = torch.cuda.synchronize
    return {"graph_flat": (flat.replay, sync),
            "graph_children": (lambda: check(driver.cuGraphLaunch(chained, cu_stream)), sync),
            "graph_children_priority": (
                lambda: check(driver.cuGraphLaunch(by_priority, cu_stream)), sync),
            "_keep": (children, chained, by_priority)}


def graph_inspector(path):
    """dev/graph_inspect.c built at `path`, subscribed to the driver's calls (CUPTI)."""
    import ctypes
    import glob
    import site
    ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    cupti = [lib for root in site.getsitepackages()
             for lib in sorted(glob.glob(f"{root}/nvidia/**/libcupti.so*", recursive=True))]
    cupti += sorted(glob.glob("/usr/local/cuda*/**/libcupti.so*", recursive=True))
    if not cupti:
        raise RuntimeError("no libcupti found")
    ctypes.CDLL(cupti[0], mode=ctypes.RTLD_GLOBAL)
    inspector = ctypes.CDLL(path)
    if inspector.graph_inspect_start():
        raise RuntimeError("CUPTI refused the subscription")
    return inspector


def timed(launch, sync, steps, warmup=3):
    for _ in range(warmup):
        launch()
        sync()
    dispatch, wall = [], []
    for _ in range(steps):
        start = time.perf_counter()
        launch()
        mid = time.perf_counter()
        sync()
        end = time.perf_counter()
        dispatch.append((mid - start) * 1e6)
        wall.append((end - start) * 1e6)
    return round(statistics.median(dispatch), 1), round(statistics.median(wall), 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="1,4096,16;16,4096,16",
                        help="b,s_k,h_q;... (default 1,4096,16;16,4096,16)")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--variants", default="xla_decode,xla_trivial,xla_thunks,graph",
                        help="among xla_decode, xla_trivial, xla_thunks, "
                             "xla_metadata, xla_scan_unrollU, xla_trivial_xN (U, N numbers), "
                             "torch_step, graph (the graphs; default all but xla_metadata, the "
                             "scans, xla_trivial_xN and torch_step)")
    parser.add_argument("--graph-inspect", metavar="LIB", default=None,
                        help="dev/graph_inspect.c built as LIB: the graphs' nodes and the "
                             "driver's calls per variant, printed at the end (no profiles "
                             "then)")
    parser.add_argument("--relaunch", action="store_true",
                        help="with --graph-inspect: also each variant's graphs launched again "
                             "from the inspector, in the ways XLA's launches differ from a "
                             "loop's and rebuilt (graph_inspect_contexts, _rebuild); no out "
                             "hashes then")
    parser.add_argument("--host-events", action="store_true",
                        help="also the host's events per step of each XLA variant (a profile)")
    parser.add_argument("--driver-trace", metavar="LIB", default=None,
                        help="dev/driver_trace.c built as LIB and LD_PRELOADed: also each "
                             "variant's driver calls per step on a timeline (driver_timeline.py)")
    parser.add_argument("--sync", choices=("block", "host_queue"), default="block",
                        help="how the XLA variants are waited for: jax.block_until_ready "
                             "(default), or popping what each step pushed to a HostQueue")
    parser.add_argument("--out", default=None, help="a JSON file for the results")
    args = parser.parse_args()
    if args.driver_trace:
        from driver_timeline import DriverTrace
        driver_trace = DriverTrace(args.driver_trace)
    inspector = graph_inspector(args.graph_inspect) if args.graph_inspect else None
    tag = (lambda name: inspector.graph_inspect_tag(name.encode())) if inspector else (
        lambda name: None)
    results = []
    for point in args.points.split(";"):
        b, s_k, h_q = map(int, point.split(","))
        p = bench_step.Point(b, s_k, h_q, 1, "bfloat16", args.layers, 30)
        names = args.variants.split(",")
        made = xla_variants(p, names, args.sync)
        runs = {name: (launch, sync) for name, (launch, sync, _) in made.items()}
        if jax.default_backend() == "gpu" and "graph" in names:
            tag(f"graph setup b={b}")
            runs.update(graph_variants(p))
            if inspector and args.relaunch:  # torch's graphs: the last two instantiated
                sys.stdout.flush()
                inspector.graph_inspect_contexts(args.steps)
                inspector.graph_inspect_rebuild(args.steps)
        if jax.default_backend() == "gpu" and "torch_step" in names:
            from torch_side import TorchStep
            tag(f"torch_step b={b}")  # its graph's capture under the tag it is timed under
            runs["torch_step"] = TorchStep().steps(p)[0]["torch_graph"]
        keep = runs.pop("_keep", None)
        record = dict(b=b, s_k=s_k, h_q=h_q, layers=p.layers, sync=args.sync,
                      xla_flags=os.environ.get("XLA_FLAGS"))
        for name, (launch, sync) in runs.items():
            tag(f"{name} b={b}")
            record[f"{name}_dispatch_us"], record[f"{name}_wall_us"] = timed(
                launch, sync, args.steps)
            record[f"{name}_queued_us"] = round(
                bench_step.queued_steps_us(launch, sync, args.steps, rounds=5), 1)
            if args.driver_trace:
                record[f"{name}_driver"] = driver_trace.timeline(launch, sync, args.steps)
            if inspector and args.relaunch:
                sys.stdout.flush()
                inspector.graph_inspect_contexts(args.steps)
                inspector.graph_inspect_rebuild(args.steps)
        for name, (_, _, out) in made.items():
            if not args.relaunch:  # relaunched graphs write into the step's buffers
                record[f"{name}_out_sha"] = hashlib.sha256(
                    np.asarray(out()).tobytes()).hexdigest()[:16]
        if jax.default_backend() == "gpu" and not inspector:
            spans = bench_step.gpu_span_us(
                {name: (lambda launch=launch, sync=sync: (launch(), sync()))
                 for name, (launch, sync) in runs.items()})
            record.update({f"{name}_span_us": None if s is None else round(s, 1)
                           for name, s in spans.items()})
        if jax.default_backend() == "gpu" and args.host_events and not inspector:
            for name, (launch, sync, _) in made.items():
                record[f"{name}_host"] = host_profile(lambda: (launch(), sync()),
                                                      host_tracer_level=3, top=40)
        print(json.dumps(record), flush=True)
        results.append(record)
        del keep, runs, made, p
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(jax=jax.__version__, device=jax.devices()[0].device_kind,
                               results=results), f, indent=1)
    if inspector:
        sys.stdout.flush()
        inspector.graph_inspect_report()


if __name__ == "__main__":
    main()
