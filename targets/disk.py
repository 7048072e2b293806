"""What the target venvs and kvspec's uv cache cost on disk, and pruning what no venv uses.

uv installs a venv by hard-linking each file from its cache (``$KVSPEC_HOME/uv-cache``,
``archive-v0/<id>/``: one unpacked wheel per entry) into the venv.  So one file's bytes are
on disk once however many venvs and the cache name it, and:

* a venv's *own* bytes are its files with one link (written for it: records, ``.pyc``);
* its *shared* bytes are its files with several links (the cache's, perhaps other venvs');
* what only it holds (with the cache) is its files with exactly two links: deleting the venv
  leaves them in the cache alone, where ``prune`` frees them;
* a cache entry no venv uses is one whose files all have one link.

``uv cache prune`` does not free these: it removes only entries no cache pointer refers to,
whatever their link counts (astral-sh/uv#16008 asks for link-count pruning), so a deleted
venv's wheels stay.  ``prune`` removes the unused entries and the pointers
(``wheels-v8/**.http|.msgpack``) that name them, so uv downloads such a wheel again if a later
resolution asks for it.  It skips entries changed in the last ``GRACE_S`` (a provisioning run
may have unpacked them and not linked them yet) and refuses while a provisioning run of this
kvspec holds the home's lock (``provision_lock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import attrs

from .registry import TargetError, home

GRACE_S = 3600.0
LOCK_NAME = "provision.lock"
ARCHIVE = "archive-v0"
POINTERS = "wheels-v8"
POINTER_SUFFIXES = (".http", ".msgpack")


def cache_dir() -> Path:
    return home() / "uv-cache"


@attrs.frozen
class VenvDisk:
    """One venv's bytes, by who else holds them (module docstring)."""

    path: Path
    own: int  # files with one link
    shared: int  # files with several links (counted once per file)
    alone: int  # files with exactly two links: this venv's and the cache's


@attrs.frozen
class CacheEntry:
    path: Path
    bytes: int
    used: bool  # a file of it has another link (a venv)
    newest: float  # the latest mtime in it


@attrs.frozen
class CacheDisk:
    path: Path
    total: int  # every file of the cache, once per inode
    entries: tuple[CacheEntry, ...]

    @property
    def unused(self) -> int:
        return sum(e.bytes for e in self.entries if not e.used)


def _files(root: Path) -> Iterator[os.stat_result]:
    for folder, _dirs, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if not os.path.islink(os.path.join(folder, name)):
                yield st


def venv_disk(venv: Path) -> VenvDisk:
    own = shared = alone = 0
    seen: set[tuple[int, int]] = set()
    for st in _files(venv):
        key = (st.st_dev, st.st_ino)
        if key in seen:
            continue
        seen.add(key)
        if st.st_nlink == 1:
            own += st.st_size
        else:
            shared += st.st_size
            if st.st_nlink == 2:
                alone += st.st_size
    return VenvDisk(venv, own, shared, alone)


def cache_disk(root: Path | None = None) -> CacheDisk:
    root = root or cache_dir()
    seen: set[tuple[int, int]] = set()
    total = 0
    for st in _files(root):
        key = (st.st_dev, st.st_ino)
        if key not in seen:
            seen.add(key)
            total += st.st_size
    entries = []
    archive = root / ARCHIVE
    for entry in sorted(archive.iterdir()) if archive.is_dir() else ():
        size, used, newest = 0, False, entry.lstat().st_mtime
        for st in _files(entry):
            size += st.st_size
            used |= st.st_nlink > 1
            newest = max(newest, st.st_mtime)
        entries.append(CacheEntry(entry, size, used, newest))
    return CacheDisk(root, total, tuple(entries))


@contextlib.contextmanager
def provision_lock(*, exclusive: bool) -> Iterator[None]:
    """The home's provisioning lock: shared while a venv is made (several may be made at
    once), exclusive while the cache is pruned; an exclusive request that would wait fails."""
    root = home()
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK_NAME, "a+") as handle:
        try:
            fcntl.flock(handle, (fcntl.LOCK_EX | fcntl.LOCK_NB) if exclusive else fcntl.LOCK_SH)
        except BlockingIOError:
            raise TargetError(
                f"a kvspec provisioning run is making a venv under {root}: prune when it is done"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@attrs.frozen
class Pruned:
    venvs: tuple[Path, ...]
    entries: tuple[CacheEntry, ...]
    pointers: tuple[Path, ...]
    kept_recent: tuple[CacheEntry, ...]  # unused, but changed within GRACE_S

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.entries)


def prune(venvs: tuple[Path, ...] = (), *, apply: bool, now: float | None = None) -> Pruned:
    """Remove ``venvs``, then every cache entry no venv uses (older than ``GRACE_S``) and the
    cache pointers naming them.  ``apply=False`` says what it would remove and removes nothing
    (the venvs to remove are then counted as gone: their entries are listed as well)."""
    now = time.time() if now is None else now
    with provision_lock(exclusive=True):
        gone: set[tuple[int, int]] = set()
        for venv in venvs:
            if apply:
                shutil.rmtree(venv)
            else:
                gone |= {(st.st_dev, st.st_ino) for st in _files(venv)}
        unused, recent = [], []
        for entry in cache_disk().entries:
            used = entry.used and not (gone and _only_linked_from(entry.path, gone))
            if used:
                continue
            (recent if now - entry.newest < GRACE_S else unused).append(entry)
        pointers = _pointers_to({e.path.name for e in unused})
        if apply:
            for entry in unused:
                shutil.rmtree(entry.path, ignore_errors=True)
            for pointer in pointers:
                pointer.unlink(missing_ok=True)
    return Pruned(tuple(venvs), tuple(unused), tuple(pointers), tuple(recent))


def _only_linked_from(entry: Path, gone: set[tuple[int, int]]) -> bool:
    """Whether every file of a cache entry with more than one link is linked from ``gone``
    (the venvs a dry run counts as removed) and nowhere else: one link from them at most."""
    for st in _files(entry):
        if st.st_nlink > 2 or (st.st_nlink == 2 and (st.st_dev, st.st_ino) not in gone):
            return False
    return True


def _pointers_to(ids: set[str]) -> list[Path]:
    """The cache's wheel pointers that name one of the archive ``ids``."""
    root = cache_dir() / POINTERS
    if not ids or not root.is_dir():
        return []
    found = []
    encoded = [i.encode() for i in ids]
    for folder, _dirs, names in os.walk(root):
        for name in names:
            if name.endswith(POINTER_SUFFIXES):
                path = Path(folder) / name
                data = path.read_bytes()
                if any(i in data for i in encoded):
                    found.append(path)
    return sorted(found)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def entry_holding(path: Path, relative: str, root: Path | None = None) -> Path | None:
    """The cache archive entry (an unpacked wheel) whose file ``relative`` (its path inside the
    wheel, as inside site-packages) is ``path`` -- the same inode: a venv's hard link; None if
    none is (uv copied the file, or the venv wrote it)."""
    st = os.lstat(path)
    if st.st_nlink < 2:
        return None
    archive = (root or cache_dir()) / ARCHIVE
    for entry in sorted(archive.iterdir()) if archive.is_dir() else ():
        try:
            other = os.lstat(entry / relative)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            return entry
    return None


def detach(path: Path, relative: str) -> tuple[Path, ...]:
    """Remove the cache entry holding ``path`` (``entry_holding``) and the cache pointers and
    links naming it, so that the venv's link is the only one left of each of its files and removing a file from the venv
    frees its bytes; what was removed.  uv downloads that wheel again if a later resolution asks
    for it.  Other venvs' links to the entry's files keep those files whole."""
    entry = entry_holding(path, relative)
    return () if entry is None else discard(entry)


def discard(entry: Path) -> tuple[Path, ...]:
    """Remove a cache entry and the cache pointers and links naming it; what was removed."""
    pointers = [*_pointers_to({entry.name}), *_links_to(entry)]
    shutil.rmtree(entry, ignore_errors=True)
    for pointer in pointers:
        pointer.unlink(missing_ok=True)
    return (entry, *pointers)


def trim(path: Path, relative: str, entries: list[Path]) -> Path | None:
    """Remove from the cache entry holding ``path`` (the venv's hard link to its file ``relative``)
    that file, and the folders it leaves empty, so that removing ``path`` frees its bytes while the
    entry stays for the next venv that pins the same wheel (which then lacks the file too); the
    entry, or None if no entry holds ``path``.  ``entries``: entries found before, tried first
    (``entry_holding`` reads every entry)."""
    st = os.lstat(path)
    entry = None
    for known in entries:
        try:
            other = os.lstat(known / relative)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            entry = known
            break
    else:
        entry = entry_holding(path, relative)
        if entry is None:
            return None
        entries.append(entry)
    (entry / relative).unlink()
    remove_empty_folders(entry / relative, entry)
    return entry


def remove_empty_folders(path: Path, root: Path) -> None:
    """Remove the folders above ``path``, up to ``root`` (kept), that are empty."""
    for folder in path.parents:
        if folder == root or root not in folder.parents:
            return
        try:
            folder.rmdir()
        except OSError:
            return


def trimmed_entries(root: Path | None = None) -> list[Path]:
    """The cache entries missing a file their wheel's RECORD lists: those a lean provisioning
    trimmed (``trim``; uv's own entries hold every file of their RECORD)."""
    import csv

    archive = (root or cache_dir()) / ARCHIVE
    found = []
    for entry in sorted(archive.iterdir()) if archive.is_dir() else ():
        for record in entry.glob("*.dist-info/RECORD"):
            rows = csv.reader(record.read_text(errors="replace").splitlines())
            if any(row and not os.path.lexists(entry / row[0]) for row in rows):
                found.append(entry)
                break
    return found


def _links_to(entry: Path) -> list[Path]:
    """The cache's symbolic links to an archive entry (uv names an unpacked wheel by one)."""
    root = cache_dir() / POINTERS
    found = []
    for folder, dirs, names in os.walk(root) if root.is_dir() else ():
        for name in [*dirs, *names]:
            path = Path(folder) / name
            if path.is_symlink() and Path(os.readlink(path)).name == entry.name:
                found.append(path)
    return sorted(found)
