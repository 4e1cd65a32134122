"""The training data loader ``deepspeed.initialize(training_data=)`` returns, as DeepSpeed's
``DeepSpeedDataLoader`` builds it: micro-batches of ``train_micro_batch_size_per_gpu`` samples,
each data-parallel rank its share through a ``DistributedSampler`` (DeepSpeed's: shuffled with
seed 0; the epoch is the script's to set, ``loader.data_sampler.set_epoch(e)``), the config's
``dataloader_drop_last`` (default false), the script's ``collate_fn``. A pipeline's loader reads in
order (``shuffle=False``), each data-parallel replica its share, as DeepSpeed's pipeline engine's.
The same samples in the
same order as DeepSpeed's; they are read in the training process (DeepSpeed starts two worker
processes, which change nothing of what is read)."""
from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader as TorchDataLoader, Dataset, DistributedSampler, IterableDataset


class DataLoader:
    """Iterates the micro-batches of one epoch; iterating again starts a new epoch (DeepSpeed's
    loader is its own iterator, and ``iter()`` on it starts over)."""

    def __init__(self, dataset, batch_size: int, *, rank: int, world: int, collate_fn=None, drop_last: bool = False,
                 shuffle: bool = True):
        if not isinstance(dataset, (Dataset, IterableDataset)):
            raise ValueError(f"training_data must be a torch Dataset, got {type(dataset).__name__}")
        if isinstance(dataset, IterableDataset):
            raise NotImplementedError("training_data as an IterableDataset is not supported yet: DeepSpeed's "
                                      "DistributedSampler needs a map-style dataset (with __len__ and __getitem__)")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.dataloader_drop_last = drop_last
        self.data_sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle)
        n = len(self.data_sampler)
        self.len = n // batch_size if drop_last else math.ceil(n / batch_size)
        self.post_process_func = None
        self._data = None

    def __len__(self) -> int:
        return self.len

    def __iter__(self):
        kw = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        self.dataloader = TorchDataLoader(self.dataset, batch_size=self.batch_size, sampler=self.data_sampler,
                                          drop_last=self.dataloader_drop_last,
                                          pin_memory=torch.cuda.is_available(), **kw)
        self._data = iter(self.dataloader)
        return self

    def __next__(self):
        if self._data is None:
            iter(self)
        return next(self._data)
