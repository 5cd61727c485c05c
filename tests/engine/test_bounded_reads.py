"""Input files are read within a size limit (issue 37, items 5 and 7): a device, a folder, a file over its limit or a
GGUF header nested too deep is a named error (exit 2, no traceback), never an endless read or a RecursionError."""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
import threading
import time

import pytest

from conftest import ROOT, SAMPLES
from engine.cli import main
from engine.errors import EngineError

SCHEMA, PROMPT = str(SAMPLES / "travel.xml"), str(SAMPLES / "travel.prompt.xml")
LIMIT_MIB = 5  # schemas, prompts and programs (engine.files.DOCUMENT_BYTES)


def run_limited(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a child with 2 GiB of data memory: an unbounded read of /dev/zero fails there in seconds instead
    of filling the machine."""
    def limit():
        resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))

    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)


# -- the CLI ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, what", [(("check", "/dev/zero"), "schema or prompt"),
                                        (("layout", "/dev/zero"), "schema"),
                                        (("run", "/dev/zero", PROMPT), "schema"),
                                        (("run", SCHEMA, "/dev/zero"), "prompt"),
                                        (("compile", "/dev/zero"), "program")])
def test_an_endless_file_is_refused_by_name(args, what):
    r = run_limited(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"/dev/zero: is a device, not a {what} file" in r.stderr


@pytest.mark.parametrize("command", ["check", "layout", "run-schema", "run-prompt", "compile"])
def test_a_file_over_the_limit_is_refused_before_anything_loads(tmp_path, capsys, command):
    big = tmp_path / ("big.py" if command == "compile" else "big.xml")
    big.write_bytes(b"#" * (LIMIT_MIB * 2**20 + 1))
    args = {"check": ["check", str(big)], "layout": ["layout", str(big)], "run-schema": ["run", str(big), PROMPT],
            "run-prompt": ["run", SCHEMA, str(big)], "compile": ["compile", str(big)]}[command]
    assert main(args) == 2
    assert f"{big}: larger than {LIMIT_MIB} MiB, the limit for a " in capsys.readouterr().err


def test_a_folder_given_as_a_program_is_named_a_folder(tmp_path, capsys):
    assert main(["compile", str(tmp_path)]) == 2
    assert f"{tmp_path}: is a folder, not a program file" in capsys.readouterr().err


# -- the reader -----------------------------------------------------------------------------------

def test_a_pipe_is_read_whole_or_refused_at_the_limit(tmp_path):
    from engine.files import read_text

    fifo = tmp_path / "fifo"
    for payload, limit in ((b"<schema name='s'/>", 1000), (b"x" * (1 << 20), 1000)):
        os.mkfifo(fifo)
        writer = threading.Thread(target=_write_ignoring_a_closed_reader, args=(fifo, payload))
        writer.start()
        try:
            if len(payload) <= limit:
                assert read_text(fifo, "schema", limit) == payload.decode()
            else:
                with pytest.raises(EngineError, match=f"{fifo}: larger than 1000 bytes, the limit for a schema file"):
                    read_text(fifo, "schema", limit)
        finally:
            writer.join(timeout=30)
            fifo.unlink()


def test_check_refuses_a_pipe_nothing_writes_to_at_once(tmp_path, capsys):
    """`pml-studio check FIFO` with no writer waited forever (as `cat` does); now it is refused after
    PIPE_WAIT_S with a named error (a pipe with a writer is still read: the test above)."""
    import engine.files

    fifo, wait_s = tmp_path / "fifo", getattr(engine.files, "PIPE_WAIT_S", 3.0)
    os.mkfifo(fifo)
    done: list[int] = []
    checker = threading.Thread(target=lambda: done.append(main(["check", str(fifo)])), daemon=True)
    checker.start()
    start = time.monotonic()
    checker.join(wait_s + 10)
    if checker.is_alive():  # main's endless wait: let it go before failing
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        checker.join(10)
    assert done == [2], "check waited for a writer"
    assert f"{fifo}: is a pipe that nothing wrote to within {wait_s:g} s" in capsys.readouterr().err
    assert time.monotonic() - start < wait_s + 5


def _write_ignoring_a_closed_reader(path, payload: bytes) -> None:
    try:
        with open(path, "wb") as f:
            f.write(payload)
    except BrokenPipeError:  # the reader stopped at its limit
        pass


def test_text_that_is_not_utf8_names_its_line(tmp_path, capsys):
    bad = tmp_path / "bad.xml"
    bad.write_bytes(b"<schema name='s'>\n<module name='m'>caf\xe9</module>\n</schema>")
    assert main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{bad}:2:1: error: ") and "not UTF-8 text" in err and "save it as UTF-8" in err


# -- model folders ------------------------------------------------------------------------------

def model_folder(tmp_path, name: str, size: int):
    """A model folder whose ``name`` is a sparse file of ``size`` bytes (no disk is used)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with open(folder / name, "wb") as f:
        f.truncate(size)
    return folder


@pytest.mark.parametrize("name, limit_mib", [("tokenizer.json", 64), ("tokenizer_config.json", 16),
                                             ("chat_template.jinja", 1)])
def test_a_model_file_over_its_limit_is_refused_before_transformers_reads_it(tmp_path, capsys, name, limit_mib):
    folder = model_folder(tmp_path, name, limit_mib * 2**20 + 1)
    assert main(["layout", SCHEMA, "--model", str(folder)]) == 2
    assert f"{folder / name}: larger than {limit_mib} MiB, the limit for a {name} file" in capsys.readouterr().err


def test_a_model_config_that_is_a_device_is_never_read(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").symlink_to("/dev/zero")
    r = run_limited("layout", SCHEMA, "--model", str(folder))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{folder / 'config.json'}: is a device, not a config.json file" in r.stderr


# -- GGUF metadata --------------------------------------------------------------------------------

def nested_gguf(path, depth: int):
    """A GGUF v3 header: general.architecture, then a key whose value nests ``depth`` arrays, no tensors."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    arrays = [struct.pack("<IQ", 9, 1)] * (depth - 1) + [struct.pack("<IQ", 4, 0)]  # (item type, count) each
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + string("general.architecture") + struct.pack("<I", 8)
                     + string("llama") + string("tokenizer.nested") + struct.pack("<I", 9) + b"".join(arrays))
    return path


def test_gguf_metadata_nested_thousands_deep_is_refused_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path / "cache"))
    bomb = nested_gguf(tmp_path / "deep.gguf", 5000)
    assert main(["info", "--model", str(bomb)]) == 2
    err = capsys.readouterr().err
    assert f"GGUF file {bomb}: metadata key 'tokenizer.nested' nests arrays deeper than 8" in err
    assert "not a model GGUF" in err


def test_gguf_metadata_nests_eight_arrays_and_no_more(tmp_path):
    import mmap

    from engine.errors import ModelError
    from engine.model.gguf import _HeaderReader

    for depth in (2, 8, 9):
        path = nested_gguf(tmp_path / f"d{depth}.gguf", depth)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            reader = _HeaderReader(blob, str(path))
            if depth <= 8:
                assert reader.metadata(lambda key: True)["general.architecture"] == "llama"
            else:
                with pytest.raises(ModelError, match="nests arrays deeper than 8"):
                    reader.metadata(lambda key: True)
