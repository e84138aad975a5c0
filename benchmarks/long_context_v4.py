"""One conversation of a million tokens through a stack of DeepSeek-V4-Flash-shaped attention
layers on one GPU: its prompt prefilled in chunks, then decoded token by token.

The layers are jax_flashmla.flax.V4Attention at V4-Flash's attention shape (HF
DeepseekV4Config's defaults: hidden 4096, 64 heads of 512, q_lora_rank 1024, 8 output groups
of rank 1024, a 128-token window, CSA ratio 4 with an indexer of 64 heads of 128 keeping 512
entries, HCA ratio 128, the compress rope's YaRN of factor 16 over 65536 positions), random
weights and sinks, bf16; by default three layers, one of each type (--layers). Attention alone:
no embedding, norms, MLPs or residual stream. Every layer is fed the same hidden states, drawn
N(0, 1) on the device for each chunk and each decode step, not the layer before's output (which,
unnormalised and without a residual, would only drift in scale): the run tests each layer's
attention over a long cache (its window ring, its compressed entries, a CSA layer's index keys
and selections), not a model. Every chunk's and step's outputs are checked finite.

The prompt, one request, goes in chunks of one shape (--chunk tokens; the last padded, its
length given): one jitted extend of the stack, compiled once, the caches donated (written in
place), each chunk synced (its finiteness read). Then --decode-steps steps of one jitted
decode of the stack, the caches donated, each step synced and timed. Prints progress; writes
OUT.json and OUT.md (--out): the prefill's seconds and tokens/s, the decode's µs a step (the
median), the device's peak memory where it reports one.
With --deadline-s, no chunk starts past that many seconds from the start: the result then
holds the tokens prefilled, and the decode runs over them.
--tiny: a small configuration (1024 tokens in chunks of 256, then 2 steps; 4 heads, hidden 64,
an indexer keeping 16 entries) on the default device through the ops' pure-JAX references.
"""
import argparse
import datetime
import os
import platform
import sys
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp

from jax_flashmla.flax import V4Attention, V4Config

CSA, HCA, SLIDING = V4Config.CSA, V4Config.HCA, V4Config.SLIDING

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results_io import write_json  # noqa: E402

LAYER_NAMES = {"hca": HCA, "csa": CSA, "sliding": SLIDING}
YARN = {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 65536, "attention_factor": 1.0}
FLASH = V4Config(hidden_size=4096, num_heads=64, q_lora_rank=1024, compress_rope_scaling=YARN)
TINY = V4Config(hidden_size=64, num_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                index_n_heads=4, index_topk=16, compress_rope_scaling=YARN)
SIZES = {False: dict(tokens=1 << 20, chunk=4096, decode_steps=32),
         True: dict(tokens=1024, chunk=256, decode_steps=2)}


def build_layers(config, layer_types, seed):
    """(graphdefs, states) of bf16 layers of random weights, their sinks N(0, 1)."""
    graphdefs, states = [], []
    for i, layer_type in enumerate(layer_types):
        layer = V4Attention(config, layer_type, rngs=nnx.Rngs(seed + i), dtype=jnp.bfloat16,
                            param_dtype=jnp.bfloat16)
        layer.sinks[...] = jax.random.normal(jax.random.key(seed + 100 + i), layer.sinks.shape)
        graphdef, state = nnx.split(layer)
        graphdefs.append(graphdef)
        states.append(state)
    return graphdefs, states


def stack_functions(graphdefs, config, chunk, implementation, seed):
    """(extend, decode), jitted, the caches donated: extend(states, caches, index, length)
    feeds chunk `index`'s hidden states, its first `length` tokens real, to every layer;
    decode(states, caches, index) decode step `index`'s. Each returns (whether every layer's
    outputs are finite, the caches)."""
    prefill_key, decode_key = jax.random.split(jax.random.key(seed))

    def run(states, caches, x, call):
        finite, new = jnp.bool_(True), []
        for graphdef, state, cache in zip(graphdefs, states, caches):
            out, cache = call(nnx.merge(graphdef, state), x, cache)
            finite &= jnp.all(jnp.isfinite(out))
            new.append(cache)
        return finite, new

    def extend(states, caches, index, length):
        x = jax.random.normal(jax.random.fold_in(prefill_key, index),
                              (1, chunk, config.hidden_size), jnp.bfloat16)
        return run(states, caches, x, lambda layer, x, cache: layer.extend(
            x, cache, lengths=length[None], implementation=implementation))

    def decode(states, caches, index):
        x = jax.random.normal(jax.random.fold_in(decode_key, index),
                              (1, 1, config.hidden_size), jnp.bfloat16)
        return run(states, caches, x, lambda layer, x, cache: layer.decode(
            x, cache, implementation=implementation))

    return jax.jit(extend, donate_argnums=1), jax.jit(decode, donate_argnums=1)


def peak_memory():
    """The device's peak bytes in use so far, and its limit, where it reports them."""
    stats = jax.devices()[0].memory_stats() or {}
    return dict(peak_bytes=stats.get("peak_bytes_in_use"), bytes_limit=stats.get("bytes_limit"))


def run(args):
    """The run (module doc): its result, a dict."""
    began = time.perf_counter()
    config = TINY if args.tiny else FLASH
    layer_types = [LAYER_NAMES[name] for name in args.layers.split(",")]
    graphdefs, states = build_layers(config, layer_types, args.seed)
    caches = [nnx.merge(g, s).init_cache(1, args.tokens + args.decode_steps)
              for g, s in zip(graphdefs, states)]
    extend, decode = stack_functions(graphdefs, config, args.chunk, args.implementation,
                                     args.seed)
    index, length = jnp.int32(0), jnp.int32(args.chunk)
    started = time.perf_counter()
    extend = extend.lower(states, caches, index, length).compile()
    decode = decode.lower(states, caches, index).compile()
    compile_s = time.perf_counter() - started
    print(f"compiled the chunk's extend and the decode step in {compile_s:.1f} s", flush=True)

    chunks = -(-args.tokens // args.chunk)
    flags, fed, started = [], 0, time.perf_counter()
    for number in range(chunks):
        if args.deadline_s is not None and time.perf_counter() - began > args.deadline_s:
            print(f"deadline: stopped after {fed} tokens", flush=True)
            break
        length = min(args.chunk, args.tokens - fed)
        finite, caches = extend(states, caches, jnp.int32(number), jnp.int32(length))
        flags.append(bool(finite))  # synced: the deadline and the progress are the device's
        fed += length
        if (number + 1) % args.report_every == 0 or number + 1 == chunks:
            elapsed = time.perf_counter() - started
            print(f"chunk {number + 1}/{chunks}: {fed} tokens in {elapsed:.1f} s, "
                  f"{fed / elapsed:.0f} tokens/s", flush=True)
    jax.block_until_ready(caches)
    prefill_s = time.perf_counter() - started
    prefill = dict(tokens=fed, chunks=len(flags), seconds=prefill_s,
                   tokens_per_s=fed / prefill_s if fed else None,
                   finite=all(flags), memory=peak_memory())

    steps_us, step_flags = [], []
    for step in range(args.decode_steps):
        started = time.perf_counter()
        finite, caches = decode(states, caches, jnp.int32(step))
        finite.block_until_ready()
        steps_us.append((time.perf_counter() - started) * 1e6)
        step_flags.append(bool(finite))
    ordered = sorted(steps_us)
    decode_result = dict(
        steps=args.decode_steps, finite=all(step_flags),
        us_per_step=ordered[len(ordered) // 2] if ordered else None,
        mean_us_per_step=sum(steps_us) / len(steps_us) if steps_us else None,
        us_repeats=steps_us, memory=peak_memory(),
        tokens_cached=[int(c.num_tokens[0]) for c in caches])
    print(f"prefill: {fed} tokens in {prefill_s:.1f} s ({prefill['tokens_per_s'] or 0:.0f} "
          f"tokens/s); decode: {decode_result['us_per_step'] or 0:.0f} µs a step (median of "
          f"{args.decode_steps}); peak memory {decode_result['memory']['peak_bytes']} bytes; "
          f"finite: prefill {prefill['finite']}, decode {decode_result['finite']}", flush=True)
    return dict(
        meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                  host=platform.node(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  implementation=args.implementation or "default", tiny=args.tiny,
                  layer_types=layer_types, config=config_fields(config),
                  requested_tokens=args.tokens, chunk=args.chunk, compile_s=compile_s),
        complete=fed == args.tokens, prefill=prefill, decode=decode_result)


def config_fields(config):
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    fields["compress_rope_scaling"] = config.compress_rope_scaling_dict
    return fields


def markdown(result):
    """The result as a short markdown report."""
    meta, prefill, decode = result["meta"], result["prefill"], result["decode"]
    gib = lambda n: "" if n is None else f"{n / 2 ** 30:.1f}"  # noqa: E731
    return "\n".join([
        f"# A {meta['requested_tokens']}-token conversation through V4 attention layers",
        "",
        f"{meta['device']}, jax {meta['jax']}, {meta['date']}; layers: "
        f"{', '.join(meta['layer_types'])}; hidden {meta['config']['hidden_size']}, "
        f"{meta['config']['num_heads']} heads; implementation {meta['implementation']}; "
        f"chunks of {meta['chunk']} tokens; compiled in {meta['compile_s']:.1f} s.",
        "",
        "| part | tokens | seconds | tokens/s | µs a step | finite | peak GiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| prefill ({prefill['chunks']} chunks) | {prefill['tokens']} | "
        f"{prefill['seconds']:.1f} | {prefill['tokens_per_s'] or 0:.0f} |  | "
        f"{'yes' if prefill['finite'] else 'NO'} | {gib(prefill['memory']['peak_bytes'])} |",
        f"| decode ({decode['steps']} steps) | {decode['tokens_cached'][0]} |  |  | "
        f"{decode['us_per_step'] or 0:.0f} | {'yes' if decode['finite'] else 'NO'} | "
        f"{gib(decode['memory']['peak_bytes'])} |",
        "",
        "The whole prompt was prefilled." if result["complete"] else
        f"Stopped at the deadline: {prefill['tokens']} of {meta['requested_tokens']} tokens.",
        ""])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="a small configuration on the default device (module doc)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="the prompt's tokens (default 1048576; tiny 1024)")
    parser.add_argument("--chunk", type=int, default=None,
                        help="tokens a prefill call (default 4096; tiny 256)")
    parser.add_argument("--decode-steps", type=int, default=None,
                        help="decode steps after the prompt (default 32; tiny 2)")
    parser.add_argument("--layers", default="hca,csa,sliding",
                        help="the stack's layer types in order, comma-separated: hca, csa, "
                             "sliding")
    parser.add_argument("--implementation", choices=("custom_call", "reference"), default=None,
                        help="the layers' (default: FlashMLA's kernels where they run)")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="start no chunk past this many seconds from the start")
    parser.add_argument("--report-every", type=int, default=16,
                        help="chunks between progress lines")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="path prefix of the .json and .md results")
    args = parser.parse_args(argv)
    for name, value in SIZES[args.tiny].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("tokens", "chunk", "decode_steps", "report_every"):
        if getattr(args, name) < (0 if name == "decode_steps" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive; got "
                         f"{getattr(args, name)}")
    unknown = set(args.layers.split(",")) - set(LAYER_NAMES)
    if unknown:
        parser.error(f"--layers takes {', '.join(LAYER_NAMES)}; got {args.layers!r}")
    result = run(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json(result, args.out + ".json")
        with open(args.out + ".md", "w") as f:
            f.write(markdown(result))
    if not (result["prefill"]["finite"] and result["decode"]["finite"]):
        print("outputs were not finite", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
