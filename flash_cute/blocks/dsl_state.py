"""Lets a block object (softmax state, mask, ...) live across the DSL's run-time loops.

A run-time `for`/`if` in a kernel carries every object it touches as MLIR values. `DslState`
gives a plain class that protocol: attributes holding compile-time Python values (ints, bools,
dtypes, None, ...) stay Python values, every other attribute (Int32, Float32, register tensors)
is flattened to MLIR values and rebuilt after the loop.
"""

import copy

import cutlass
from cutlass.base_dsl.typing import NumericMeta

_STATIC_TYPES = (int, float, bool, str, type(None), type, NumericMeta, cutlass.Constexpr)


def _is_static(value) -> bool:
    """A compile-time value: a static type, or a tuple of them (a traced mod's graph)."""
    if isinstance(value, tuple):
        return all(_is_static(v) for v in value)
    return isinstance(value, _STATIC_TYPES)


class DslState:
    """Mixin: DSL values in instance attributes survive run-time control flow."""

    def _dsl_dynamic_names(self):
        return [
            name
            for name, value in vars(self).items()
            if not name.startswith("_dsl") and not _is_static(value)
        ]

    def __extract_mlir_values__(self):
        values, counts = [], []
        for name in self._dsl_dynamic_names():
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            counts.append(len(field_values))
        self._dsl_counts = counts
        return values

    def __new_from_mlir_values__(self, values):
        new = copy.copy(self)
        pos = 0
        for name, count in zip(self._dsl_dynamic_names(), self._dsl_counts):
            setattr(new, name, cutlass.new_from_mlir_values(getattr(self, name),
                                                            values[pos : pos + count]))
            pos += count
        return new
