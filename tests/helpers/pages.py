"""Where a pointer lives in this process's memory map (/proc/self/smaps)."""
from __future__ import annotations

from pathlib import Path

# Whether this kernel has transparent huge pages at all (MADV_HUGEPAGE is refused without them).
THP_BUILT = Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def mapping_of(ptr: int) -> tuple[int, int, set[str]] | None:
    """(start, end, VmFlags) of the mapping holding address ``ptr``, or None."""
    start = end = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
        elif head == "VmFlags:" and start is not None and start <= ptr < end:
            return start, end, set(line.split()[1:])
    return None


def advised_huge(ptr: int) -> bool:
    """The mapping holding ``ptr`` is advised for huge pages (MADV_HUGEPAGE: VmFlags ``hg``)."""
    found = mapping_of(ptr)
    return found is not None and "hg" in found[2]
