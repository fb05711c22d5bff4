"""The host backend's directory: made safe when missing, refused when another user, a foreign
filesystem or a foreign file could break its locks, its registry initialised exactly once, and
nothing left open when it is refused. On real directories and real processes; no mocks."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lockmgr import LockError
from lockmgr.host._directory import (
    HEADER,
    REGISTRY,
    SHARD_SLOT,
    SHARDS,
    HOLDER_SLOT,
    HOLDER_SLOTS,
    HOLDERS,
    WAIT_SLOT,
    WAIT_SLOTS,
    WAITS,
    LockDirectory,
    UnsafeDirectoryError,
    _filesystem_refusal,
    _filesystem_type,
    open_lock_directory,
    registry_size,
)

pytestmark = [pytest.mark.posix_only,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="OFD locks, statfs types and /proc are Linux's")]

needs_root = pytest.mark.skipif(os.geteuid() != 0,
                                reason="giving a file to another user needs root (CI runs as root)")
NOBODY = 65534  # a user and a group this process is not (checked where it matters)
SHARD_NAMES = [f"shard-{shard:02d}" for shard in range(SHARDS)]
# The layout the lead's code reads: the magic (padded to 24 bytes), version, shards, size.
HEADER_FIELDS = struct.Struct("=24sIIQ")
MAGIC = b"lockmgr-host-registry\0"


def header(version: int = 3, shards: int = SHARDS, size: int | None = None,
           magic: bytes = MAGIC) -> bytes:
    fields = HEADER_FIELDS.pack(magic.ljust(24, b"\0"), version, shards,
                                registry_size() if size is None else size)
    return fields.ljust(HEADER, b"\0")


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def refused(path: str | Path, **options: Any) -> str:
    """open_lock_directory refuses ``path`` and leaves no descriptor open; the message."""
    before = open_fds()
    with pytest.raises(UnsafeDirectoryError) as caught:
        open_lock_directory(path, **options)
    assert open_fds() == before
    return str(caught.value)


@pytest.fixture
def umask() -> Iterator[None]:
    """A umask that would strip the group's bits, restored after the test."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


@pytest.fixture
def made(tmp_path: Path) -> Path:
    """A lock directory with all its files, made by an open that was closed again."""
    path = tmp_path / "locks"
    open_lock_directory(path).close()
    return path


def test_the_interface_constants() -> None:
    assert (SHARDS, REGISTRY, SHARD_SLOT, HEADER) == (64, "registry", 64, 64)
    assert registry_size() % os.sysconf("SC_PAGESIZE") == 0
    assert WAITS == HEADER + SHARDS * SHARD_SLOT
    assert HOLDERS == WAITS + WAIT_SLOTS * WAIT_SLOT
    assert registry_size() >= HOLDERS + HOLDER_SLOTS * HOLDER_SLOT > registry_size() - os.sysconf(
        "SC_PAGESIZE")
    assert issubclass(UnsafeDirectoryError, LockError)


def test_a_missing_directory_is_made_0700_with_its_files_and_an_initialised_registry(
        tmp_path: Path) -> None:
    path = tmp_path / "deep" / "er" / "locks"
    before = open_fds()
    directory = open_lock_directory(path)
    try:
        assert isinstance(directory, LockDirectory)
        assert directory.path == str(path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert sorted(os.listdir(path)) == sorted([*SHARD_NAMES, REGISTRY])
        for name in [*SHARD_NAMES, REGISTRY]:
            assert stat.S_IMODE((path / name).stat().st_mode) == 0o600
        assert len(directory.shard_fds) == SHARDS
        for shard, fd in enumerate(directory.shard_fds):
            assert os.path.samestat(os.fstat(fd), (path / SHARD_NAMES[shard]).stat())
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
            assert not os.get_inheritable(fd)
        assert len(directory.registry) == registry_size()
        assert directory.registry[:HEADER] == header()
        assert (path / REGISTRY).read_bytes() == header() + bytes(registry_size() - HEADER)
    finally:
        directory.close()
    assert open_fds() == before


def test_each_shard_descriptor_is_an_open_file_description_of_its_own(tmp_path: Path) -> None:
    """OFD locks belong to the description: two opens of one directory exclude each other."""
    first, second = open_lock_directory(tmp_path), open_lock_directory(tmp_path)
    try:
        assert len(set(first.shard_fds)) == SHARDS
        held = struct.pack("@hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 5, 1, 0)
        fcntl.fcntl(first.shard_fds[9], fcntl.F_OFD_SETLK, held)
        with pytest.raises(BlockingIOError):
            fcntl.fcntl(second.shard_fds[9], fcntl.F_OFD_SETLK, held)
    finally:
        first.close()
        second.close()


def test_a_shared_directory_is_made_0770_and_its_files_0660_whatever_the_umask(
        tmp_path: Path, umask: None) -> None:
    path = tmp_path / "shared"
    open_lock_directory(path, shared_with_group=True).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o770
    assert {stat.S_IMODE((path / name).stat().st_mode) for name in [*SHARD_NAMES, REGISTRY]} \
        == {0o660}


def test_close_closes_everything_and_again_does_nothing(tmp_path: Path) -> None:
    before = open_fds()
    directory = open_lock_directory(tmp_path)
    fds = directory.shard_fds
    directory.close()
    assert open_fds() == before
    assert directory.registry.closed and directory.shard_fds == ()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    directory.close()
    assert open_fds() == before


@pytest.mark.parametrize("path", [123, None, b"/tmp/locks"])
def test_a_path_that_is_not_a_str_or_pathlike_is_a_type_error(path: object) -> None:
    with pytest.raises(TypeError, match="path must be"):
        open_lock_directory(path)  # type: ignore[arg-type]


def test_a_pathlike_naming_bytes_is_a_type_error(tmp_path: Path) -> None:
    class BytesPath:
        def __fspath__(self) -> bytes:
            return os.fsencode(tmp_path / "locks")

    with pytest.raises(TypeError, match="str path"):
        open_lock_directory(BytesPath())  # type: ignore[arg-type]
    assert not (tmp_path / "locks").exists()


def test_an_empty_path_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        open_lock_directory("")


def test_shared_with_group_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="shared_with_group"):
        open_lock_directory(tmp_path / "locks", shared_with_group="yes")  # type: ignore[arg-type]
    assert not (tmp_path / "locks").exists()


def test_an_existing_file_in_place_of_the_directory_is_refused_and_kept(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.write_bytes(b"data")
    assert "not a directory" in refused(path)
    assert path.read_bytes() == b"data"


def test_the_path_may_be_a_symlink_to_a_directory(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    directory = open_lock_directory(tmp_path / "link")
    try:
        assert directory.path == str(tmp_path / "link")
        assert (tmp_path / "real" / REGISTRY).is_file()
    finally:
        directory.close()


# -- the filesystem ---------------------------------------------------------------------------


def statfs_type_by_coreutils(path: str | Path) -> int:
    done = subprocess.run(["stat", "-f", "-c", "%t", str(path)], capture_output=True, text=True,
                          check=True, timeout=60)
    return int(done.stdout, 16)


def test_the_statfs_type_read_is_the_kernels(tmp_path: Path) -> None:
    paths: list[str | Path] = [tmp_path, "/proc", "/sys"]
    for path in paths:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert _filesystem_type(fd) == statfs_type_by_coreutils(path)
        finally:
            os.close(fd)


def test_a_directory_on_tmpfs_is_accepted() -> None:
    base = tempfile.mkdtemp(dir="/dev/shm")
    try:
        assert statfs_type_by_coreutils(base) == 0x01021994  # tmpfs: the test means something
        open_lock_directory(os.path.join(base, "locks")).close()
    finally:
        shutil.rmtree(base)


def test_the_test_directorys_filesystem_is_accepted(tmp_path: Path) -> None:
    assert _filesystem_refusal(statfs_type_by_coreutils(tmp_path)) is None
    open_lock_directory(tmp_path).close()


@pytest.mark.parametrize("path, filesystem_type", [("/proc", 0x9FA0)])
def test_a_mounted_filesystem_off_the_allowlist_is_refused_naming_its_type(
        path: str, filesystem_type: int) -> None:
    """A real mount of a type nobody listed (the closest this machine has to a foreign
    filesystem: no NFS, SMB or FUSE server can be mounted here). /proc, which every run of
    the suite has mounted (a chroot may have /sys as a plain directory)."""
    message = refused(path)
    assert f"statfs type {filesystem_type:#x}" in message and path in message
    assert "/dev/shm" in message  # how to proceed


@pytest.mark.parametrize("filesystem_type, name", [
    (0x6969, "nfs"), (0x517B, "smb"), (0xFF534D42, "cifs"), (0xFE534D42, "smb2"),
    (0x65735546, "fuse"), (0x01021997, "9p"), (0x00C36400, "ceph"), (0x5346414F, "afs"),
    (0x6B414653, "afs"), (0x0BD00BD0, "lustre"), (0x01161970, "gfs2"), (0x7461636F, "ocfs2"),
])
def test_network_and_cluster_filesystems_are_refused_by_name(filesystem_type: int,
                                                            name: str) -> None:
    """The decision on the kernel's magic numbers (linux/magic.h) of filesystems that cannot
    be mounted here."""
    refusal = _filesystem_refusal(filesystem_type)
    assert refusal is not None
    assert f"on {name}" in refusal and f"{filesystem_type:#x}" in refusal


@pytest.mark.parametrize("filesystem_type", [
    0xEF53, 0x58465342, 0x9123683E, 0x2FC12FC1, 0xF2F52010, 0xCA451A4E, 0x01021994,
    0x858458F6, 0x794C7630,
])
def test_local_filesystems_are_accepted(filesystem_type: int) -> None:
    assert _filesystem_refusal(filesystem_type) is None


def test_an_unknown_filesystem_is_refused_saying_how_to_proceed() -> None:
    refusal = _filesystem_refusal(0x12345678)
    assert refusal is not None
    assert "0x12345678" in refusal and "ext2/ext3/ext4" in refusal and "/dev/shm" in refusal


# -- ownership and permissions ----------------------------------------------------------------


def test_a_directory_anyone_can_write_is_refused_even_shared(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    path.chmod(0o777)
    for shared in (False, True):
        assert "written by any user" in refused(path, shared_with_group=shared)
    assert os.listdir(path) == []


def test_a_group_writable_directory_is_refused_unless_shared(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir()
    path.chmod(0o770)
    assert "shared_with_group=True" in refused(path)
    assert os.listdir(path) == []
    open_lock_directory(path, shared_with_group=True).close()


@needs_root
def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir(mode=0o700)
    os.chown(path, NOBODY, os.getegid())
    assert f"owned by uid {NOBODY}" in refused(path)
    assert os.listdir(path) == []


@needs_root
def test_a_shared_directory_of_another_user_in_one_of_our_groups_is_accepted(
        tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir(mode=0o770)
    os.chown(path, NOBODY, os.getegid())
    assert f"owned by uid {NOBODY}" in refused(path)
    open_lock_directory(path, shared_with_group=True).close()


@needs_root
def test_a_shared_directory_of_another_user_and_group_is_refused(tmp_path: Path) -> None:
    assert NOBODY not in os.getgroups() and NOBODY != os.getegid()
    path = tmp_path / "locks"
    path.mkdir(mode=0o770)
    os.chown(path, NOBODY, NOBODY)
    message = refused(path, shared_with_group=True)
    assert f"owned by uid {NOBODY}" in message and "not one of this process's groups" in message
    assert os.listdir(path) == []


def test_a_file_anyone_can_write_is_refused_naming_it(made: Path) -> None:
    (made / "shard-17").chmod(0o606)
    message = refused(made, shared_with_group=False)
    assert str(made / "shard-17") in message and "any user" in message
    assert stat.S_IMODE((made / "shard-17").stat().st_mode) == 0o606


def test_a_group_writable_file_is_refused_unless_shared(made: Path) -> None:
    (made / REGISTRY).chmod(0o660)
    assert str(made / REGISTRY) in refused(made)
    open_lock_directory(made, shared_with_group=True).close()


@needs_root
def test_a_file_of_another_user_is_refused_naming_it(made: Path) -> None:
    os.chown(made / "shard-40", NOBODY, NOBODY)
    message = refused(made)
    assert str(made / "shard-40") in message and f"uid {NOBODY}" in message


@pytest.mark.parametrize("name", ["shard-00", "shard-63", REGISTRY])
def test_a_symlink_in_place_of_a_file_is_refused_and_its_target_untouched(
        made: Path, tmp_path: Path, name: str) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    target.chmod(0o640)
    (made / name).unlink()
    (made / name).symlink_to(target)
    message = refused(made)
    assert str(made / name) in message and "symbolic link" in message
    assert target.read_bytes() == b"keep me"
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_dangling_symlink_in_place_of_a_file_is_refused_and_nothing_created(
        tmp_path: Path) -> None:
    path = tmp_path / "locks"
    path.mkdir(mode=0o700)
    (path / "shard-05").symlink_to(tmp_path / "created-through-the-link")
    assert "symbolic link" in refused(path)
    assert not (tmp_path / "created-through-the-link").exists()


def test_a_fifo_in_place_of_a_file_is_refused(made: Path) -> None:
    (made / "shard-31").unlink()
    os.mkfifo(made / "shard-31", 0o600)
    assert "not a regular file" in refused(made)


def test_a_file_with_another_name_is_refused(made: Path, tmp_path: Path) -> None:
    os.link(made / "shard-02", tmp_path / "second-name")
    assert "hard links" in refused(made)


# -- the registry -----------------------------------------------------------------------------


@pytest.mark.parametrize("content, why", [
    (b"lockmgr", "7 bytes long"),
    (header(), f"{HEADER} bytes long"),
    (header() + bytes(registry_size()), "bytes long"),
    (bytes(registry_size()), "another magic"),
    (header(magic=b"lockmgr-host-registrx\0") + bytes(registry_size() - HEADER), "another magic"),
    (header(version=1) + bytes(registry_size() - HEADER), "layout version 1"),
    (header(shards=32) + bytes(registry_size() - HEADER), "32 shards"),
    (header(size=registry_size() * 2) + bytes(registry_size() - HEADER), "header"),
    (header()[:-1] + b"\1" + bytes(registry_size() - HEADER), "header"),
])
def test_a_foreign_or_truncated_registry_is_never_trusted_and_left_as_it_is(
        made: Path, content: bytes, why: str) -> None:
    (made / REGISTRY).write_bytes(content)
    message = refused(made)
    assert str(made / REGISTRY) in message and why in message and "never trusted" in message
    assert (made / REGISTRY).read_bytes() == content


def test_an_empty_registry_left_by_an_opener_that_died_is_initialised(made: Path) -> None:
    (made / REGISTRY).write_bytes(b"")
    directory = open_lock_directory(made)
    try:
        assert directory.registry[:HEADER] == header()
    finally:
        directory.close()


def test_the_registry_is_shared_between_openers(tmp_path: Path) -> None:
    first, second = open_lock_directory(tmp_path), open_lock_directory(tmp_path)
    try:
        first.registry[HEADER + 3 * SHARD_SLOT:HEADER + 3 * SHARD_SLOT + 4] = b"\1\2\3\4"
        assert second.registry[HEADER + 3 * SHARD_SLOT:HEADER + 3 * SHARD_SLOT + 4] == b"\1\2\3\4"
    finally:
        first.close()
        second.close()


ROUNDS = 200
OPENERS = 4


def open_fresh_directories_in_step(base: str, start: Any, results: Any) -> None:
    """A spawned process: opens directory r of ``base`` for each round r, all processes at once."""
    failures = []
    for round_ in range(ROUNDS):
        start.wait(timeout=120)
        try:
            open_lock_directory(os.path.join(base, str(round_))).close()
        except Exception as error:
            failures.append(f"round {round_}: {error!r}")
    results.put(failures)


def test_processes_opening_a_new_directory_at_once_all_succeed_with_one_header(
        tmp_path: Path) -> None:
    """Without the registry's lock, an opener reads the header while another writes it (a
    file of the full size, zeros) and refuses it as foreign."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(OPENERS), context.Queue()
    openers = [context.Process(target=open_fresh_directories_in_step,
                               args=(str(tmp_path), start, results)) for _ in range(OPENERS)]
    for opener in openers:
        opener.start()
    failures = [failure for _ in openers for failure in results.get(timeout=240)]
    for opener in openers:
        opener.join(timeout=60)
        assert opener.exitcode == 0
    assert failures == []
    for round_ in range(ROUNDS):
        registry = (tmp_path / str(round_) / REGISTRY).read_bytes()
        assert registry == header() + bytes(registry_size() - HEADER)


# -- fork -------------------------------------------------------------------------------------

FORKED_CHILD = textwrap.dedent("""
    import fcntl, os, struct, sys, traceback
    from lockmgr.host._directory import UnsafeDirectoryError, open_lock_directory

    def take(fd, byte):
        try:
            request = struct.pack("@hhqqi", fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0)
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
            return True
        except BlockingIOError:
            return False

    path = sys.argv[1]
    opened_before = sorted(os.listdir("/proc/self/fd"))  # (the interpreter's own, and the listing's)
    directory = open_lock_directory(path)
    inherited = directory.shard_fds
    {before_fork}
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            {in_child}
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(status)
    _, wait_status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait_status) == 0, "the child failed"
    {after_child}
    directory.close()
    print("done")
""")


def run_forked_child(path: Path, in_child: str, before_fork: str = "",
                     after_child: str = "") -> None:
    """Runs, in a subprocess, a parent that opens ``path``, runs ``before_fork``, forks a child
    running ``in_child`` (which must end without an exception), then runs ``after_child``."""
    def placed(code: str, indent: int) -> str:  # at the placeholder's indentation
        return textwrap.indent(textwrap.dedent(code).strip() or "pass", " " * indent).lstrip()

    script = FORKED_CHILD.format(before_fork=placed(before_fork, 0),
                                 in_child=placed(in_child, 8), after_child=placed(after_child, 0))
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done"


def test_a_forked_child_reopens_its_shards_as_descriptions_of_its_own(tmp_path: Path) -> None:
    run_forked_child(tmp_path, before_fork="""
        assert take(directory.shard_fds[0], 7)  # the parent holds byte 7 of shard-00
    """, in_child="""
        # the inherited descriptor is the parent's description: the kernel lets it through
        assert take(inherited[0], 7)
        directory.reopen_after_fork()
        assert set(directory.shard_fds).isdisjoint(inherited)
        for fd in inherited:  # closed (listing /proc/self/fd would reuse a number)
            try:
                os.fstat(fd)
            except OSError:
                continue
            raise AssertionError(f"inherited descriptor {fd} still open")
        assert not take(directory.shard_fds[0], 7), "the child shares the parent's lock"
        assert take(directory.shard_fds[0], 8)
        assert directory.registry[:7] == b"lockmgr"  # the mapping stays
        directory.close()
    """, after_child="""
        # the child's closing of its inherited descriptors left the parent's lock alone
        other = os.open(os.path.join(path, "shard-00"), os.O_RDWR | os.O_CLOEXEC)
        assert not take(other, 7), "the child dropped the parent's lock"
        assert take(other, 8), "the child's lock outlived it"
        os.close(other)
    """)


def test_a_child_reopens_once_and_its_own_child_reopens_again(tmp_path: Path) -> None:
    run_forked_child(tmp_path, in_child="""
        directory.reopen_after_fork()
        try:  # the child's descriptors are now its own
            directory.reopen_after_fork()
        except RuntimeError:
            pass
        else:
            raise AssertionError("reopened its own descriptors")
        assert take(directory.shard_fds[3], 1)  # the child holds byte 1 of shard-03
        grandchild = os.fork()
        if grandchild == 0:
            directory.reopen_after_fork()
            os._exit(0 if not take(directory.shard_fds[3], 1) else 1)
        assert os.waitstatus_to_exitcode(os.waitpid(grandchild, 0)[1]) == 0
    """)


def test_reopening_a_shard_that_was_replaced_is_refused_and_closes_everything(
        tmp_path: Path) -> None:
    run_forked_child(tmp_path, in_child="""
        os.rename(os.path.join(path, "shard-12"), os.path.join(path, "elsewhere"))
        os.close(os.open(os.path.join(path, "shard-12"), os.O_CREAT | os.O_WRONLY, 0o600))
        try:
            directory.reopen_after_fork()
        except UnsafeDirectoryError as error:
            assert "shard-12 was replaced" in str(error)
        else:
            raise AssertionError("reopened a replaced shard")
        assert directory.shard_fds == () and directory.registry.closed
        assert sorted(os.listdir("/proc/self/fd")) == opened_before, "left open"
    """)


def test_reopening_a_shard_that_is_gone_creates_nothing_and_closes_everything(
        tmp_path: Path) -> None:
    run_forked_child(tmp_path, in_child="""
        os.unlink(os.path.join(path, "shard-50"))
        try:
            directory.reopen_after_fork()
        except FileNotFoundError:
            pass
        else:
            raise AssertionError("reopened a shard that is gone")
        assert not os.path.exists(os.path.join(path, "shard-50"))
        assert directory.shard_fds == () and directory.registry.closed
        assert sorted(os.listdir("/proc/self/fd")) == opened_before, "left open"
    """)


def test_reopening_in_the_process_that_opened_is_refused_and_keeps_its_locks(
        tmp_path: Path) -> None:
    directory = open_lock_directory(tmp_path)
    try:
        fds = directory.shard_fds
        with pytest.raises(RuntimeError, match="forked child"):
            directory.reopen_after_fork()
        assert directory.shard_fds == fds and not directory.registry.closed
    finally:
        directory.close()
    with pytest.raises(ValueError, match="closed"):
        directory.reopen_after_fork()
