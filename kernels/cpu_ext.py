"""sluice's C++ CPU kernels (``cpu_blockq.cpp``, ``cpu_kquant.cpp``, ``cpu_ops.cpp``, ``cpu_stack.cpp``,
and ``cpu_pages.cpp``'s weights on huge pages),
built on first use, as one module.

They are compiled once per machine, torch installation and source by ``torch.utils.cpp_extension``
(which needs a C++ compiler and the ``ninja`` package) into ``$SLUICE_CACHE_DIR/ext`` (default
``~/.cache/sluice/ext``); the first build takes about a minute on 2 cores, later loads are
instant. ``-march=native``: the AVX512-VNNI paths are compiled where the CPU has them, AVX2 ones
on CPUs with AVX2 but no AVX512-VNNI (AMD Zen 2/3 among them), portable C++ with the same
arithmetic elsewhere (``cpu_blockq.isa()`` names the path). Nothing falls back silently:
``available()`` is False with ``unavailable_reason()`` when the build fails, and callers that
need the kernels say so.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

_SOURCES = [Path(__file__).with_name(name) for name in ("cpu_blockq.cpp", "cpu_kquant.cpp", "cpu_ops.cpp", "cpu_pages.cpp",
                                                           "cpu_stack.cpp")]
_lock = threading.Lock()
log = logging.getLogger("sluice.kernels")
_module = None
_error: str | None = None


def _cpu_flags() -> bytes:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""


# Builds of the same sources: the one sluice runs (-march=native) and the ones tests hold it to.
# "portable": x86-64-v2, no AVX2 (the portable C++ loops); "avx2": x86-64-v3 (AVX2, FMA, F16C, no
# AVX-512 or VNNI: the path AVX2-only CPUs such as AMD Zen 2/3 run); "avxvnni": this CPU without
# AVX-512 (the 256-bit AVX-VNNI paths of CPUs that have AVX-VNNI but no AVX-512); "avxvnni_evex":
# cpu_kquant.cpp's AVX-VNNI tile built for an AVX-512 VNNI CPU (the EVEX forms of its instructions),
# so that the hosts without AVX-VNNI, every AVX-512 one, run it too.
VARIANTS = {"native": ["-march=native"], "portable": ["-march=x86-64-v2"], "avx2": ["-march=x86-64-v3"],
            "avxvnni": ["-march=native", "-mno-avx512f"],
            "avxvnni_evex": ["-march=native", "-DSLUICE_KQ_VNNI256_EVEX"]}


def build_dir(variant: str = "native") -> Path:
    root = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice")) / "ext"
    # The sources' folder and torch's own are part of the key: torch's build files name the sources
    # and torch's headers by path, so two checkouts (or an install and a checkout), or two
    # environments with the same torch version (CI's floors venv and the test venv), sharing one
    # folder would rebuild on every switch.
    key = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES) + torch.__version__.encode() + _cpu_flags()
                         + str(_SOURCES[0].resolve().parent).encode()
                         + str(Path(torch.__file__).resolve().parent).encode())
    return root / f"cpu-{'' if variant == 'native' else variant + '-'}{key.hexdigest()[:16]}"


def _flags(variant: str) -> tuple[list[str], list[str]]:
    """(compiler, linker) flags of a build. -fopenmp: at::parallel_for is OpenMP inline in the
    headers; without it the loops run on one thread. The libgomp.so.1 that torch has loaded is the
    one used."""
    return ["-O3", *VARIANTS[variant], "-fopenmp"], ["-fopenmp"]


def _stamp_text(variant: str) -> str:
    cflags, ldflags = _flags(variant)
    return f"cflags={cflags!r} ldflags={ldflags!r}\n"


def _import_built(name: str, library: Path):
    """The built module, imported as torch's loader does, without importing
    ``torch.utils.cpp_extension`` (it imports setuptools: ~0.13 s of every engine start)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(variant: str):
    build = build_dir(variant)
    name = "sluice_cpu" if variant == "native" else f"sluice_cpu_{variant}"
    library, stamp = build / f"{name}.so", build / f"{name}.flags"
    # The folder's key covers the sources, torch and the CPU, but not the flags: ``stamp`` records
    # them, written once a build of these flags has loaded. With it in place, nothing can need
    # rebuilding, so the library is imported directly.
    try:
        if stamp.read_text() == _stamp_text(variant) and library.exists():
            return _import_built(name, library)
    except OSError:
        pass
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    cflags, ldflags = _flags(variant)
    with open(build / "sluice.lock", "w") as guard:
        # torch marks a build in progress with a `lock` file that it deletes when done, and waits,
        # without a timeout, for one it finds. A process killed while it built (Ctrl-C during a
        # first `sluice serve`) leaves it behind, and every later load would wait forever. This
        # flock is released by the kernel when its holder dies: whoever holds it is the only one
        # of sluice's processes building here, so a `lock` file it finds is stale.
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process that is building sluice's C++ CPU kernels in %s", build)
            fcntl.flock(guard, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        stamp.unlink(missing_ok=True)             # other flags' build may rewrite the library now
        if not library.exists():   # a first start spends a minute here: say so, or it looks hung
            log.info("compiling sluice's C++ CPU kernels%s into %s (once per machine, torch and source; "
                     "about a minute on 2 cores)", "" if variant == "native" else f" ({variant} build)", build)
        module = cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES], build_directory=str(build),
                                    extra_cflags=cflags, extra_ldflags=ldflags, verbose=False)
        partial = stamp.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(_stamp_text(variant))
        os.replace(partial, stamp)                # whole or absent, for a process reading it now
        return module


def _load():
    global _module, _error
    with _lock:
        if _module is not None or _error is not None:
            return _module
        try:
            _module = _build("native")
        except Exception as exc:                      # no compiler, no ninja, a build error
            text = str(exc).strip()
            _error = f"{type(exc).__name__}: {text.splitlines()[-1] if text else exc!r}"
        return _module


def portable_module():
    """The same sources built without AVX2 or AVX-512 (x86-64-v2): the portable C++ paths, for
    tests that hold them to the vector ones. Raises when the build fails."""
    return _build("portable")


def variant_module(variant: str):
    """The same sources built for one of ``VARIANTS`` (tests hold each path the CPU can run to the
    others). Raises when the build fails."""
    if variant not in VARIANTS:
        raise ValueError(f"no build variant {variant!r}; one of {sorted(VARIANTS)}")
    return _build(variant)


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _error


def module():
    """The compiled module; RuntimeError with the reason when it could not be built."""
    mod = _load()
    if mod is None:
        raise RuntimeError(f"sluice's C++ CPU kernels are not available: {_error}")
    return mod


if __name__ == "__main__":       # `python -m sluice.kernels.cpu_ext [--portable]`: build now (make setup does)
    import sys

    if available():
        print(f"sluice CPU kernels: built in {build_dir()}")
    else:
        print(f"sluice CPU kernels: not available ({unavailable_reason()}); quantization=auto will not pick "
              "w4a8/w8a8", file=sys.stderr)
    if "--portable" in sys.argv[1:]:   # the build the tests hold the vector paths to (make setup builds it too)
        portable_module()
        print(f"sluice CPU kernels, portable build: built in {build_dir('portable')}")
