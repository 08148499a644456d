"""Keep freed memory in the process heap during CPU inference (glibc's malloc).

torch's CPU allocator is plain malloc/free. glibc serves every block above its mmap threshold
(128 KiB at first, raised dynamically up to 32 MiB) with a fresh mmap and returns it with munmap on
free, and it gives the top of the heap back to the kernel once more than the trim threshold is free.
A batched forward allocates and frees activations of a few MiB per op (a 1024-token round of the
bundled model: [1024, 768] floats, 3 MiB), so every such op paid for its pages again: page faults
and zeroing, ~0.25 us a page. Measured on a 2-core VM (`lopa bench step --batches`, bundled model,
k = 1): a round of 16 requests took 29 ms with glibc's defaults and 17 ms with freed memory kept,
one request's k = 3 step 3.4 -> 2.6 ms. Either setting alone did not help: freed blocks must both
stay mapped (mmap threshold) and not be trimmed away (trim threshold).

`keep_freed_memory()` raises both thresholds with mallopt, which also turns off the dynamic
adjustment. The process then keeps up to its peak heap mapped (what jemalloc or tcmalloc, which
torch's CPU tuning guide recommends, do as well). It is a no-op where the C library has no mallopt
(musl, macOS) and where the user set these thresholds already (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_, MALLOC_MMAP_MAX_, a glibc.malloc tunable in
GLIBC_TUNABLES) or preloaded another allocator (jemalloc, tcmalloc, mimalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

log = logging.getLogger("lopa.execution")

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1024**3
_USER_TUNING = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def user_tuned(environ: dict[str, str] | os._Environ[str] = os.environ) -> str | None:
    """Why the user's own malloc settings take precedence, or None."""
    for name in _USER_TUNING:
        if environ.get(name):
            return f"{name} is set"
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc tunables"
    preload = environ.get("LD_PRELOAD", "")
    if any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc")):
        return f"LD_PRELOAD={preload}"
    return None


@functools.cache
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they were raised."""
    reason = user_tuned()
    if reason is not None:
        log.debug("malloc thresholds left alone: %s", reason)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (AttributeError, OSError):
        log.debug("no mallopt in this C library: malloc thresholds left alone")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = {"M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)}
    refused = [name for name, (param, value) in settings.items() if mallopt(param, value) != 1]
    if refused:
        log.warning("mallopt refused %s: CPU forwards may pay page faults", ", ".join(refused))
    return not refused
