"""Keeps ``gateway serve``'s shared engine process running (``GATEWAY_TORCH_ENGINE=shared``).

A thread of the serving process starts the engine, waits for it to say it listens (a byte on a
pipe) and for it to exit, and starts it again after a delay that doubles with each consecutive
failed start (from ``backoff`` to ``max_backoff``). A start fails when the engine exits before it
listens or within ``stable`` seconds of being started; after ``attempts`` failed starts in a row the
supervisor gives up and calls ``on_give_up`` (``gateway serve`` then stops its workers and exits
non-zero, so the container is restarted: a crash loop is the orchestrator's to see). The workers
reconnect by themselves to each new engine.

The engine also holds the read end of a second pipe whose write end only the serving process has
(``--parent-fd``): when that process dies, however (SIGKILL, an OOM kill), the kernel closes the
write end and the engine, reading end-of-file, stops; no engine outlives the gateway that started it.
That pipe is also how ``stop`` stops it: the engine ignores SIGTERM and SIGINT, which systemd or a
Ctrl-C sends to every process of the gateway at once, so that it serves the workers' drain.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


class EngineSupervisor:
    def __init__(
        self,
        command: Sequence[str],
        *,
        attempts: int,
        on_give_up: Callable[[], None],
        backoff: float = 0.5,
        max_backoff: float = 30.0,
        stable: float = 60.0,
    ) -> None:
        """``command`` starts the engine; ``--ready-fd N`` (the engine writes a byte to that fd once
        it listens) and ``--parent-fd M`` (end-of-file there: the serving process is gone) are added."""
        self.command = list(command)
        self.attempts = attempts
        self.on_give_up = on_give_up
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.stable = stable
        self.gave_up = False
        self.starts = 0
        """Engine processes started so far."""
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._parent_pipe: int | None = None
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop supervising; stop the engine (end-of-file on its ``--parent-fd``: it ignores
        SIGTERM and SIGINT, which may come to every process of the gateway at once while the
        workers drain), SIGKILL it after ``timeout`` seconds."""
        with self._lock:
            self._stopping.set()
            process = self._process
        self._close_parent_pipe()
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stopping.is_set():
            started = time.monotonic()
            served, status = self._run_once()
            if self._stopping.is_set():
                return
            ran = time.monotonic() - started
            failures = 0 if served and ran >= self.stable else failures + 1
            if failures >= self.attempts:
                logger.error("engine: exited with status %s; %d failed starts in a row, giving up", status, failures)
                self.gave_up = True
                self.on_give_up()
                return
            delay = min(self.backoff * 2 ** max(failures - 1, 0), self.max_backoff)
            logger.error(
                "engine: exited with status %s after %.1f s (%s); starting it again in %.1f s",
                status,
                ran,
                "it had served" if served else "before serving",
                delay,
            )
            self._stopping.wait(delay)

    def _run_once(self) -> tuple[bool, int | None]:
        """One engine process's life: whether it listened, and its exit status."""
        read_end, write_end = os.pipe()  # not inheritable: only the engine gets the write end
        parent_read, parent_write = os.pipe()  # the engine gets the read end; this process keeps the other
        with self._lock:
            self._parent_pipe = parent_write
        try:
            try:
                with self._lock:
                    if self._stopping.is_set():
                        os.close(read_end)
                        return False, None
                    self._process = process = subprocess.Popen(
                        [*self.command, "--ready-fd", str(write_end), "--parent-fd", str(parent_read)],
                        pass_fds=(write_end, parent_read),
                    )
                    self.starts += 1
            except OSError as exc:
                logger.error("engine: could not be started: %s", exc)
                os.close(read_end)
                return False, None
            finally:
                os.close(write_end)
                os.close(parent_read)
            with os.fdopen(read_end, "rb") as ready:
                served = ready.read(1) == b"1"  # b"" once the engine exits without listening
            return served, process.wait()
        finally:
            self._close_parent_pipe()  # held for the engine's life: the kernel closes it if this process dies

    def _close_parent_pipe(self) -> None:
        """Close this process's end of the engine's ``--parent-fd`` pipe (once: ``stop`` and the
        thread may both try): the engine reads end-of-file and stops."""
        with self._lock:
            fd, self._parent_pipe = self._parent_pipe, None
        if fd is not None:
            os.close(fd)
