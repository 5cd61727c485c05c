"""Result records every benchmark writes the same way: the machine a run measured on and a spread of timings.
Each is a frozen dataclass whose ``to_json`` gives the fields the result files have always held, in their order."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone


@dataclass(frozen=True)
class Machine:
    """Where a run measured: the date, the software, the threads and the load when it ended."""

    date: str
    python: str
    torch: str
    threads: int
    cpu: str
    cuda: bool
    loadavg_1min: float
    gpu: str | None = None  # its name, when ``cuda``

    @classmethod
    def here(cls) -> "Machine":
        import torch

        cuda = torch.cuda.is_available()
        return cls(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), python=platform.python_version(),
                   torch=torch.__version__, threads=torch.get_num_threads(),
                   cpu=platform.processor() or platform.machine(), cuda=cuda,
                   loadavg_1min=round(os.getloadavg()[0], 2), gpu=torch.cuda.get_device_name(0) if cuda else None)

    def to_json(self) -> dict:
        out = {"date": self.date, "python": self.python, "torch": self.torch, "threads": self.threads, "cpu": self.cpu,
               "cuda": self.cuda, "loadavg_1min": self.loadavg_1min}
        return {**out, "gpu": self.gpu} if self.cuda else out


@dataclass(frozen=True)
class Spread:
    """min / median / max of timings (or ratios), rounded; ``every``: each value too (None: not kept)."""

    min: float | None
    median: float | None
    max: float | None
    every: tuple[float, ...] | None = None

    @classmethod
    def of(cls, xs: list[float], digits: int = 2, every: bool = True) -> "Spread":
        """An empty ``xs`` gives None for each figure."""
        kept = tuple(round(x, digits) for x in xs) if every else None
        if not xs:
            return cls(None, None, None, kept)
        return cls(round(min(xs), digits), round(statistics.median(xs), digits), round(max(xs), digits), kept)

    def to_json(self) -> dict:
        out = {"min": self.min, "median": self.median, "max": self.max}
        return out if self.every is None else {**out, "all": list(self.every)}
