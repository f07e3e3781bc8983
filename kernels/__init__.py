"""Triton kernels, each beside its plain-torch reference, and the C++ CPU kernels
(``cpu_blockq``, ``cpu_ext``). Never imports ``engine``.

The Triton modules load on first use (``from sluice.kernels import sample`` still works): a CPU
engine that only runs the C++ kernels then never imports triton, whose library alone is ~64 MiB
of resident memory."""
import importlib
import sys
import types

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


sys.modules[__name__].__class__ = _Package
