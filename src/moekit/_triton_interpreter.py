"""The Triton CPU interpreter's comparisons, made to yield int1 as compiled Triton's do.

The interpreter (TRITON_INTERPRET=1) computes a comparison as a bool array but labels it with
its operands' type (int32, fp32, ...). A vector mask `&` a scalar condition then splats the
scalar to that label's numpy type, and Triton 3.7+'s interpreter rejects the resulting int32
load / store mask ("mask has unsupported dtype"), where compiled kernels take it. `fix()`
relabels comparison results as int1 (bool), only when the interpreter mislabels them.
"""

from __future__ import annotations

import numpy as np

_done = False


def _mislabels(builder_cls, handle_cls, tl) -> bool:
    """True when an int32 comparison comes back bool-valued but not labelled int1."""
    one = handle_cls(np.array([1], dtype=np.int32), tl.int32)
    out = builder_cls().create_icmpSLT(one, one)
    return out.data.dtype == np.bool_ and out.dtype != tl.int1


def fix() -> bool:
    """Relabel the interpreter's comparisons as int1 if it mislabels them (idempotent).
    Returns whether a fix is in place."""
    global _done
    if _done:
        return True
    import triton.language as tl
    from triton.runtime import interpreter

    builder, handle = interpreter.InterpreterBuilder, interpreter.TensorHandle
    if not _mislabels(builder, handle, tl):
        return False

    def relabelled(compare):
        return lambda self, lhs, rhs: handle(compare(self, lhs, rhs).data, tl.int1)

    for name in dir(builder):
        if name.startswith(("create_icmp", "create_fcmp")):
            setattr(builder, name, relabelled(getattr(builder, name)))
    _done = True
    return True
