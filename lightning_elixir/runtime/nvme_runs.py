"""Run directories under ``nvme_path``: one per NVMe store, locked for its life, removed when it ends.

A store works in a directory of its own, ``lightning-elixir-<host>-<pid>-rank<r>-<id>``, so that ranks and
runs sharing one scratch directory never touch each other's files. A run that crashed leaves its
directory behind; the next store on the same host removes it ([Note: whose run directory is it]).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import tempfile
import uuid
try:
    import fcntl
except ImportError:  # not on Windows: a run's liveness is then its process id only
    fcntl = None  # type: ignore[assignment]
from pathlib import Path
from typing import Optional, Union

log = logging.getLogger(__name__)

PathLike = Union[str, os.PathLike]
_RUN_PREFIX = "lightning-elixir"
_LOCK_NAME = ".lock"
"""Held (flock) by the store that owns a run directory: [Note: whose run directory is it]."""


def check_nvme_path(path: PathLike) -> Path:
    """Validate a user's ``nvme_path``: an existing, writable directory.

    Args:
        path: Directory on the NVMe drive under which the store keeps its run directory.

    Returns:
        The resolved path.

    Raises:
        ValueError: The path does not exist, is not a directory or is not writable.
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        raise ValueError(f"nvme_path {str(path)!r} does not exist: create the directory (on the NVMe drive) "
                         "or pass an existing one")
    if not resolved.is_dir():
        raise ValueError(f"nvme_path {str(path)!r} is not a directory: pass a directory on the NVMe drive")
    try:
        fd, probe = tempfile.mkstemp(prefix=".elixir-probe-", dir=resolved)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"nvme_path {str(path)!r} is not writable ({err.strerror or err}): "
                         "fix its permissions or pass a directory this process can write to") from err
    return resolved


def new_run_dir(path: PathLike, rank: int) -> tuple[Path, Optional[int]]:
    """A new run directory under ``path`` (checked first) for this process and rank, and the descriptor of its
    held lock (None where there is no flock); the leftovers of this host's crashed runs are removed first."""
    root = check_nvme_path(path)
    host = socket.gethostname()
    _remove_dead_runs(root, host)
    # A process may hold several stores at once (the runtime re-lays records out into a new one).
    name = f"{_RUN_PREFIX}-{host}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
    making = root / f".{name}"  # locked before it gets a name another store's cleanup looks at
    making.mkdir(exist_ok=False)
    lock = _lock_run(making)
    return making.rename(root / name), lock


def remove_run_dir(run_dir: Path, lock: Optional[int]) -> None:
    """Remove a run directory ``new_run_dir`` made, then let its lock go."""
    shutil.rmtree(run_dir, ignore_errors=True)
    if lock is not None:
        os.close(lock)


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _lock_run(run_dir: Path) -> Optional[int]:
    """Hold ``run_dir``'s lock file for the store's life: the descriptor (None where there is no flock)."""
    if fcntl is None:
        return None
    fd = os.open(run_dir / _LOCK_NAME, os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _run_in_use(run_dir: Path) -> bool:
    """Whether a live store holds ``run_dir``'s lock (a directory without one is a crashed run's)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(run_dir / _LOCK_NAME, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock this check took
    return False


def _remove_dead_runs(root: Path, host: str) -> None:
    """Remove run directories of this host whose process no longer exists (crashed runs).

    [Note: whose run directory is it]
    The name says which host and process made a run directory, but a process id means something
    only in its own PID namespace: two containers on one node share the hostname (host networking,
    common for RDMA) and may share the NVMe scratch directory, and each would see the other's
    processes as gone and remove directories in use. So a live store also holds an exclusive flock
    on its directory's lock file (made before the directory gets its name), which the kernel drops
    when the process dies, whatever its namespace; a directory is removed only when its process
    looks gone and its lock is free.
    """
    pattern = re.compile(rf"\.?{re.escape(_RUN_PREFIX)}-{re.escape(host)}-(\d+)-rank\d+(-[0-9a-f]+)?")
    for entry in root.iterdir():
        match = pattern.fullmatch(entry.name)
        if (match is None or entry.is_symlink() or not entry.is_dir() or _pid_alive(int(match.group(1)))
                or _run_in_use(entry)):
            continue
        try:
            shutil.rmtree(entry)
        except FileNotFoundError:  # another rank on this host removed it first
            continue
        except OSError as err:
            log.warning("Could not remove %s, left over from a crashed run: %s", entry, err)
            continue
        log.info("Removed %s, left over from a crashed run (process %s is gone)", entry, match.group(1))
