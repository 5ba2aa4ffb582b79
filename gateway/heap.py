"""Keep the gateway's heap from holding on to the memory of a burst of large requests.

A multi-megabyte request passes through many buffers on its way in (gRPC's TLS records and
slices, the protobuf message, the prompt's ``str``); glibc's malloc keeps what is freed in its
arenas (one per thread that allocated), so after a burst of 4 MB prompts the gateway's RSS stays
up by much of the burst. Two glibc calls bring it back; no library offers them, hence the
``ctypes`` here:

- at start, ``mallopt(M_MMAP_THRESHOLD)``: every allocation of 128 KiB or more gets its own
  mmap, unmapped when freed (by default glibc raises that threshold after the first large
  free, up to 32 MiB, and the large buffers of a burst stay in the heap);
- once a burst of large requests is over, ``malloc_trim(0)`` (glibc >= 2.8 walks every arena):
  the free pages of the smaller buffers go back to the OS.

Measured on the 2-core CPU machine (a gateway over TLS, four bursts of 8 concurrent 4 MB
prompts, each refused before tokenization): RSS 120-128 MB before; after the bursts 157-207 MB
with the threshold alone, 118-149 MB with the trim (``tests/e2e/test_bounded_gateway.py`` holds
it to 1.5x). Where the C library is not glibc both are no-ops.
"""

from __future__ import annotations

import asyncio
import ctypes

_M_MMAP_THRESHOLD = -3  # mallopt parameter (malloc.h)


def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def return_large_buffers_to_the_os(threshold_bytes: int = 128 << 10) -> None:
    """Have malloc serve every allocation of ``threshold_bytes`` or more with its own mmap,
    given back to the OS when freed (call once, at start)."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes)


class HeapTrimmer:
    """Give malloc's free pages back to the OS (``malloc_trim(0)``, on a thread of the event
    loop's default executor) once ``quiet_s`` seconds have passed without a large request: a
    burst costs one trim (a few milliseconds), after its buffers are freed.

    Args:
        large_request_bytes: serialized request size, in bytes, from which a request counts as large.
        quiet_s: seconds without a large request before the trim (a refused request is over in
            milliseconds; a large one being served keeps its memory whatever is trimmed).
    """

    def __init__(self, large_request_bytes: int = 256 << 10, quiet_s: float = 1.0) -> None:
        libc = _glibc()
        self._malloc_trim = getattr(libc, "malloc_trim", None) if libc is not None else None
        self.large_request_bytes = large_request_bytes
        self.quiet_s = quiet_s
        self.trims = 0  # trims done
        self._last_large = 0.0  # event-loop time of the last large request
        self._scheduled = False

    def request_arrived(self, request_bytes: int) -> None:
        """Note a request of ``request_bytes`` serialized bytes (call on the event loop)."""
        if self._malloc_trim is None or request_bytes < self.large_request_bytes:
            return
        loop = asyncio.get_running_loop()
        self._last_large = loop.time()
        if not self._scheduled:
            self._scheduled = True
            loop.call_later(self.quiet_s, self._when_quiet, loop)

    def _when_quiet(self, loop: asyncio.AbstractEventLoop) -> None:
        quiet_at = self._last_large + self.quiet_s
        if loop.time() < quiet_at:  # another large request came meanwhile
            loop.call_at(quiet_at, self._when_quiet, loop)
            return
        self._scheduled = False
        loop.run_in_executor(None, self._trim)

    def _trim(self) -> None:
        self._malloc_trim(0)
        self.trims += 1
