"""A tensor-parallel group as the model sees it: its shard plan and the three collectives of a forward.

The collectives run through ``torch.distributed`` on the backend's torch tensors: NCCL between GPUs (captured
in the CUDA graphs with the rest of the forward), gloo for CPU tensors (the tests, under the Triton interpreter)
and for several ranks sharing one GPU (a correctness check; gloo runs no collective inside a CUDA graph, so
graphs are off then). Every collective is one that gloo also runs on GPU tensors: broadcast and all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from quanta.errors import QuantaError
from quanta.parallel.shard import ShardPlan


@dataclass
class TensorParallel:
    """Rank ``plan.rank`` of a group of ``plan.world``. The lead (rank 0) also holds ``followers``: one pipe to
    each other rank, over which each step's inputs go (:meth:`lead`)."""

    plan: ShardPlan
    followers: list[Connection] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return self.plan.rank

    def lead(self, message: Any) -> None:
        """Send ``message`` (a step's host inputs) to every follower, which then runs the same forward."""
        for conn in self.followers:
            try:
                conn.send(message)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                raise QuantaError("a tensor-parallel worker process has exited; the model cannot run without it "
                                  "(its error went to its stderr)") from None

    def broadcast_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The lead's token ids on every rank (the lead's may be tokens it sampled on the device)."""
        dist.broadcast(ids, src=0)
        return ids

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, local: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The full logits (n, n_vocab) in ``out`` from every rank's vocabulary columns ``local``: each rank writes
        its columns into zeros and the ranks sum them (an all-reduce, which gloo runs on GPU tensors too)."""
        start, stop = self.plan.vocab
        out.zero_()
        out[:, start:stop] = local
        dist.all_reduce(out)
        return out
