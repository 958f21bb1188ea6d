"""The data-parallel operations the pipeline runs with: :class:`Collectives`.

One object carries them from whoever starts the processes (``torchrun`` through
:meth:`Collectives.torch_distributed`, a Lightning strategy through
:meth:`Collectives.lightning`) to every step that needs them: statistics and Hessians are
summed, static activation amaxes maxed, GPTQ's layers split across ranks and broadcast by their
owner, the auto-brake's scored tokens gathered.  On one process every operation is the
identity (``Collectives()``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["BroadcastFn", "Collectives", "ReduceFn"]

ReduceFn = Callable[[Tensor], Tensor]
BroadcastFn = Callable[[Any, int], Any]
"""``broadcast(obj, src)``: every rank returns rank ``src``'s ``obj``."""


def _unchanged(value: Any, *_: Any) -> Any:
    return value


@dataclass(frozen=True)
class Collectives:
    """``reduce_sum`` / ``reduce_max`` all-reduce one tensor, ``broadcast(obj, src)`` gives every
    rank rank ``src``'s object; this process is ``rank`` of ``world_size``.  The defaults are
    one process's: identities."""

    reduce_sum: ReduceFn = _unchanged
    reduce_max: ReduceFn = _unchanged
    broadcast: BroadcastFn = _unchanged
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")

    @property
    def can_broadcast(self) -> bool:
        """Whether a real broadcast was given (several processes need one to split work)."""
        return self.world_size == 1 or self.broadcast is not _unchanged

    def gather_rows(self, x: Tensor, limit: int | None = None) -> Tensor:
        """The rows of every rank's ``x [n_r, D]`` stacked in rank order, on every rank, at most
        ``limit`` of them, through the sum all-reduce (each rank fills its slot of a zero tensor;
        adding zeros is exact)."""
        if self.world_size > 1:
            counts = torch.zeros(self.world_size, dtype=torch.float64, device=x.device)
            counts[self.rank] = x.shape[0]
            counts = self.reduce_sum(counts).long()
            start = int(counts[:self.rank].sum())
            stacked = x.new_zeros(int(counts.sum()), x.shape[1])
            stacked[start:start + x.shape[0]] = x
            x = self.reduce_sum(stacked)
        return x if limit is None else x[:limit]

    @classmethod
    def torch_distributed(cls, group: Any = None) -> Collectives:
        """The operations of an initialized ``torch.distributed`` process group."""
        import torch.distributed as dist

        def reduce(op: Any) -> ReduceFn:
            def run(t: Tensor) -> Tensor:
                out = t.detach().clone().contiguous()
                dist.all_reduce(out, op=op, group=group)
                return out
            return run

        def broadcast(obj: Any, src: int) -> Any:
            box = [obj]
            dist.broadcast_object_list(box, src=src, group=group)
            return box[0]

        return cls(reduce(dist.ReduceOp.SUM), reduce(dist.ReduceOp.MAX), broadcast,
                   dist.get_rank(group), dist.get_world_size(group))

    @classmethod
    def lightning(cls, strategy: Any) -> Collectives:
        """The operations of a Lightning strategy (``trainer.strategy``); one process's
        identities when it runs one process."""
        if strategy.world_size == 1:
            return cls()
        return cls(lambda t: strategy.reduce(t, reduce_op="sum"),
                   lambda t: strategy.reduce(t, reduce_op="max"),
                   lambda obj, src: strategy.broadcast(obj, src=src),
                   strategy.global_rank, strategy.world_size)
