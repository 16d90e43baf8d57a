"""The NVMe store on CPU: records round-trip bit for bit, damage is reported, run directories are cleaned up."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import socket
import threading
from pathlib import Path

import pytest
import torch

from lightning_elixir.runtime import nvme, nvme_runs
from lightning_elixir.runtime.nvme import HEADER_BYTES, NvmeError, NvmeStore
from lightning_elixir.runtime.nvme_runs import check_nvme_path

SIZES = {0: 1, 1: 7, 2: 4096, 3: 4097, 4: 12_345, 5: 65_539, 6: 100_000, 7: 0}


@pytest.fixture
def store(tmp_path):
    store = NvmeStore(tmp_path, rank=0, buffers=2)
    for key, nbytes in SIZES.items():
        store.define(key, nbytes)
    yield store
    store.close()


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def put(store: NvmeStore, key: int, value: torch.Tensor):
    page = store.acquire()
    page.data[:value.numel()].copy_(value)
    return store.write(key, page)


def get(store: NvmeStore, key: int) -> torch.Tensor:
    page = store.acquire()
    try:
        store.read(key, page).result()
        return page.data[:SIZES[key]].clone()
    finally:
        store.release(page)


def written(store: NvmeStore, key: int = 4) -> Path:
    """Write record ``key`` with random bytes, flush, and return its file."""
    put(store, key, random_bytes(SIZES[key], seed=key))
    store.flush()
    return store.record_path(key)


def expect_read_error(store: NvmeStore, key: int, match: str) -> None:
    """Reading ``key`` fails with ``match``, and flush reports the same error once more."""
    with pytest.raises(NvmeError, match=match):
        get(store, key)
    with pytest.raises(NvmeError, match=match):
        store.flush()


def dead_pid() -> int:
    """A pid that no process on this host has."""
    for pid in range(4_194_303, 1, -1):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except PermissionError:
            continue
    pytest.skip("no free pid found")


# ---- round trip ------------------------------------------------------------------------------


def test_records_round_trip_bit_for_bit_through_fewer_pages_than_keys(store):
    values = {key: random_bytes(nbytes, seed=key) for key, nbytes in SIZES.items()}
    for key, value in values.items():
        put(store, key, value)
    for key, value in values.items():
        assert torch.equal(get(store, key), value), key
    assert len(store._pages) == 2  # eight records went through two reused pages
    assert store.page_bytes == 102_400 and store.host_bytes == 2 * (102_400 + HEADER_BYTES)


def test_a_read_sees_the_write_of_its_key_issued_just_before(store):
    for round_ in range(5):
        for key, nbytes in SIZES.items():
            value = random_bytes(nbytes, seed=100 * round_ + key)
            put(store, key, value)  # no flush: the read must wait for this write
            assert torch.equal(get(store, key), value), (round_, key)


def test_stats_count_payload_bytes(store):
    for key in (3, 5):
        written(store, key)
        get(store, key)
    stats = store.stats
    assert (stats.writes, stats.reads) == (2, 2)
    assert stats.bytes_written == stats.bytes_read == SIZES[3] + SIZES[5]
    assert stats.write_s > 0 and stats.read_s > 0


def test_buffered_io_when_the_filesystem_refuses_o_direct(store, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", no_direct)
    value = random_bytes(SIZES[5], seed=5)
    put(store, 5, value)
    assert torch.equal(get(store, 5), value)
    assert not store._direct


def test_acquire_blocks_until_a_page_is_released(tmp_path):
    store = NvmeStore(tmp_path, rank=0, buffers=1)
    store.define(0, 10)
    page = store.acquire()
    got = []
    waiter = threading.Thread(target=lambda: got.append(store.acquire()))
    waiter.start()
    waiter.join(timeout=0.1)
    assert waiter.is_alive() and not got
    store.release(page)
    waiter.join(timeout=5)
    assert got == [page]
    store.close()


def test_defining_records(store):
    store.define(1, SIZES[1])  # the same size again is fine
    with pytest.raises(ValueError, match="already defined with 7 bytes"):
        store.define(1, 8)
    store.release(store.acquire())
    with pytest.raises(RuntimeError, match="before the first acquire"):
        store.define(99, 10)
    with pytest.raises(KeyError, match="define"):
        store.read(99, store.acquire())


# ---- damaged records -------------------------------------------------------------------------


def test_truncated_file_names_the_file(store):
    path = written(store)
    os.truncate(path, path.stat().st_size - 1)
    expect_read_error(store, 4, f"{path}.*truncated")


def test_flipped_payload_byte_fails_the_checksum(store):
    path = written(store)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 1234)
        byte = f.read(1)[0]
        f.seek(HEADER_BYTES + 1234)
        f.write(bytes([byte ^ 0x10]))
    expect_read_error(store, 4, f"{path}.*checksum")


@pytest.mark.parametrize("damage, field", [(lambda f: f.write(b"NOTELIXR"), "magic"),
                                            (lambda f: (f.seek(8), f.write(b"\x07")), "format version")])
def test_wrong_header(store, damage, field):
    path = written(store)
    with open(path, "r+b") as f:
        damage(f)
    expect_read_error(store, 4, f"{path}.*{field}")


def test_another_records_file_is_refused(store):
    written(store, 2)
    shutil.copy(store.record_path(2), store.record_path(1))
    os.truncate(store.record_path(1), HEADER_BYTES + 4096)  # the size of record 1, so the header decides
    expect_read_error(store, 1, "key is 2, expected 1")


def test_missing_file(store):
    expect_read_error(store, 2, f"{store.record_path(2)}.*does not exist")


def test_write_errors_name_the_file_and_surface_in_flush(store, monkeypatch):
    def disk_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", disk_full)
    future = put(store, 3, random_bytes(SIZES[3], seed=3))
    with pytest.raises(OSError, match=f"{store.record_path(3)}.*No space left.*another nvme_path"):
        future.result()
    with pytest.raises(OSError, match="No space left"):
        store.flush()
    store.flush()  # reported once
    assert len(store._free) == 1  # the page came back despite the error
    put(store, 4, random_bytes(SIZES[4], seed=4))
    with pytest.raises(OSError, match="No space left"):
        store.close()  # cleans up, then reports
    assert not store.path.exists()


# ---- paths and space -------------------------------------------------------------------------


def test_check_nvme_path_accepts_a_writable_directory(tmp_path):
    assert check_nvme_path(tmp_path) == tmp_path.resolve()
    assert list(tmp_path.iterdir()) == []


def test_check_nvme_path_refuses_a_missing_path_and_a_file(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path / 'absent'}.*does not exist"):
        check_nvme_path(tmp_path / "absent")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"{tmp_path / 'file'}.*not a directory"):
        check_nvme_path(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories")
def test_check_nvme_path_refuses_an_unwritable_directory(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ValueError, match=f"{locked}.*not writable"):
            check_nvme_path(locked)
    finally:
        locked.chmod(0o700)


def test_check_nvme_path_reports_a_failed_write(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(nvme_runs.tempfile, "mkstemp", refused)
    with pytest.raises(ValueError, match=f"{tmp_path}.*not writable.*Permission denied"):
        check_nvme_path(tmp_path)


def test_reserve_checks_free_space(store, monkeypatch):
    needed = sum(HEADER_BYTES + nvme.round_up_block(n) for n in SIZES.values())
    free = needed

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(free + 1, 1, free))
    store.reserve()
    free = needed - 1
    with pytest.raises(OSError, match=f"{store.path.parent}.*{needed} more.*another nvme_path"):
        store.reserve()
    path = written(store, 6)  # what the records' files already take counts as reserved
    free = needed - path.stat().st_size
    store.reserve()


# ---- run directories -------------------------------------------------------------------------


def test_close_removes_the_run_directory_and_is_idempotent(tmp_path):
    store = NvmeStore(tmp_path, rank=3)
    assert store.path.parent == tmp_path.resolve() and f"-{os.getpid()}-rank3-" in store.path.name
    store.define(0, 10)
    put(store, 0, random_bytes(10, seed=0))
    store.close()
    store.close()
    assert not store.path.exists()
    with pytest.raises(RuntimeError, match="closed"):
        store.acquire()


def test_a_forgotten_store_is_cleaned_up(tmp_path):
    store = NvmeStore(tmp_path, rank=0)
    path = store.path
    del store
    gc.collect()
    assert not path.exists()


def test_leftovers_of_dead_processes_on_this_host_are_removed(tmp_path, caplog):
    host = socket.gethostname()
    dead = tmp_path / f"lightning-elixir-{host}-{dead_pid()}-rank1"
    alive = tmp_path / f"lightning-elixir-{host}-{os.getppid()}-rank0"
    other_host = tmp_path / f"lightning-elixir-not-{host}-{dead_pid()}-rank0"
    unrelated = tmp_path / "checkpoints"
    for directory in (dead, alive, other_host, unrelated):
        directory.mkdir()
        (directory / "chunk00000.bin").write_bytes(b"old")
    caplog.set_level("INFO", logger=nvme_runs.__name__)
    store = NvmeStore(tmp_path, rank=0)
    assert not dead.exists() and str(dead) in caplog.text
    assert alive.exists() and other_host.exists() and unrelated.exists()
    store.close()


def test_a_run_whose_process_looks_gone_but_holds_its_lock_is_kept(tmp_path):
    import fcntl  # Linux, where the tests run
    # another container's job on a shared scratch directory: its pid means nothing in this namespace
    foreign = tmp_path / f"lightning-elixir-{socket.gethostname()}-{dead_pid()}-rank0-0123abcd"
    foreign.mkdir()
    lock = os.open(foreign / ".lock", os.O_CREAT | os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)
    NvmeStore(tmp_path, rank=0).close()
    assert foreign.exists()  # its lock is held: in use
    os.close(lock)  # as the kernel does when that job's process dies
    NvmeStore(tmp_path, rank=0).close()
    assert not foreign.exists()


def test_pinned_pages_are_counted_as_the_pinned_allocator_rounds_them(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # counted only: no page is allocated
    pinned = NvmeStore(tmp_path, rank=0, buffers=3, pin_memory=True)
    pinned.define(0, 48 << 20)
    assert pinned.host_bytes == 3 * (64 << 20)  # 48 MiB + the header block: a 64 MiB block each
    pinned.close()


def test_two_stores_of_one_process_and_rank_live_side_by_side(tmp_path):
    first = NvmeStore(tmp_path, rank=0)
    first.define(0, 10)
    put(first, 0, random_bytes(10, seed=0)).result()
    second = NvmeStore(tmp_path, rank=0)  # the runtime re-lays records out into a second store
    assert second.path != first.path and (first.path / "chunk00000.bin").exists()
    second.close()
    assert first.path.exists()
    first.close()
