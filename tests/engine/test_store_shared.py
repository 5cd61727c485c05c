"""One module store folder shared by several processes (studio workers behind a router, docs/scale-out.md): two
processes saving the same entries at once leave one valid file each, and a third reading them meanwhile never
finds one half-written (a save is written aside and renamed into place: engine/files.save_whole)."""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from engine.cache.store import DiskStore
from engine.kv import ModuleKV
from tests.conftest import ROOT

ROUNDS = 40
WRITER = """
import sys, time, torch
from pathlib import Path
from engine.cache.store import DiskStore
from engine.kv import ModuleKV

folder, go, rounds, me = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
disk = DiskStore(folder)
entry = ModuleKV(torch.ones(1, 2, 2, 512, 64), torch.arange(512), torch.arange(512))  # 1 MiB: a write takes a while
(go.parent / f"ready-{me}").touch()
while not go.exists():
    time.sleep(0.0005)
for i in range(rounds):  # each key saved by both writers at one time: each waits at the key for the other
    (go.parent / f"at-{me}-{i}").touch()
    while not (go.parent / f"at-{1 - me}-{i}").exists():
        time.sleep(0.0002)
    assert disk.save(f"k{i}", entry), disk.last_error
print(disk.writes)
"""
READER = """
import sys, time
from pathlib import Path
from engine.cache.store import DiskStore

folder, go, rounds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
disk = DiskStore(folder)
while not go.exists():
    time.sleep(0.0005)
seen = 0
until = time.monotonic() + 120
while seen < rounds and time.monotonic() < until:
    for i in range(rounds):
        if disk.has(f"k{i}"):
            assert disk.load(f"k{i}") is not None, disk.last_error  # whole, or not there: never half of one
            seen = max(seen, i + 1)
print(disk.corrupt + disk.unreadable)
"""


def test_two_processes_saving_one_entry_at_once_leave_one_valid_file_a_reader_never_sees_half(tmp_path):
    folder, go = tmp_path / "modules", tmp_path / "go"
    args = [str(folder), str(go), str(ROUNDS)]
    procs = [subprocess.Popen([sys.executable, "-c", code, *args, str(me)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for me, code in enumerate((WRITER, WRITER, READER))]
    try:
        until = time.monotonic() + 120
        while not all((tmp_path / f"ready-{me}").exists() for me in (0, 1)) and time.monotonic() < until:
            time.sleep(0.01)  # both writers started: neither has a head start
        go.touch()
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    writes = [int(out) for out, _ in outs[:2]]
    assert sum(writes) > ROUNDS, writes  # some keys were written by both: the race was run
    assert int(outs[2][0]) == 0  # the reader found no damaged file
    entries = sorted(p.name for p in folder.iterdir())
    assert entries == sorted(f"k{i}.safetensors" for i in range(ROUNDS))  # one file a key, no temporary left
    disk = DiskStore(folder)
    want = ModuleKV(torch.ones(1, 2, 2, 512, 64), torch.arange(512), torch.arange(512))
    for i in range(ROUNDS):
        got = disk.load(f"k{i}")
        assert got is not None and torch.equal(got.kv, want.kv) and torch.equal(got.token_ids, want.token_ids)
    assert disk.corrupt == 0
