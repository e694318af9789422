"""Work-arounds for Triton's CPU interpreter (``TRITON_INTERPRET=1``) used by the scripts that run the fused kernels
on CPU tensors (tests/core/padded_steps.py, tests/core/decode_forms.py). Each touches the interpreter only, never a
compiled kernel, and is a no-op where triton is missing."""

from __future__ import annotations

from typing import Any


def apply() -> None:
    """Install both shims below (call before the first kernel runs)."""
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    _index_from_one_element_arrays(interpreter)
    _boolean_splats(interpreter)


def _index_from_one_element_arrays(interpreter: Any) -> None:
    """The interpreter turns a loaded scalar used as a loop bound into an int with ``int(array)``, which NumPy >= 2.4
    refuses for a 1-element array: take its element instead."""
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return

    def patched(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def _boolean_splats(interpreter: Any) -> None:
    """Triton 3.6's interpreter gives a comparison's result its operand's dtype, so splatting a scalar comparison
    (the decode kernel's ``(l_i > 0.0) & (d < DH)`` store mask) turns it into float32 and the ``&`` then fails in
    NumPy: keep boolean data boolean when it is splatted."""
    import numpy as np

    builder = getattr(interpreter, "InterpreterBuilder", None)
    splat = getattr(builder, "create_splat", None)
    if splat is None:
        return

    def create_splat(self: Any, ret_ty: Any, arg: Any) -> Any:
        out = splat(self, ret_ty, arg)
        if np.asarray(arg.data).dtype == np.bool_:
            out.data = out.data.astype(np.bool_)
        return out

    builder.create_splat = create_splat
