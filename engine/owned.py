"""Folders and files the engine writes, or loads code and data from: the user's own, or refused.

As ssh checks its keys and git its ``safe.directory``: a path is trusted when it and every folder above it belong to
this user (or root) and no other account can write to them. A folder others may write to is passed over only above
the path and only when it has the sticky bit and a trusted owner (``/tmp``): there, nobody else can rename or remove
what the user made. A symlink is followed only when a trusted account made it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from engine.errors import StorageError

MAX_LINKS = 40  # symlinks followed along one path, as the kernel's ELOOP limit


class ForeignPathError(StorageError):
    """A path another account controls, or one that other accounts can write to; the message names it and the fix."""


def trusted_owners() -> set[int]:
    """This process's user and root."""
    return {os.geteuid(), 0}


def private_folder(path: str | Path, what: str, fix: str = "") -> Path:
    """``path`` made where missing (each new folder 0700) and checked with :func:`check_trusted`; returned as given."""
    path = Path(path)
    check_trusted(path, what, fix, missing_ok=True)  # before making anything inside another account's folder
    for folder in reversed([path, *path.parents]):
        if not os.path.lexists(folder):
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:  # made meanwhile: its owner is checked below
                pass
            except OSError as err:
                raise StorageError(f"cannot make the {what} {folder}: {err.strerror or err}; "
                                   f"{fix or 'choose a folder of yours'}") from None
    check_trusted(path, what, fix)
    if not path.is_dir():
        raise StorageError(f"the {what} {path} is not a folder; {fix or 'choose a folder of yours'}")
    return path


def check_trusted(path: str | Path, what: str, fix: str = "", missing_ok: bool = False) -> None:
    """ForeignPathError unless ``path`` and every folder above it belong to this user or root and no other account
    can write to them (a sticky folder above the path excepted); with ``missing_ok``, the part that exists."""
    fix = fix or "choose a folder of yours"
    trusted = trusted_owners()
    parts = list(Path(os.path.abspath(path)).parts)
    here, links = Path(parts[0]), 0
    index = 1
    while True:
        try:
            st = os.lstat(here)
        except (FileNotFoundError, NotADirectoryError):
            if missing_ok:  # nothing there yet (or a file in the way: the first write says so)
                return
            raise
        last = index == len(parts)
        if st.st_uid not in trusted:
            raise ForeignPathError(f"the {what} {path} is not yours: {_where(here, path)}belongs to another account "
                                   f"(uid {st.st_uid}), which could change what the studio loads or read what it "
                                   f"writes; {fix}")
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise ForeignPathError(f"the {what} {path}: too many symbolic links; {fix}")
            target = Path(os.readlink(here))
            rest = parts[index:]
            parts = list((here.parent / target).parts) + rest if not target.is_absolute() else \
                list(target.parts) + rest
            parts = list(Path(os.path.normpath(Path(*parts))).parts)
            here, index = Path(parts[0]), 1
            continue
        if st.st_mode & 0o022 and not (not last and st.st_mode & stat.S_ISVTX and stat.S_ISDIR(st.st_mode)):
            raise ForeignPathError(f"the {what} {path} is not private: {_where(here, path)}can be written by other "
                                   f"accounts (mode {stat.S_IMODE(st.st_mode):04o}), who could change what the studio "
                                   f"loads; run chmod go-w {here}, or {fix}")
        if last:
            return
        here = here / parts[index]
        index += 1


def check_own_file(path: str | Path, what: str, fix: str = "") -> None:
    """:func:`check_trusted` for a file that must be this user's own (root's is not enough: the run log, a library
    about to be loaded)."""
    check_trusted(path, what, fix)
    owner = os.stat(path).st_uid
    if owner != os.geteuid():
        raise ForeignPathError(f"the {what} {path} belongs to uid {owner}, not to you (uid {os.geteuid()}); "
                               f"{fix or 'choose a file of yours'}")


def create_private(path: str | Path) -> bool:
    """Make the empty file ``path`` (0600), only if nothing is there (``O_EXCL``: a file another account made, or a
    symlink, is never opened); False when something already is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return False
    os.close(fd)
    return True


def _where(here: Path, path) -> str:
    """'' when ``here`` is the path itself, else which folder above it."""
    return "" if os.path.abspath(here) == os.path.abspath(path) else f"{here} "
