"""Folders and files another account controls are refused (engine/owned.py), and a full disk under the module store
loses nothing.

The other account is uid 65534 (nobody): the suite runs as root in CI, which makes a folder or file and hands it to
that account (``chown``), the state the account would leave had it made them itself. Its "code" is a shared library
whose constructor writes a marker file: the marker says whether loading ran it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.devices import cache_folder, cache_root, check_cache
from engine.owned import ForeignPathError, check_own_file, check_trusted, create_private, private_folder
from engine.runlog import RunLog, RunLogError

OTHER = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="handing a file to another account needs root")


def theirs(path: Path, mode: int | None = None) -> Path:
    """``path`` handed to the other account (and set to ``mode``)."""
    os.chown(path, OTHER, OTHER)
    if mode is not None:
        os.chmod(path, mode)
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("PML_STUDIO_CACHE", str(root))
    return root


# ----------------------------------------------------------------------------------------------
# The rule, path by path
# ----------------------------------------------------------------------------------------------

def test_the_users_own_folders_pass_and_missing_ones_are_made_private(tmp_path):
    made = private_folder(tmp_path / "a" / "b", "cache folder")
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert ((tmp_path / "a").stat().st_mode & 0o777) == 0o700
    check_trusted(made, "cache folder")


@as_root
def test_a_folder_another_account_made_is_refused_naming_it_and_the_fix(tmp_path):
    (tmp_path / "shared").mkdir()
    theirs(tmp_path / "shared", 0o777)
    with pytest.raises(ForeignPathError) as err:
        private_folder(tmp_path / "shared", "cache folder", "set PML_STUDIO_CACHE to a folder of yours")
    said = str(err.value)
    assert str(tmp_path / "shared") in said and f"uid {OTHER}" in said and "PML_STUDIO_CACHE" in said
    assert "\n" not in said
    with pytest.raises(ForeignPathError):  # nor anything below it, made or not
        private_folder(tmp_path / "shared" / "kernels", "cache folder")
    assert not (tmp_path / "shared" / "kernels").exists()


def test_a_folder_others_can_write_to_is_refused_even_when_the_users(tmp_path):
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(ForeignPathError, match="chmod go-w"):
        check_trusted(tmp_path / "open", "cache folder")
    os.chmod(tmp_path / "open", 0o775)  # group-writable too: as ssh's StrictModes
    with pytest.raises(ForeignPathError, match="mode 0775"):
        check_trusted(tmp_path / "open" / "inside", "cache folder", missing_ok=True)


def test_a_sticky_folder_above_the_path_is_passed_but_never_the_path_itself(tmp_path):
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # as /tmp: only an entry's owner renames or removes it
    private_folder(sticky / "mine", "temporary folder")
    with pytest.raises(ForeignPathError, match="can be written by other accounts"):
        check_trusted(sticky, "run log's folder")


@as_root
def test_a_symlink_is_followed_only_when_the_user_made_it_and_to_what_the_user_owns(tmp_path):
    target = tmp_path / "theirs"
    target.mkdir()
    theirs(target, 0o755)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(ForeignPathError, match=f"uid {OTHER}"):
        check_trusted(tmp_path / "link", "cache folder")
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "their-link").symlink_to(mine)
    os.lchown(tmp_path / "their-link", OTHER, OTHER)  # a link the other account made, to the user's own folder
    with pytest.raises(ForeignPathError, match=f"uid {OTHER}"):
        check_trusted(tmp_path / "their-link", "cache folder")
    (tmp_path / "good").symlink_to(mine)
    check_trusted(tmp_path / "good" / "x", "cache folder", missing_ok=True)


def test_a_new_private_file_is_made_exclusively(tmp_path):
    assert create_private(tmp_path / "log.db")
    assert ((tmp_path / "log.db").stat().st_mode & 0o777) == 0o600
    assert not create_private(tmp_path / "log.db")  # never opens what is there
    (tmp_path / "link.db").symlink_to(tmp_path / "elsewhere.db")
    assert not create_private(tmp_path / "link.db") and not (tmp_path / "elsewhere.db").exists()


# ----------------------------------------------------------------------------------------------
# The cache folder at a start
# ----------------------------------------------------------------------------------------------

@as_root
def test_a_cache_folder_another_account_made_is_refused_at_start(cache):
    cache.mkdir()
    theirs(cache, 0o777)
    with pytest.raises(ForeignPathError, match=str(cache)):
        check_cache()
    assert list(cache.iterdir()) == []  # nothing of the user's written there


@as_root
@pytest.mark.parametrize("name", ["models", "gguf", "kernels", "packed", "modules"])
def test_each_folder_the_engine_loads_from_is_checked_at_start(cache, name):
    check_cache()
    (cache / name).mkdir()
    theirs(cache / name, 0o755)
    with pytest.raises(ForeignPathError, match=f"{cache / name}.*uid {OTHER}"):
        check_cache()
    with pytest.raises(ForeignPathError):
        cache_folder(name)


def test_the_default_cache_starts_with_no_word(cache, capfd):
    assert check_cache() == cache == cache_root()
    assert (cache.stat().st_mode & 0o077) == 0
    assert capfd.readouterr().err == ""


@as_root
def test_the_studio_refuses_a_foreign_cache_in_one_line_before_loading_anything(cache, tmp_path):
    cache.mkdir()
    theirs(cache, 0o777)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PML_STUDIO_CACHE": str(cache)}
    done = subprocess.run([sys.executable, str(root / "app.py"), "--port", "1"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(cache) in lines[0] and "PML_STUDIO_CACHE" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and list(cache.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# Compiled kernels: loaded only from the user's own files
# ----------------------------------------------------------------------------------------------

def library_with_constructor(folder: Path, marker: Path) -> Path:
    """A shared library whose constructor writes ``marker`` when loaded (code that would run as the user)."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the stand-in library")
    src = folder / "ctor.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void ran(void) '
                   f'{{ FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }} }}\n')
    lib = folder / "pml_packed_x.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    src.unlink()
    return lib


@as_root
def test_a_kernel_library_another_account_wrote_is_never_loaded(cache, tmp_path):
    from engine.model.kernels import load_built

    folder = cache_folder("kernels") / "abc"
    folder.mkdir()
    marker = tmp_path / "ran"
    lib = theirs(library_with_constructor(folder, marker), 0o755)
    with pytest.raises(ForeignPathError, match=f"{lib}.*uid {OTHER}"):
        load_built("pml_packed_x", lib)
    assert not marker.exists()
    os.chown(lib, 0, 0)  # the control: the user's own library is loaded, and its constructor runs
    with pytest.raises(ImportError):  # it is no Python module
        load_built("pml_packed_x", lib)
    assert marker.read_text() == "ran"


def test_a_kernel_library_in_a_folder_others_can_write_to_is_never_loaded(cache, tmp_path):
    from engine.model.kernels import load_built

    folder = cache_folder("kernels") / "abc"
    folder.mkdir()
    marker = tmp_path / "ran"
    lib = library_with_constructor(folder, marker)
    os.chmod(folder, 0o777)
    with pytest.raises(ForeignPathError, match="can be written by other accounts"):
        load_built("pml_packed_x", lib)
    assert not marker.exists()


# ----------------------------------------------------------------------------------------------
# The run log
# ----------------------------------------------------------------------------------------------

def test_a_new_run_log_is_made_private_and_exclusive(tmp_path):
    log = RunLog(tmp_path / "runs.db")
    assert (log.path.stat().st_mode & 0o777) == 0o600
    check_own_file(log.path, "run log")


@as_root
def test_a_run_log_another_account_made_is_refused_and_left_as_it_was(tmp_path):
    db = tmp_path / "victim.db"
    db.write_bytes(b"")
    theirs(db, 0o666)
    with pytest.raises(RunLogError) as err:
        RunLog(db)
    assert str(db) in str(err.value) and f"uid {OTHER}" in str(err.value) and "--db" in str(err.value)
    assert db.stat().st_uid == OTHER and (db.stat().st_mode & 0o777) == 0o666 and db.read_bytes() == b""


@as_root
def test_a_journal_another_account_made_beside_the_log_is_refused(tmp_path):
    RunLog(tmp_path / "runs.db")
    wal = tmp_path / "runs.db-wal"
    wal.write_bytes(b"")
    theirs(wal, 0o666)
    with pytest.raises(RunLogError, match="journal"):
        RunLog(tmp_path / "runs.db")


@as_root
def test_a_run_log_linked_to_another_accounts_file_is_refused(tmp_path):
    target = tmp_path / "theirs.db"
    target.write_bytes(b"")
    theirs(target, 0o666)
    (tmp_path / "runs.db").symlink_to(target)
    with pytest.raises(RunLogError, match=f"uid {OTHER}"):
        RunLog(tmp_path / "runs.db")
    assert target.read_bytes() == b""


def test_a_run_log_in_a_folder_others_can_write_to_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # as /tmp itself: others could make its -wal file before SQLite does
    with pytest.raises(RunLogError, match="can be written by other accounts"):
        RunLog(shared / "runs.db")
    assert list(shared.iterdir()) == []


@as_root
def test_a_store_folder_another_account_makes_after_the_start_is_never_written_or_read(tiny_lm, tmp_path):
    """The module store's folder was missing at the start (allowed: it is made at the first save); another account
    makes it, world-writable, before that save. The save is refused and says why, nothing is written there, the run
    goes on from memory; a module file put there is not read. A folder the store makes itself is 0700."""
    from engine.arms.registry import Sampling
    from engine.session import Engine
    from test_module_memory import PROMPT, SCHEMA

    folder = tmp_path / "shared" / "modules"
    eng = Engine.from_loaded(tiny_lm, persist=True, module_dir=folder)
    eng.store()  # the start: checked while missing
    folder.parent.mkdir()
    folder.mkdir()
    theirs(folder, 0o777)
    run = eng.compare(SCHEMA, PROMPT, Sampling(2))
    assert list(folder.iterdir()) == [] and len(run.arm("cached").run.token_ids) == 2
    assert run.store.stats["disk_write_errors"] >= 1 and "is not yours" in run.store.stats["disk_error"]

    mine = Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mine" / "modules")
    mine.compare(SCHEMA, PROMPT, Sampling(2))
    made = sorted((tmp_path / "mine").rglob("*"))
    assert made and all(p.stat().st_mode & 0o077 == 0 for p in [tmp_path / "mine", *made])

    planted = folder / next((tmp_path / "mine" / "modules").glob("*.safetensors")).name
    shutil.copy(next((tmp_path / "mine" / "modules").glob("*.safetensors")), planted)
    again = Engine.from_loaded(tiny_lm, persist=True, module_dir=tmp_path / "mine" / "modules")
    store = again.store()
    store.disk.root = folder  # the same store, its folder now another account's: nothing is read from it
    assert store.disk.load(planted.stem) is None and "is not yours" in store.disk.note
