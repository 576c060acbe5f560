"""Collective kernels: ``all_reduce`` and ``all_gather`` over torch.distributed's default group.

Decides how a graph's collective node runs: on the process group the distributed launcher
(``fuel.runtime.distributed``) initialized — gloo on the CPU, NCCL on CUDA — with the group's
size checked against the node's ``ranks`` on every call.

Invariants:
- A kernel never runs without a group of the size its node was built for: it raises
  :class:`CollectiveUnavailable` naming the node's ranks and what it found, never returns its
  input unreduced.
- Results are fresh tensors (the input is never reduced in place: the executor may hold views
  of it), in rank order for ``all_gather``.
"""

from __future__ import annotations

from fuel.errors import FuelError


class CollectiveUnavailable(FuelError):
    """A collective node ran outside a process group of its size."""

    def __init__(self, op: str, ranks: int, found: str):
        self.op, self.ranks, self.found = op, ranks, found
        super().__init__(f"{op} over {ranks} ranks needs torch.distributed initialized with "
                         f"world size {ranks} (fuel run --tp {ranks} launches one); found {found}")


def _group_of(op: str, ranks: int):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise CollectiveUnavailable(op, ranks, "no process group")
    if dist.get_world_size() != ranks:
        raise CollectiveUnavailable(op, ranks, f"world size {dist.get_world_size()}")
    return dist


def all_reduce_kernel(ranks: int):
    def all_reduce(x):
        dist = _group_of("all_reduce", ranks)
        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out
    return all_reduce


def all_gather_kernel(ranks: int, dim: int):
    import torch

    def all_gather(x):
        dist = _group_of("all_gather", ranks)
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ranks)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=dim)
    return all_gather


__all__ = ["CollectiveUnavailable", "all_gather_kernel", "all_reduce_kernel"]
