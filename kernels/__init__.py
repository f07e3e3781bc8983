"""Triton kernels, each beside its plain-torch reference. Never imports ``engine``."""
from kernels.kv_store import kv_store, kv_store_ref
from kernels.paged_decode import paged_decode, paged_decode_ref
from kernels.paged_prefill import paged_prefill, paged_prefill_ref
from kernels.penalties import apply_penalties, apply_penalties_ref
from kernels.rejection import rejection_sample, rejection_sample_ref
from kernels.sampling import sample, sample_ref, sampling_probs_ref

__all__ = [
    "apply_penalties", "apply_penalties_ref", "kv_store", "kv_store_ref", "paged_decode", "paged_decode_ref",
    "paged_prefill", "paged_prefill_ref", "rejection_sample", "rejection_sample_ref", "sample", "sample_ref",
    "sampling_probs_ref",
]
