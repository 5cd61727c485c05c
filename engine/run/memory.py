"""A run's peak memory: the kernel's resident high-water mark (``VmHWM``), else a polling thread, and the CUDA
peak (bench/peak_memory.py measures what each costs a TTFT)."""

from __future__ import annotations

import os
import threading

import torch


class PeakMemory:
    """Peak resident and CUDA memory during a ``with`` block."""

    def __init__(self, device: str):
        self.device = device
        self.peak_rss = 0
        self.cuda_peak: int | None = None

    def __enter__(self) -> "PeakMemory":
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        self._start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak_rss = max(self._stop(), _rss_bytes())
        if self.device.startswith("cuda"):
            self.cuda_peak = int(torch.cuda.max_memory_allocated())

    def _start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size

    def _stop(self) -> int:
        return _status_bytes("VmHWM")


class SampledPeak(PeakMemory):
    """The fallback: a thread samples the resident size."""

    def __init__(self, device: str, interval: float = 0.005):
        super().__init__(device)
        self.interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak_rss = max(self.peak_rss, _rss_bytes())
            self._done.wait(self.interval)

    def _start(self) -> None:
        self.peak_rss = _rss_bytes()
        self._thread.start()

    def _stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak_rss


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm_resettable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


PEAK_MEMORY = PeakMemory if _hwm_resettable() else SampledPeak  # what timed_run uses
