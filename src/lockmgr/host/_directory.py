"""The directory of a host's locks and its files, opened so that nobody else can tamper with them.

Every process of the host that names the same directory shares its locks: ``SHARDS`` shard
files, whose byte ranges are the kernel record locks of the keys, and one ``registry`` file
that each process maps (``MAP_SHARED``) for what the processes tell each other (a doorbell per
shard now). A lock is only as safe as these files, so the directory is refused unless:

- its filesystem keeps record locks local to this kernel and reliable (Linux: the ``statfs``
  type is on an allowlist; NFS, SMB, FUSE, 9p, Ceph, ... are refused);
- nobody but this user can write it or its files (the group too, when told it is shared);
- its files are regular files opened without following a link (``O_NOFOLLOW``), and the
  registry carries this layout's header (anything else is never trusted, never rewritten).

Every check is made with ``fstat``/``fstatfs`` on the descriptor that is then used, and the
files are opened relative to the directory's own descriptor: what was checked is what is used.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import platform
import stat
import struct
import sys
import threading
from typing import Any

from .._errors import LockError

SHARDS = 64
REGISTRY = "registry"
SHARD_SLOT = 64
HEADER = 64
#: The table of published waits (``_waits``): where it starts, and its slots.
WAITS = HEADER + SHARDS * SHARD_SLOT
WAIT_SLOT = 512
WAIT_SLOTS = 128
#: The table of writers (``_holders``): where it starts, and its slots.
HOLDERS = WAITS + WAIT_SLOTS * WAIT_SLOT
HOLDER_SLOT = 32
HOLDER_SLOTS = 4096

_MAGIC = b"lockmgr-host-registry\0"
_LAYOUT_VERSION = 3  # 2: the table of published waits; 3: the table of writers
# The magic padded to 24 bytes so that the integers after it are aligned; native byte order:
# a registry is only ever read by processes of the kernel that wrote it.
_HEADER_FIELDS = struct.Struct("=24sIIQ")

_DIRECTORY_MODE = 0o700
_SHARED_DIRECTORY_MODE = 0o770
_FILE_MODE = 0o600
_SHARED_FILE_MODE = 0o660


class UnsafeDirectoryError(LockError):
    """The directory cannot hold locks safely (names the path and why).

    Nothing was changed: a file that is not lockmgr's, or not as lockmgr left it, is left as
    it is for a person to look at.
    """


def registry_size() -> int:
    """The registry's length: its header, a slot per shard, the table of published waits
    and the table of writers, in whole pages (it is mapped)."""
    used = HOLDERS + HOLDER_SLOTS * HOLDER_SLOT
    return -(-used // mmap.PAGESIZE) * mmap.PAGESIZE


def _shard_name(shard: int) -> str:
    return f"shard-{shard:02d}"


# -- the filesystem ---------------------------------------------------------------------------
#
# An allowlist, not a denylist: a filesystem nobody looked at may pass record locks to a server
# (and lose them when it restarts) or keep them per client host, and a lock that silently
# excludes nobody is worse than a refusal. Those below are local disk or memory filesystems
# whose record locks the kernel's own VFS keeps (none defines its own lock operation), so a
# lock is seen by every process of this kernel and goes away exactly with its holder:
# ext2/3/4 (one magic), xfs, btrfs, zfs, f2fs, bcachefs; tmpfs and ramfs (memory; /dev/shm,
# /run); overlayfs (containers' root: it keeps the locks on its own inodes, one per file for
# every process that uses the mount).
_LOCAL_FILESYSTEMS = {
    0xEF53: "ext2/ext3/ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0x2FC12FC1: "zfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlayfs",
}
# Known to be refused, named in the error: their locks go through a server or a user-space
# daemon (or are kept per client host), and their shared mappings are not coherent across
# clients.
_NETWORK_FILESYSTEMS = {
    0x6969: "nfs",
    0x517B: "smb",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x65735546: "fuse (sshfs, glusterfs, s3fs, ...)",
    0x01021997: "9p",
    0x00C36400: "ceph",
    0x5346414F: "afs",
    0x6B414653: "afs",
    0x0BD00BD0: "lustre",
    0x01161970: "gfs2",
    0x7461636F: "ocfs2",
}


def _filesystem_refusal(filesystem_type: int) -> str | None:
    """Why a directory on the filesystem of this ``statfs`` type cannot hold locks, or None."""
    if filesystem_type in _LOCAL_FILESYSTEMS:
        return None
    known = _NETWORK_FILESYSTEMS.get(filesystem_type)
    if known is not None:
        return (f"it is on {known} (statfs type {filesystem_type:#x}), whose record locks are "
                "not local to this host and reliable: use a directory on a local filesystem "
                "(/run or /dev/shm, say)")
    return (f"its filesystem (statfs type {filesystem_type:#x}) is not one known to keep record "
            f"locks local and reliable ({', '.join(sorted(set(_LOCAL_FILESYSTEMS.values())))}): "
            "use a directory on one of those (/run or /dev/shm, say)")


# The type is read with fstatfs(2) on the directory's descriptor, not from the mount table
# (/proc/self/mountinfo): it is the filesystem of the very directory opened (bind mounts, mount
# namespaces, a mount made after the table was read and escaped mount points cannot mislead
# it), and it is one call. struct statfs begins with f_type, a C long on every Linux ABI but
# s390x (an unsigned int there). The magics are 32-bit: the mask undoes a long's sign.
_F_TYPE = ctypes.c_uint if platform.machine() == "s390x" else ctypes.c_long
_STATFS_BUFFER = 512  # more than any ABI's struct statfs (120 bytes on 64-bit Linux)


def _fstatfs() -> Any:
    """libc's fstatfs64 where it has one (the same call on 64-bit; on 32-bit, the one that
    does not fail with EOVERFLOW on a large filesystem), else fstatfs."""
    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, "fstatfs64", None) or libc.fstatfs
    function.argtypes = [ctypes.c_int, ctypes.c_void_p]
    function.restype = ctypes.c_int
    return function


_FSTATFS = _fstatfs() if sys.platform.startswith("linux") else None


def _filesystem_type(directory_fd: int) -> int:
    assert _FSTATFS is not None, "read on Linux only"
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER)
    if _FSTATFS(directory_fd, buffer) != 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error))
    return _F_TYPE.from_buffer(buffer).value & 0xFFFFFFFF


def _check_filesystem(directory_fd: int, path: str) -> None:
    """Linux only: elsewhere the filesystem's type is not checked (macOS and the BSDs name it
    in statfs's f_fstypename, at an offset that differs between them; not read here until a
    platform that runs it tests it)."""
    if not sys.platform.startswith("linux"):
        return
    refusal = _filesystem_refusal(_filesystem_type(directory_fd))
    if refusal is not None:
        raise UnsafeDirectoryError(f"{path}: {refusal}")


# -- ownership and permissions ----------------------------------------------------------------


def _check_access(status: os.stat_result, what: str, shared_with_group: bool) -> None:
    """Refuse what another user could write: whoever can write a lock file or its directory can
    swap or truncate it under the holders. With ``shared_with_group``, the group may too, and a
    member of the group may own it; other users never."""
    if status.st_uid != os.geteuid():
        in_group = status.st_gid == os.getegid() or status.st_gid in os.getgroups()
        if not shared_with_group:
            raise UnsafeDirectoryError(
                f"{what} is owned by uid {status.st_uid}, not by this process's user "
                f"({os.geteuid()}); pass shared_with_group=True to share it with its group")
        if not in_group:
            raise UnsafeDirectoryError(
                f"{what} is owned by uid {status.st_uid}, not by this process's user "
                f"({os.geteuid()}), and its group ({status.st_gid}) is not one of this "
                "process's groups")
    if status.st_mode & stat.S_IWOTH:
        raise UnsafeDirectoryError(f"{what} can be written by any user "
                                   f"(mode {stat.S_IMODE(status.st_mode):o})")
    if status.st_mode & stat.S_IWGRP and not shared_with_group:
        raise UnsafeDirectoryError(
            f"{what} can be written by its group (mode {stat.S_IMODE(status.st_mode):o}); "
            "pass shared_with_group=True if the group's processes are to share its locks")


def _check_file(fd: int, what: str, shared_with_group: bool) -> None:
    status = os.fstat(fd)
    if not stat.S_ISREG(status.st_mode):
        raise UnsafeDirectoryError(f"{what} is not a regular file")
    if status.st_nlink != 1:
        # A second name for the file may be another file of this user's, hard-linked in.
        raise UnsafeDirectoryError(f"{what} has {status.st_nlink} names (hard links), not one")
    _check_access(status, what, shared_with_group)


def _open_file(directory_fd: int, name: str, what: str, shared_with_group: bool, *,
               create: bool) -> int:
    """Open a file of the directory read-write, never through a link; create it (only) when it
    is missing and ``create``, with exactly 0600 (0660 shared) whatever the umask. O_EXCL tells
    this opener it created the file, so that only the creator sets the mode."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    mode = _SHARED_FILE_MODE if shared_with_group else _FILE_MODE
    created = False
    try:
        try:
            fd = os.open(name, flags, dir_fd=directory_fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=directory_fd)
                created = True
            except FileExistsError:  # another process created it meanwhile
                fd = os.open(name, flags, dir_fd=directory_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise UnsafeDirectoryError(f"{what} is a symbolic link; lockmgr never follows a link "
                                       "in its directory") from None
        raise
    try:
        if created:
            os.fchmod(fd, mode)
        _check_file(fd, what, shared_with_group)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_directory(path: str, shared_with_group: bool) -> int:
    """The directory's descriptor; a missing directory is made (its parents as os.makedirs
    does), with exactly 0700 (0770 shared) whatever the umask."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    mode = _SHARED_DIRECTORY_MODE if shared_with_group else _DIRECTORY_MODE
    try:
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.mkdir(path, mode)
        except FileExistsError:  # another process made it meanwhile
            return os.open(path, flags)
        fd = os.open(path, flags)
    except NotADirectoryError:
        raise UnsafeDirectoryError(f"{path} is not a directory") from None
    try:
        os.fchmod(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- the registry -----------------------------------------------------------------------------

# An OFD lock excludes every other open file description, those of this process's other threads
# included. Elsewhere only POSIX record locks exist: they exclude other processes, not this
# one's threads, which _POSIX_REGISTRY_CHECK excludes instead (made anew in a forked child,
# where a thread of the parent may have left it held). (A POSIX lock also ends when any
# descriptor of the file closes in the process, another opener's registry mapping included:
# a narrow window there, on those platforms only.)
_OFD_WRITE_LOCK_WAIT = getattr(fcntl, "F_OFD_SETLKW", None)
_FLOCK = struct.Struct("@hhqqi")  # struct flock: l_type, l_whence, l_start, l_len, l_pid
_POSIX_REGISTRY_CHECK = threading.Lock()


def _renew_posix_registry_check() -> None:
    global _POSIX_REGISTRY_CHECK
    _POSIX_REGISTRY_CHECK = threading.Lock()


if _OFD_WRITE_LOCK_WAIT is None:
    os.register_at_fork(after_in_child=_renew_posix_registry_check)


def _lock_registry(fd: int, lock_type: int) -> None:
    """Write-lock (waiting) or unlock the whole registry file (l_len 0: to its end and past)."""
    if _OFD_WRITE_LOCK_WAIT is None:
        fcntl.lockf(fd, fcntl.LOCK_UN if lock_type == fcntl.F_UNLCK else fcntl.LOCK_EX)
    else:  # l_pid must be 0 for an OFD lock
        fcntl.fcntl(fd, _OFD_WRITE_LOCK_WAIT, _FLOCK.pack(lock_type, os.SEEK_SET, 0, 0, 0))


def _header() -> bytes:
    fields = _HEADER_FIELDS.pack(_MAGIC, _LAYOUT_VERSION, SHARDS, registry_size())
    return fields + bytes(HEADER - len(fields))


def _initialise_registry(fd: int) -> None:
    os.ftruncate(fd, registry_size())
    if os.pwrite(fd, _header(), 0) != HEADER:
        raise OSError("short write of the lock registry's header")


def _registry_refusal(fd: int) -> str | None:
    """Why the registry is not one this code wrote for this layout, or None."""
    size = os.fstat(fd).st_size
    if size != registry_size():
        return f"is {size} bytes long, not {registry_size()}"
    header = os.pread(fd, HEADER, 0)
    magic, version, shards, total = _HEADER_FIELDS.unpack_from(header)
    if magic != _MAGIC.ljust(24, b"\0"):
        return "is not a lockmgr registry (another magic)"
    if version != _LAYOUT_VERSION:
        return f"has layout version {version}, not {_LAYOUT_VERSION} (another lockmgr release?)"
    if shards != SHARDS:
        return f"is for {shards} shards, not {SHARDS}"
    if total != registry_size() or any(header[_HEADER_FIELDS.size:]):
        return "has a header this layout does not write"
    return None


def _map_registry(directory_fd: int, path: str, shared_with_group: bool) -> mmap.mmap:
    """Map the registry, initialising an empty one first. The check and the initialisation are
    made under a write lock on the file, so that when several processes open a new directory at
    once exactly one initialises it and none sees it half-written. Anything but an empty file
    or this layout is refused, and left as it is: its content is never trusted."""
    what = os.path.join(path, REGISTRY)
    fd = _open_file(directory_fd, REGISTRY, what, shared_with_group, create=True)
    try:
        with contextlib.nullcontext() if _OFD_WRITE_LOCK_WAIT else _POSIX_REGISTRY_CHECK:
            _lock_registry(fd, fcntl.F_WRLCK)
            try:
                if os.fstat(fd).st_size == 0:
                    _initialise_registry(fd)
                refusal = _registry_refusal(fd)
                if refusal is not None:
                    raise UnsafeDirectoryError(
                        f"{what} {refusal}: it is never trusted and was left as it is; remove "
                        "it when no process uses the directory, or use another directory")
                return mmap.mmap(fd, registry_size(), mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                # Explicitly: the mapping keeps a duplicate of the descriptor, so closing this
                # one would not end an OFD lock.
                _lock_registry(fd, fcntl.F_UNLCK)
    finally:
        os.close(fd)


# -- the directory ----------------------------------------------------------------------------


class LockDirectory:
    """An opened lock directory: a descriptor per shard file and the registry's mapping.

    ``shard_fds[i]`` is ``shard-{i:02d}``, each a file description of its own (an OFD lock
    belongs to the description). Made by ``open_lock_directory``.
    """

    __slots__ = ("_directory_fd", "_opened_by", "_shared_with_group", "path", "registry",
                 "shard_fds")

    def __init__(self, path: str, directory_fd: int, shard_fds: tuple[int, ...],
                 registry: mmap.mmap, shared_with_group: bool) -> None:
        self.path = path
        self.shard_fds = shard_fds
        self.registry = registry
        # Kept so that a forked child reopens the very files its parent locks, not whatever
        # the path names by then.
        self._directory_fd = directory_fd
        self._shared_with_group = shared_with_group
        self._opened_by = os.getpid()  # the process whose descriptions shard_fds are

    def __repr__(self) -> str:
        state = "closed" if self._directory_fd < 0 else "open"
        return f"<LockDirectory {self.path!r} {state}>"

    def open_file(self, name: str) -> int:
        """A descriptor of the directory's file ``name`` (made if missing), opened and checked
        as the shard files are; the caller closes it. ValueError once closed."""
        if self._directory_fd < 0:
            raise ValueError(f"{self!r} is closed")
        return _open_file(self._directory_fd, name, os.path.join(self.path, name),
                          self._shared_with_group, create=True)

    def reopen_after_fork(self) -> None:
        """In a forked child: open each shard file again (new open file descriptions), then
        close the inherited descriptors. An inherited descriptor shares its open file
        description, and so its OFD locks, with the parent: a child locking or unlocking
        through it would take or drop the parent's locks. Closing it in the child leaves the
        parent's locks alone (they last while the parent's descriptor does). Each reopened
        file must be the inherited one (same device and inode), else the child would lock
        another file than its parent. On any error everything is closed. The registry's
        mapping stays: it is meant to be shared.

        Refused (RuntimeError) in the process that opened the descriptors, where closing them
        would drop its own locks; ValueError once closed."""
        if self._directory_fd < 0:
            raise ValueError(f"the lock directory {self.path} is closed")
        if os.getpid() == self._opened_by:
            raise RuntimeError("reopen_after_fork() is for a forked child: this process opened "
                               "these descriptors, and closing them would drop its locks")
        fresh: list[int] = []
        try:
            for shard, inherited in enumerate(self.shard_fds):
                name = _shard_name(shard)
                what = os.path.join(self.path, name)
                fresh.append(_open_file(self._directory_fd, name, what, self._shared_with_group,
                                        create=False))
                before, now = os.fstat(inherited), os.fstat(fresh[-1])
                if (before.st_dev, before.st_ino) != (now.st_dev, now.st_ino):
                    raise UnsafeDirectoryError(f"{what} was replaced since the parent opened it")
        except BaseException:
            _close_all(fresh)
            self.close()
            raise
        inherited_fds, self.shard_fds = self.shard_fds, tuple(fresh)
        self._opened_by = os.getpid()
        _close_all(inherited_fds)

    def close(self) -> None:
        """Close the descriptors and the mapping; again is a no-op. Closing ends this process's
        locks taken through these descriptors. The mapping closes only once nothing exports
        its buffer (ctypes objects made from it): BufferError otherwise, the descriptors being
        closed already, and a later close() tries the mapping again."""
        shard_fds, self.shard_fds = self.shard_fds, ()
        directory_fd, self._directory_fd = self._directory_fd, -1
        _close_all(shard_fds)
        if directory_fd >= 0:
            os.close(directory_fd)
        self.registry.close()


def _close_all(fds: tuple[int, ...] | list[int]) -> None:
    for fd in fds:
        os.close(fd)


def open_lock_directory(path: str | os.PathLike[str], *,
                        shared_with_group: bool = False) -> LockDirectory:
    """Open (making it if missing) the lock directory ``path`` and its files, or refuse it.

    ``path`` may itself be a symbolic link to a directory (a deployment's choice); the files
    inside are never followed. The directory's parents are not checked: the directory is held
    by its descriptor once opened, and a directory swapped in under its name would fail the
    same checks in the processes that open it.

    ``shared_with_group=False`` (the default): the directory and its files must belong to this
    process's effective user and be writable by nobody else. ``True``: they may also belong to
    another user whose group (the file's group) is one of this process's groups, and may be
    group-writable; a missing directory and new files are made group-writable (0770, 0660).
    Writable by any user is refused either way.

    Raises ``UnsafeDirectoryError`` (naming the path and why) for a directory that cannot
    hold locks safely, ``OSError`` for what the system refused; nothing stays open then.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or an os.PathLike of str, not {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str):
        raise TypeError(f"path must name a str path, not {type(text).__name__}")
    if not text:
        raise ValueError("path must not be empty")
    if not isinstance(shared_with_group, bool):
        raise TypeError(
            f"shared_with_group must be a bool, not {type(shared_with_group).__name__}")
    absolute = os.path.abspath(text)
    directory_fd = _open_directory(absolute, shared_with_group)
    shard_fds: list[int] = []
    try:
        _check_filesystem(directory_fd, absolute)
        _check_access(os.fstat(directory_fd), absolute, shared_with_group)
        for shard in range(SHARDS):
            name = _shard_name(shard)
            shard_fds.append(_open_file(directory_fd, name, os.path.join(absolute, name),
                                        shared_with_group, create=True))
        registry = _map_registry(directory_fd, absolute, shared_with_group)
    except BaseException:
        _close_all(shard_fds)
        os.close(directory_fd)
        raise
    return LockDirectory(absolute, directory_fd, tuple(shard_fds), registry, shared_with_group)
