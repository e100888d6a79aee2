"""Data-parallel short runs with torch.distributed: the launcher, the rank's slice of the global
batch, DDP wrapping and the gathering of eval outputs.

The model is the one a single process trains, replicated on every rank: dense parameters and
embedding tables alike, wrapped in :class:`torch.nn.parallel.DistributedDataParallel`, which
all-reduces (averages) every gradient after backward; the embedding tables' gradients are
sparse and DDP reduces them as sparse tensors. Every rank reads the *same* global batch
stream (the source's order for the run's seed) and keeps its own ``batch_size / world_size``
rows, so N processes take the same optimizer steps on the same examples as one process at the
same global batch: the mean of the ranks' mean losses is the global mean loss and DDP's
average of their gradients is its gradient. Results match one process within float noise
(the order of the sums differs).

Replicated tables suit the reference models' sizes (a few GB at most); sharding them
(TorchRec) is for models whose tables do not fit one GPU and is not done here.

Launching: ``loka-tune train --nproc N`` re-runs the same command under
``python -m torch.distributed.run --standalone --nproc-per-node N`` (torchrun); a command
started by torchrun directly (``torchrun --nproc-per-node N -m loka_tune train ...``) works
the same. The environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) is what :func:`dist_env` reads. The process group uses gloo
on the CPU and NCCL on CUDA (rank ``r`` on ``cuda:LOCAL_RANK``). Rank 0 writes the results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loka_tune.errors import ConfigError

__all__ = ["DistEnv", "dist_env", "process_group", "local_rows", "RankSource", "gather_rows", "launch",
           "strip_nproc", "rank_share", "join", "torn_down", "exit_rank"]

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env() -> DistEnv | None:
    """The torchrun environment of this process, or None when it runs alone (no ``WORLD_SIZE``,
    or a world of one)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world, local = (int(os.environ.get(k, "0")) for k in _ENV_KEYS)
    except ValueError:
        got = {k: os.environ.get(k) for k in _ENV_KEYS}
        raise ConfigError(f"got {got}; RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)",
                          key="WORLD_SIZE") from None
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"got RANK={rank}, WORLD_SIZE={world}; expected 0 <= RANK < WORLD_SIZE", key="RANK")
    return None if world == 1 else DistEnv(rank, world, local)


def rank_device(env: DistEnv, device: torch.device) -> torch.device:
    """The device of this rank: ``cuda:LOCAL_RANK`` on CUDA (one GPU per process), else ``device``."""
    if device.type != "cuda":
        return device
    if env.local_rank >= torch.cuda.device_count():
        raise ConfigError(f"LOCAL_RANK {env.local_rank} but this host has {torch.cuda.device_count()} GPU(s):"
                          " start at most one process per GPU (--nproc)", key="nproc")
    return torch.device("cuda", env.local_rank)


def join(device: torch.device, batch_size: int, cuda_graphs: bool = False) -> tuple[DistEnv | None, torch.device]:
    """This process's torchrun environment (None alone) and its device, with the run's settings
    checked against the job: a global batch that splits evenly, no CUDA graphs."""
    env = dist_env()
    if env is None:
        return None, device
    check_batch(batch_size, env)
    if cuda_graphs:
        raise ConfigError(f"cuda_graphs with {env.world_size} processes is not supported: turn cuda_graphs off"
                          " or train in one process", key="cuda_graphs")
    return env, rank_device(env, device)


@contextlib.contextmanager
def process_group(env: DistEnv, device: torch.device) -> Iterator[None]:
    """The default process group for the run (gloo on the CPU, NCCL on CUDA), torn down after
    it unless it existed before."""
    if dist.is_initialized():
        yield
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    kw: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size, **kw)
    with torn_down():
        yield


#: Process groups past ``destroy_process_group``, kept referenced until the process exits (see
#: :func:`torn_down`).
_RETIRED: list[Any] = []


@contextlib.contextmanager
def torn_down() -> Iterator[None]:
    """Destroy the default process group after the block, keeping this module's reference to it
    until the process exits. Why: gloo's worker threads free a finished collective's tensors
    after its ``wait()`` returns, and freeing a tensor Python still sees takes the GIL. The group
    object releases the GIL while its destructor joins those threads, but DDP's reducer does not:
    when the reducer drops the last reference to the group (a trained model freed after the
    run), it joins the threads with the GIL held and both wait for ever (seen with torch 2.13 on
    the CPU: with a barrier before the teardown, one two-process run in twenty; without it,
    about one in three). Kept here, the group is never freed by Python at all: a rank ends
    through :func:`exit_rank`, which skips interpreter finalization (freed there, the group's
    threads reach for a GIL that is going away and the rank aborts, "terminate called without an
    active exception": the CI failure of stop 33, one two-process run in the suite). On a normal
    exit every rank first meets at a barrier."""
    try:
        yield
    except BaseException:
        _retire()  # another rank may be gone: no barrier
        raise
    dist.barrier()
    _retire()


def _retire() -> None:
    _RETIRED.append(dist.distributed_c10d._get_default_group())
    dist.destroy_process_group()


def exit_rank(code: int | str | None) -> None:
    """End this process with ``code`` (``sys.exit``'s meaning) when it is a rank of a torchrun
    job, without interpreter finalization: stdout, stderr and logging are flushed, then
    ``os._exit``. Alone (no torchrun), return and let the caller exit as usual.

    Why: finalization frees what the run left, the retired process groups of :func:`torn_down`
    among them, while gloo's threads may still need the GIL; Python 3.11 ends such threads
    mid-C++ and the rank aborts with exit -6. Every result a rank writes is written and closed
    before its entry point returns, and nothing here registers ``atexit`` work (MLflow is called
    synchronously)."""
    if dist_env() is None:
        return
    import logging

    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        sys.stderr.write(f"{code}\n")
        status = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def check_batch(batch_size: int, env: DistEnv, *, key: str = "batch_size") -> int:
    """The rows per rank of a global batch of ``batch_size``."""
    if batch_size % env.world_size:
        raise ConfigError(f"got {key}={batch_size} on {env.world_size} processes; the global batch must split"
                          f" evenly: use a multiple of {env.world_size}", key=key)
    return batch_size // env.world_size


def local_rows(batch: Any, env: DistEnv) -> Any:
    """Rank ``env.rank``'s contiguous slice of every tensor field of ``batch`` (a dataclass)."""
    n = len(batch)
    per = check_batch(n, env)
    lo, hi = env.rank * per, (env.rank + 1) * per
    vals = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return type(batch)(**{k: v[lo:hi] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v
                          for k, v in vals.items()})


class RankSource:
    """A data source seen by one rank: train batches are its slice of the global batch; eval
    batches are the whole batches ``i`` with ``i % world_size == rank`` (gathered afterwards
    by :func:`gather_rows`). Everything else is the wrapped source's."""

    def __init__(self, source: Any, env: DistEnv) -> None:
        self.source = source
        self.env = env

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)

    def batches(self, split: str, batch_size: int, *, seed: int = 0, device: Any = None) -> Iterator[Any]:
        it = self.source.batches(split, batch_size, seed=seed, device=device)
        if split == "train":
            check_batch(batch_size, self.env)
            return (local_rows(b, self.env) for b in it)
        return (b for i, b in enumerate(it) if i % self.env.world_size == self.env.rank)


def gather_rows(parts: Sequence[torch.Tensor], env: DistEnv) -> list[torch.Tensor]:
    """All ranks' eval outputs in the global batch order: rank ``r`` computed batches
    ``r, r + W, r + 2W, ...``; every rank gets the full list back (CPU tensors)."""
    mine = [p.detach().cpu() for p in parts]
    everyone: list[Any] = [None] * env.world_size
    dist.all_gather_object(everyone, mine)
    out: list[torch.Tensor] = []
    longest = max(len(x) for x in everyone)
    for j in range(longest):
        for r in range(env.world_size):
            if j < len(everyone[r]):
                out.append(everyone[r][j])
    return out


def rank_share(n: int, env: DistEnv | None) -> int:
    """How many of the first ``n`` eval batches this rank evaluates (batch ``i`` is rank ``i % W``'s)."""
    return n if env is None else len(range(env.rank, n, env.world_size))


def wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model`` in DistributedDataParallel (gradients averaged over the ranks after backward)."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    # buffers are not trained state here: no collective per forward to keep them in step
    # (newer torch names the switch forward_sync_buffers and deprecates broadcast_buffers)
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    sync: dict[str, Any] = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
    return DistributedDataParallel(model, device_ids=ids, **sync)


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` averaged over the ranks (in place; returns it)."""
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.div_(dist.get_world_size())


# ------------------------------------------------------------------------------------ launching
def strip_nproc(argv: Sequence[str]) -> list[str]:
    """``argv`` without its ``--nproc N`` / ``--nproc=N``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def launch(nproc: int, program: Sequence[str], *, env: dict[str, str] | None = None) -> int:
    """Run ``program`` (``["-m", "module", *args]`` or ``["script.py", *args]``) as ``nproc``
    processes under torchrun on this host (``--standalone``: a free local rendezvous).
    Returns the job's exit status."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ConfigError(f"got {nproc!r}; expected the number of processes (>= 1, at most one per GPU)",
                          key="nproc")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *program]
    child_env = {**os.environ, **(env or {})}
    child_env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its warning
    return subprocess.call(cmd, env=child_env)
