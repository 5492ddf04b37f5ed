"""A DataLoader `batch_sampler` that yields planned bins: each batch is one static-shape row.

Under accelerate, the DataLoader's batch sampler is wrapped in `BatchSamplerShard`, which deals
batches round-robin (batch i goes to rank i % N). With `interleave_replicas=True` this sampler
yields the bins of all ranks in exactly that dealing order, so rank r receives
`plan_bins(..., num_replicas=N, rank=r)`, and the number of bins is a multiple of N, so no rank
ever waits on a missing or repeated batch.

Epochs: `DataLoaderShard.set_epoch` (accelerate 1.15) does not call `set_epoch` on a batch sampler
wrapped in `BatchSamplerShard`; it does call `batch_sampler.batch_sampler.sampler.set_epoch`. This
sampler therefore exposes a `sampler` attribute (the plan's samples in order) whose `set_epoch`
re-plans the owner, and accelerate's per-iteration `set_epoch(self.iteration)` reaches us.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import BatchSampler, Sampler

from .planner import EpochPlan, Item, Piece, _check_plan_args, as_lengths, check_token_budget, plan_epoch


class _PlanOrderSampler(Sampler[int]):
    """The current plan's dataset indices in bin order; its `set_epoch` re-plans the owner.

    It exists for accelerate, which forwards epochs to `batch_sampler.batch_sampler.sampler`
    rather than to the batch sampler it wraps. It has no `generator` attribute on purpose:
    accelerate would otherwise seed and synchronise one it does not need.
    """

    def __init__(self, owner: PackedBatchSampler):
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        for bin_ in self._owner.plan().iter_bins():
            for item in bin_:
                if not (isinstance(item, Piece) and item.filler):
                    yield item.index if isinstance(item, Piece) else item

    def __len__(self) -> int:
        plan = self._owner.plan()
        return len(plan.flat) - plan.filler_bins


class PackedBatchSampler(BatchSampler):
    """Yields bins (lists of dataset indices, or `Piece`s) of at most `token_budget` tokens.

    `interleave_replicas=True` (for a DataLoader that accelerate shards with `BatchSamplerShard`,
    `split_batches=False`): yields every rank's bins interleaved; `len()` counts all of them.
    `interleave_replicas=False`: yields only rank `rank`'s bins, for a DataLoader nobody shards.

    `set_epoch(epoch)` re-plans (new order, same bin count); `len()` is exact and the same for every
    epoch. `batch_size` is None: bins hold different numbers of samples, and `BatchSamplerShard`
    skips its "full batch" length check only when the wrapped sampler has no batch size.
    If the plan can hold `Piece`s (see `needs_piece_dataset`), wrap the dataset in `PieceDataset`.
    """

    def __init__(
        self,
        lengths,
        token_budget: int,
        *,
        seed: int = 0,
        num_replicas: int = 1,
        overlong: str = "error",
        interleave_replicas: bool = True,
        rank: int = 0,
    ):
        # BatchSampler.__init__ insists on an int batch size; set its attributes ourselves.
        self.token_budget = check_token_budget(token_budget)
        _check_plan_args(num_replicas, rank, seed, 0, overlong)
        self.lengths = as_lengths(lengths).copy()
        self.seed = int(seed)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.overlong = overlong
        self.interleave_replicas = bool(interleave_replicas)
        self.batch_size = None
        self.drop_last = False
        self.sampler = _PlanOrderSampler(self)
        self.epoch = 0
        self._plan: EpochPlan | None = None
        self.plan()  # plan now: overlong errors surface at construction, and len() is cheap

    def set_epoch(self, epoch: int) -> None:
        """Re-plan for `epoch` (deterministic in (seed, epoch)); a no-op for the current epoch."""
        if epoch != self.epoch or self._plan is None:
            _check_plan_args(self.num_replicas, self.rank, self.seed, epoch, self.overlong)
            self.epoch = int(epoch)
            self._plan = None

    def plan(self) -> EpochPlan:
        """This epoch's plan for all ranks (cached)."""
        if self._plan is None:
            self._plan = plan_epoch(
                self.lengths,
                self.token_budget,
                seed=self.seed,
                epoch=self.epoch,
                num_replicas=self.num_replicas,
                overlong=self.overlong,
            )
        return self._plan

    @property
    def needs_piece_dataset(self) -> bool:
        """True when bins may hold `Piece`s, i.e. the DataLoader's dataset must be a `PieceDataset`."""
        return self.overlong != "error" or self.plan().filler_bins > 0

    def __iter__(self) -> Iterator[list[Item]]:
        plan = self.plan()
        return plan.iter_bins(None if self.interleave_replicas else self.rank)

    def __len__(self) -> int:
        bins = len(self.plan())
        return bins if self.interleave_replicas else bins // self.num_replicas

