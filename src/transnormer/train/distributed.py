"""The one seam between the training loop and parallelism: ``setup_distributed`` / ``wrap_model``.

Launched by ``torchrun`` the environment carries RANK / WORLD_SIZE / LOCAL_RANK; otherwise the run
is a single process. CPU uses the gloo backend (``torchrun --nproc_per_node 2`` works on this
machine), CUDA uses NCCL. DDP is the default; FSDP2 (``fully_shard``) by flag, on GPUs or (gloo) CPUs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    # whether setup_distributed created the process group, so that cleanup() tears it down: a
    # caller that runs several trainings (compare, lra train) sets the group up once around them
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str | None = None) -> DistInfo:
    """Initialise the process group when launched by torchrun (unless it exists); pick the device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device (--device) must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device (--device) must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if dev.type == "cuda" and dev.index is not None and local_world > 1 and torch.cuda.device_count() > 1:
        raise ValueError(f"device (--device) {device!r}: with {local_world} processes on this node each takes "
                         "its own GPU; give 'cuda' (rank r takes cuda:r, or cuda:0 where each process sees one GPU)")
    if dev.type == "cuda" and dev.index is None:  # "cuda": this process's GPU under torchrun
        # (one visible GPU per process, as a launcher setting CUDA_VISIBLE_DEVICES per rank gives: cuda:0)
        dev = torch.device("cuda", local_rank if torch.cuda.device_count() > 1 else 0)
    try:
        torch.empty(0, device=dev)  # an absent device fails here, not deep in the model
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"device (--device) {device!r} is not available here: "
                         f"{str(e).splitlines()[0][:200]}") from None
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    owns = world_size > 1 and not dist.is_initialized()
    if owns:
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=dev, owns_group=owns)


def check_strategy(info: DistInfo, strategy: str) -> None:
    """Whether ``strategy`` can wrap a model here (called before any work, and by wrap_model)."""
    if strategy not in ("ddp", "fsdp"):
        raise ValueError(f"strategy must be 'ddp' or 'fsdp', got {strategy!r}")


def is_sharded(info: DistInfo, strategy: str) -> bool:
    """Whether wrap_model shards the parameters (FSDP over more than one process)."""
    return strategy == "fsdp" and info.enabled


def full_state(model: nn.Module, optimizer, info: DistInfo, strategy: str) -> tuple[dict | None, dict]:
    """(model weights or None, optimizer state) for a checkpoint, called on every rank.

    Sharded (FSDP): both gathered whole to rank 0's CPU memory (the other ranks get empty dicts),
    the optimizer state keyed by parameter name. Otherwise (None: the model's own) and the
    optimizer's ``state_dict()``."""
    if not is_sharded(info, strategy):
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer, state: dict, info: DistInfo, strategy: str) -> None:
    """Restore what full_state saved; every rank holds the whole state (read from the checkpoint)."""
    if not is_sharded(info, strategy):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, optim_state_dict=_keyed_by_name(model, optimizer, state),
                             options=StateDictOptions(full_state_dict=True))


def _keyed_by_name(model: nn.Module, optimizer, state: dict) -> dict:
    """An optimizer state keyed by parameter name, as set_optimizer_state_dict reads it. A
    checkpoint of an unsharded run (one process, or DDP) numbers the parameters in the optimizer's
    order instead, which is the same here (the same model and groups): resuming it sharded, with
    the same global batch, had failed with KeyError 'state.0.step'."""
    ids = [i for group in state["param_groups"] for i in group["params"]]
    if not all(isinstance(i, int) for i in ids):
        return state
    names = {id(p): n for n, p in getattr(model, "_orig_mod", model).named_parameters()}  # no compile prefix
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    if len(ordered) != len(ids):
        raise ValueError(f"the checkpoint's optimizer state has {len(ids)} parameters, this model {len(ordered)}")
    name_of = dict(zip(sorted(ids), ordered, strict=True))
    return {"state": {name_of[i]: v for i, v in state["state"].items()},
            "param_groups": [{**g, "params": [name_of[i] for i in g["params"]]} for g in state["param_groups"]]}


def global_value(x: torch.Tensor) -> torch.Tensor:
    """A reduction over sharded parameters (e.g. clip_grad_norm_'s norm under FSDP, a DTensor) as
    one plain tensor; other tensors as they are."""
    return x.full_tensor() if hasattr(x, "full_tensor") else x


def wrap_model(model: nn.Module, info: DistInfo, strategy: str = "ddp", *, sync_batch_norm: bool = False) -> nn.Module:
    """DDP (default) or FSDP2 around ``model``; the model itself unchanged when single-process.

    FSDP2 replaces the parameters by sharded DTensors in place: make the optimizer afterwards.
    ``sync_batch_norm``: the model's batch norms pool their statistics over the processes (the
    result of one process holding the global batch, as the authors' LRA SyncBatchNorm); without
    it they stay per process. A model without batch norm is refused."""
    check_strategy(info, strategy)
    if sync_batch_norm:
        from ..modules.norms import sync_batch_norm as sync_norms

        if not sync_norms(model):
            raise ValueError("sync_batch_norm (--sync-batch-norm): the model has no batch norm (norm_type 'batch')")
    if not info.enabled:
        return model
    if strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # the run's own device: without a mesh fully_shard takes CUDA whenever a GPU is present, and
        # a --device cpu run (gloo) would have moved its model there
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in getattr(getattr(model, "model", model), "layers", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[info.device.index] if info.device.type == "cuda" else None)


def forwards_in_step(model: nn.Module, info: DistInfo) -> bool:
    """Whether every rank must run as many forwards of ``model``: an FSDP-sharded model all-gathers
    its weights in each forward, a collective every rank must join (see :func:`forwards_to_match`)."""
    from torch.distributed.fsdp import FSDPModule

    # compiled before wrap_model, the compile wrapper is the FSDP module; compiled after, its _orig_mod
    return info.enabled and (isinstance(model, FSDPModule) or isinstance(getattr(model, "_orig_mod", None), FSDPModule))


def forwards_to_match(model: nn.Module, n_local: int, info: DistInfo) -> int:
    """The forwards this rank must add to its ``n_local`` for every rank to run as many. A rank
    with fewer evaluation batches of an FSDP model had gone on to the next collective and hung or
    crashed the others. 0 for a model whose forward is local (single process, DDP's unwrapped
    module)."""
    if not forwards_in_step(model, info):
        return 0
    t = torch.tensor([n_local], dtype=torch.int64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) - n_local


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def all_reduce_mean(value: float, info: DistInfo) -> float:
    """Average a Python float over ranks (identity when single-process)."""
    if not info.enabled:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    dist.all_reduce(t)
    return t.tolist()


@torch.no_grad()
def broadcast_buffers(model: nn.Module, names, info: DistInfo) -> None:
    """Give every rank rank 0's buffers named in ``names`` (in place; nothing in one process)."""
    if not info.enabled:
        return
    for name, buf in model.named_buffers():
        if name in names:
            dist.broadcast(buf, src=0)


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` in one process."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def main_first(info: DistInfo, fn):
    """Run ``fn()`` on rank 0, then (after a barrier) on the other ranks: rank 0 fills a shared cache
    (tokenizer, token ids) and the others read it instead of building it concurrently."""
    if info.is_main:
        result = fn()
    barrier(info)
    if not info.is_main:
        result = fn()
    return result


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    """Tear the process group down, if ``info``'s setup_distributed created it, without the gloo
    exit deadlock. (Destroying it and initialising another against the same torchrun store, once
    per run of a compare, failed to connect in 3 of 7 tries.)

    A finished gloo work item is released by a gloo worker thread, which needs the GIL when it
    holds Python-created tensors (our metric all-reduces). If the main thread meanwhile blocks in
    the process group's destructor (joining those threads) while holding the GIL, both wait
    forever. So: a barrier (all ranks done), a short sleep that releases the GIL so the workers
    can drop what they hold, then the explicit destroy.
    """
    if info.owns_group and dist.is_initialized():
        dist.barrier()
        time.sleep(0.2)
        dist.destroy_process_group()
