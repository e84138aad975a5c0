"""Where a jitted decode step's wall clock goes beyond its GPU span.

For bench_step.py's unrolled stacked step at a few points, and variants of how it is called:
  base         as bench_step.py runs it (the cache donated, the step's out a new array)
  out_donated  the last step's out donated back, so every output keeps its address
  +SKIP_TEMP   xla_gpu_command_buffer_update_mode=SKIP_TEMP (temporaries at fixed addresses)
  pair         two executables of the step, called in turn
  sleep        base with 5 ms of host sleep after each synced step (inside its wall clock)
  unrolled_alternating, scan_alternating
               bench_step.py's unrolled and scanned steps through AlternatingStep
it reports the median wall clock per layer, the GPU span per layer, the host's XLA events in a
step (by name, µs per step), the delay from the call to the first kernel and from the last
kernel to the return; and, from XLA's log in a child process, what each steady-state
execution re-records in its command buffers.

  python dev/probe_step_host.py --points "1,4096,16;16,4096,128" --out probe.json
"""
import argparse
import collections
import json
import os
import re
import statistics
import subprocess
import sys
import time

import jax  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_step  # noqa: E402  (sets XLA_FLAGS and the allocator as bench_step.py runs)
import jax_flashmla as jf  # noqa: E402
from device_time import profile_options, traced  # noqa: E402

VARIANTS = ("base", "out_donated", "base+SKIP_TEMP", "pair", "sleep")
LOGGED = ("base", "base+SKIP_TEMP", "pair", "sleep", "base@prealloc")
LOG_PATTERNS = {
    "updates": re.compile(r"by recoding command buffer cmd sequence"),
    "updated_allocs": re.compile(r"updated_allocs=(\d+)"),
    "update_us": re.compile(r"Updated command buffer in (\d+)"),
    "commands_updated": re.compile(r"Updated (\d+) commands in (\d+) .s \(skipped (\d+)"),
    "skipped": re.compile(r"Skip updating command"),
    "traces": re.compile(r"trace cache create new item"),
}
MARK = "probe_step_host step "


def unrolled(p):
    """bench_step.py's unrolled stacked step."""
    def step(stack, rows, rope, q, t):
        md = bench_step._metadata(p, t)
        latent = rows[0, ..., :bench_step.D_V]
        for layer in range(p.layers):
            stack, out = bench_step._layer(p, t, stack, layer * p.pages, q, latent,
                                           rows[layer], md)
            q, latent = bench_step._next(out, rope[layer])
        return stack, q[..., :bench_step.D_V]
    return step


def variant(p, name):
    """(compiled step, state, run) for one variant: run() does one synced step."""
    options = ({"xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}
               if name.endswith("+SKIP_TEMP") else None)
    step = unrolled(p)
    args = (p.rows, p.rope, p.q0, p.tables())
    state = {"stack": p.stacked_cache()}
    if name.startswith("out_donated"):
        def donated(stack, out_prev, *args):
            del out_prev  # donated: the step's out takes its buffer
            return step(stack, *args)
        f = jax.jit(donated, donate_argnums=(0, 1), compiler_options=options)
        state["out"] = jax.numpy.zeros((p.b, p.s_q, p.h_q, bench_step.D_V), jax.numpy.bfloat16)
        compiled = f.lower(state["stack"], state["out"], *args).compile()

        def run():
            state["stack"], state["out"] = compiled(state["stack"], state["out"], *args)
            jax.block_until_ready(state["out"])
    elif name in ("unrolled_alternating", "scan_alternating"):
        f, _ = bench_step.jax_steps(p)[name.split("_")[0]]
        step_pair = jf.serving.AlternatingStep(f.lower(state["stack"], *args).compile())

        def run():
            state["stack"], state["out"] = step_pair(state["stack"], *args)
            jax.block_until_ready(state["out"])
    elif name == "pair":
        # Two executables (an option without effect here tells them apart), called in turn.
        pair = [jax.jit(step, donate_argnums=0,
                        compiler_options={"xla_gpu_graph_min_graph_size": str(size)})
                .lower(state["stack"], *args).compile() for size in (5, 6)]
        state["turn"] = 0

        def run():
            state["turn"] ^= 1
            state["stack"], state["out"] = pair[state["turn"]](state["stack"], *args)
            jax.block_until_ready(state["out"])
    else:
        f = jax.jit(step, donate_argnums=0, compiler_options=options)
        compiled = f.lower(state["stack"], *args).compile()

        def run():
            state["stack"], state["out"] = compiled(state["stack"], *args)
            jax.block_until_ready(state["out"])
        if name == "sleep":
            synced = run

            def run():
                synced()
                time.sleep(0.005)
    return run, state


def host_profile(run, steps=3, host_tracer_level=None, top=25):
    """Per step: GPU span, call-to-first-kernel, last-kernel-to-return (µs), and the host's
    events inside the step by name, an HLO instruction's number dropped from it (µs per step,
    count per step; the `top` longest). host_tracer_level 3 adds XLA's most detailed events."""
    def all_steps():
        for k in range(steps):
            with jax.profiler.TraceAnnotation(f"{MARK}{k}"):
                run()
    options = profile_options()
    if host_tracer_level is not None:
        options.host_tracer_level = host_tracer_level
    gpu, _, host = traced(all_steps, options, keep_host_line=lambda name: True)
    spans, firsts, lasts = [], [], []
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for k in range(steps):
        (window,) = [(e.start, e.end) for e in host if e.name == f"{MARK}{k}"]
        inside = [e for e in gpu if window[0] <= e.start < window[1]]
        first, last = min(e.start for e in inside), max(e.end for e in inside)
        spans.append((last - first) / 1e3)
        firsts.append((first - window[0]) / 1e3)
        lasts.append((window[1] - last) / 1e3)
        for e in host:
            if window[0] <= e.start < window[1] and not e.name.startswith(MARK):
                name = re.sub(r"\.\d+", "", e.name)
                by_name[name][0] += (e.end - e.start) / 1e3 / steps
                by_name[name][1] += 1 / steps
    longest = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(span_us=statistics.median(spans), call_to_first_kernel_us=statistics.median(firsts),
                last_kernel_to_return_us=statistics.median(lasts),
                host_events={name: [round(us, 1), round(n, 1)] for name, (us, n) in longest})


def log_summary(text):
    """What XLA's log says each marked execution did, and its first update lines."""
    keys = ("pdate", "emap", "VMM", "policy", "llocator")
    per_step = [[line[-300:] for line in text.splitlines() if any(k in line for k in keys)][:8]]
    for chunk in text.split(MARK)[1:]:
        row = {}
        for key, pattern in LOG_PATTERNS.items():
            found = pattern.findall(chunk)
            if key in ("updates", "skipped", "traces"):
                row[key] = len(found)
            elif key == "commands_updated":
                row[key] = [list(map(int, f)) for f in found][:4]
            else:
                row[key] = [int(f) for f in found][:8]
        per_step.append(row)
    return per_step


def logged_child(point, name, dump=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0",
               TF_CPP_VMODULE="command_buffer_thunk=3,command_executor=1,command_buffer_cmd=1,"
                              "traced_command_buffer=6,gpu_executable=3,"
                              "gpu_executable_buffer_allocator=3,"
                              "gpu_executable_va_remap_allocator=3,se_gpu_pjrt_client=1")
    if name.endswith("@prealloc"):  # JAX's default: one BFC pool taken at start
        env.update(XLA_PYTHON_CLIENT_PREALLOCATE="true", XLA_PYTHON_CLIENT_MEM_FRACTION="0.5")
    if dump:
        env["XLA_FLAGS"] += f" --xla_dump_to={dump} --xla_dump_hlo_module_re=jit_step"
    done = subprocess.run([sys.executable, __file__, "--child", point, name], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return dict(error=done.stderr[-2000:])
    return log_summary(done.stderr)


def allocations_of(dump):
    """The first lines of each allocation in the step's buffer assignment (XLA's dump)."""
    import glob
    files = sorted(glob.glob(f"{dump}/*jit_step*buffer-assignment.txt"))
    if not files:
        return None
    lines = open(files[-1]).read().splitlines()
    return [line[:160] for line in lines if line.startswith("allocation ")
            and "constant" not in line]


def child(point, name):
    b, s_k, h_q = map(int, point.split(","))
    p = bench_step.Point(b, s_k, h_q, 1, "bfloat16", 61, 30)
    run, _ = variant(p, name.split("@")[0])
    for k in range(6):
        if k >= 3:
            print(f"{MARK}{k}", file=sys.stderr, flush=True)
        run()
    print(MARK + "end", file=sys.stderr, flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default="1,4096,16;16,4096,128;128,4096,16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--logged", default=",".join(LOGGED),
                        help="variants also run in a child process with XLA's log")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    parser.add_argument("--tag", default="", help="a label for this run's environment")
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    results = []
    for point in args.points.split(";"):
        b, s_k, h_q = map(int, point.split(","))
        p = bench_step.Point(b, s_k, h_q, 1, "bfloat16", 61, 30)
        record = dict(b=b, s_k=s_k, h_q=h_q, layers=p.layers, variants={}, tag=args.tag,
                      xla_flags=os.environ.get("XLA_FLAGS"),
                      allocator=os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"))
        outs = {}
        for name in args.variants.split(","):
            try:
                run, state = variant(p, name)
            except Exception as e:  # an option this jaxlib refuses
                record["variants"][name] = dict(error=str(e)[:300])
                continue
            times = bench_step.time_steps(run, args.steps)
            v = dict(wall_us=round(statistics.median(times) / p.layers, 2))
            if jax.default_backend() == "gpu":
                v.update(host_profile(run))
                v["span_us"] = round(v["span_us"] / p.layers, 2)
            outs[name] = np.asarray(state["out"], np.float32)
            del state
            record["variants"][name] = v
            print(json.dumps(dict(point=point, variant=name, **v)), flush=True)
        first = next(iter(outs.values()), None)
        record["outs_identical"] = all(np.array_equal(o, first) for o in outs.values())
        if args.logged:
            for name in args.logged.split(","):
                dump = f"/tmp/probe_dump_{b}_{h_q}" if name == "base" else None
                record["variants"].setdefault(name, {})["log"] = logged_child(point, name, dump)
                print(point, name, json.dumps(record["variants"][name]["log"]), flush=True)
            if "base" in args.logged.split(","):
                record["buffer_assignment"] = allocations_of(f"/tmp/probe_dump_{b}_{h_q}")
        results.append(record)
        del p
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(jax=jax.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
