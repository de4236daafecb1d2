"""Worker processes of a data-parallel run, started and watched by rank 0: none is left behind, whatever happens.

Each worker is a fresh interpreter (``subprocess``, never ``fork``: the parent has usually initialised CUDA, and a
forked CUDA context is unusable) running an *entry script* given by path, with three environment variables: the
address of rank 0's control listener (``127.0.0.1``, a port the system picks), a random key (the listener accepts
only clients that know it) and the worker's rank. Over that connection the worker says hello, receives its
payloads, reports ``ready`` (it is about to join the process group), then ``done``, ``stopped`` or ``error`` with
its traceback.

Rank 0 watches every connection on a thread of its own: a worker that reports an error, exits without a word
(killed, crashed) or never connects becomes a :class:`WorkerFailedError` naming the rank, its process id and its
exit (a signal by name), which the collectives raise in rank 0 at once (:class:`~.collective.Collective`'s
``check``). :meth:`WorkerPool.close` ends every worker: the control connection is closed, which makes a worker's
own watch thread exit it at once (a worker never outlives rank 0, even one blocked inside a collective), then
``terminate`` and ``kill`` for a worker that is still there after a grace period; every process is waited for.

Ranks on other machines (``remote``) are not started here: a join process there (``scripts/join-training``)
connects to the same listener, bound then to an address other machines reach, with the key the user gave both
sides (the handshake authenticates both ends before anything is unpickled: a peer without the key is refused and
the listener goes on waiting). Each is given the next free remote rank. Such a rank ends with its connection: rank 0
cannot kill a process on another machine, and closing the connection ends it there as it ends a local worker.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

__all__ = ["ADDRESS_ENV", "KEY_ENV", "RANK_ENV", "WorkerFailedError", "WorkerLink", "WorkerPool", "connect", "join"]

log = logging.getLogger("dataset_cache.workers")

ADDRESS_ENV = "STREAMCACHE_WORKER_ADDRESS"
KEY_ENV = "STREAMCACHE_WORKER_KEY"
RANK_ENV = "STREAMCACHE_WORKER_RANK"
START_TIMEOUT_S = 600.0
"""How long a worker may take to start (interpreter, torch and ComfyUI imports) and report ``ready``."""
GRACE_S = 10.0
"""How long :meth:`WorkerPool.close` waits for workers to exit by themselves before it terminates them."""


class WorkerFailedError(RuntimeError):
    """A worker process failed: its own error, or how it ended.

    Attributes:
        rank: the worker's rank.
        reason: one line: the worker's error message, or its exit.
        details: the worker's traceback, when it sent one.
    """

    def __init__(self, rank: int, reason: str, details: str = "") -> None:
        tail = f"\n--- rank {rank}'s traceback ---\n{details.rstrip()}" if details else ""
        super().__init__(f"training on several devices failed on rank {rank}: {reason}{tail}")
        self.rank = rank
        self.reason = reason
        self.details = details


def describe_exit(code: int | None) -> str:
    """``"exited with code 3"`` / ``"was killed by signal SIGKILL"`` / ``"is still running"``."""
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = (" (unless someone killed it on purpose, the system ran out of memory: each rank holds its own copy "
                "of the model in host RAM while it loads it)") if name == "SIGKILL" else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


class _Worker:
    def __init__(self, rank: int, proc: subprocess.Popen[bytes] | None) -> None:
        self.rank = rank
        self.proc = proc
        """The local process (``None``: a rank joining from another machine)."""
        self.where = ""
        """A remote rank's machine, as it said and as it connected (``"gpu-box-2 at 10.0.0.7"``)."""
        self.about: dict[str, str] = {}
        """What the worker said of itself with ``ready`` (e.g. its software versions)."""
        self.conn: Connection | None = None
        self.state = "starting"  # starting → connected → ready → done | stopped | error | lost
        self.thread: threading.Thread | None = None

    def describe(self) -> str:
        """``"the worker (pid 123)"`` or ``"the rank on gpu-box-2 at 10.0.0.7"``, for messages."""
        return f"the worker (pid {self.proc.pid})" if self.proc is not None else f"the rank on {self.where}"


class WorkerPool:
    """Rank 0's workers: start, hand out payloads, watch, end.

    Args:
        entry: the entry script each worker runs (by path, with ``python``).
        ranks: the workers' ranks (1 .. N-1).
        env: extra environment of each worker, by rank (e.g. ``CUDA_VISIBLE_DEVICES``).
        python: the interpreter (this one's by default).
        remote: the ranks that join from other machines (started there, not here).
        address: where the listener listens (``127.0.0.1`` at a port the system picks unless ranks join from
            other machines).
        key: the key every connection must know (random unless ranks join from other machines).
    """

    def __init__(self, entry: Path, ranks: Sequence[int], env: Callable[[int], Mapping[str, str]], *,
                 python: str = sys.executable, remote: Sequence[int] = (),
                 address: tuple[str, int] = ("127.0.0.1", 0), key: bytes | None = None) -> None:
        self.entry = Path(entry)
        self.ranks = list(ranks)
        self.remote = list(remote)
        self.env = env
        self.python = python
        self.bind = address
        self.key = key
        self._workers: dict[int, _Worker] = {}
        self._cond = threading.Condition()
        self._failure: WorkerFailedError | None = None
        self._listener: Listener | None = None
        self._acceptor: threading.Thread | None = None
        self._closing = False

    # ------------------------------------------------------------------------------------------ start
    def start(self, payloads: Callable[[int], Sequence[bytes]]) -> None:
        """Start every worker; each receives ``payloads(rank)`` (in order) once it has connected."""
        key = self.key or secrets.token_bytes(32)
        try:
            self._listener = Listener(self.bind, authkey=key)
        except OSError as exc:
            raise RuntimeError(f"cannot listen for the training's ranks at {self.bind[0]}:{self.bind[1]} ({exc}): "
                               "pick another address or port") from exc
        host, port = self._listener.address
        host = _loopback_for(host)  # listening everywhere: local workers come over the loopback
        for rank in self.remote:
            self._workers[rank] = _Worker(rank, None)
        for rank in self.ranks:
            env = {**os.environ, **self.env(rank), ADDRESS_ENV: f"{host}:{port}", KEY_ENV: key.hex(),
                   RANK_ENV: str(rank)}
            proc = subprocess.Popen([self.python, str(self.entry)], env=env, stdin=subprocess.DEVNULL)
            self._workers[rank] = _Worker(rank, proc)
            log.info("started worker rank %d (pid %d)", rank, proc.pid)
        if self.remote:
            log.info("waiting for %d rank(s) to join from other machines at %s:%d", len(self.remote), *self.bind)
        self._acceptor = threading.Thread(target=self._accept, args=(payloads,), name="streamcache-ddp-accept",
                                          daemon=True)
        self._acceptor.start()

    @property
    def pids(self) -> dict[int, int]:
        """Rank → process id of every worker started here."""
        return {r: w.proc.pid for r, w in self._workers.items() if w.proc is not None}

    @property
    def machines(self) -> dict[int, str]:
        """Rank → the machine of every rank that joined from another (``"gpu-box-2 at 10.0.0.7"``)."""
        with self._cond:
            return {r: w.where for r, w in sorted(self._workers.items()) if w.proc is None and w.where}

    @property
    def about(self) -> dict[int, dict[str, str]]:
        """Rank → what each worker said of itself when it reported ``ready``."""
        with self._cond:
            return {r: dict(w.about) for r, w in sorted(self._workers.items()) if w.about}

    @property
    def address(self) -> tuple[str, int]:
        """Where the listener listens (the port the system picked, once started)."""
        listener = self._listener
        return tuple(listener.address) if listener is not None else self.bind

    def _accept(self, payloads: Callable[[int], Sequence[bytes]]) -> None:
        listener = self._listener
        assert listener is not None
        while True:  # until close(): a connection after every rank has joined is turned away, not left hanging
            with self._cond:
                if self._closing:
                    return
            try:
                conn = listener.accept()
            except (AuthenticationError, EOFError, ConnectionError, TimeoutError) as exc:
                if self._closing:
                    return
                log.warning("refused a connection to the training listener (%s): it did not know the key",
                            type(exc).__name__)
                continue
            except Exception:  # closed while waiting (close(), a failure)
                if not self._closing:
                    log.debug("worker listener stopped", exc_info=True)
                return
            worker = self._claim(conn, listener.last_accepted)
            if worker is None:
                conn.close()
                continue
            rank = worker.rank
            try:
                made = list(payloads(rank))
            except Exception as exc:  # rank 0's own failure to make the job: the run cannot go on
                with self._cond:
                    self._fail(WorkerFailedError(rank, f"rank 0 could not make its job ({type(exc).__name__}: "
                                                 f"{exc})"))
                    self._cond.notify_all()
                conn.close()
                continue
            try:
                for payload in made:
                    conn.send_bytes(payload)
            except Exception as exc:  # e.g. the worker died meanwhile: its watch thread reports how
                log.debug("could not send rank %d its payload: %r", rank, exc)
            with self._cond:
                worker.conn = conn
                worker.state = "connected"
                self._cond.notify_all()
            worker.thread = threading.Thread(target=self._watch, args=(worker,), name=f"streamcache-ddp-{rank}",
                                             daemon=True)
            worker.thread.start()

    def _claim(self, conn: Connection, peer: Any) -> _Worker | None:
        """The slot an authenticated connection takes by its hello: ``("hello", rank)`` a local worker's own,
        ``("join", machine)`` the next free remote rank; ``None`` for anything else."""
        try:
            hello = conn.recv() if conn.poll(30.0) else None
        except Exception:
            return None
        if not (isinstance(hello, tuple) and len(hello) == 2):
            return None
        kind, detail = hello
        with self._cond:
            if kind == "hello":
                worker = self._workers.get(detail) if isinstance(detail, int) else None
                return worker if worker is not None and worker.proc is not None and worker.conn is None else None
            if kind == "join":
                free = [w for w in self._workers.values() if w.proc is None and w.conn is None and not w.where]
                if not free:
                    log.warning("refused a rank joining from %s: every remote rank has joined", detail)
                    return None
                worker = min(free, key=lambda w: w.rank)
                host = peer[0] if isinstance(peer, tuple) and peer else peer
                worker.where = f"{str(detail)[:100]} at {host}"
                log.info("rank %d joins from %s", worker.rank, worker.where)
                return worker
        return None

    def _watch(self, worker: _Worker) -> None:
        conn = worker.conn
        assert conn is not None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0] if isinstance(message, tuple) and message else None
            with self._cond:
                if kind == "ready":
                    worker.state = "ready"
                    if len(message) > 1 and isinstance(message[1], dict):
                        worker.about = {str(k): str(v)[:200] for k, v in list(message[1].items())[:20]}
                elif kind in ("done", "stopped"):
                    worker.state = kind
                elif kind == "error":
                    worker.state = "error"
                    self._fail(WorkerFailedError(worker.rank, str(message[1]),
                                                 str(message[2]) if len(message) > 2 else ""))
                self._cond.notify_all()
        code: int | None = None
        if worker.proc is not None:
            try:
                code = worker.proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                code = None
            ended = describe_exit(code)
        else:
            ended = ("ended its connection (the machine is unreachable, or its join process ended: its output is "
                     "in that machine's console)")
        log.info("rank %d (%s) ended: %s, %s", worker.rank, worker.describe(), worker.state, ended)
        with self._cond:
            if worker.state not in ("done", "stopped", "error"):
                worker.state = "lost"
                if not self._closing:
                    self._fail(WorkerFailedError(worker.rank, f"{worker.describe()} {ended}"))
            elif code and worker.state != "error" and not self._closing:
                self._fail(WorkerFailedError(worker.rank, f"{worker.describe()} {ended} after it finished"))
            self._cond.notify_all()

    def _fail(self, error: WorkerFailedError) -> None:
        if self._failure is None:  # the first failure is the cause; the others follow from it
            self._failure = error
            log.error("%s", error)

    # ------------------------------------------------------------------------------------------ waiting
    def check(self, wait_s: float = 0.0) -> None:
        """Raise the first failure; ``wait_s``: how long to wait for one to be reported (after a collective
        failed, the failing worker's exit is noticed a moment later)."""
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._failure is None and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            if self._failure is None:
                self._check_unconnected()
            if self._failure is not None:
                raise self._failure

    def _check_unconnected(self) -> None:
        for worker in self._workers.values():
            if worker.conn is None and worker.proc is not None and worker.proc.poll() is not None \
                    and not self._closing:
                self._fail(WorkerFailedError(worker.rank, f"the worker (pid {worker.proc.pid}) "
                                             f"{describe_exit(worker.proc.returncode)} before it connected (its "
                                             "output is in ComfyUI's console)"))

    def wait_ready(self, stop_requested: Callable[[], bool], on_stop: Callable[[], None],
                   timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every worker reported ``ready``; a failure raises it, a stop request calls ``on_stop``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            with self._cond:
                waiting = [w.rank for w in self._workers.values() if w.state not in ("ready", "done", "stopped")]
                if not waiting:
                    return
                self._cond.wait(timeout=0.1)
            if stop_requested():
                on_stop()
                raise RuntimeError("stopped while the workers were starting")
            if time.monotonic() > deadline:
                absent = [r for r in waiting if self._workers[r].proc is None and self._workers[r].conn is None]
                if absent:
                    host, port = self.bind[0], self.address[1]
                    raise WorkerFailedError(absent[0], f"{len(absent)} of {len(self.remote)} ranks from other "
                                            f"machines did not join within {timeout_s:.0f} s: start the join "
                                            f"command on each (scripts/join-training --main <this machine>:{port}, "
                                            "with the same STREAMCACHE_JOIN_KEY), and check that they reach "
                                            f"this machine at port {port} (listening on {host})")
                raise WorkerFailedError(waiting[0], f"the worker did not start within {timeout_s:.0f} s; "
                                        "see its output in ComfyUI's console")

    def finish(self, timeout_s: float = 60.0) -> None:
        """At the end of a run (or an agreed stop): wait until every worker has reported and exited by itself;
        :meth:`close` ends any that did not in time.

        Raises:
            WorkerFailedError: a worker failed at the end.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._failure is None and time.monotonic() < deadline and any(
                    w.state not in ("done", "stopped", "error", "lost") for w in self._workers.values()):
                self._cond.wait(timeout=0.1)
        for worker in self._workers.values():  # its watch thread ends once the process has exited
            if worker.thread is not None:
                worker.thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.check()

    # ------------------------------------------------------------------------------------------ ending
    def close(self) -> None:
        """End every worker and wait for it: the control connections closed (a worker exits when its connection
        ends), then ``terminate``, then ``kill``, each after a grace period. Idempotent."""
        with self._cond:
            self._closing = True
        listener, self._listener = self._listener, None
        if listener is not None:
            _wake(listener)
            try:
                listener.close()
            except OSError:
                pass
        for worker in self._workers.values():
            if worker.conn is not None:
                try:
                    worker.conn.send(("stop",))
                except (OSError, ValueError):
                    pass
                worker.conn.close()
        procs = [w.proc for w in self._workers.values() if w.proc is not None]
        _wait_all(procs, GRACE_S)
        for action in ("terminate", "kill"):
            alive = [proc for proc in procs if proc.poll() is None]
            if not alive:
                break
            for proc in alive:
                log.warning("worker pid %d did not exit: %s", proc.pid, action)
                getattr(proc, action)()
            _wait_all(alive, GRACE_S)
        for worker in self._workers.values():
            if worker.thread is not None:
                worker.thread.join(timeout=GRACE_S)
        if self._acceptor is not None:
            self._acceptor.join(timeout=GRACE_S)


def _loopback_for(host: str) -> str:
    """How this machine reaches a listener bound to ``host``: the loopback for every interface (connecting to
    ``0.0.0.0`` works on Linux only), else ``host`` itself."""
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wake(listener: Listener) -> None:
    """End a pending ``accept()`` (closing the listener does not): a connection that fails its handshake."""
    host, port = listener.address
    try:
        with socket.create_connection((_loopback_for(host), port), timeout=1.0):
            pass
    except OSError:
        pass


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


class WorkerLink:
    """A worker's side of its control connection: payloads in, reports out, and a watch thread that exits the
    process as soon as rank 0 says stop or the connection ends (rank 0 gone, cancelled or failed)."""

    def __init__(self, conn: Connection, rank: int) -> None:
        self.conn = conn
        self.rank = rank
        self._lock = threading.Lock()
        self._watch: threading.Thread | None = None

    def receive(self) -> bytes:
        """The next payload."""
        return self.conn.recv_bytes()

    def send(self, *message: Any) -> None:
        """Report to rank 0 (``("ready", about)``, ``("done",)``, ``("stopped",)``, ``("error", message, traceback)``);
        a report rank 0 can no longer take is dropped."""
        with self._lock:
            try:
                self.conn.send(message)
            except (OSError, ValueError):
                pass

    def watch_parent(self, exit_code: int = 3, on_exit: Callable[[int], Any] = os._exit) -> None:
        """Start the watch thread: ``("stop",)`` or the end of the connection exits the process with
        ``exit_code`` at once (``os._exit``: no cleanup, nothing of the run is worth keeping then)."""
        def watch() -> None:
            while True:
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    break
                if isinstance(message, tuple) and message[:1] == ("stop",):
                    break
            on_exit(exit_code)

        self._watch = threading.Thread(target=watch, name="streamcache-ddp-parent", daemon=True)
        self._watch.start()


def connect(environ: Mapping[str, str] = os.environ) -> WorkerLink:
    """Connect to rank 0 with the address, key and rank in ``environ`` and say hello.

    Raises:
        RuntimeError: the variables are missing (the script was not started by a :class:`WorkerPool`).
    """
    try:
        host, port = environ[ADDRESS_ENV].rsplit(":", 1)
        key = bytes.fromhex(environ[KEY_ENV])
        rank = int(environ[RANK_ENV])
    except (KeyError, ValueError) as exc:
        raise RuntimeError(f"not started as a training worker ({exc!r}): this script is run by rank 0 only") from exc
    conn = Client((host, int(port)), authkey=key)
    conn.send(("hello", rank))
    return WorkerLink(conn, rank)


def join(host: str, port: int, key: bytes, machine: str) -> WorkerLink:
    """Join a run from another machine: connect to rank 0's listener at ``host:port`` with ``key`` and say which
    ``machine`` this is; rank 0 assigns the rank (in the job it sends; :attr:`WorkerLink.rank` is -1 until then).

    Raises:
        ConnectionRefusedError: nothing listens there (no run is waiting for ranks yet).
        PermissionError: the listener does not know ``key`` (or this side does not know its key).
    """
    try:
        conn = Client((host, port), authkey=key)
    except AuthenticationError as exc:
        raise PermissionError(f"the training listener at {host}:{port} and this machine have different keys "
                              "(STREAMCACHE_JOIN_KEY): set the same key on both") from exc
    conn.send(("join", machine))
    return WorkerLink(conn, -1)
