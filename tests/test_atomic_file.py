"""Crash-safe writes: a stop signal arriving mid-write is held until the file is in place."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from dilocox.common.atomic_file import atomic_torch_save, stop_signals_deferred, write_text_atomic


class Stop(Exception):
    pass


@pytest.fixture
def sigterm_raises():
    def handler(*_):
        raise Stop

    previous = signal.signal(signal.SIGTERM, handler)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_during_the_body_is_delivered_after_it(sigterm_raises):
    """With another thread alive (a worker has gRPC threads), as the kernel may hand it the signal."""
    stop_thread = threading.Event()
    other = threading.Thread(target=stop_thread.wait, daemon=True)
    other.start()
    handler = signal.getsignal(signal.SIGTERM)
    finished = []
    try:
        with pytest.raises(Stop):
            with stop_signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                finished.append("body")  # the handler has not run yet: the signal is held
    finally:
        stop_thread.set()
    assert finished == ["body"]
    assert signal.getsignal(signal.SIGTERM) is handler  # the process's own handler is back


def test_without_a_signal_nothing_is_raised(sigterm_raises):
    with stop_signals_deferred():
        pass


def test_a_torch_checkpoint_interrupted_by_sigterm_is_whole(sigterm_raises, tmp_path, monkeypatch):
    """The worker's SIGTERM handler raises SystemExit; raised inside torch.save it used to leave a zip
    writer half-closed (`unexpected pos …`) instead of a clean exit with a whole checkpoint."""
    real_save = torch.save

    def save_with_signal(obj, f):
        os.kill(os.getpid(), signal.SIGTERM)  # lands in the middle of the write
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_with_signal)
    state = {"w": torch.arange(10_000, dtype=torch.float32)}
    with pytest.raises(Stop):
        atomic_torch_save(state, tmp_path / "ck.pt")
    assert torch.equal(torch.load(tmp_path / "ck.pt")["w"], state["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind


def test_text_is_written_whole_before_the_signal(sigterm_raises, tmp_path):
    target = tmp_path / "sub" / "port"
    with pytest.raises(Stop):
        with stop_signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            write_text_atomic(target, "12345")
    assert target.read_text() == "12345"


def test_a_durable_marker_is_synced_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    """A checkpoint's COMMITTED must never be left empty or missing by a crash."""
    synced: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (synced.append("rename"), real_replace(a, b))[1])
    write_text_atomic(tmp_path / "COMMITTED", "{}\n", durable=True)
    assert synced == ["fsync", "rename", "fsync"] and (tmp_path / "COMMITTED").read_text() == "{}\n"
    synced.clear()
    write_text_atomic(tmp_path / "port", "1")  # a hand-over file: the rename is enough
    assert synced == ["rename"]
