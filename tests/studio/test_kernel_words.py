"""The studio words a model's weight kernels from the engine's data (engine.model.KernelUse, ``info()``'s
``weight_kernel_use``): the same sentences ``pml-studio info`` and the Model tab said before the engine gave data."""

from __future__ import annotations

from dataclasses import asdict

from engine.model import KernelUse
from studio.kernel_words import info_words, weight_kernels

ENGINE = "the engine's AVX-512 VNNI kernels"


def test_each_use_has_its_sentence():
    said = {use: weight_kernels(asdict(use), ENGINE, 64) for use in
            (KernelUse(), KernelUse(10, 10, True), KernelUse(10, 0, True), KernelUse(10, 4, True))}
    assert said == {
        KernelUse(): "torch's dense matrix products",
        KernelUse(10, 10, True): ENGINE,
        KernelUse(10, 0, True): "torch's kernels (no layer has a multiple of 64 rows, as the engine's need)",
        KernelUse(10, 4, True): f"{ENGINE} for 4 of 10 layers, torch's for the rest (rows not a multiple of 64)"}


def test_kernels_that_are_not_built_say_why():
    why = "torch's kernels (PML_STUDIO_KERNELS=0)"
    assert weight_kernels(asdict(KernelUse(10, 0, False)), why, 64) == why


def test_info_words_adds_the_field_the_engine_gives_as_data():
    info = {"weights": "fp32", "weight_kernel_use": asdict(KernelUse())}
    assert info_words(info) == {"weight_kernels": "torch's dense matrix products"}
