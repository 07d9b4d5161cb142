"""Pinned host buffers that a pass's rows and readout indices reach the device through.

A host -> device copy that does not wait for the work already queued on the device must
start from pinned memory. ``Tensor.pin_memory()`` on every pass goes through the caching
host allocator (a lock, events polled, now and then a fresh ``cudaHostAlloc``) on the one
thread that lays out passes: on a loaded host that cost milliseconds a pass, paid while the
device waited for the next pass. A ring of buffers pinned once costs a memcpy instead. A
buffer is written again only once the copy out of it has run (an event recorded behind it):
with passes two deep, that copy ran long before the ring comes round.
"""

from __future__ import annotations

import numpy as np
import torch

SLOTS = 8            # uploads in flight: two a pass (rows, readout indices), four passes
MIN_SLOT_BYTES = 1 << 20


class HostStaging:
    def __init__(self, device: torch.device, slots: int = SLOTS):
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * slots   # pinned uint8
        self._copied = [torch.cuda.Event() for _ in range(slots)]   # each slot's last copy
        self._next = 0

    def upload(self, array: np.ndarray, out: torch.Tensor | None = None) -> torch.Tensor:
        """``array`` on the device (into ``out`` where given: a captured graph's input
        buffer), queued on the current stream without the host waiting for the device."""
        slot = self._next
        self._next = (slot + 1) % len(self._buffers)
        buffer = self._buffers[slot]
        if buffer is not None:     # used before: its last copy has run (long ago, as a rule)
            settled(self._copied[slot])
        if buffer is None or buffer.numel() < array.nbytes:
            size = max(MIN_SLOT_BYTES, 1 << (array.nbytes - 1).bit_length())
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8,
                                                       pin_memory=True)
        staged = buffer[:array.nbytes].numpy().view(array.dtype).reshape(array.shape)
        staged[...] = array
        source = torch.from_numpy(staged)
        if out is None:
            out = torch.empty(array.shape, dtype=source.dtype, device=self.device)
        out.copy_(source, non_blocking=True)
        self._copied[slot].record()
        return out


def settled(event: torch.cuda.Event) -> None:
    """Wait for ``event``, asking first: ``synchronize`` lets go of the interpreter lock
    even when the event is done, and the thread then waits to take it back from whichever
    thread runs Python meanwhile (up to the switch interval); ``query`` keeps it."""
    if not event.query():
        event.synchronize()
