"""The CPU interpreter fix-up (moekit._triton_interpreter): comparisons are int1, so a vector
mask combined with a scalar (per-program) condition loads and stores what compiled Triton does."""

import pytest
import torch

import moekit  # noqa: F401  (in interpreter mode its import applies the fix)

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the interpreter runs where CUDA is not (conftest.py)"
)

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _masked_copy_kernel(src_ptr, dst_ptr, live_rows, width, BLOCK: tl.constexpr):
    """Row r of dst = row r of src where r < live_rows (a scalar condition), columns < width."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = (cols < width) & (row < live_rows)
    v = tl.load(src_ptr + row * BLOCK + cols, mask=mask, other=-1.0)
    tl.store(dst_ptr + row * BLOCK + cols, v, mask=mask)


def test_comparisons_are_int1_after_fix():
    import numpy as np
    from triton.runtime import interpreter

    from moekit import _triton_interpreter

    _triton_interpreter.fix()
    h = interpreter.TensorHandle(np.array([1, 5], dtype=np.int32), tl.int32)
    out = interpreter.InterpreterBuilder().create_icmpSLT(h, h)
    assert out.dtype == tl.int1 and out.data.dtype == np.bool_
    assert not _triton_interpreter._mislabels(interpreter.InterpreterBuilder,
                                              interpreter.TensorHandle, tl)  # fmt: skip


@pytest.mark.parametrize("live_rows, width", [(0, 8), (2, 3), (4, 8)])
def test_vector_mask_and_scalar_condition(live_rows, width):
    src = torch.randn(4, 8)
    dst = torch.full((4, 8), 7.0)
    _masked_copy_kernel[(4,)](src, dst, live_rows, width, BLOCK=8)
    want = torch.full((4, 8), 7.0)
    want[:live_rows, :width] = src[:live_rows, :width]
    assert torch.equal(dst, want)
