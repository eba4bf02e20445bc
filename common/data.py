"""DataLoader defaults, data preparation order, augmentation that survives a resume, and datasets
that live on the training device."""

from __future__ import annotations

import contextlib
import os

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import DataLoader, Dataset, Sampler

from .preemption import ignore_stop_signals
from .runtime import RecipeError, one_line


@contextlib.contextmanager
def prepare_data_first(accelerator):
    """Run the block on the main process first, then on each node's local main, then the rest.

    Downloads and `datasets` cache writes then happen once on a shared filesystem and once per node
    on node-local disks; every other process finds the data already there. If the block fails on the
    main process (bad data), the others do not run it: they raise its error too, which the main
    process alone reports, as one line.
    """
    if accelerator.num_processes == 1:
        yield
        return
    outcome = [None]
    if accelerator.is_main_process:
        try:
            yield
        except BaseException as err:
            why = "" if isinstance(err, RecipeError) else "the main process failed preparing the data: "
            broadcast_object_list([why + one_line(err)])
            raise
        broadcast_object_list(outcome)
        with accelerator.local_main_process_first():  # its turn done: each node's local main, then the rest
            return
    broadcast_object_list(outcome)  # waits for the main process's turn
    if outcome[0] is not None:
        raise RecipeError(outcome[0])
    with accelerator.local_main_process_first():
        yield


def default_num_workers() -> int:
    """Loader workers per process: the CPUs this node gives each process, less one for the
    training loop itself, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    per_process = cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(0, min(8, per_process - 1))


def make_dataloader(
    dataset, batch_size: int, *, train: bool, seed: int | None = None, num_workers: int | None = None, collate_fn=None
):
    """A DataLoader with the defaults a data-parallel job wants.

    Training draws samples in the order of an EpochSampler (fixed by seed and epoch, resumable at any
    sample) and drops the last partial batch; Accelerate deals the batches to the processes round-robin
    and drops an incomplete round, so every process takes the same number of steps. Evaluation keeps
    every sample in order, and `gather_for_metrics` removes the padding Accelerate adds to make the
    shards even.
    """
    on_device = isinstance(dataset, DeviceTensorDataset)
    if on_device:  # batches are cut on the device: nothing for workers to do, no host memory to pin
        num_workers, collate_fn = 0, _already_collated
    elif num_workers is None:
        num_workers = default_num_workers()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), seed) if train else None,  # the run's --seed: it fixes the order
        drop_last=train,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available() and not on_device,
        persistent_workers=num_workers > 0,
        collate_fn=collate_fn,
        worker_init_fn=ignore_stop_signals,
    )


def _already_collated(batch):
    return batch


class EpochSampler(Sampler):
    """Every sample once per epoch, in an order that depends on (seed, epoch) alone.

    The order is one list of samples for the whole job, whatever the number of processes, the batch
    size or the accumulation: Accelerate cuts it into batches and deals them to the processes in turn,
    so after n rounds the job has trained exactly the first n x processes x batch samples of it. A
    resumed run starts the epoch it stopped in at that sample (`resume_at`), with this or any other
    layout, and later epochs from their start. No `generator` attribute: Accelerate would reseed it.
    """

    def __init__(self, num_samples: int, seed: int):
        if not isinstance(seed, int):
            raise TypeError("EpochSampler needs the run's --seed: the order of the data follows it")
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0
        self._resume_epoch, self._resume_sample = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, sample: int) -> None:
        """Start `epoch` at position `sample` of its order (the samples before it were trained)."""
        self._resume_epoch, self._resume_sample = epoch, sample

    def order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        return torch.randperm(self.num_samples, generator=generator)

    def _start(self) -> int:
        return self._resume_sample if self.epoch == self._resume_epoch else 0

    def __iter__(self):
        return iter(self.order(self.epoch)[self._start() :].tolist())

    def __len__(self) -> int:
        return self.num_samples - self._start()


def epoch_batches(dataloader, epoch: int, first_sample: int = 0):
    """An iterator over the batches of `epoch`, from position `first_sample` of its order on (a run
    resumed mid-epoch): the order (EpochSampler) and the augmentation (SeededTransform) follow the epoch.
    Set here on the sampler itself: accelerate passes set_epoch on to a sampler inside its wrapper only
    from version 1.7, and to the dataset only when the sampler has no set_epoch."""
    dataloader.set_epoch(epoch)  # accelerate's loader counts its iterations by it
    sampler = dataloader
    while not isinstance(sampler, EpochSampler):  # DataLoaderShard -> BatchSamplerShard -> BatchSampler -> ours
        sampler = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
        if sampler is None:
            raise TypeError("the training DataLoader needs an EpochSampler (common.make_dataloader(train=True))")
    sampler.set_epoch(epoch)
    sampler.resume_at(epoch, first_sample)
    if hasattr(dataloader.dataset, "set_epoch"):
        dataloader.dataset.set_epoch(epoch)
    return iter(dataloader)


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


_M32 = 0xFFFFFFFF


def _mix32(x):
    """A 32-bit integer hash (avalanching multiply-xorshift), on Python ints or int64 tensors."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def seeded_uniform(seed: int, epoch: int, index: torch.Tensor, draws: int) -> torch.Tensor:
    """(len(index), draws) numbers in [0, 1), each a fixed function of (seed, epoch, sample index,
    draw), computed on index's device. A counter-based hash rather than a generator's stream: the
    numbers a sample gets do not depend on which batch, process or resumed run fetches it."""
    key = _mix32((_mix32(seed & _M32) + epoch) & _M32)
    per_sample = _mix32((index.long() + key) & _M32)
    offsets = torch.arange(draws, device=index.device) * 0x9E3779B9
    bits = _mix32((per_sample[:, None] + offsets) & _M32)
    return (bits >> 8).float() / 2**24  # 24 bits: exact in float32


class DeviceTensorDataset(Dataset):
    """Tensors that already sit on the training device, fetched a whole batch at a time.

    For data small enough to keep in accelerator memory (CIFAR-10 is 150 MB as uint8): a batch is
    one indexing operation on the device instead of per-sample Python in worker processes and a
    host-to-device copy. It still goes through a DataLoader and `accelerator.prepare`, so the
    seedable sampler shards it by rank and skip_first_batches, set_epoch, even_batches and
    gather_for_metrics work as for any dataset (`make_dataloader` sets no workers, no pinning and
    a pass-through collate). `transform(batch, uniforms)`, if given, gets the indexed tensors and
    `draws` numbers per sample from `seeded_uniform`, so augmentation is the same whatever the
    process count and wherever a run was resumed.
    """

    def __init__(self, *tensors: torch.Tensor, transform=None, draws: int = 0, seed: int = 0):
        if len({len(t) for t in tensors}) != 1:
            raise ValueError("all tensors need the same first dimension")
        self.tensors, self.transform, self.draws, self.seed, self.epoch = tensors, transform, draws, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return len(self.tensors[0])

    def __getitems__(self, indices):
        index = torch.as_tensor(indices, device=self.tensors[0].device)
        batch = tuple(t[index] for t in self.tensors)
        if self.transform is not None:
            batch = self.transform(batch, seeded_uniform(self.seed, self.epoch, index, self.draws))
        return batch

    def __getitem__(self, index):
        return tuple(t[0] for t in self.__getitems__([index]))
