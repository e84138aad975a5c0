"""Where the host's CPU time goes while a jitted step runs synced, step after step: a sampling
profile (dev/host_sampler.c, SIGPROF on the process's CPU time) of bench_sparse.py's 61-layer
sparse step (unrolled and scanned, through AlternatingStep and a HostQueue, as the bench runs
them), or on CPU of a small stand-in; and beforehand, the steps' synced wall clock with each
variant run on its own and with the variants taking turns. Per thread: its samples, the functions it was in (self:
the innermost frame; total: anywhere on its stack) and its commonest innermost stacks. PCs are
named from each object's ELF symbol table (demangled by c++filt where there is one).

  gcc -shared -fPIC -O2 dev/host_sampler.c -o /tmp/host_sampler.so
  python dev/probe_host_profile.py --sampler /tmp/host_sampler.so --batches 1 --out prof.json
"""
import argparse
import bisect
import collections
import ctypes
import json
import mmap
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
import bench_sparse  # noqa: E402  (sets XLA_FLAGS as the bench runs)
import bench_step  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SHT_SYMTAB, SHT_DYNSYM, STT_FUNC = 2, 11, 2


class Symbols:
    """An ELF object's function symbols, by address (its .symtab, else its .dynsym)."""

    def __init__(self, path):
        self.starts, self.names = [], []
        try:
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                self._read(m)
        except (OSError, ValueError, struct.error):
            pass

    def _read(self, m):
        if m[:4] != b"\x7fELF" or m[4] != 2:
            return
        shoff, = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize)
                    for i in range(shnum)]
        for wanted in (SHT_SYMTAB, SHT_DYNSYM):
            tables = [s for s in sections if s[1] == wanted]
            if tables:
                break
        else:
            return
        table = tables[0]
        strings = sections[table[6]][4]
        found = []
        for off in range(table[4], table[4] + table[5], 24):
            name, info, _, shndx, value, size = struct.unpack_from("<IBBHQQ", m, off)
            if info & 0xF == STT_FUNC and value and shndx:
                end = m.find(b"\0", strings + name)
                found.append((value, size, m[strings + name:end].decode(errors="replace")))
        found.sort()
        self.starts = [v for v, _, _ in found]
        self.names = [(v + s, n) for v, s, n in found]

    def name(self, address):
        i = bisect.bisect_right(self.starts, address) - 1
        if i < 0:
            return None
        end, name = self.names[i]
        return name if address < end or end == self.starts[i] else None


def demangled(names):
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines()))


def read_profile(path):
    """(samples [(tid, [pc, ...])], modules [(start, end, base, path)])."""
    samples, modules = [], []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "module":
                base, start, end = (int(x, 16) for x in parts[1:4])
                modules.append((start, end, base, " ".join(parts[4:])))
            else:
                samples.append((int(parts[0]), [int(x, 16) for x in parts[1:]]))
    return samples, sorted(modules)


def symbolize(samples, modules):
    """{pc: 'function (object)'} for every PC in samples."""
    starts = [m[0] for m in modules]
    tables, raw = {}, {}
    for pc in {pc for _, pcs in samples for pc in pcs}:
        i = bisect.bisect_right(starts, pc) - 1
        if i < 0 or pc >= modules[i][1]:
            raw[pc] = (None, "?")
            continue
        _, _, base, path = modules[i]
        if path not in tables:
            tables[path] = Symbols(path if path != "main" else sys.executable)
        # backtrace's return addresses point past the call: look the call itself up.
        raw[pc] = (tables[path].name(pc - base - 1), os.path.basename(path))
    readable = demangled(sorted({n for n, _ in raw.values() if n}))
    return {pc: f"{readable[n] if n else '?'} ({obj})" for pc, (n, obj) in raw.items()}


def summary(samples, names, top=40, stack_depth=8):
    by_thread = collections.defaultdict(list)
    for tid, pcs in samples:
        by_thread[tid].append(pcs)
    threads = []
    for tid, stacks in sorted(by_thread.items(), key=lambda kv: -len(kv[1])):
        # The signal handler's own frames (the sampler and the kernel's trampoline) first.
        stacks = [[names[pc] for pc in pcs[2:]] for pcs in stacks]
        self_counts = collections.Counter(s[0] for s in stacks if s)
        total = collections.Counter(n for s in stacks for n in set(s))
        leaf_stacks = collections.Counter(" <- ".join(s[:stack_depth]) for s in stacks)
        threads.append(dict(
            tid=tid, samples=len(stacks),
            self=[(n, c) for n, c in self_counts.most_common(top)],
            total=[(n, c) for n, c in total.most_common(top * 2)],
            stacks=[(n, c) for n, c in leaf_stacks.most_common(top // 2)]))
    return threads


def sparse_steps(b, layers, sliced):
    inp = bench_sparse.StepInputs(b, 32768, 128, 1, 2048, layers, cache_gb=40)
    return inp, bench_sparse.compiled_jax_steps(inp, sliced=sliced)


def cpu_steps(layers, sliced):
    """A small stand-in on CPU: the tiny sparse step of bench_sparse --tiny's sizes."""
    inp = bench_sparse.StepInputs(2, 128, 16, 1, 64, layers, cache_gb=1)
    return inp, bench_sparse.compiled_jax_steps(inp, sliced=sliced)


def profile_step(sampler, inp, queue, step, seconds, interval_us, path):
    arguments = inp.arguments()
    run = lambda: (step(*arguments), queue.pop())
    for _ in range(20):
        run()
    start, steps = time.perf_counter(), 0
    if sampler.host_sampler_start(interval_us) != 0:
        raise OSError("host_sampler_start failed")
    while time.perf_counter() - start < seconds:
        run()
        steps += 1
    taken = sampler.host_sampler_stop()
    elapsed = time.perf_counter() - start
    if sampler.host_sampler_write(path.encode()) != 0:
        raise OSError(f"host_sampler_write({path}) failed")
    return dict(steps=steps, step_us=round(elapsed / steps * 1e6, 1), samples=taken,
                samples_per_step=round(taken / steps, 2))


def step_timings(made, inp, steps=200, round_steps=10):
    """µs a layer, median over steps synced one at a time: each variant run on its own
    (continuous), and the variants taking turns of round_steps steps (as bench_sparse.py's
    synced figure is timed, there with the torch graphs among the turns too)."""
    arguments = inp.arguments()
    runs = {name: (lambda queue=queue, step=step: (step(*arguments), queue.pop()))
            for name, queue, step in made}
    result = {}
    for name, run in runs.items():
        result[f"{name}_continuous_us"] = statistics.median(
            bench_step.time_steps(run, steps, warmup=20)) / inp.layers
    turns = {name: [] for name in runs}
    for _ in range(steps // round_steps):
        for name, run in runs.items():
            turns[name] += bench_step.time_steps(run, round_steps, warmup=1)
    for name, samples in turns.items():
        result[f"{name}_in_turns_us"] = statistics.median(samples) / inp.layers
        result[f"{name}_in_turns_first_us"] = statistics.median(
            samples[::round_steps]) / inp.layers
    # Rounds after the host idled as long as another variant's round would take: asleep (as
    # a thread blocked in torch.cuda.synchronize), or spinning.
    for idle, wait in (("sleep", time.sleep), ("spin", spin)):
        for name, run in runs.items():
            samples = []
            for _ in range(steps // round_steps):
                wait(IDLE_S)
                samples += bench_step.time_steps(run, round_steps, warmup=0)
            result[f"{name}_after_{idle}_us"] = statistics.median(samples) / inp.layers
    return {k: round(v, 2) for k, v in result.items()}


IDLE_S = 0.015


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sampler", required=True, help="the built dev/host_sampler.c")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--seconds", type=float, default=8.0,
                        help="profiled per step variant (0: the timings alone)")
    parser.add_argument("--interval-us", type=int, default=100,
                        help="CPU time between samples (the kernel rounds up to its tick)")
    parser.add_argument("--sliced", action="store_true",
                        help="also the unrolled step slicing each layer's indices")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    sampler = ctypes.CDLL(args.sampler)
    sampler.host_sampler_start.argtypes = [ctypes.c_long]
    sampler.host_sampler_stop.restype = ctypes.c_long
    sampler.host_sampler_write.argtypes = [ctypes.c_char_p]
    result = dict(device=jax.devices()[0].device_kind, python_tid=threading.get_native_id(),
                  interval_us=args.interval_us, points=[])
    gpu = jax.default_backend() == "gpu"
    with tempfile.TemporaryDirectory() as tmp:
        for b in args.batches if gpu else [2]:
            inp, made = (sparse_steps(b, args.layers, args.sliced) if gpu
                         else cpu_steps(args.layers, args.sliced))
            timings = dict(b=inp.b, **step_timings(made, inp))
            result.setdefault("timings", []).append(timings)
            print(json.dumps(timings), flush=True)
            if args.seconds <= 0:
                continue
            for name, queue, step in made:
                path = os.path.join(tmp, f"{name}_{b}.txt")
                point = dict(b=inp.b, variant=name, **profile_step(
                    sampler, inp, queue, step, args.seconds, args.interval_us, path))
                samples, modules = read_profile(path)
                point["threads"] = summary(samples, symbolize(samples, modules))
                result["points"].append(point)
                main_thread = [t for t in point["threads"] if t["tid"] == result["python_tid"]]
                print(json.dumps({k: v for k, v in point.items() if k != "threads"}), flush=True)
                for t in point["threads"][:4]:
                    print(f"  thread {t['tid']}{' (python)' if t in main_thread else ''}: "
                          f"{t['samples']} samples", flush=True)
                    for n, c in t["self"][:12]:
                        print(f"    self {c:6d} {n[:160]}")
                    for n, c in t["total"][:30]:
                        print(f"    total {c:5d} {n[:160]}")
            del inp, made
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
