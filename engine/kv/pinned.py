"""Page-locked (pinned) host memory for stored entries, so host-to-device copies run asynchronously.

A copy from pageable memory is staged by the driver and blocks the host; from page-locked memory it is
one DMA transfer that a side stream can run beside the forward (engine/kv/layerwise.py). Pinning applies
only where the model computes on CUDA and the entries are kept in CPU memory; elsewhere an entry is
stored as it is, and :class:`PinState` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.devices import cuda_available
from engine.kv.quant import entry_from_tensors

CUDA_ONLY = "off: CUDA only (pinned memory speeds host-to-device copies; the model computes on the CPU here)"
NO_CUDA = "off: CUDA only (no CUDA device on this machine)"
NOT_ASKED = CUDA_ONLY


@dataclass
class PinState:
    """Whether a store keeps its entries page-locked, and what happened when it tried."""

    wanted: bool  # the model computes on CUDA and the store keeps entries in CPU memory
    active: bool = False
    why: str = NOT_ASKED  # "on", or why not
    failures: int = 0  # entries the OS refused to pin (stored pageable)
    pinned_bytes: int = 0
    last_error: str = field(default="", repr=False)

    @classmethod
    def for_store(cls, wanted: bool, storage: str) -> "PinState":
        """The state of a store on ``storage`` asked (``wanted``) to pin its entries."""
        if not wanted:
            return cls(False, why=NOT_ASKED)
        if storage != "cpu":
            return cls(False, why="off: entries are kept in GPU memory")
        if not cuda_available():
            return cls(True, why=NO_CUDA)
        return cls(True, active=True, why="on")

    def pin(self, entry):
        """``entry`` in page-locked memory, or ``entry`` unchanged where pinning is off or refused."""
        if not self.active or entry.device.type != "cpu":
            return entry
        try:
            pinned = page_locked(entry)
        except RuntimeError as err:  # the OS's locked-memory limit (ulimit -l), or the driver
            self.failures += 1
            self.last_error = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
            self.why = (f"on, but the OS refused to pin {self.failures} entr{'y' if self.failures == 1 else 'ies'} "
                        f"(stored pageable, copied synchronously): {self.last_error}; raise the locked-memory "
                        "limit (ulimit -l) or lower the module memory budget")
            return entry
        self.pinned_bytes += pinned.nbytes
        return pinned

    def forget(self, entry) -> None:
        """Count ``entry`` (evicted or cleared) out of the pinned bytes."""
        if self.active and is_page_locked(entry):
            self.pinned_bytes = max(0, self.pinned_bytes - entry.nbytes)


def page_locked(entry, pin=torch.Tensor.pin_memory):
    """A copy of ``entry`` whose tensors are page-locked (``pin``: how one tensor is); RuntimeError when the OS or
    driver refuses."""
    tensors = {k: pin(t) for k, t in entry.tensors().items()}
    return entry_from_tensors(tensors, entry.manifest())


def is_page_locked(entry) -> bool:
    """Whether every tensor of ``entry`` is in page-locked memory."""
    try:
        return all(t.is_pinned() for t in entry.tensors().values())
    except RuntimeError:  # no CUDA runtime: nothing is pinned
        return False
