"""Start one process per rank, join them into a process group, collect what each returns.

    results = run_ranks(fn, 2, x)   # fn(rank, world_size, x) in 2 processes; [fn's value per rank]

gloo on a CPU, NCCL on GPUs (rank r on GPU r). The processes are started with
torch.multiprocessing. By default a CPU rank is forked from a "forkserver": a fresh interpreter,
started once, that has imported torch and the course (a rank then starts in a fraction of a
second instead of importing torch again); a CUDA rank is spawned (a fresh interpreter each).
Both import `fn` by its module and name, so `fn` must live in a file. "fork" copies this
process, so any function works, on a CPU only (a process that has used CUDA cannot be forked).

CPU ranks run in the course's CPU mode, also on a machine with GPUs: they are started with no GPU
visible, so the course's kernels run under Triton's interpreter on their CPU tensors.

Each rank leaves the group and ends by itself (and ends when its launcher is gone); one that
raises, hangs or dies is reported as a RankError naming the rank, with its traceback;
stragglers past `timeout_s` are ended.
"""

import contextlib
import datetime
import io
import os
import queue
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised, died or ran past its time; `rank` names it, `details` holds its traceback."""

    def __init__(self, rank: int, details: str):
        last = details.strip().splitlines()[-1] if details.strip() else "no details"
        super().__init__(f"rank {rank} failed: {last}\n{details}")
        self.rank, self.details = rank, details


def backend_for(device: str) -> str:
    """'nccl' for CUDA ranks, 'gloo' for CPU ranks."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return "nccl" if device == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port nobody listens on now: rank 0 serves the group's rendezvous there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(value) -> bytes:
    # through bytes, not shared memory: a rank may end before the parent reads its tensors
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _end_with_parent() -> None:
    # a rank whose parent is gone (the launcher, or the forkserver, which ends with the launcher)
    # ends too, whatever fn is doing
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _rank_main(rank, world_size, device, port, timeout_s, fn, args, results):
    _end_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cpu":
        torch.set_num_threads(1)  # two ranks on a small CPU: no OpenMP threads spinning
    else:
        torch.cuda.set_device(rank)
    failed_at = None  # when fn raised: the first rank to fail is the cause, the others echo it
    try:
        dist.init_process_group(
            backend_for(device),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            value = fn(rank, world_size, *args)
            if device == "cuda":
                torch.cuda.synchronize()
        except BaseException:
            failed_at = time.time()
            raise
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", _dumps(value), 0.0))
    except BaseException:  # reported to the parent, whatever it was
        results.put((rank, "error", traceback.format_exc(), failed_at or time.time()))


def run_ranks(fn, world_size: int, *args, device: str = "cpu", timeout_s: float = 60.0,
              start_method: str | None = None) -> list:  # fmt: skip
    """[fn(rank, world_size, *args) for each rank], each in its own process of one group."""
    if not callable(fn):
        raise TypeError(f"run_ranks needs a function first, got {type(fn).__name__}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    backend_for(device)
    if device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"{world_size} CUDA ranks need {world_size} GPUs; this machine has "
            f"{torch.cuda.device_count()}"
        )
    start_method = start_method or default_start_method(device)
    if start_method != "fork":
        _check_importable(fn)
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(PRELOAD)
    results = context.Queue()
    port = free_port()
    common = (device, port, timeout_s, fn, args, results)
    procs = [
        context.Process(target=_rank_main, daemon=True, args=(r, world_size, *common))
        for r in range(world_size)
    ]
    with _no_gpu_visible(device == "cpu"):  # the ranks (and a forkserver started now) inherit it
        for p in procs:
            p.start()
    return _collect(procs, results, timeout_s)


@contextlib.contextmanager
def _no_gpu_visible(hide: bool):
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hide:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


# What the forkserver imports once, so that its ranks need not: the chapter's rank functions
PRELOAD = ["kernels.distributed.collectives", "kernels.distributed.tp",
           "kernels.distributed.overlap", "kernels.distributed.invariance"]  # fmt: skip


def default_start_method(device: str = "cpu") -> str:
    """CPU ranks: 'forkserver' where the platform has it (Linux, macOS), else 'spawn'. CUDA
    ranks: 'spawn', a fresh interpreter each (importing the course asks torch whether there is
    a GPU, which starts CUDA's driver, and a process forked after that cannot use CUDA)."""
    if device == "cpu" and "forkserver" in mp.get_all_start_methods():
        return "forkserver"
    return "spawn"


def _check_importable(fn):
    where = getattr(fn, "__module__", None)
    if where == "__main__" or "<locals>" in getattr(fn, "__qualname__", "<locals>"):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} cannot be imported by a rank's process (it is "
            "defined in a notebook, a script or another function): put it at the top level of "
            "a module; start_method='fork' runs any function, on a CPU"
        )


def _next(results):
    try:
        return results.get(timeout=0.2)
    except queue.Empty:
        return None


# After a rank's error, how long to wait for the others': a rank that raised makes the others
# fail too (their peer is gone), and the report names the one that failed first.
GRACE_S = 2.0


def _first_error(errors, results, procs, grace_s=GRACE_S) -> RankError:
    end = time.monotonic() + grace_s
    while len(errors) < len(procs) and time.monotonic() < end:
        message = _next(results)
        if message is not None and message[1] == "error":
            errors[message[0]] = (message[3], message[2])
    rank = min(errors, key=lambda r: (errors[r][0], r))
    return RankError(rank, errors[rank][1])


def _collect(procs, results, timeout_s) -> list:
    values, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(values) < len(procs):
            message = _next(results)
            if message is None:
                for rank, p in enumerate(procs):
                    if rank not in values and not p.is_alive() and p.exitcode not in (0, None):
                        raise RankError(rank, f"its process died (exit code {p.exitcode})")
                if time.monotonic() > deadline:
                    late = [r for r in range(len(procs)) if r not in values]
                    raise RankError(late[0], f"still running after {timeout_s:g} s (ranks "
                                    f"{late} had not returned)")  # fmt: skip
                continue
            rank, status, payload, failed_at = message
            if status == "error":
                raise _first_error({rank: (failed_at, payload)}, results, procs)
            values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
        return [values[r] for r in range(len(procs))]
    finally:
        for p in procs:  # only the processes started here: a failure ends the others
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
