"""Result records every benchmark writes the same way: the machine a run measured on and a spread of timings.
Each is a frozen dataclass whose ``to_json`` gives the fields the result files have always held, in their order."""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone

# the features a CPU figure turns on here: the engine's kernels (AVX-512 VNNI), the prefill's bf16 units, and AMX
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


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
    cpu_model: str = ""  # /proc/cpuinfo's model name: the same VM kind lands on different CPUs
    cpu_features: tuple[str, ...] = ()  # those of :data:`CPU_FEATURES` it has

    @classmethod
    def here(cls) -> "Machine":
        import torch

        from engine.model.kernels import _cpu_flags, cpu_info

        cuda = torch.cuda.is_available()
        flags = _cpu_flags()
        return cls(date=datetime.now(timezone.utc).strftime("%Y-%m-%d"), python=platform.python_version(),
                   torch=torch.__version__, threads=torch.get_num_threads(),
                   cpu=platform.processor() or platform.machine(), cuda=cuda,
                   loadavg_1min=round(os.getloadavg()[0], 2), gpu=torch.cuda.get_device_name(0) if cuda else None,
                   cpu_model=cpu_info("model name"), cpu_features=tuple(f for f in CPU_FEATURES if f in flags))

    def to_json(self) -> dict:
        out = {"date": self.date, "python": self.python, "torch": self.torch, "threads": self.threads, "cpu": self.cpu,
               "cuda": self.cuda, "loadavg_1min": self.loadavg_1min}
        if self.cuda:
            out["gpu"] = self.gpu
        if self.cpu_model:  # added after the fields above, which older result files hold alone
            out["cpu_model"] = self.cpu_model
            out["cpu_features"] = list(self.cpu_features)
        return out


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
