"""Triton kernels, each beside its plain-torch reference, and the C++ CPU kernels
(``cpu_blockq``, ``cpu_ext``). Never imports ``engine``.

The Triton modules load on first use (``from sluice.kernels import sample`` still works): a CPU
engine that only runs the C++ kernels then never imports triton, whose library alone is ~64 MiB
of resident memory."""
import importlib
import sys
import types

if __name__ == "kernels":
    # This folder is ``sluice.kernels``; it is found under the bare name only when a checkout's root
    # is on sys.path (a test run, a shell in the checkout). There it would hide Hugging Face's
    # ``kernels``, which transformers (>= 5.25 requires it) imports whenever it is installed. Hand
    # the name to that package, or fail as a missing module does.
    import importlib.machinery
    import importlib.util
    import os

    # Real paths on both sides: a checkout also reached through a symlink would otherwise find
    # this file again, and run it again, without end.
    _checkout = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.realpath(p or os.curdir) != _checkout])
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (this checkout's kernels/ is sluice.kernels)",
                                  name="kernels")
    sys.modules["kernels"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["kernels"])

_HOME = {
    "kv_store": "kv_store", "kv_store_ref": "kv_store",
    "paged_decode": "paged_decode", "paged_decode_ref": "paged_decode",
    "paged_prefill": "paged_prefill", "paged_prefill_ref": "paged_prefill",
    "apply_penalties": "penalties", "apply_penalties_ref": "penalties",
    "rejection_sample": "rejection", "rejection_sample_ref": "rejection",
    "sample": "sampling", "sample_ref": "sampling", "sampling_probs_ref": "sampling",
}
__all__ = sorted(_HOME)


class _Package(types.ModuleType):
    """``sluice.kernels.kv_store`` is the function, as it was with eager imports, although the
    import system sets the package's attribute to the submodule of the same name on its import."""

    def __getattribute__(self, name: str):
        home = _HOME.get(name)
        if home is None:
            return super().__getattribute__(name)
        return getattr(importlib.import_module(f"{__name__}.{home}"), name)


if __name__ != "kernels":
    sys.modules[__name__].__class__ = _Package
