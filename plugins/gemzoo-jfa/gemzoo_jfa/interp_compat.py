"""Triton 3.6's interpreter (the H200 image's) turns a loop bound into an int with ``int(array)``, which fails on
the 1-element arrays that scalar loads give there; 3.7 squeezes first. ``apply()`` installs 3.7's behaviour on
3.6 for interpreter runs (the test scripts call it; kernels are untouched)."""

from __future__ import annotations


def apply() -> None:
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_gemzoo_squeeze", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._gemzoo_squeeze = True
    interpreter._patch_lang_tensor = patched
