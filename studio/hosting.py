"""What both servers (the studio and `pml-studio api`) do before they listen: check the address, keep files private."""

from __future__ import annotations

import os
import socket


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
