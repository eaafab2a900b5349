"""Triton's CPU interpreter, less its redundant work: imported first by the interpreted children.

Triton 3.x's interpreter re-patches triton.language on every call of a @jit device function
(tl.sum, tl.sigmoid, tl.cdiv, ...): `_patch_lang` walks the language modules with
inspect.getmembers, about 3 ms a call, a third of the interpreted step kernels' time (the GDN
kernels call tl.sum a few times per row, per program). Within one launch the second and later
patches for the same function change nothing: the first one replaced every builtin it finds
(later walks find none left to replace, and re-set the same tensor and core attributes), and
nothing is restored until the launch's own scope is, at its end. So a device function is patched
once per launch; the kernels run the same interpreted operations on the same values.

The interpreter also maps a Triton dtype to numpy's through a table of twenty dtypes it builds
(hashing each Triton dtype, in Python) on every call, tens of thousands of calls a case: the
table is built once instead, the same mapping (np_dtype_once).

A Triton whose interpreter lacks these names keeps its own behaviour (install() does nothing).
"""
from __future__ import annotations


def install() -> bool:
    try:
        from triton.runtime import interpreter
        patch_lang, scope_cls = interpreter._patch_lang, interpreter._LangPatchScope
        scope_cls.restore
    except (ImportError, AttributeError):
        return False
    if getattr(interpreter, "_blockspec_fast", False):
        return True
    patched: set = set()             # functions whose language modules are patched in this launch

    def once_per_launch(fn):
        if fn in patched:
            return scope_cls()       # nothing to do: an empty scope (a device call drops it anyway)
        patched.add(fn)
        return patch_lang(fn)

    restore = scope_cls.restore

    def restore_and_forget(self):
        patched.clear()              # a scope restored: the next call patches again
        restore(self)

    interpreter._patch_lang = once_per_launch
    scope_cls.restore = restore_and_forget
    np_dtype_once(interpreter)
    interpreter._blockspec_fast = True
    return True


def np_dtype_once(interpreter) -> None:
    """interpreter._get_np_dtype with each scalar dtype's answer kept: the interpreter's own answer
    the first time (a dtype it has none for still raises there), a lookup after."""
    get_np_dtype = getattr(interpreter, "_get_np_dtype", None)
    tl, np = getattr(interpreter, "tl", None), getattr(interpreter, "np", None)
    if get_np_dtype is None or tl is None or np is None:
        return
    known: dict = {}

    def np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):
            return np.dtype(np.uint64)
        found = known.get(element)
        if found is None:
            found = known[element] = get_np_dtype(element)
        return found

    interpreter._get_np_dtype = np_dtype
