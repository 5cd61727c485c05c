"""What both servers (the studio and `pml-studio api`) do before they listen: check the address, keep files private;
and the studio's private temporary folder, made at its start and removed at the next start if it was killed."""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from engine.public import check_trusted, process_alive

TEMP_PREFIX = "pml-studio-"
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"(\d+)-[a-z0-9_]{8}")  # its pid, then mkdtemp's eight characters


def keep_private() -> None:
    """Files made from now on are the user's alone (0600, folders 0700): they hold prompts, documents and answers."""
    os.umask(0o077)



def check_address(host: str) -> None:
    """OSError naming ``host`` when this machine cannot serve on it (before any port is tried)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise OSError(f"cannot serve on --host {host}: not an address or a name this machine knows ({err}); "
                      "use --host 127.0.0.1 (this machine only)") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address[0], 0))
        except OSError as err:
            raise OSError(f"cannot serve on --host {host}: it is not an address of this machine ({err.strerror}); "
                          "use --host 127.0.0.1 (this machine only)") from None


def private_temp() -> Path:
    """The studio's temporary folder (0700): downloads, exports and Gradio's own cache, which would otherwise go to
    /tmp/gradio, readable by every account. Set before the Blocks are built: components read it when made. Its
    name holds the studio's pid, so that the next start removes it if the studio was killed (SIGKILL) with it."""
    remove_dead_temps(Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
    check_trusted(folder, "temporary folder", "set TMPDIR to a folder of yours (or leave it unset for /tmp)")
    (folder / "gradio").mkdir(mode=0o700)
    os.environ["GRADIO_TEMP_DIR"] = str(folder / "gradio")
    return folder


def remove_dead_temps(top: Path) -> list[Path]:
    """Remove from ``top`` the folders :func:`private_temp` made for studios that are gone: this user's own, and
    only those whose process no longer runs; return them."""
    removed = []
    try:
        entries = list(os.scandir(top))
    except OSError:
        return removed
    for entry in entries:
        named = _TEMP_NAME.fullmatch(entry.name)
        try:
            if named is None or not entry.is_dir(follow_symlinks=False) or \
                    entry.stat(follow_symlinks=False).st_uid != os.getuid() or process_alive(int(named.group(1))):
                continue
            shutil.rmtree(entry.path)
            removed.append(Path(entry.path))
        except OSError:  # another account's, or removed meanwhile: not ours to report
            pass
    return removed
