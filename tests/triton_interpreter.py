"""A faster Triton interpreter for the suite: the language patched once per launch, not once per
device-function call, and no int32 overflow sanitizer.

Under ``TRITON_INTERPRET=1`` a launch swaps ``triton.language``'s builtins for interpreted ones
(``interpreter._patch_lang``: ``inspect.getmembers`` over the language modules, ~0.2 ms; 3.9 puts
them back when the launch ends, 3.4 leaves them). Both repeat that swap on every call of a
``@triton.jit`` helper inside the launch, and our kernels call helpers in their loops: the
sampling kernel's top-k bisection calls ``_mass_above`` up to 31 times a row. That repetition
was ~40% of the interpreter's time in tests/kernels/test_sampling.py. Inside a launch the builtins
are already the interpreted ones, so a helper whose module sees no language module the launch
has not patched skips the swap; any other call goes through Triton's own code unchanged.

The interpreter also checks, by default, every signed 32-bit add, sub and mul for overflow
(``InterpreterOptions.sanitize_overflow``; compiled kernels check only in debug mode): each one
is redone in int64 and compared with the bounds, ~25% of the interpreter's time on the real-model
Triton test. Index arithmetic overflows int32 only past 2**31 elements, and the shapes the
interpreter can run here are thousands of times smaller, so the check cannot fire in this suite;
it is switched off.

Nothing here changes what a kernel computes: every kernel test compares with its torch
reference, through this path. ``install()`` leaves Triton alone (and returns False) if its
interpreter lacks the two functions it wraps; tests/kernels/test_interpreter_speed_up.py then fails.
"""
from __future__ import annotations

import dataclasses
import functools
import threading


class _AlreadyPatched:
    """What a nested call gets back instead of a patch scope: there is nothing to undo."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap the interpreter; True when installed (or already), False when Triton's layout differs."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None:
        return False
    if getattr(patch_lang, "once_per_launch", False):
        return True
    state = threading.local()
    lang_modules = (tl, tl.core)

    @functools.cache
    def langs_of(fn) -> frozenset[int]:
        """The language modules ``fn``'s module sees (what ``_patch_lang`` patches for it)."""
        return frozenset(id(v) for v in fn.__globals__.values() if any(v is m for m in lang_modules))

    @functools.wraps(patch_lang)
    def patch_once(fn):
        launch = getattr(state, "launch", None)
        if launch is None:                         # outside a launch: Triton's own behaviour
            return patch_lang(fn)
        langs = langs_of(fn)
        if not launch["langs"]:                    # the launch's own patch (GridExecutor.__call__)
            launch["langs"] = langs
            return patch_lang(fn)
        if langs <= launch["langs"]:               # a helper inside the launch: already patched
            return _AlreadyPatched()
        launch["langs"] = launch["langs"] | langs  # a language module not patched yet: patch it
        return patch_lang(fn)

    patch_once.once_per_launch = True
    run_launch = executor.__call__

    @functools.wraps(run_launch)
    def launch(self, *args, **kwargs):
        outer = getattr(state, "launch", None)
        state.launch = {"langs": frozenset()}
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            state.launch = outer

    interpreter._patch_lang = patch_once
    executor.__call__ = launch
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)
    return True
