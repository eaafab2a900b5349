"""Starting the tensor-parallel ranks, and their lives: rank 0 is the process the user started
(server, CLI, LLM); it starts one worker process per further device (`python -m
blockspec.distributed.launch RANK …`: a fresh interpreter, as multiprocessing's spawn would
make, but without re-importing the caller's main module, so a script using LLM(...) needs no
`if __name__ == "__main__"` guard, and without a resource tracker to complain at a fatal exit),
or, under torchrun (several hosts), every rank is a process torchrun started and the ranks above
0 run `serve_steps` instead of the command.

Messages from rank 0 (Load, StepPlan, Unload, Exit: runner.py) go over the control group, one
per step. Faults end everything with one line, never a hang: a watchdog thread on rank 0 waits
on each worker process; a worker that dies (killed, crashed) makes rank 0 print
`blockspec: tensor-parallel worker rank R (pid P) died (…); stopping` and exit 1 at once, killing
the other workers; a worker dies with its parent (PR_SET_PDEATHSIG). Workers ignore SIGINT and
SIGTERM: those are rank 0's to handle (the server drains, then stops every worker at exit).
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from blockspec.distributed.group import TPGroup, init_group
from blockspec.distributed.runner import Exit, Load, StepPlan, Unload, WorkerRunner

STOP_TIMEOUT_S = 10.0
FATAL_GRACE_S = 1.0          # a step error on rank 0 waits this long for a worker's death to name


@dataclass
class Workers:
    """Rank 0's handle on the group: its collectives and the worker processes it started."""
    tp: TPGroup | None                              # None while the spawned workers join
    processes: list[subprocess.Popen] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    fatal_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, message: object) -> None:
        self.tp.broadcast_message(message)

    def stop(self) -> None:
        """Stop every worker (at exit: after the server's drain, after generate's output)."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        try:
            self.send(Exit())
        except Exception:  # noqa: BLE001 - a group already broken has nobody left to tell
            pass
        for process in self.processes:
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
        dist.destroy_process_group()

    def dead_worker(self, timeout: float) -> str | None:
        """A line naming the first worker that has died (waiting up to timeout), or None."""
        deadline = time.monotonic() + timeout
        while True:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None:
                    return death_line(rank, process)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def fatal(self, message: str) -> None:
        """End this process (and every worker) with one line on stderr."""
        with self.fatal_lock:
            if self.stopping.is_set():
                return
            message = self.dead_worker(FATAL_GRACE_S) or message
            print(f"blockspec: {message}", file=sys.stderr, flush=True)
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
            os._exit(1)

    def watch(self, rank: int, process: subprocess.Popen) -> None:
        """A watchdog thread per worker: its death while not stopping is fatal."""
        process.wait()
        if not self.stopping.is_set():
            self.fatal(death_line(rank, process))

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Rank 0's side of a load: every rank says whether it loaded, so a rank that failed
        (a bad checkpoint, no memory) fails the load everywhere with its own message, and the
        workers wait for the next message rather than a forward that will never come."""
        try:
            yield
        except Exception as exc:
            exchange_status(self.tp, f"{type(exc).__name__}: {exc}")
            raise
        failures = exchange_status(self.tp, None)
        if failures:
            from blockspec.loader import LoadError
            raise LoadError(failures[0])


_LEADER: Workers | None = None


def leader(size: int, device_type: str) -> Workers:
    """This process as rank 0 of `size` ranks: the group started once per process (spawned
    workers, or joined under torchrun) and kept for every LLM made in it."""
    global _LEADER
    if _LEADER is not None:
        if _LEADER.tp.size != size:
            from blockspec.config import ConfigError
            raise ConfigError(f"--tensor-parallel-size {size}: this process already runs a group of {_LEADER.tp.size}")
        return _LEADER
    if torchrun_rank() is not None:
        check_torchrun_size(size)
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        workers = Workers(init_group(0, size, "env://", device_type))
    else:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        processes = [subprocess.Popen([sys.executable, "-m", "blockspec.distributed.launch", str(rank), str(size),
                                       init_method, device_type])
                     for rank in range(1, size)]
        workers = Workers(None, processes)          # the watchdogs run while the group forms
        for rank, process in enumerate(processes, start=1):
            threading.Thread(target=workers.watch, args=(rank, process), name=f"blockspec-tp{rank}-watchdog",
                             daemon=True).start()
        workers.tp = init_group(0, size, init_method, device_type)
    atexit.register(workers.stop)
    _LEADER = workers
    return workers


def stop_leader() -> None:
    """Stop this process's group now, its workers included (at exit this happens by itself)."""
    global _LEADER
    if _LEADER is not None:
        _LEADER.stop()
        atexit.unregister(_LEADER.stop)
        _LEADER = None


def death_line(rank: int, process: subprocess.Popen) -> str:
    code = process.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    return f"tensor-parallel worker rank {rank} (pid {process.pid}) died ({how}); stopping"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_rank() -> int | None:
    """This process's rank when torchrun started it (RANK and WORLD_SIZE set), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def check_torchrun_size(size: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        from blockspec.config import ConfigError
        raise ConfigError(f"--tensor-parallel-size {size} but torchrun started {world} processes")


def exchange_status(tp: TPGroup, error: str | None) -> list[str]:
    """Every rank's load error (None: loaded) → the failures, named by rank."""
    statuses: list[str | None] = [None] * tp.size
    dist.all_gather_object(statuses, error, group=tp.control)
    return [f"tensor-parallel rank {rank}: {status}" for rank, status in enumerate(statuses) if status is not None]


def worker_main(rank: int, size: int, init_method: str, device_type: str) -> None:
    """A worker process: dies with its parent, leaves signals to it, serves rank 0's steps."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    tp = init_group(rank, size, init_method, device_type)
    serve_steps(tp)


def torchrun_worker(device: str) -> int:
    """A rank above 0 under torchrun: serve rank 0's steps, then exit."""
    from blockspec.loader import resolve_device
    device_type = resolve_device(device).type
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    tp = init_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", device_type)
    serve_steps(tp)
    return 0


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: the kernel kills this process when its parent (rank 0) dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
    except OSError:
        pass


def serve_steps(tp: TPGroup) -> None:
    """A worker's loop: load when told, run each step's plan, stop when told. A failure here
    would leave rank 0 waiting on a collective: it ends this process with one line, which the
    watchdog turns into rank 0's exit."""
    runner: WorkerRunner | None = None
    try:
        while True:
            message = tp.broadcast_message()
            if isinstance(message, StepPlan):
                runner.run(message)
            elif isinstance(message, Load):
                runner = None                          # the last runner's pools go before the next one's
                runner = load_runner(message, tp)
            elif isinstance(message, Unload):
                runner = None
            elif isinstance(message, Exit):
                break
    except Exception as exc:  # noqa: BLE001 - one line, then the watchdog ends rank 0
        print(f"blockspec: tensor-parallel rank {tp.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        os._exit(1)
    dist.destroy_process_group()


def load_runner(load: Load, tp: TPGroup) -> WorkerRunner | None:
    """This rank's share of the models and its runner (None when any rank failed to load)."""
    try:
        target, draft, config = load.make(tp, *load.args)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        error = f"{type(exc).__name__}: {exc}"
    if exchange_status(tp, error):
        return None
    return WorkerRunner(target, draft, config, tp)


def rank_models(tp: TPGroup, options) -> tuple:
    """Load's `make` for an LLM: this rank's share of the target, the draft, the engine config."""
    from blockspec.llm import load_models
    target, draft, config, _ = load_models(options, tp)
    return target, draft, config

if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
