"""The C++ decoder's ``enum class Kernel`` (csrc/decode_step.cpp) and the Python ``Kernel`` name the same values."""

from __future__ import annotations

import re

import pytest

from engine.model import kernels
from engine.model.kernels import Kernel


def cpp_kernel_enum() -> dict[str, int]:
    """``enum class Kernel``'s names (upper case) and values, read from the C++ source."""
    text = (kernels.SOURCES[0].parent / "decode_step.cpp").read_text()
    body = re.search(r"enum class Kernel\s*:\s*int64_t\s*\{([^}]*)\}", text).group(1)
    pairs = [re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", item).groups() for item in body.split(",") if item.strip()]
    return {name.upper(): int(value) for name, value in pairs}


def test_the_cpp_source_and_the_python_enum_agree():
    assert cpp_kernel_enum() == {k.name: k.value for k in Kernel}


@pytest.mark.skipif(kernels.ops() is None, reason=kernels.status())
def test_the_built_module_exports_the_same_enum():
    built = {name.upper(): int(value) for name, value in kernels.ops().Kernel.__members__.items()}
    assert built == {k.name: k.value for k in Kernel}
