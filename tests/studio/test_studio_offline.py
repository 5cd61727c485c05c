"""No network at start: the studio, served as `make run` serves it, opens no socket to a non-loopback address
and looks up no host name but its own.

The studio runs in a child process whose socket layer refuses (and records) every connection to or name
lookup of anything but loopback, before any byte leaves. A control run with Gradio's analytics switched
back on shows the hook sees the lookups the studio now avoids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT
from tests.conftest import free_port

CHILD = textwrap.dedent("""
    import ipaddress, json, socket, sys, time, urllib.request
    LOCAL = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "", None}
    seen = {"foreign": [], "loopback": 0}

    def local(host):
        if host in LOCAL:
            return True
        try:
            return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
        except ValueError:
            return False

    def guard(host, what):
        if local(host):
            seen["loopback"] += 1
            return
        seen["foreign"].append(f"{what} {host}")
        raise OSError(f"network refused by the test: {what} {host}")

    real_getaddrinfo, real_connect, real_connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex
    def getaddrinfo(host, *a, **k):
        guard(host if not isinstance(host, bytes) else host.decode(), "lookup")
        return real_getaddrinfo(host, *a, **k)
    def addr_host(addr):
        return addr[0] if isinstance(addr, tuple) else None  # AF_UNIX paths are local
    def connect(self, addr):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            guard(addr_host(addr), "connect")
        return real_connect(self, addr)
    def connect_ex(self, addr):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            guard(addr_host(addr), "connect")
        return real_connect_ex(self, addr)
    socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex = getaddrinfo, connect, connect_ex

    from studio.launch import StudioOptions, serve
    port = int(sys.argv[1])
    # preload off: exiting during a background load aborts the process
    demo = serve(StudioOptions(port=port, preload=False, token="offline-test-token-0123"), block=False)
    page = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Authorization": "Bearer offline-test-token-0123"})
    with urllib.request.urlopen(page, timeout=30) as resp:
        assert resp.status == 200
    time.sleep(3)  # background threads of a launch (analytics, version checks) have had their chance
    demo.close()
    print("SEEN " + json.dumps(seen), flush=True)
""")


def run_studio(tmp_path, **env) -> dict:
    from engine.devices import cache_root

    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(cache_root() / "models")  # the converted default model, not a new copy
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("GRADIO_", "HF_HUB", "DO_NOT_TRACK"))}
    child_env.update(PML_STUDIO_CACHE=str(cache), PYTHONPATH=str(ROOT), **env)
    out = subprocess.run([sys.executable, "-c", CHILD, str(free_port())], capture_output=True, text=True,
                         timeout=240, cwd=ROOT, env=child_env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("SEEN ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1][5:])


@pytest.mark.real_model
def test_studio_start_makes_no_network_call(tmp_path):
    seen = run_studio(tmp_path)
    assert seen["loopback"] > 0  # the hook is live: the page was fetched through it
    assert seen["foreign"] == []


@pytest.mark.real_model
def test_the_hook_sees_gradio_analytics_when_switched_on(tmp_path):
    seen = run_studio(tmp_path, GRADIO_ANALYTICS_ENABLED="True")
    assert any("gradio" in call for call in seen["foreign"]), seen
