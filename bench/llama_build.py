"""Which llama.cpp build .peers/llama holds, and whether it can run here: llama.cpp's native build runs its AMX
kernels on a CPU with AMX, and there its first prefill segfaults (issue 46); `make peers` builds it without AMX on
such a CPU. The peers' scripts ask :func:`refusal` before they start it (and run it in its own process)."""

from __future__ import annotations

import subprocess
from pathlib import Path

AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
CHECK = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode(errors='replace'))"


def cpu_has_amx() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return any(f in flags for f in AMX_FLAGS)


def system_info(python: Path) -> str:
    done = subprocess.run([str(python), "-c", CHECK], capture_output=True, text=True, timeout=300)
    return done.stdout.strip()


def refusal(python: Path) -> str:
    """Why the build of ``python``'s llama-cpp-python must not run here ("" when it may)."""
    if not python.exists() or not cpu_has_amx():
        return ""
    info = system_info(python)
    if "AMX_INT8 = 1" in info or "AMX = 1" in info:
        return ("llama.cpp in .peers/llama was built with its AMX kernels, whose prefill segfaults on this AMX CPU; "
                "rebuild it without them: rm -rf .peers/llama && make peers")
    return ""
