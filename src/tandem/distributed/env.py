"""The process group: who this rank is, how it joined, and the few collectives the loops need.

Ranks come from the launcher's environment (torchrun and the deepspeed launcher both set RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). Data moves between ranks as plain tensors
(`scatter_tensor_dicts`): nothing is pickled on the way, as on every other tandem socket.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tandem.config import ConfigError

KEEP_ALIVE = "waiting"  # what rank 0 broadcasts, now and then, while it waits for samplers


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None  # None: no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.backend is not None


def launched_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    strategy: str, device_type: str, backend: str = "auto", timeout_s: float = 1800.0
) -> DistEnv:
    """Join the launcher's process group (or make a group of one for DeepSpeed alone); a collective
    fails after `timeout_s` seconds without its peers.

    strategy `none` never creates a group; started under torchrun with several ranks it is a
    mistake the message names. Without CUDA, DeepSpeed is told to use its CPU accelerator.
    """
    world = launched_world_size()
    if strategy == "none":
        if world > 1:
            raise ConfigError(
                f"`training.distributed_strategy` is none but {world} ranks were launched; "
                "set training.distributed_strategy=ddp (or deepspeed / auto)"
            )
        return DistEnv()
    if device_type != "cuda":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is first imported
    if backend == "auto":
        backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl" and device_type != "cuda":
        raise ConfigError("`training.dist_backend` is nccl but training runs on the CPU; use gloo or auto")
    if world == 1 and "MASTER_ADDR" not in os.environ:  # one process, no launcher: a group of one
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
        )
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(
            process_group_backend(backend, device_type), timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistEnv(rank=rank, world_size=dist.get_world_size(), local_rank=local_rank, backend=backend)


def process_group_backend(backend: str, device_type: str) -> str:
    """The backend string for init_process_group. nccl moves only CUDA tensors, and the loops' own
    collectives (`broadcast_json`, `all_reduce_sum`, `scatter_tensor_dicts`) move small CPU
    tensors, so a CUDA run maps each device type to its backend: CPU tensors over gloo, CUDA
    tensors over nccl. gloo alone (`training.dist_backend: gloo`, for GPUs where nccl cannot run,
    such as some vGPUs) moves both."""
    if backend == "nccl" and device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return backend


def shutdown(env: DistEnv, *, clean: bool = True) -> None:
    """Leave the process group; after a clean finish, only once every rank is done (a rank that
    tears its connections down while a peer still works can abort gloo)."""
    if env.active and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
    _remove_deepspeed_shm(env)


def _remove_deepspeed_shm(env: DistEnv) -> None:
    """DeepSpeed's CPU all-reduce maps one /dev/shm workspace per rank and never unlinks it (about
    70 MB each, left behind by every run). Every peer mapped it at start-up, so this rank removes its
    own once it leaves; the name is DeepSpeed's: <prefix>_<uid>_<master addr>_<master port>_<rank>."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (env.active and addr and port and "deepspeed" in sys.modules):
        return
    path = Path("/dev/shm") / f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{env.rank}"
    path.unlink(missing_ok=True)


def barrier(env: DistEnv) -> None:
    if env.active:
        dist.barrier()


def broadcast_json(env: DistEnv, obj=None):
    """Rank 0's JSON-able object on every rank (as UTF-8 bytes in a tensor, never pickled)."""
    if not env.active:
        return obj
    data = json.dumps(obj).encode() if env.is_main else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if env.is_main else None
    if buf is None or buf.numel() == 0:
        buf = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.numpy()).decode())


def keep_alive(env: DistEnv) -> None:
    """Rank 0, while it waits for samplers: tell the other ranks, who wait in
    `broadcast_after_waits`, so that their collective does not time out however long that is."""
    broadcast_json(env, KEEP_ALIVE)


def broadcast_after_waits(env: DistEnv, obj=None):
    """`broadcast_json` of a value rank 0 may take long to have (it waits for samplers first and
    sends `keep_alive` meanwhile); the other ranks skip those keep-alives."""
    while True:
        value = broadcast_json(env, obj)
        if env.is_main or value != KEEP_ALIVE:
            return value


def all_reduce_sum(env: DistEnv, values: list[float]) -> list[float]:
    if not env.active:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_dict(env: DistEnv, sums: dict[str, float]) -> dict[str, float]:
    """Every rank's `sums` added up by name (in float64, one collective); every rank passes the same
    names in the same order."""
    return dict(zip(sums, all_reduce_sum(env, list(sums.values()))))


_DTYPES = {"int64": torch.int64, "float32": torch.float32}


def scatter_tensor_dicts(
    env: DistEnv, shares: list[dict[str, torch.Tensor]] | None
) -> dict[str, torch.Tensor]:
    """Rank 0 gives rank r `shares[r]` (named 1-D int64/float32 tensors); returns this rank's.

    One header (names, dtypes, lengths, as JSON) is broadcast, then each tensor is scattered with
    padding to the longest share; nothing is pickled.
    """
    if not env.active:
        assert shares is not None and len(shares) == 1
        return shares[0]
    header = None
    if env.is_main:
        assert shares is not None and len(shares) == env.world_size
        names = sorted(shares[0])
        header = {
            "names": names,
            "dtypes": [str(shares[0][n].dtype).removeprefix("torch.") for n in names],
            "lengths": [[int(share[n].numel()) for n in names] for share in shares],
        }
    header = broadcast_json(env, header)
    out = {}
    for i, (name, dtype) in enumerate(zip(header["names"], header["dtypes"])):
        width = max(lengths[i] for lengths in header["lengths"])
        recv = torch.empty(width, dtype=_DTYPES[dtype])
        scatter_list = None
        if env.is_main:
            scatter_list = []
            for share in shares:
                padded = torch.zeros(width, dtype=_DTYPES[dtype])
                padded[: share[name].numel()] = share[name].reshape(-1)
                scatter_list.append(padded)
        dist.scatter(recv, scatter_list, src=0)
        out[name] = recv[: header["lengths"][env.rank][i]]
    return out


@contextlib.contextmanager
def main_first(env: DistEnv):
    """Rank 0 runs the block first (e.g. converts and caches a model), the others after it."""
    if not env.is_main:
        barrier(env)
    yield
    if env.is_main:
        barrier(env)
