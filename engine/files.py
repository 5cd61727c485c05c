"""Files read from paths a user gives, within a size limit; files the engine saves, whole or not at all."""

from __future__ import annotations

import os
import re
import select
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Callable

from engine.devices import process_alive
from engine.errors import InputFileError

MiB = 1 << 20
_SAVING = re.compile(r"\..+\.(\d+)\.\d+\.tmp")  # .NAME.PID.THREAD.tmp: one save's folder (a file, before)
_WRITER_TEMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")  # safetensors' own temporary file, left by older versions
STALE_SAVE_S = 3600  # a save this old is a killed one, whatever its process id says now
PIPE_WAIT_S = 3.0  # a named pipe's writer has this long to send its first bytes (or close)
DOCUMENT_BYTES = 5 * MiB  # a schema, prompt or prompt program
MODEL_FILE_BYTES = {  # Gemma 3's tokenizer.json, the largest seen, is 33 MiB
    "config.json": 1 * MiB, "generation_config.json": 1 * MiB, "chat_template.jinja": 1 * MiB,
    "chat_template.json": 1 * MiB, "special_tokens_map.json": 16 * MiB, "added_tokens.json": 16 * MiB,
    "tokenizer_config.json": 16 * MiB, "tokenizer.json": 64 * MiB, "vocab.json": 64 * MiB, "vocab.txt": 64 * MiB,
    "merges.txt": 64 * MiB, "tokenizer.model": 64 * MiB, "spiece.model": 64 * MiB,
}


def read_text(path: str | Path, what: str, limit: int = DOCUMENT_BYTES, fix: str = "") -> str:
    """The UTF-8 text of the ``what`` file at ``path``, or InputFileError."""
    data = read_bytes(path, what, limit, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise InputFileError(f"{path}:{line}:1: error: the {what} file is not UTF-8 text ({err.reason} at byte "
                             f"{err.start}); save it as UTF-8") from None


def read_bytes(path: str | Path, what: str, limit: int, fix: str = "") -> bytes:
    """At most ``limit`` bytes of the regular file or pipe at ``path`` (a pipe that nothing writes to within
    :data:`PIPE_WAIT_S` seconds is refused)."""
    try:
        mode = os.stat(path).st_mode
        _check_kind(path, what, mode, fix, pipes=True)  # a device is never opened
        f = _open_pipe(path, what) if stat.S_ISFIFO(mode) else open(path, "rb")
    except OSError as err:
        raise _unreadable(path, what, err) from None
    with f:
        _check_kind(path, what, os.fstat(f.fileno()).st_mode, fix, pipes=True)  # it may have changed
        try:
            data = f.read(limit + 1)
        except OSError as err:
            raise _unreadable(path, what, err) from None
    if len(data) > limit:
        raise _too_large(path, what, limit, fix)
    return data


def check_file(path: str | Path, what: str, limit: int, fix: str = "") -> None:
    """InputFileError unless ``path`` is a regular file of at most ``limit`` bytes."""
    try:
        st = os.stat(path)
    except OSError as err:
        raise _unreadable(path, what, err) from None
    _check_kind(path, what, st.st_mode, fix, pipes=False)
    if st.st_size > limit:
        raise _too_large(path, what, limit, fix)


def check_model_folder(folder: str | Path) -> None:
    """Check the files transformers reads whole."""
    fix = "a model folder holds config.json, the weights and the tokenizer's files; check the folder's files"
    for name, limit in MODEL_FILE_BYTES.items():
        path = Path(folder) / name
        if os.path.lexists(path):
            check_file(path, name, limit, fix)


def save_whole(target: Path, write: Callable[[Path], None]) -> None:
    """Make the file ``target`` with ``write(path)``, whole or not at all: ``write`` writes into a folder of this
    save's own beside ``target`` (the writer's temporary files land there too: safetensors makes a ``.tmpXXXXXX``
    beside the file it writes), the file is renamed into place, the folder removed. A killed save leaves only that
    folder, which :func:`remove_killed_saves` removes. OSError when the disk refuses."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    work = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        work.mkdir(mode=0o700)
        write(work / target.name)
        os.replace(work / target.name, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def remove_killed_saves(folder: Path, stale_s: float = STALE_SAVE_S) -> list[Path]:
    """Remove from ``folder`` what killed saves left: the folders (or files) of :func:`save_whole` whose process
    is gone or that are older than ``stale_s``, and writers' temporary files older than that; return them."""
    try:
        found = [p for p in folder.iterdir() if p.name.startswith(".")]
    except OSError:
        return []
    removed = []
    for path in found:
        saving = _SAVING.fullmatch(path.name)
        if saving is None and not _WRITER_TEMP.fullmatch(path.name):
            continue
        try:
            age = time.time() - path.lstat().st_mtime
            if age <= stale_s and (saving is None or process_alive(int(saving.group(1)))):
                continue
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            removed.append(path)
        except OSError:
            pass
    return removed


def size_text(n: int) -> str:
    """``n`` bytes in words: '5 MiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} bytes"


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def _open_pipe(path, what: str):
    """The pipe at ``path`` opened for reading once its writer has sent something or closed; InputFileError after
    :data:`PIPE_WAIT_S` seconds without a writer (a plain open would wait for one forever)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # returns at once, writer or not
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN | select.POLLHUP)
        if not poll.poll(PIPE_WAIT_S * 1000):
            raise InputFileError(f"{path}: is a pipe that nothing wrote to within {PIPE_WAIT_S:g} s; give the path "
                                 f"of a {what} file (or write to the pipe first)")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_kind(path, what: str, mode: int, fix: str, pipes: bool) -> None:
    if stat.S_ISREG(mode) or (pipes and stat.S_ISFIFO(mode)):
        return
    kind = "a folder" if stat.S_ISDIR(mode) else _special(mode)
    raise InputFileError(f"{path}: is {kind}, not a {what} file; {fix or 'give the path of a file'}")


def _special(mode: int) -> str:
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file"


def _too_large(path, what: str, limit: int, fix: str) -> InputFileError:
    return InputFileError(f"{path}: larger than {size_text(limit)}, the limit for a {what} file; "
                          f"{fix or 'is it the right file? Split a large one into smaller files'}")


def _unreadable(path, what: str, err: OSError) -> InputFileError:
    if isinstance(err, FileNotFoundError):
        return InputFileError(f"{path}: no such file")
    if isinstance(err, IsADirectoryError):
        return InputFileError(f"{path}: is a folder, not a {what} file; give the path of a file")
    return InputFileError(f"{path}: cannot read the {what} file: {err.strerror or err}")
