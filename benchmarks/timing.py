"""Wall-clock timing shared by the benchmarks: N calls back to back, then one sync (CUDA events
would not see XLA's stream), with the variants of a comparison taking turns within each
repeat, so that the GPU's clocks drifting under sustained load (2-3% between runs on the H200)
hit both sides of a ratio alike; ratios are then taken per repeat.

A batch's time per call is the steady cost of a call plus, spread over the batch, what the
batch pays once: the first dispatch before the GPU starts, and the final sync's wake-up. jax
pays more of the latter than torch (a jitted call's dispatch, and a sync that waits on XLA's
host callback), so batches of a few hundred calls charge it to the calls. fit_in_turns
separates the two: batches of several lengths, and a line through their times."""
import gc
import statistics
import time

import jax
import jax.numpy as jnp


def compiler_option(text):
    """A benchmark's --xla-option 'NAME=VALUE' -> (NAME, VALUE as a bool, an int or the
    string), as jax.jit's compiler_options take it."""
    name, sep, value = text.partition("=")
    if not sep:
        raise SystemExit(f"--xla-option takes NAME=VALUE; got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    try:
        return name, int(value)
    except ValueError:
        return name, value


# At least this many calls per repeat, even where one call outlasts the target time.
MIN_CALLS = 3


@jax.jit
def device_copy(x):
    """One read and one write of x on the device (XLA issues it as a device-to-device memcpy,
    as torch's copy_ does): the copy behind the grid's bandwidth ceiling."""
    return x + jnp.zeros((), x.dtype)


def issued_and_done(call, sync, calls):
    """(seconds the host took to issue call(0), ..., call(calls - 1) back to back, seconds until
    the one sync after them returned). The garbage collector is off meanwhile, as in timeit: a
    collection pausing the host early in a batch, before the GPU's queue has filled, would
    charge its pause to the calls."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        for i in range(calls):
            result = call(i)
        issued = time.perf_counter() - start
        sync(result)
        return issued, time.perf_counter() - start
    finally:
        if collecting:
            gc.enable()


def timed_batch(call, sync, calls):
    """Seconds per call of call(0), ..., call(calls - 1) back to back, then one sync."""
    return issued_and_done(call, sync, calls)[1] / calls


def host_seconds_per_call(call, sync, calls):
    """Seconds per call the host took to issue a batch of calls (the sync after them not
    counted): where it reaches the batch's wall clock per call, the host set the pace, or
    waited inside the calls, and the device did not."""
    return issued_and_done(call, sync, calls)[0] / calls


def size_calls(call, sync, *, target_ms, max_calls):
    """(N, the first call's result): the first call compiles; doubling batches then warm up
    and size N so that N calls last about target_ms."""
    first = call(0)
    sync(first)
    calls = 1
    while True:
        elapsed = timed_batch(call, sync, calls)
        if elapsed * calls >= target_ms / 4e3 or calls >= max_calls:
            break
        calls *= 2
    return int(min(max_calls, max(MIN_CALLS, round(target_ms / 1e3 / elapsed)))), first


def in_turns(variants, *, repeats, warmup):
    """variants: name -> (call, sync, calls, decodes per call), call taking no argument.
    After `warmup` calls of each, every repeat times each variant in turn, the order reversed
    every other repeat (so that a drift within a repeat favours neither side). Returns name ->
    seconds per decode, one sample per repeat."""
    warm_up(variants, warmup)
    samples = {name: [] for name in variants}
    for repeat in range(repeats):
        for name in turn_order(variants, repeat):
            call, sync, calls, per_call = variants[name]
            samples[name].append(timed_batch(lambda _: call(), sync, calls) / per_call)
    return samples


def warm_up(variants, calls):
    for call, sync, _, _ in variants.values():
        for _ in range(calls):
            result = call()
        sync(result)


def turn_order(names, repeat):
    """The names in order on even repeats, reversed on odd ones."""
    names = list(names)
    return names if repeat % 2 == 0 else names[::-1]


# Batch lengths, as multiples of a variant's calls, that fit_in_turns times.
FIT_SCALES = (0.5, 1.0, 2.0)


def line_fit(xs, ys):
    """(slope, intercept) of the least-squares line through the points (xs, ys)."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys))
             / sum((x - mean_x) ** 2 for x in xs))
    return slope, mean_y - slope * mean_x


def fit_sizes(calls, scales=FIT_SCALES):
    """The batch lengths a fit times for a variant sized to `calls` calls."""
    return [max(MIN_CALLS, round(calls * scale)) for scale in scales]


def batches_in_turns(variants, sizes, repeat, failed=None):
    """One repeat of batches of several lengths: at each length, the variants in turn (in
    turn_order), each timed over a batch of sizes[name][k] calls; a variant with fewer lengths
    sits the rest out. variants: name -> (call taking the call's index, sync). Returns name ->
    seconds per batch, one per length. With a `failed` dict, a variant that raises is recorded
    there and left out of the rest and of the result; without, its error propagates."""
    totals = {name: [] for name in variants}
    for length in range(max((len(s) for s in sizes.values()), default=0)):
        for name in turn_order(totals, repeat):
            if length >= len(sizes[name]):
                continue
            call, sync = variants[name]
            n = sizes[name][length]
            try:
                totals[name].append(timed_batch(call, sync, n) * n)
            except Exception as e:
                if failed is None:
                    raise
                failed[name] = e
                del totals[name]
    return totals


def fit_in_turns(variants, *, repeats, warmup, scales=FIT_SCALES):
    """As in_turns, but every repeat times each variant's batch at several lengths (its calls
    times each of `scales`; the variants in turn at each length, so that batches of one length
    run close together) and fits a line through their total times. Returns name -> (seconds
    per decode: the slope, what one more call adds to a stream of calls; seconds per batch:
    the intercept, what a batch pays once however long), as two lists of one sample per
    repeat."""
    warm_up(variants, warmup)
    fits = {name: ([], []) for name in variants}
    indexed = {name: (lambda _, call=call: call(), sync)
               for name, (call, sync, _, _) in variants.items()}
    sizes = {name: fit_sizes(variants[name][2], scales) for name in variants}
    for repeat in range(repeats):
        totals = batches_in_turns(indexed, sizes, repeat)
        for name in variants:
            slope, intercept = line_fit(sizes[name], totals[name])
            fits[name][0].append(slope / variants[name][3])
            fits[name][1].append(intercept)
    return fits


def time_in_turns(variants, *, target_ms, repeats, max_calls, fitted):
    """variants: name -> (call, sync). Sizes each, then times them in turns within every
    repeat, so that the GPU's clocks drifting under sustained load hit all alike (ratios are
    then taken per repeat; the order reverses every other repeat). A variant that raises is
    dropped. Returns (name -> dict(samples, calls, first, fits), name -> the error of a
    dropped variant); samples are seconds per call over a batch of `calls`, and for the
    variants named in `fitted` fits holds (seconds per call, seconds per batch) of the line
    through batches of FIT_SCALES times their calls."""
    timed, failed = {}, {}
    for name, (call, sync) in variants.items():
        try:
            calls, first = size_calls(call, sync, target_ms=target_ms, max_calls=max_calls)
            timed[name] = dict(samples=[], calls=calls, first=first, fits=[])
        except Exception as e:  # one failing implementation should not cost the whole point
            failed[name] = e
    sizes = {name: fit_sizes(t["calls"]) if name in fitted else [t["calls"]]
             for name, t in timed.items()}
    for repeat in range(repeats):
        # Each length in turn for all, the order reversed every other repeat: neither side
        # of a ratio always runs first, and batches of one length run close together.
        totals = batches_in_turns({name: variants[name] for name in timed}, sizes, repeat,
                                  failed)
        for name in set(timed) - set(totals):
            del timed[name]
        for name, t in timed.items():
            t["samples"].append(totals[name][sizes[name].index(t["calls"])] / t["calls"])
            if name in fitted:
                t["fits"].append(line_fit(sizes[name], totals[name]))
    return timed, failed


def paired_ratios(numerator, denominator):
    """Per repeat, a / b of two variants timed back to back: (median, min, max)."""
    ratios = sorted(a / b for a, b in zip(numerator, denominator))
    return statistics.median(ratios), ratios[0], ratios[-1]
