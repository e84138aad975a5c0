"""A paged-cache decode loop: admit requests, write their prompts, decode T tokens, jitted.

    python examples/decode_loop.py                  # CPU: the pure-JAX reference, in seconds
    python examples/decode_loop.py --custom-call    # FlashMLA's C++ model (on Hopper: kernels)
    python examples/decode_loop.py --prompt-lens 1000 2000 --steps 64 --heads 128  # larger

Runs on CPU in seconds (the pure-JAX path, or FlashMLA's C++ model with --custom-call) and on a
Hopper GPU with FlashMLA's kernels. The "model" is a toy, its weights and inputs seeded: the
next token's query and cache row are a fixed projection of this step's attention output.
"""
import argparse
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from jax_flashmla import PagedKVCache
from jax_flashmla.serving import PageAllocator, decode_loop, pad_batch, write_prompt


def hopper_gpu():
    """Whether JAX's default backend is a Hopper GPU (sm 9.x), where FlashMLA's kernels run."""
    return jax.default_backend() == "gpu" and any(
        str(getattr(d, "compute_capability", "")).startswith("9.") for d in jax.devices())


def flashmla_here():
    """Whether implementation=None picks FlashMLA's kernels here: a Hopper GPU, and
    jax_flashmla built with its bridge to them."""
    return hopper_gpu() and importlib.util.find_spec("jax_flashmla._flashmla") is not None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[2],
        epilog="suggested command lines:\n" + __doc__.split("\n\n")[1] + "\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[5, 64, 130],
                        help="prompt length of each request (default: 5 64 130)")
    parser.add_argument("--steps", type=int, default=8, help="tokens to decode (default: 8)")
    parser.add_argument("--heads", type=int, default=16, help="query heads (default: 16)")
    parser.add_argument("--custom-call", action="store_true",
                        help="implementation='custom_call' (FlashMLA's C++ model on CPU); "
                             "default: FlashMLA on a Hopper GPU, else the pure-JAX reference")
    args = parser.parse_args(argv)
    if min(args.prompt_lens) < 1 or args.steps < 1 or args.heads < 1:
        parser.error("--prompt-lens, --steps and --heads must be >= 1")
    if sum(-(-(n + args.steps) // 64) for n in args.prompt_lens) > 64:
        parser.error("the requests need more than the 64 pages of the cache: shorter "
                     "--prompt-lens or fewer --steps")
    if args.custom_call and jax.default_backend() != "cpu" and not hopper_gpu():
        parser.error(f"--custom-call runs FlashMLA's kernels on a Hopper GPU or its C++ model "
                     f"on CPU, and JAX's default backend here is {jax.default_backend()}, "
                     "neither: leave it out")
    return args


def main(args):
    implementation = "custom_call" if args.custom_call else None
    if flashmla_here():
        runs = "FlashMLA's kernels"
    else:
        runs = "FlashMLA's C++ model" if args.custom_call else "the pure-JAX reference"
    print(f"implementation: {runs}")

    # Host side: pages for prompt + every decoded token, then one padded bucket.
    alloc = PageAllocator(num_pages=64)
    ids = list(range(len(args.prompt_lens)))
    for i, n in zip(ids, args.prompt_lens):
        alloc.admit(i, n + args.steps)
    max_pages = max(len(alloc.pages(i)) for i in ids)
    prefix = np.array(args.prompt_lens, np.int32)
    rng = np.random.default_rng(0)
    prompt_kv = rng.standard_normal((len(ids), max(args.prompt_lens), 576)).astype(np.float32)
    prefix, table, prompt_kv = pad_batch(prefix, alloc.block_table(ids, max_pages), prompt_kv)
    bucket = prefix.shape[0]

    proj_q = jnp.asarray(rng.standard_normal((512, args.heads * 576)) / 512 ** 0.5, jnp.bfloat16)
    proj_kv = jnp.asarray(rng.standard_normal((512, 576)) / 512 ** 0.5, jnp.bfloat16)

    def model(step, out):  # out: (batch, 1, heads, 512) -> next q (batch, 1, heads, 576), row
        pooled = out.mean(axis=2)
        q = (pooled @ proj_q).reshape(out.shape[0], 1, args.heads, 576)
        return step + 1, q, pooled @ proj_kv

    @functools.partial(jax.jit, donate_argnums=0)
    def generate(cache, table, prefix, prompt_kv, q0, kv0):
        cache = write_prompt(cache, table, prefix, prompt_kv)
        return decode_loop(cache, table, prefix, q0, kv0, model, jnp.int32(0),
                           num_steps=args.steps, implementation=implementation)

    q0 = jnp.asarray(rng.standard_normal((bucket, 1, args.heads, 576)), jnp.bfloat16)
    kv0 = jnp.asarray(rng.standard_normal((bucket, 1, 576)), jnp.bfloat16)
    cache = PagedKVCache.create(alloc.num_pages)
    print(f"cache: {cache.num_pages} pages, {cache.num_tokens} tokens, "
          f"{cache.nbytes / 2**20:.1f} MiB; batch {len(ids)} padded to bucket {bucket}")
    cache, out, lse, steps = generate(cache, *map(jnp.asarray, (table, prefix, prompt_kv)),
                                      q0, kv0)
    print(f"{int(steps)} steps: out {out.shape}, lse of the last step per request "
          f"{[f'{x:.3f}' for x in np.asarray(lse[-1, :, 0, 0])]} (inf: padding)")
    for i in ids:
        alloc.finish(i)
    print(f"finished; {alloc.num_free} of {alloc.num_pages} pages free")


if __name__ == "__main__":
    main(parse_args())
