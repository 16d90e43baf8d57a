"""NVMe store: records of bytes (a chunk's sharded optimizer state) paged through a few host buffers.

[Note: NVMe record format]
One file per record, ``chunk{key:05d}.bin`` in the store's run directory: a 4096-byte header block
(magic ``ELIXIRNV``, format version, header size, key, payload bytes, checksum; the rest zeros)
followed by the payload, zero-padded to a multiple of 4096 bytes. Header and payload are one
contiguous, page-aligned host buffer (the page's header block sits right before ``Page.data``), so
each record moves in a single ``pwrite``/``preadv`` from or into the page, with no copy. Every
length and file offset is a multiple of 4096, so the file is opened with ``O_DIRECT`` (no page
cache: host memory stays what the plan counted) wherever the filesystem allows it; where opening
with ``O_DIRECT`` fails with EINVAL (tmpfs on older kernels, some network filesystems) the store
falls back to buffered I/O for good and asks the kernel to drop the cached pages after each transfer.

[Note: NVMe checksum]
The checksum must keep up with the drive (GB/s), so it is plain arithmetic that torch runs at memory
speed on all cores: the padded payload is viewed as int64 words in blocks of 4096 bytes; each block's
words are summed, the block sums are weighted by odd numbers 1, 3, 5, ... and summed, and the payload
length times a large odd constant is added, all wrapping modulo 2**64. Any single changed byte changes
the checksum (a change of ``d * 256**j`` with ``0 < |d| < 256`` and ``j < 8``, times an odd weight, is
never zero modulo 2**64), and so does a change of length. The odd weights make two swapped or
misplaced blocks (a device writing a block at the wrong offset) very likely to show. It is not a
cryptographic or CRC-grade code: changes to several words that cancel in the sum, such as two words
swapped within one block, go unseen. It guards against truncation, stale or foreign files and
sporadic corruption, not against an adversary.

[Note: NVMe ordering]
Reads and writes run on a small thread pool (the GIL is released inside the I/O calls and the
checksum, so they overlap compute). Operations on the same key run in the order they were issued:
each one first waits for the previous operation of its key. The pool's queue is first in, first out,
so that previous operation is already running or done and the wait cannot deadlock.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import mmap
import os
import shutil
import struct
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

from lightning_elixir.runtime.hostmem import pow2_ceil
from lightning_elixir.runtime.nvme_runs import PathLike, new_run_dir, remove_run_dir

log = logging.getLogger(__name__)

BLOCK_BYTES = 4096
"""Alignment of every length, file offset and page address (what ``O_DIRECT`` needs)."""
HEADER_BYTES = BLOCK_BYTES
"""The header takes a whole block so that the payload starts aligned."""
MAGIC = b"ELIXIRNV"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, header bytes, key, payload bytes, checksum
_MASK64 = (1 << 64) - 1
_LENGTH_MIX = 0x9E3779B97F4A7C15  # odd: distinct lengths shift the checksum differently
_IO_THREADS = 2
_FULL = (errno.ENOSPC, errno.EDQUOT)


class NvmeError(RuntimeError):
    """A record on NVMe is missing, truncated or corrupted (message names the file, what was expected and found)."""


@dataclass
class NvmeStats:
    """What the store moved, summed over its I/O threads."""

    bytes_read: int = 0
    """Payload bytes read (records' ``nbytes``, without header and padding)."""
    bytes_written: int = 0
    """Payload bytes written (records' ``nbytes``, without header and padding)."""
    read_s: float = 0.0
    """Seconds spent inside open/read calls, summed over threads (may exceed wall time)."""
    write_s: float = 0.0
    """Seconds spent inside open/write calls, summed over threads (may exceed wall time)."""
    reads: int = 0
    writes: int = 0


@dataclass(eq=False)
class Page:
    """One host buffer of the store: ``data`` holds a record's payload, ``data[:nbytes]``."""

    index: int
    data: torch.Tensor
    """uint8 tensor of ``page_bytes``; I/O also uses ``data[nbytes:round_up_block(nbytes)]`` as zero padding."""
    _buffer: torch.Tensor = field(repr=False)
    """Header block followed by ``data``: what one transfer moves."""


def round_up_block(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 4096."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _checksum(payload: torch.Tensor, nbytes: int) -> int:
    """[Note: NVMe checksum] of a 4096-padded uint8 payload holding ``nbytes`` bytes."""
    blocks = payload.view(torch.int64).view(-1, BLOCK_BYTES // 8)
    weights = torch.arange(1, 2 * blocks.shape[0] + 1, 2, dtype=torch.int64)
    weighted = int((blocks.sum(dim=1) * weights).sum())
    return (weighted + nbytes * _LENGTH_MIX) & _MASK64


def _shut_down(executor: concurrent.futures.ThreadPoolExecutor, run_dir: Path, lock: Optional[int]) -> None:
    """Stop the I/O threads and remove the run directory (also run for a store never closed)."""
    try:
        executor.shutdown(wait=True)
    except RuntimeError:  # a forgotten store's last reference died in one of its own I/O threads
        pass
    remove_run_dir(run_dir, lock)


def _new_buffer(nbytes: int, pin_memory: bool) -> torch.Tensor:
    """A page-aligned uint8 host buffer (anonymous mmap) or a pinned one (page-aligned by CUDA)."""
    if pin_memory:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    # Populated now: the plan counts this memory, and faulting it in during the first transfer is slow.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)


def _transfer(call: Callable[[memoryview, int], int], view: memoryview) -> int:
    """Run a pwrite/preadv-style ``call`` from offset 0 until ``view`` is done or the file ends."""
    done = 0
    while done < len(view):
        moved = call(view[done:], done)
        if moved == 0:
            break
        done += moved
    return done


class NvmeStore:
    """Records of bytes on an NVMe drive, moved through a few host page buffers by background threads.

    Args:
        path: The user's ``nvme_path``; the store works in a run directory of its own under it.
        rank: This process's rank (part of the run directory's name).
        buffers: Number of host page buffers (allocated on first use).
        pin_memory: Pin the page buffers (only when CUDA is available).
    """

    def __init__(self, path: PathLike, rank: int, *, buffers: int = 3, pin_memory: bool = False) -> None:
        if buffers < 1:
            raise ValueError(f"NvmeStore needs at least one page buffer, got buffers={buffers}")
        self.path, lock = new_run_dir(path, rank)
        self.stats = NvmeStats()
        self._buffers = buffers
        self._pin = pin_memory and torch.cuda.is_available()
        self._sizes: dict[int, int] = {}
        self._pages: list[Page] = []
        self._free: list[Page] = []
        self._page_cond = threading.Condition()
        self._lock = threading.Lock()  # guards ordering, pending futures and stats
        self._last: dict[int, concurrent.futures.Future] = {}
        self._pending: dict[concurrent.futures.Future, None] = {}
        self._direct = hasattr(os, "O_DIRECT")
        self._closed = False
        self._executor = concurrent.futures.ThreadPoolExecutor(_IO_THREADS, thread_name_prefix="elixir-nvme")
        self._finalizer = weakref.finalize(self, _shut_down, self._executor, self.path, lock)

    # ---- records ----------------------------------------------------------------------------

    def define(self, key: int, nbytes: int) -> None:
        """Declare record ``key`` of ``nbytes`` bytes; every record is defined before the first acquire."""
        if key < 0 or nbytes < 0:
            raise ValueError(f"NVMe record {key}: key and nbytes must be >= 0, got key={key}, nbytes={nbytes}")
        known = self._sizes.get(key)
        if known == nbytes:
            return
        if known is not None:
            raise ValueError(f"NVMe record {key} is already defined with {known} bytes, not {nbytes}: "
                             "give each record one size, or a key of its own")
        if self._pages:
            raise RuntimeError(f"NVMe record {key} defined after the page buffers were allocated: "
                               "define every record before the first acquire()")
        self._sizes[key] = nbytes

    def record_path(self, key: int) -> Path:
        """The file that holds record ``key``."""
        return self.path / f"chunk{key:05d}.bin"

    def reserve(self) -> None:
        """Check that the drive has room for every defined record.

        Raises:
            OSError: Less space is free than the records still need.
        """
        needed = sum(HEADER_BYTES + round_up_block(n) for n in self._sizes.values())
        for key in self._sizes:
            try:
                needed -= self.record_path(key).stat().st_size
            except FileNotFoundError:
                pass
        free = shutil.disk_usage(self.path).free
        if free < needed:
            raise OSError(errno.ENOSPC, f"nvme_path {self.path.parent} has {free} bytes free but the optimizer "
                          f"state offloaded by this rank needs {needed} more: free space on the drive or "
                          "choose another nvme_path")

    # ---- pages ------------------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's ``data``: the largest record, rounded up to 4096."""
        return round_up_block(max(self._sizes.values(), default=1) or 1)

    @property
    def host_bytes(self) -> int:
        """Host memory the pages take once all are allocated (each also holds a 4096-byte header block).
        Pinned pages hold a power of two each: torch's pinned allocator rounds every block up to one
        ([Note: pinned memory in slabs] in hostmem.py), a page of 48 MiB holds 64."""
        page = self.page_bytes + HEADER_BYTES
        return self._buffers * (pow2_ceil(page) if self._pin else page)

    def acquire(self) -> Page:
        """A free page; allocates one while fewer than ``buffers`` exist, else blocks until one is released."""
        with self._page_cond:
            while True:
                self._check_open()
                if self._free:
                    return self._free.pop()
                if len(self._pages) < self._buffers:
                    return self._new_page()
                self._page_cond.wait()

    def _new_page(self) -> Page:
        """Allocate the next page buffer (called with the page lock held)."""
        if not self._sizes:
            raise RuntimeError("NvmeStore.acquire() before any record was defined: define() the records first")
        buffer = _new_buffer(HEADER_BYTES + self.page_bytes, self._pin)
        page = Page(index=len(self._pages), data=buffer[HEADER_BYTES:], _buffer=buffer)
        self._pages.append(page)
        return page

    def release(self, page: Page) -> None:
        """Give a page back to the store (a no-op once the store is closed)."""
        with self._page_cond:
            if self._closed:
                return
            assert page in self._pages and page not in self._free, f"page {page.index} released twice or foreign"
            self._free.append(page)
            self._page_cond.notify()

    # ---- I/O --------------------------------------------------------------------------------

    def read(self, key: int, page: Page) -> concurrent.futures.Future:
        """Read record ``key`` into ``page.data[:nbytes]`` in the background.

        Returns:
            A future whose ``result()`` is the page, or raises NvmeError if the file is missing,
            has the wrong size or header, or its checksum does not match.
        """
        nbytes = self._size(key)
        return self._submit(key, lambda: self._read(key, nbytes, page))

    def write(self, key: int, page: Page, release: bool = True) -> concurrent.futures.Future:
        """Write ``page.data[:nbytes]`` as record ``key`` in the background, then release the page if asked.

        The page must not change until the future is done. Write errors (ENOSPC, ...) surface from
        ``result()`` and from ``flush()`` as OSError naming the file.
        """
        nbytes = self._size(key)
        return self._submit(key, lambda: self._write(key, nbytes, page, release))

    def flush(self) -> None:
        """Wait for every read and write issued so far; re-raise the first error among them.

        Each failed operation is reported by one flush (even if its ``result()`` already raised it).
        """
        with self._lock:
            futures = list(self._pending)
        concurrent.futures.wait(futures)
        with self._lock:
            for future in futures:
                self._pending.pop(future, None)
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Flush, stop the I/O threads and remove the run directory; flush errors are raised after cleanup."""
        if self._closed:
            return
        error: Optional[BaseException] = None
        try:
            self.flush()
        except BaseException as err:  # clean up first, then report
            error = err
        self._closed = True
        self._finalizer()
        with self._page_cond:
            self._pages, self._free = [], []
            self._page_cond.notify_all()
        if error is not None:
            raise error

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"NvmeStore at {self.path} is closed")

    def _size(self, key: int) -> int:
        """The defined size of record ``key``."""
        self._check_open()
        if key not in self._sizes:
            raise KeyError(f"NVMe record {key} was not defined: call define({key}, nbytes) before using it")
        return self._sizes[key]

    def _submit(self, key: int, task: Callable[[], object]) -> concurrent.futures.Future:
        """Queue ``task`` after the previous operation of ``key`` ([Note: NVMe ordering])."""
        with self._lock:
            before = self._last.get(key)
            future = self._executor.submit(_after, before, task)
            self._last[key] = future
            self._pending[future] = None
        future.add_done_callback(self._forget_if_ok)
        return future

    def _forget_if_ok(self, future: concurrent.futures.Future) -> None:
        """Drop a finished operation from the pending set unless flush must still report its error."""
        if future.exception() is None:
            with self._lock:
                self._pending.pop(future, None)

    def _write(self, key: int, nbytes: int, page: Page, release: bool) -> Page:
        """Header, padding and checksum into the page, then one transfer to the file."""
        try:
            padded = round_up_block(nbytes)
            page.data[nbytes:padded].zero_()
            checksum = _checksum(page.data[:padded], nbytes)
            view = memoryview(page._buffer.numpy())[:HEADER_BYTES + padded]
            page._buffer[:HEADER_BYTES].zero_()
            _HEADER.pack_into(view, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, key, nbytes, checksum)
            path = self.record_path(key)
            start = time.perf_counter()
            try:
                self._write_file(path, view, self._aligned(page))
            except OSError as err:
                hint = "; free space on the drive or choose another nvme_path" if err.errno in _FULL else ""
                message = f"writing NVMe record {key} to {path} failed: {err.strerror or err}{hint}"
                raise OSError(err.errno, message, str(path)) from err
            self._count("write", nbytes, time.perf_counter() - start)
            return page
        finally:
            if release:
                self.release(page)

    def _write_file(self, path: Path, view: memoryview, aligned: bool) -> None:
        """Create ``path`` or overwrite it in place with the bytes of ``view``.

        Not ``O_TRUNC``: records keep their size, and truncating frees and reallocates the file's
        blocks on every write (measured about half the write bandwidth with ``O_DIRECT``)."""
        fd, direct = self._open(path, os.O_WRONLY | os.O_CREAT, aligned)  # fixed size: overwrite in place
        try:
            written = _transfer(lambda v, offset: os.pwrite(fd, v, offset), view)
            if written != len(view):
                raise OSError(errno.EIO, f"wrote {written} of {len(view)} bytes")
            if os.fstat(fd).st_size > written:  # never for a record of fixed size; cheap to make sure
                os.ftruncate(fd, written)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # start write-back, keep no cache
        finally:
            os.close(fd)

    def _read(self, key: int, nbytes: int, page: Page) -> Page:
        """One transfer from the file into the page, then header and checksum checks."""
        path = self.record_path(key)
        padded = round_up_block(nbytes)
        view = memoryview(page._buffer.numpy())[:HEADER_BYTES + padded]
        start = time.perf_counter()
        self._read_file(path, view, self._aligned(page), key)
        self._count("read", nbytes, time.perf_counter() - start)
        _check_header(path, bytes(view[:_HEADER.size]), key, nbytes)
        checksum = _checksum(page.data[:padded], nbytes)
        expected = _HEADER.unpack_from(view)[5]
        if checksum != expected:
            raise NvmeError(f"NVMe record {key} in {path} is corrupted: payload checksum {checksum:#018x} does not "
                            f"match {expected:#018x} in its header; the drive or filesystem changed the data")
        return page

    def _read_file(self, path: Path, view: memoryview, aligned: bool, key: int) -> None:
        """Fill ``view`` with the whole of ``path``, which must be exactly as long."""
        try:
            fd, direct = self._open(path, os.O_RDONLY, aligned)
        except FileNotFoundError as err:
            raise NvmeError(f"NVMe record {key} is missing: {path} does not exist (was the record written, "
                            "or was the run directory removed?)") from err
        try:
            _read_all(fd, path, view, key)
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # keep no cache: the plan did not count it
        except NvmeError:
            raise
        except OSError as err:
            raise OSError(err.errno, f"reading NVMe record {key} from {path} failed: {err.strerror or err}",
                          str(path)) from err
        finally:
            os.close(fd)

    def _aligned(self, page: Page) -> bool:
        """Whether ``O_DIRECT`` may move this page (lengths and offsets are always block multiples)."""
        return self._direct and page._buffer.data_ptr() % BLOCK_BYTES == 0

    def _open(self, path: Path, flags: int, direct: bool) -> tuple[int, bool]:
        """Open ``path``, with ``O_DIRECT`` when asked and the filesystem allows; says which it got."""
        if direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600), True
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                self._direct = False  # this filesystem has no direct I/O: stay buffered from now on
                log.debug("O_DIRECT not supported under %s; using buffered I/O", self.path)
        return os.open(path, flags, 0o600), False

    def _count(self, kind: str, nbytes: int, seconds: float) -> None:
        """Add one transfer (``kind`` "read" or "write") to the stats."""
        with self._lock:
            if kind == "read":
                self.stats.bytes_read += nbytes
                self.stats.read_s += seconds
                self.stats.reads += 1
            else:
                self.stats.bytes_written += nbytes
                self.stats.write_s += seconds
                self.stats.writes += 1


def _after(before: Optional[concurrent.futures.Future], task: Callable[[], object]) -> object:
    """Run ``task`` once ``before`` is done (its error is its own: ``task`` still runs)."""
    if before is not None:
        concurrent.futures.wait([before])
    return task()


def _read_all(fd: int, path: Path, view: memoryview, key: int) -> None:
    """Read the open record file into ``view``, which it must fill exactly."""
    size = os.fstat(fd).st_size
    if size != len(view):
        raise NvmeError(f"NVMe record {key} in {path} is {size} bytes, expected {len(view)} "
                        f"({HEADER_BYTES} header + {len(view) - HEADER_BYTES} padded payload): "
                        f"the file was {'truncated' if size < len(view) else 'extended'} or replaced")
    got = _transfer(lambda v, offset: os.preadv(fd, [v], offset), view)
    if got != len(view):
        raise NvmeError(f"NVMe record {key} in {path}: read {got} bytes, expected {len(view)}; "
                        "the file was truncated while being read")


def _check_header(path: Path, header: bytes, key: int, nbytes: int) -> None:
    """Raise NvmeError unless ``header`` is this format's header of record ``key`` with ``nbytes`` bytes."""
    magic, version, header_bytes, got_key, got_nbytes, _ = _HEADER.unpack(header)
    expected = (MAGIC, FORMAT_VERSION, HEADER_BYTES, key, nbytes)
    found = (magic, version, header_bytes, got_key, got_nbytes)
    names = ("magic", "format version", "header bytes", "key", "payload bytes")
    for name, want, got in zip(names, expected, found):
        if want != got:
            raise NvmeError(f"NVMe record {key} in {path} has a wrong header: {name} is {got!r}, expected {want!r}; "
                            "the file is not this record (stale, foreign or corrupted)")
