"""Checkpoint files that appear whole or not at all, on local disks and fsspec file systems.

[Note: temporary checkpoint names]
A checkpoint is written under a temporary name in the directory of its target and renamed into
place once the write has completed (``os.replace`` on a local disk, ``fs.mv`` on other fsspec file
systems). The temporary name is ``.elixir-partial-<12 random lowercase letters>.tmp``:

- hidden, and not ending in ``.ckpt``, so ModelCheckpoint's ``last*.ckpt`` matching and
  ``ckpt_path="last"`` never pick up an unfinished file;
- without the target's name or any digit, because Lightning's SLURM resume takes the largest
  number found in any file name containing ``hpc_ckpt_`` as the checkpoint to load;
- random, so concurrent saves never share a file and a leftover never collides with a new save.

A save killed before the rename leaves its temporary file behind. The next process that saves into
that directory (or sets up a ModelCheckpoint there) removes every file of this pattern that none of
its own saves is writing, and ``.<name>.ckpt.tmp`` files of the scheme used before this one. One
writer per checkpoint directory is assumed, as ModelCheckpoint's own bookkeeping assumes it.

Object stores (S3, GCS, Azure) have no rename, and an upload there becomes visible only once it
completed, so checkpoints are uploaded to their target directly.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import secrets
import shutil
import string
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import IO, Any, Optional, Union

import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]

_TEMP_PREFIX, _TEMP_SUFFIX = ".elixir-partial-", ".tmp"
_TEMP_NAME = re.compile(r"\.elixir-partial-[a-z]{12}\.tmp|\..+\.ckpt\.tmp")  # this scheme | the one before it
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl"})


def temp_name() -> str:
    """A fresh temporary file name ([Note: temporary checkpoint names])."""
    token = "".join(secrets.choice(string.ascii_lowercase) for _ in range(12))
    return f"{_TEMP_PREFIX}{token}{_TEMP_SUFFIX}"


def is_temp_name(name: str) -> bool:
    """Whether a file name is a temporary name of an unfinished save, of this scheme or the one before."""
    return _TEMP_NAME.fullmatch(name) is not None


def checkpoint_dir_problem(dirpath: PathLike) -> Optional[str]:
    """Why checkpoints cannot be written to the local directory ``dirpath``, or None. A missing directory is
    made to probe it, and removed again.

    Remote directories are not checked: whether a bucket accepts writes is the storage plugin's
    business and may cost a request."""
    fs, path = url_to_fs(str(dirpath))
    if not _is_local(fs):
        return None
    try:
        with made_for_a_probe(path):
            probe = os.path.join(path, temp_name())
            with open(probe, "wb"):
                pass
            os.remove(probe)
    except OSError as err:
        return (f"the checkpoint directory {str(dirpath)!r} cannot be created or written to "
                f"({err.strerror or err}): pass a writable ModelCheckpoint(dirpath=...) "
                "or Trainer(default_root_dir=...)")
    return None


@contextmanager
def made_for_a_probe(path: str) -> Generator[None, None, None]:
    """The local directory ``path`` for the duration, its missing parents made and removed again after (when
    empty): a run that never saves leaves no checkpoint directory, as ModelCheckpoint makes it at its first
    save."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.exists(head) and head != os.path.dirname(head):
        missing.append(head)
        head = os.path.dirname(head)
    try:
        os.makedirs(path, exist_ok=True)
        yield
    finally:
        for directory in missing:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(directory)


class AtomicCheckpointIO:
    """Makes the files of another CheckpointIO appear whole or not at all.

    It implements the CheckpointIO interface (save, load, remove, teardown) and delegates to
    ``checkpoint_io``; it does not subclass Lightning's CheckpointIO because this module imports no
    Lightning: the same object serves ``lightning.pytorch`` and ``pytorch_lightning`` Trainers.
    Saves write to a temporary name next to the target and rename it into place
    once the write has completed ([Note: temporary checkpoint names]); inside an AsyncCheckpointIO
    that happens in the saving thread, after its write. Loads and removals pass through.

    Args:
        checkpoint_io: the plugin that writes, loads and removes the files.
        stream_local: write local files with ``torch.save`` straight into the temporary file. For
            Lightning's TorchCheckpointIO, whose local writes first serialize the whole checkpoint
            into memory and then write it to a file in the system's temporary directory.
    """

    def __init__(self, checkpoint_io: Any = None, stream_local: bool = False) -> None:
        self.checkpoint_io = checkpoint_io
        self.stream_local = stream_local
        self._lock = threading.Lock()
        self._writing: set[str] = set()  # temporary names this process is writing
        self._swept: set[tuple[Any, str]] = set()  # directories already cleared of leftovers

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike,
                        storage_options: Optional[Any] = None) -> None:
        """Save through ``checkpoint_io`` under a temporary name, then rename it to ``path``."""
        def write(fs: AbstractFileSystem, tmp_url: str, tmp: str) -> None:
            if _is_local(fs) and self.stream_local and storage_options is None:
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
                torch.save(checkpoint, tmp)
            else:
                self.checkpoint_io.save_checkpoint(checkpoint, tmp_url, storage_options=storage_options)

        self._save(path, write)

    def can_stream(self, path: PathLike, storage_options: Optional[Any] = None) -> bool:
        """Whether ``save_streamed`` writes what ``checkpoint_io`` would: a ``torch.save`` file at ``path``."""
        return self.stream_local and storage_options is None and not _is_object_store(url_to_fs(str(path))[0])

    def save_streamed(self, path: PathLike, write: Callable[[IO[bytes]], None]) -> None:
        """Save a file that ``write`` writes into an open binary file, under a temporary name, then rename it.

        For TorchCheckpointIO's format written piece by piece (``can_stream``); see
        [Note: streamed full checkpoints] in runtime/full_file.py."""
        def write_file(fs: AbstractFileSystem, tmp_url: str, tmp: str) -> None:
            if _is_local(fs):
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
            with fs.open(tmp, "wb") as file:
                write(file)

        self._save(path, write_file)

    def _save(self, path: PathLike, write: Callable[[AbstractFileSystem, str, str], None]) -> None:
        """``write(fs, temporary URL, temporary path)``, then the rename; the temporary file goes on failure."""
        fs, target = url_to_fs(str(path))
        if _is_object_store(fs):  # uploads appear only once complete; there is no rename
            write(fs, str(path), target)
            return
        directory = _parent(str(path), fs)
        if (fs.protocol, _parent(target, fs)) not in self._swept:
            self.remove_leftovers(directory)
        name = temp_name()
        tmp = _join(_parent(target, fs), name, fs)
        with self._claim(name):
            try:
                write(fs, _join(directory, name, fs), tmp)
                if _is_local(fs):
                    _fsync(tmp)  # the data reaches the disk before the rename does: a power cut cannot leave an empty file
                _rename(fs, tmp, target)
            except BaseException:
                _remove(fs, tmp)
                raise

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.checkpoint_io.remove_checkpoint(*args, **kwargs)

    def teardown(self) -> None:
        """Nothing to release; ``checkpoint_io`` is torn down by whoever holds it."""

    def remove_leftovers(self, directory: PathLike) -> list[str]:
        """Remove temporary files of unfinished saves from ``directory`` that this process is not writing.

        Returns:
            The paths removed."""
        fs, path = url_to_fs(str(directory))
        try:
            listed = fs.ls(path, detail=False)
        except OSError:  # no directory yet, or not listable: the save itself reports what is wrong
            listed = []
        with self._lock:
            self._swept.add((fs.protocol, path))
            stale = [p for p in listed if is_temp_name(_basename(p)) and _basename(p) not in self._writing]
        removed = [p for p in stale if _remove(fs, p)]
        if removed:
            log.info(f"removed {len(removed)} temporary file(s) of interrupted checkpoint saves "
                     f"from {str(directory)!r}")
        return removed

    @contextmanager
    def _claim(self, name: str) -> Generator[None, None, None]:
        """Mark a temporary name as being written, so that a sweep leaves it alone."""
        with self._lock:
            self._writing.add(name)
        try:
            yield
        finally:
            with self._lock:
                self._writing.discard(name)

    def __getstate__(self) -> dict[str, Any]:  # the spawn launcher pickles the strategy that holds this
        return {"checkpoint_io": self.checkpoint_io, "stream_local": self.stream_local}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)


def _is_local(fs: AbstractFileSystem) -> bool:
    return "file" in _protocols(fs)


def _is_object_store(fs: AbstractFileSystem) -> bool:
    return not _OBJECT_STORES.isdisjoint(_protocols(fs))


def _protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def _basename(path: str) -> str:
    return path.rstrip("/").rpartition("/")[2]


def _parent(path: str, fs: AbstractFileSystem) -> str:
    """The directory of a path or URL, in the same form (a local path stays a plain path)."""
    return os.path.dirname(path) if _is_local(fs) and "://" not in path else path.rpartition("/")[0]


def _join(directory: str, name: str, fs: AbstractFileSystem) -> str:
    if _is_local(fs) and "://" not in directory:
        return os.path.join(directory, name)
    return f"{directory}/{name}" if directory else name


def _rename(fs: AbstractFileSystem, tmp: str, target: str) -> None:
    if not _is_local(fs):
        fs.mv(tmp, target)
        return
    os.replace(tmp, target)  # atomic within a file system, and the temporary file sits next to the target
    if os.name == "posix":  # makes the rename itself durable; directories cannot be opened for fsync on Windows
        _fsync(os.path.dirname(target))


def replace_dir(tmp: str, target: str) -> None:
    """Put the complete directory ``tmp`` at ``target`` (local), replacing a checkpoint already there.

    Where the system can swap two names in one step (Linux ``renameat2`` with ``RENAME_EXCHANGE``),
    ``target`` always holds a whole checkpoint, the previous or the new one, and the previous one is
    then removed under the temporary name. Elsewhere it takes two renames, ``target`` to a temporary
    name first: a kill between them leaves no checkpoint at ``target`` (the previous one is a leftover)."""
    old = None
    if os.path.lexists(target):
        if _exchange(tmp, target):
            old = tmp  # the previous checkpoint, now under the temporary name
        else:
            old = os.path.join(os.path.dirname(target), temp_name())
            os.replace(target, old)
            os.replace(tmp, target)
    else:
        os.replace(tmp, target)
    if os.name == "posix":
        _fsync(os.path.dirname(target) or ".")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


def remove_dir(path: str) -> None:
    """Remove a local checkpoint directory so that no kill leaves a partial one under its name: it is
    renamed to a temporary name first (a kill then leaves a leftover for the next sweep)."""
    hidden = os.path.join(os.path.dirname(os.path.abspath(path)), temp_name())
    os.replace(path, hidden)
    if os.name == "posix":
        _fsync(os.path.dirname(hidden))
    shutil.rmtree(hidden)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step; False where the system or file system cannot."""
    renameat2 = getattr(_libc(), "renameat2", None)
    if renameat2 is None:
        return False
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # no C library to load (not a POSIX system)
        return None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(fs: AbstractFileSystem, path: str) -> bool:
    """Remove a file if it is there; a failure is logged, not raised (it is only a leftover)."""
    try:
        fs.rm(path, recursive=True)  # a sharded save's temporary directory too
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as err:  # ValueError: a directory
        log.warning(f"could not remove the temporary checkpoint file {path!r}: {err}")
        return False
    return True
