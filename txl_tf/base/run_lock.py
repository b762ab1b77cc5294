"""One writer per run directory: an exclusive lock that `python -m txl_tf.train` holds while it trains.

Two trainers writing the same model_dir interleave their checkpoints, config.gin and event files, and the
first run's weights are lost. The trainer takes `RunLock(model_dir)` before it writes anything; a second one is
refused with one line naming the holder:

    error: runs/sample is being trained by pid 4242 on host gpu-7 since 2026-11-24 17:02:11 UTC (lock
    runs/sample/train.lock); stop that run first, or train into another --model_dir

The lock is an `fcntl.flock` on the run directory itself. The kernel drops it when its process ends however it
ends (kill -9 included), so a lock left by a dead trainer never blocks a re-run. While it holds the lock the
trainer keeps model_dir/train.lock, a note of who holds it (pid, host, start time) for the refusal's message,
and removes the note when it lets go; a note left by a killed trainer is only a note and is overwritten. Readers
(evaluate, export, average, generate) take no lock. flock works between processes of one machine and on most
local and network file systems; where a file system refuses it the trainer says so and trains without the lock.
A run directory that cannot be written (a read-only file system, no write permission) is refused in one line
before anything else happens: `error: --model_dir=runs/x is not writable (Read-only file system): writing
runs/x/train.lock failed; give a writable --model_dir (or make it writable)`.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import socket
import sys

from txl_tf.base.errors import UserError

LOCK_FILE = "train.lock"
_NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class RunLockedError(UserError):
    """Another live process holds the run directory's lock."""


class RunDirNotWritableError(UserError):
    """The run directory (or the folder it is to be made in) cannot be written."""


def _holder(path: str) -> str:
    """'pid N on host H since T' from the lock file, or a generic phrase if it cannot be read."""
    try:
        with open(path) as f:
            info = json.load(f)
        return f"pid {info['pid']} on host {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


class RunLock:
    """An exclusive lock on `model_dir` (created if missing) for as long as it is held.

    Use as a context manager, or `acquire()` / `release()`. Raises RunLockedError when another process holds it.
    """

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_FILE)
        self._fd: int | None = None
        self._note = ""

    def _not_writable(self, error: OSError) -> RunDirNotWritableError:
        return RunDirNotWritableError(
            f"--model_dir={self.model_dir} is not writable ({error.strerror}): writing {error.filename or self.path} "
            "failed; give a writable --model_dir (or make it writable)")

    def acquire(self) -> RunLock:
        try:
            os.makedirs(self.model_dir, exist_ok=True)
        except OSError as error:
            if error.errno in _NOT_WRITABLE:
                raise self._not_writable(error) from None
            raise
        fd = os.open(self.model_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLockedError(
                    f"{self.model_dir} is being trained by {_holder(self.path)} (lock {self.path}); stop that "
                    "run first, or train into another --model_dir") from None
            print(f"warning: cannot lock {self.model_dir} ({error.strerror}); training without a lock, so make sure "
                  "no other trainer uses this --model_dir", file=sys.stderr, flush=True)
            return self
        self._fd = fd
        since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        self._note = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
        try:
            with open(self.path, "w") as f:  # the first write of a training run
                f.write(self._note)
        except OSError as error:
            self.release()
            if error.errno in _NOT_WRITABLE:
                raise self._not_writable(error) from None
            raise
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            with open(self.path) as f:
                ours = f.read() == self._note
            if ours:
                os.remove(self.path)
        except OSError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
