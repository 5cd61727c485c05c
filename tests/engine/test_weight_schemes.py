"""One class per weight layout (engine/model/weights.py): ``pack_linear(linear, kind)`` builds the class the scheme
and the kernels pick, and ``kernel_use`` reports as data which kernels multiply a packed model."""

from __future__ import annotations

import pytest
import torch

from engine.model import KernelUse, kernels
from engine.model.weights import (Bf16Linear, Int4Linear, Int8Linear, pack_linear, TorchInt4Linear,
                                  TorchInt8Linear, kernel_use)

built = kernels.ops() is not None


@pytest.mark.parametrize("kind,engine,torch_cls", [("int8", Int8Linear, TorchInt8Linear),
                                                   ("int4", Int4Linear, TorchInt4Linear),
                                                   ("bf16", Bf16Linear, Bf16Linear)])
def test_the_scheme_and_the_kernels_pick_the_class(kind, engine, torch_cls, monkeypatch):
    linear = torch.nn.Linear(64, 128)
    assert type(pack_linear(linear, kind)) is (engine if built else torch_cls)
    monkeypatch.setitem(kernels._state, "ops", None)
    assert type(pack_linear(linear, kind)) is torch_cls
    assert type(pack_linear(torch.nn.Linear(64, 80), kind)) is torch_cls  # 80 rows: not the engine's tiles


def test_kernel_use_counts_the_packed_layers():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 80), torch.nn.Linear(80, 64))
    for i, layer in enumerate(model):
        model[i] = pack_linear(layer, "int8")
    own = 2 if built else 0  # 128 and 64 rows tile; 80 do not
    assert kernel_use(model) == KernelUse(packed=3, own=own, built=built)
    assert kernel_use(torch.nn.Sequential(pack_linear(torch.nn.Linear(64, 64), "bf16"))) == KernelUse()
