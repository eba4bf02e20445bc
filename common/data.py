"""DataLoader defaults, data preparation order, and augmentation that survives a resume."""

from __future__ import annotations

import contextlib
import os

import torch
from torch.utils.data import DataLoader, Dataset


@contextlib.contextmanager
def prepare_data_first(accelerator):
    """Run the block on the main process first, then on each node's local main, then the rest.

    Downloads and `datasets` cache writes then happen once on a shared filesystem and once per
    node on node-local disks; every other process finds the data already there.
    """
    with accelerator.main_process_first(), accelerator.local_main_process_first():
        yield


def default_num_workers() -> int:
    """Loader workers per process: the CPUs this node gives each process, less one for the
    training loop itself, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_process = cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, per_process - 1))


def make_dataloader(dataset, batch_size: int, *, train: bool, num_workers: int | None = None, collate_fn=None):
    """A DataLoader with the defaults a data-parallel job wants.

    Training shuffles and drops the last partial batch (every process then takes the same number
    of steps); evaluation keeps every sample, and `gather_for_metrics` removes the padding
    Accelerate adds to make the shards even. Accelerate replaces the sampler in `prepare`.
    """
    if num_workers is None:
        num_workers = default_num_workers()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train,
        drop_last=train,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
    )


def set_epoch(dataloader, epoch: int) -> None:
    """Set the epoch on the sampler (the shuffle order) and on the dataset (its augmentation).

    Accelerate's DataLoaderShard forwards the epoch to the dataset only when the sampler has no
    `set_epoch`, and the seedable sampler has one, so the dataset is told here.
    """
    dataloader.set_epoch(epoch)
    if hasattr(dataloader.dataset, "set_epoch"):
        dataloader.dataset.set_epoch(epoch)


class SeededTransform(Dataset):
    """Apply a random `transform` whose randomness is fixed by (seed, epoch, index).

    A worker's RNG stream depends on how many samples it has already produced, so a run resumed
    mid-epoch, or run with another number of workers or processes, would augment differently.
    Seeding each sample from (seed, epoch, index) makes augmentation a function of the data order
    alone, which the seedable sampler makes reproducible. The epoch sits in shared memory so
    persistent workers see `set_epoch`. The transform must draw from torch's RNG (torchvision's
    transforms do).
    """

    def __init__(self, dataset, transform, seed: int):
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        sample, target = self.dataset[index]
        seed = (self.seed * 1_000_003 + int(self._epoch)) * 1_000_003 + index
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed % (2**63))
            return self.transform(sample), target
