"""The builder of jax_flashmla's logical ops: one primitive per op over its pure-JAX reference
and its custom calls.

LogicalOp(name, ...) makes the primitive jax_flashmla_<name>_logical, whose operands are
arrays named by its `operands` parameter (an op may leave some out: a sink, a metadata) and
whose other parameters (`implementation` and the op's own, static and hashable) are those of
`op(...)`. Its rules:

  - abstract evaluation: the op's `abstract_eval`;
  - JVP: raises NotImplementedError naming the op: FlashMLA has no backward pass, and the ops
    define no gradient;
  - batching: with `fold_vmap` a factor (rows or batch: each slice along it computed alone),
    the vmapped axis folds into that factor's dim, one call over vmapped size x that many
    rows, where every mapped operand has the factor and those without it are unmapped;
    otherwise, and always without `fold_vmap`, one call per element of the vmapped axis;
  - lowering: "reference" inlines the reference; "custom_call" the kernel function wrapped in
    `custom_partitioning`, with a Shardy rule generated from the operands' and results' factors
    (one letter per dim, op-wide): the factors in `split` may be split across devices, every
    other stays whole. The mesh axes of a split factor are those of the first operand that has
    it; every operand and result follows them, and each device runs the kernel function on its
    local shapes. On one device the kernel function is inlined as it is.

An op's `constants` are operands of the custom-call path made from the shapes alone (the sparse
decode's schedule): numpy arrays, made when the op is bound (or vmap folds it) for the whole
shapes, and, under a split, for each device's local shapes, which its kernel function gets in
their place. They are operands, not constants of the kernel function, because
custom_partitioning traces the function for the whole shapes without closed-over constants.
"""
import functools

import jax
import jax.numpy as jnp
from jax._src import dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flashmla.base.validation import IMPLEMENTATIONS
from jax_flashmla.kernels import custom_calls


class LogicalOp:
    """One logical op: `op(operands, implementation=..., **params)` binds its primitive on
    `operands`, a dict of arrays by name (their order is kept), and returns its results as a
    tuple.

    Args:
      name: the op's public name (mla_decode, ...), which errors name.
      factors: each operand's and result's dims as Shardy factors, a string of space-separated
        letters by name (the same letter for the same dim across names).
      results: the results' names, in order.
      split: the factors that may be split across devices.
      abstract_eval(avals, **params): the results' ShapedArrays; avals a dict by operand name.
      reference(named, **params): the pure-JAX results; named a dict of arrays by name.
      kernels(named, **params): the custom calls' results on one device's operands.
      no_gradient: why the op has no gradient, and what to do instead (the JVP's error).
      fold_vmap: the factor a vmapped axis folds into, or None (module doc).
      constants: fn(avals, **params) -> numpy array by name (module doc), their factors whole.
      check_split(operands, axes, **params): raises where the op cannot run split so (axes:
        each split factor's mesh axes, None where whole), or None.
    """

    def __init__(self, name, *, factors, results, split, abstract_eval, reference, kernels,
                 no_gradient, fold_vmap=None, check_split=None, constants=None):
        self.name, self.factors, self.results, self.split = name, factors, results, set(split)
        self._constants = constants or {}
        self._abstract_eval, self._reference, self._kernels = abstract_eval, reference, kernels
        self._no_gradient, self._fold_vmap, self._check_split = no_gradient, fold_vmap, check_split
        self.primitive = custom_calls.make_primitive(f"jax_flashmla_{name}_logical",
                                                     self._abstract)
        ad.primitive_jvps[self.primitive] = self._jvp
        batching.primitive_batchers[self.primitive] = self._batch
        self._partitioned = custom_partitioning(self._local, static_argnums=(0, 1))
        self._partitioned.def_partition(self._partition, sharding_rule=self._sharding_rule)
        mlir.register_lowering(self.primitive, self._lower)
        # custom_partitioning's lowering needs the devices, which jit hands to a lowering only
        # when it sees a primitive that asks for them (as TransformerEngine's outer primitives
        # do).
        dispatch.prim_requires_devices_during_lowering.add(self.primitive)

    def __call__(self, operands, *, implementation, **params):
        if implementation not in IMPLEMENTATIONS:
            raise AssertionError(f"{self.name}: implementation {implementation!r} unresolved")
        return tuple(self._bind(operands, implementation=implementation, **params))

    def _bind(self, operands, *, implementation, **params):
        """Binds the primitive on operands (without constants), the constants added for their
        shapes on the custom-call path."""
        if implementation == "custom_call":
            operands = {**operands, **self._constants_for(operands, params)}
        return self.primitive.bind(*operands.values(), operands=tuple(operands),
                                   implementation=implementation, **params)

    def _constants_for(self, avals, params):
        avals = {name: jax.core.ShapedArray(x.shape, x.dtype) for name, x in avals.items()}
        return {name: make(avals, **params) for name, make in self._constants.items()}

    def _abstract(self, *avals, operands, implementation, **params):
        return self._abstract_eval(dict(zip(operands, avals)), **params)

    def _jvp(self, primals, tangents, **params):
        raise NotImplementedError(
            f"{self.name} has no gradient: {self._no_gradient} (FlashMLA has no backward pass, "
            "so jax_flashmla defines no gradient nor JVP for it). Wrap its inputs in "
            "jax.lax.stop_gradient if no gradient should flow through it.")

    # -- vmap ------------------------------------------------------------------------------

    def _batch(self, args, dims, *, operands, **params):
        fold = self._fold_vmap
        if fold is None or not self._foldable(operands, dims):
            return custom_calls.batch_sequentially(self.primitive, args, dims,
                                                   operands=operands, **params)
        size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
        folded = {}
        for name, x, d in zip(operands, args, dims):
            if name in self._constants:  # made anew for the folded shapes
                continue
            if fold not in self.factors[name].split():
                folded[name] = x
                continue
            at = self.factors[name].split().index(fold)
            x = (jnp.moveaxis(x, d, at) if d is not None
                 else jnp.broadcast_to(jnp.expand_dims(x, at),
                                       x.shape[:at] + (size,) + x.shape[at:]))
            folded[name] = x.reshape(x.shape[:at] + (-1,) + x.shape[at + 2:])
        outs = self._bind(folded, **params)
        unfolded, out_dims = [], []
        for name, out in zip(self.results, outs):
            at = self.factors[name].split().index(fold)
            unfolded.append(out.reshape(out.shape[:at] + (size, -1) + out.shape[at + 1:]))
            out_dims.append(at)
        return unfolded, out_dims

    def _foldable(self, operands, dims):
        """Whether every mapped operand has the fold factor, every other is unmapped, and
        every result has it."""
        has = lambda name: self._fold_vmap in self.factors[name].split()
        return (all(has(name) for name in self.results)
                and all(d is None or has(name) for name, d in zip(operands, dims)))

    # -- lowering --------------------------------------------------------------------------

    def _lower(self, ctx, *values, operands, implementation, **params):
        if implementation == "reference":
            fn = lambda *vs: self._reference(dict(zip(operands, vs)), **params)
        else:
            fn = functools.partial(self._partitioned, operands, tuple(sorted(params.items())))
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *values)

    def _local(self, operands, params, *values):
        return self._kernels_with(operands, params, {}, *values)

    def _kernels_with(self, operands, params, constants, *values):
        """The kernel function on values, `constants` in place of the operands of their
        names."""
        named = dict(zip(operands, values))
        named.update(constants)
        return tuple(self._kernels(named, **dict(params)))

    def _sharding_rule(self, operands, params, mesh, operand_types, result_types):
        rule = (", ".join(self.factors[name] for name in operands) + " -> "
                + ", ".join(self.factors[name] for name in self.results))
        factors = dict.fromkeys(rule.replace(",", " ").replace("->", " ").split())
        return rule, dict(need_replication_factors=tuple(f for f in factors
                                                         if f not in self.split))

    def _partition(self, operands, params, mesh, operand_shapes, result_shape):
        axes = {}
        for name, shape in zip(operands, operand_shapes):
            spec = tuple(shape.sharding.spec) + (None,) * len(shape.shape)
            for factor, dim_axes in zip(self.factors[name].split(), spec):
                if factor in self.split:
                    axes.setdefault(factor, dim_axes)
        if self._check_split is not None:
            self._check_split(operands, axes, **dict(params))
        sharding = lambda name: NamedSharding(
            mesh, P(*(axes.get(f) for f in self.factors[name].split())))
        local_avals = {name: jax.core.ShapedArray(sharding(name).shard_shape(shape.shape),
                                                  shape.dtype)
                       for name, shape in zip(operands, operand_shapes)
                       if name not in self._constants}
        local = functools.partial(self._kernels_with, operands, params,
                                  self._constants_for(local_avals, dict(params)))
        return (mesh, local, tuple(sharding(name) for name in self.results),
                tuple(sharding(name) for name in operands))
