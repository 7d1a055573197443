"""Crash-safe file replacement: write a temporary file beside the target, fsync, rename, fsync the folder.

A crash at any point leaves either the previous file or the new one, never a torn mix. Small
hand-over files (a bound port for a parent process to read) only need the rename: a reader never sees
them half-written.

A stop signal is held back while a file is written: processes here turn SIGTERM into `sys.exit`, and an
exception raised inside `torch.save` leaves its zip writer half-closed, which then fails with an
unrelated error instead of the clean exit the operator asked for. The signal is delivered as soon as the
file is in place.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold back the Python handlers of SIGTERM and SIGINT while the body runs, then deliver a signal that
    arrived meanwhile. Python runs signal handlers on the main thread only, so a write from another
    thread is never interrupted by them and needs nothing. Blocking the signal in the OS is not enough:
    a process with gRPC threads takes it on another thread and still runs the handler here."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    held = {}
    for signum in _STOP_SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler):  # SIG_DFL / SIG_IGN end or ignore the process outside Python: nothing to hold
            held[signum] = handler
            signal.signal(signum, lambda number, _frame: arrived.append(number))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        if arrived:
            signal.raise_signal(arrived[0])


def write_text_atomic(path: str | os.PathLike, text: str, durable: bool = False) -> None:
    """Write `text` to a temporary file beside `path` (a name of its own, so that concurrent writers of
    the same file never share one), then rename it into place; creates the folder if needed.
    `durable`: fsync the file before the rename and the folder after it — for a marker a crash must never
    leave empty or missing once it was said to be written (a checkpoint's `COMMITTED`)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with stop_signals_deferred(), os.fdopen(fd, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        _fsync_folder(path.parent)


def _fsync_folder(folder: pathlib.Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash
    finally:
        os.close(dir_fd)


def atomic_torch_save(obj: object, path: str | os.PathLike) -> pathlib.Path:
    import torch  # here, so that processes writing only text files (relays, probes) start without it

    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with stop_signals_deferred(), os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def _as_umask_allows(folder: pathlib.Path) -> None:
    """Give the folder's files the permissions `open` would have (0666 less the umask): some writers
    (safetensors' `save_file`, `tempfile`) make 0600 files, which teammates on a shared file system then
    cannot read."""
    umask = _umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def _umask() -> int:
    """The process's umask, read without setting it (`os.umask` sets it process-wide, racing other threads)."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


@contextlib.contextmanager
def atomic_folder(out: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Write a whole folder or nothing: yields a temporary sibling to fill, renamed to `out` on success
    and removed on any error. `out` must not exist, or be an empty folder."""
    out = pathlib.Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not an empty folder: choose another or remove it")
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        yield partial
        _as_umask_allows(partial)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
