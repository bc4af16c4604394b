"""The slot directory and slot files: the pool touches only what is its own alone.

The tmpfs slots live under /dev/shm, which every local user may write, and
the pool runs as root.  Whoever owns the slot directory can swap a slot
file for one of their own (and read the next guest's RAM) or for a
symlink to any file, which root's fill would then truncate and its scrub
punch.  So the directory must be ours, not a symlink, and writable by no
one else; a slot is opened only through the checked directory, never
through a symlink, and used only if it is a regular file of ours, with one
link, on the directory's filesystem, readable by no one else.
"""

import contextlib
import errno
import os
import pwd
import stat
from collections.abc import Iterator

from thinvm.pool.model import PoolError

DIRECTORY_MODE = 0o700
SLOT_MODE = 0o600


class UnsafePath(PoolError):
    """A slot directory or file that is not the pool's alone; the pool does not touch it."""

    def __init__(self, message: str, problem: str) -> None:
        super().__init__(message)
        self.problem = problem  # what is wrong with it, e.g. "is a symbolic link"


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def directory_problem(st: os.stat_result, euid: int) -> str | None:
    """Why a slot directory (its lstat) is not the pool's alone, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != euid:
        return f"belongs to {_who(st.st_uid)}, not to {_who(euid)}, which runs the pool"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def slot_problem(st: os.stat_result, euid: int, device: int) -> str | None:
    """Why an opened slot file (its fstat) is not the pool's alone, or None.

    `device`: the slot directory's st_dev.  A second link would be a name
    for the same data somewhere else (a file of root's linked in).
    """
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != euid:
        return f"belongs to {_who(st.st_uid)}, not to {_who(euid)}, which runs the pool"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} links, not 1"
    if st.st_dev != device:
        return "is on another filesystem than its directory"
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return f"is open to others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def _refuse_directory(path: str, problem: str) -> UnsafePath:
    return UnsafePath(
        f"slot directory {path} {problem}: the pool keeps guest memory there and shares it "
        f"with no one; see what is in it, remove it (rm -r {path}) and start the pool "
        "again, or pass --files DIR with a directory only you can write",
        problem,
    )


def _refuse_slot(path: str, problem: str) -> UnsafePath:
    return UnsafePath(f"slot file {path} {problem}: not touched", problem)


def claim_directory(path: str) -> None:
    """Make the slot directory (mode 0700), or accept an existing one only if it is ours alone."""
    try:
        os.mkdir(path, DIRECTORY_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:
        raise PoolError(f"cannot make slot directory {path}: its parent does not exist") from None
    with open_directory(path):
        pass


@contextlib.contextmanager
def open_directory(path: str) -> Iterator[tuple[int, os.stat_result]]:
    """The slot directory, opened without following a symlink and checked: (fd, its fstat)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            problem = directory_problem(os.lstat(path), os.geteuid()) or "is not a directory"
            raise _refuse_directory(path, problem) from None
        raise
    try:
        st = os.fstat(fd)
        refused = directory_problem(st, os.geteuid())
        if refused is not None:
            raise _refuse_directory(path, refused)
        yield fd, st
    finally:
        os.close(fd)


def open_slot(path: str, *, create: bool = False) -> int:
    """A slot file opened read-write, checked as the pool's alone; the caller closes it.

    `create`: make it (mode 0600, O_EXCL) if it does not exist.
    """
    directory, name = os.path.split(path)
    with open_directory(directory) as (dir_fd, dir_st):
        return _open_in(dir_fd, dir_st.st_dev, path, name, create)


def _open_in(dir_fd: int, device: int, path: str, name: str, create: bool) -> int:
    # O_NONBLOCK: a FIFO or device in a slot's place must not hang the
    # open; it is refused right after, and a slot file is made blocking again.
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, SLOT_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refuse_slot(path, "is a symbolic link") from None
        raise
    problem = slot_problem(os.fstat(fd), os.geteuid(), device)
    if problem is not None:
        os.close(fd)
        raise _refuse_slot(path, problem)
    os.set_blocking(fd, True)
    return fd


def check_slot(path: str) -> None:
    """Raise UnsafePath unless `path` is a slot file of the pool's alone."""
    os.close(open_slot(path))


def remove_slot(path: str) -> None:
    """Unlink a slot's name from its (checked) directory; a symlink goes, never its target."""
    directory, name = os.path.split(path)
    with open_directory(directory) as (dir_fd, _), contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
