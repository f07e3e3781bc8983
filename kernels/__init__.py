"""Triton kernels, each beside its plain-torch reference. Never imports ``engine``."""
from sluice.kernels.kv_store import kv_store, kv_store_ref
from sluice.kernels.paged_decode import paged_decode, paged_decode_ref
from sluice.kernels.paged_prefill import paged_prefill, paged_prefill_ref
from sluice.kernels.penalties import apply_penalties, apply_penalties_ref
from sluice.kernels.rejection import rejection_sample, rejection_sample_ref
from sluice.kernels.sampling import sample, sample_ref, sampling_probs_ref

__all__ = [
    "apply_penalties", "apply_penalties_ref", "kv_store", "kv_store_ref", "paged_decode", "paged_decode_ref",
    "paged_prefill", "paged_prefill_ref", "rejection_sample", "rejection_sample_ref", "sample", "sample_ref",
    "sampling_probs_ref",
]
