"""The module store heals itself (issue 37, items 4 and 6): a stored entry whose header was changed is re-encoded with
a note, never a traceback, and the temporary files of killed saves are removed when the store opens."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from engine.arms.registry import Sampling
from engine.cache.store import DiskStore
from engine.cli import main
from engine.kv import QuantKV
from engine.session import Engine
from test_module_memory import PROMPT, SCHEMA

FIELDS = ("bits", "key_group", "value_group")


def edit_header(path, **fields) -> None:
    """Rewrite the safetensors file at ``path`` with manifest ``fields`` changed (tensors unchanged)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    meta.update({k: v for k, v in fields.items() if v is not None})
    for k in [k for k, v in fields.items() if v is None]:
        meta.pop(k, None)
    save_file(tensors, str(path), metadata=meta)


def changed(field: str, value: str) -> str:
    """A value of ``field`` that misreads the entry: the other bit width, or half the group."""
    return {"bits": "4" if value == "8" else "8"}.get(field, str(max(1, int(value) // 2)))


def quantized_entry(tiny_lm, folder):
    """(engine, store key, file) of module d1 stored as int8 in ``folder``."""
    eng = Engine.from_loaded(tiny_lm, persist=True, module_dir=folder, storage_dtype="int8")
    eng.compare(SCHEMA, PROMPT, Sampling(2))
    key = eng.encode(eng.layout(SCHEMA)).encoded.module_keys["d1"]
    return eng, key, folder / f"{key}.safetensors"


@pytest.mark.parametrize("field", FIELDS)
def test_an_edited_header_field_is_re_encoded_with_a_note(tiny_lm, tmp_path, field):
    eng, key, path = quantized_entry(tiny_lm, tmp_path / "modules")
    edit_header(path, **{field: changed(field, eng.store().disk.manifest(key)[field])})
    again = Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "modules", storage_dtype="int8")
    c = again.compare(SCHEMA, PROMPT, Sampling(2))
    assert c.encode["encoded"] == 1 and c.store.stats["disk_corrupt"] == 1
    assert c.store.stats["disk_note"] == (f"module file {path.name} could not be used (its header's checksum does "
                                          "not match: a field was changed); it will be re-encoded")
    fresh = Engine.from_loaded(tiny_lm, storage_dtype="int8").compare(SCHEMA, PROMPT, Sampling(2))
    assert torch.equal(c.cached.first_logits, fresh.cached.first_logits)  # the re-encoded entry, not the edited one
    assert again.store().disk.manifest(key)[field] == eng.store().disk.manifest(key)[field]  # written anew


@pytest.mark.parametrize("field", FIELDS)
def test_an_entry_from_before_the_header_checksum_is_checked_against_its_shapes(tiny_lm, tmp_path, field):
    eng, key, path = quantized_entry(tiny_lm, tmp_path / "modules")
    disk = DiskStore(tmp_path / "modules")
    edit_header(path, header_sha256=None)  # as written before the header had its checksum
    assert isinstance(disk.load(key), QuantKV) and disk.corrupt == 0  # such entries still load
    edit_header(path, **{field: changed(field, eng.store().disk.manifest(key)[field])})
    assert disk.load(key) is None and disk.corrupt == 1 and not path.exists()
    assert disk.note.startswith(f"module file {path.name} could not be used (") and field in disk.note


def test_the_cli_re_encodes_an_edited_entry_prints_a_note_and_exits_0(tiny_lm, tmp_path, monkeypatch, capsys):
    folder = tmp_path / "tiny"
    tiny_lm.model.save_pretrained(folder)
    tiny_lm.tokenizer.save_pretrained(folder)
    (tmp_path / "mem.xml").write_text(SCHEMA)
    (tmp_path / "mem.prompt.xml").write_text(PROMPT)
    monkeypatch.setenv("PML_STUDIO_MODULES", str(tmp_path / "modules"))
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path / "cache"))
    run = ["run", str(tmp_path / "mem.xml"), str(tmp_path / "mem.prompt.xml"), "--model", str(folder),
           "--storage-dtype", "int8", "--max-new-tokens", "2", "--arms", "cached", "--json"]
    assert main(run) == 0
    assert "note:" not in capsys.readouterr().err
    files = sorted((tmp_path / "modules").glob("*.safetensors"))
    quantized = [p for p in files if DiskStore(p.parent).manifest(p.stem).get("bits") == "8"]
    assert quantized
    edit_header(quantized[0], bits="4")
    assert main(run) == 0
    err = capsys.readouterr().err
    assert f"pml-studio: note: module file {quantized[0].name} could not be used" in err and "Traceback" not in err
    assert DiskStore(tmp_path / "modules").manifest(quantized[0].stem)["bits"] == "8"  # re-encoded and saved


# -- temporary files of killed saves --------------------------------------------------------------

KILLED = """
import os, sys, torch
import safetensors.torch
from engine.cache.store import DiskStore
from engine.kv import ModuleKV

real = safetensors.torch.save_file
def save_then_die(*args, **kwargs):
    real(*args, **kwargs)
    os.kill(os.getpid(), 9)  # killed between the write and the rename, as by the OOM killer
safetensors.torch.save_file = save_then_die
DiskStore(sys.argv[1]).save("k", ModuleKV(torch.zeros(1, 2, 1, 3, 4), torch.arange(3), torch.arange(3)))
"""


def test_a_killed_save_leaves_a_temporary_file_the_next_store_removes(tmp_path):
    folder = tmp_path / "modules"
    killed = subprocess.run([sys.executable, "-c", KILLED, str(folder)], cwd=ROOT, capture_output=True, timeout=120)
    assert killed.returncode == -9, killed.stderr
    (left,) = folder.iterdir()
    assert left.name.startswith(".k.safetensors.") and left.name.endswith(".tmp")
    disk = DiskStore(folder)
    assert list(folder.iterdir()) == [] and disk.removed_temps == [left]


KILLED_WHILE_WRITING = """
import os, sys, threading, time, torch
from engine.cache.store import DiskStore
from engine.kv import ModuleKV

folder = sys.argv[1]
entry = ModuleKV(torch.ones(1, 2, 2, 1 << 16, 64), torch.arange(1 << 16), torch.arange(1 << 16))  # 64 MiB
saving = threading.Thread(target=DiskStore(folder).save, args=("k", entry), daemon=True)
saving.start()
while not any(n.startswith(".tmp") for _, _, names in os.walk(folder) for n in names):
    if not saving.is_alive():
        sys.exit(3)  # the write ended before it was seen
    time.sleep(0.0005)
os.kill(os.getpid(), 9)  # safetensors has made its own temporary file and writes into it
"""


def test_a_save_killed_while_safetensors_writes_leaves_nothing_after_the_next_start(tmp_path):
    """safetensors writes into a temporary file of its own (.tmpXXXXXX beside the file it is asked for): a save
    killed then left it in the store's folder forever; now it is inside the save's own folder, removed at start."""
    folder = tmp_path / "modules"
    killed = subprocess.run([sys.executable, "-c", KILLED_WHILE_WRITING, str(folder)], cwd=ROOT, capture_output=True,
                            timeout=120)
    assert killed.returncode == -9, killed.stderr
    left = [p for p in folder.rglob("*")]
    assert any(p.name.startswith(".tmp") for p in left), left  # killed mid-write indeed
    DiskStore(folder)
    assert list(folder.iterdir()) == []


def test_a_writers_temporary_file_left_by_an_older_version_goes_once_stale(tmp_path):
    folder = tmp_path / "modules"
    folder.mkdir()
    old, new = folder / ".tmpA1b2C3", folder / ".tmpZ9y8X7"
    for path in (old, new):
        path.write_bytes(b"x" * 100)
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    DiskStore(folder)
    assert list(folder.iterdir()) == [new]  # a recent one may be another studio's save under way


def test_only_the_temporary_files_of_gone_processes_are_removed(tmp_path):
    folder = tmp_path / "modules"
    folder.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    names = {"dead": f".a.safetensors.{gone.pid}.1.tmp", "live": f".b.safetensors.{os.getpid()}.2.tmp",
             "old": f".c.safetensors.{os.getpid()}.3.tmp", "other": ".notes.tmp", "entry": "d.safetensors"}
    for name in names.values():
        (folder / name).write_bytes(b"x")
    hours_ago = time.time() - 2 * 3600
    os.utime(folder / names["old"], (hours_ago, hours_ago))  # a live pid's file this old: a reused pid's
    DiskStore(folder)
    assert sorted(p.name for p in folder.iterdir()) == sorted([names["live"], names["other"], names["entry"]])
