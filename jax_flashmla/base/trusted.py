"""Pytrees whose values a kernel trusts (a schedule, masked indices): only the library makes
them. Their constructor refuses, their fields cannot be assigned, and jax's transformations
(jit, scan, vmap) rebuild them from their leaves as they flattened them.

A function mapped over their leaves (jax.tree.map) rebuilds them too: that is the one way
around the constructor, and what it makes is the caller's to keep within the contract.
"""
import jax


def library_made(data_fields, meta_fields, maker):
    """A class decorator: cls (whose __slots__ are data_fields + meta_fields) as such a pytree.
    cls(...) raises TypeError naming `maker`, the function that makes them; the library makes
    one with cls._make(*fields) and changes one with instance._replace(**fields)."""
    fields = tuple(data_fields) + tuple(meta_fields)

    def decorate(cls):
        def refuse(self, *args, **kwargs):
            raise TypeError(f"{cls.__name__} is made by {maker}; it cannot be built from "
                            "arrays, because kernels trust its values")

        def make(klass, *values):
            made = object.__new__(klass)
            for name, value in zip(fields, values, strict=True):
                object.__setattr__(made, name, value)
            return made

        def assign(self, name, value):
            raise AttributeError(f"{cls.__name__} is immutable; got an assignment to {name!r}")

        def replace(self, **changes):
            unknown = sorted(set(changes) - set(fields))
            if unknown:
                raise TypeError(f"{cls.__name__} has no fields {unknown}")
            return cls._make(*(changes.get(name, getattr(self, name)) for name in fields))

        def represent(self):
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in fields)
            return f"{cls.__name__}({shown})"

        cls.__init__, cls.__setattr__, cls.__repr__ = refuse, assign, represent
        cls._make, cls._replace = classmethod(make), replace
        jax.tree_util.register_pytree_node(
            cls,
            lambda made: (tuple(getattr(made, n) for n in data_fields),
                          tuple(getattr(made, n) for n in meta_fields)),
            lambda meta, data: cls._make(*data, *meta))
        return cls
    return decorate
