"""DataLoader defaults, the order data is prepared in, a data order and augmentation that survive a resume on
any layout, and datasets that live on the training device."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import time

import torch
from accelerate import PartialState
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset

from .preemption import ignore_stop_signals, stop_received
from .runtime import RecipeError, logger, taking_turns

# Who works in each turn of prepare_data_first, as the processes that wait for it name it.
PREPARERS = ("the main process (rank 0)", "another node's first process", "another process")


@contextlib.contextmanager
def prepare_data_first(state, timeout: int):
    """The block on the main process first, then on each node's local main, then on the rest: a download or a
    `datasets` cache is written once. The others wait as long as it takes, not --ddp_timeout (`timeout`): that bounds
    only how long they wait for a process that stopped answering (runtime.taking_turns). They raise the main
    process's error without running the block."""
    turn = 0 if state.is_main_process else 1 if state.is_local_main_process else 2
    with taking_turns(state, turn, PREPARERS, timeout):
        yield


def make_dataloader(dataset, batch_size: int, *, train: bool, seed=None, num_workers=None, collate_fn=None):
    """A DataLoader with a data-parallel job's defaults: training in an EpochSampler's order without a last
    partial batch (every process takes the same steps); evaluation every sample in order (`gather_for_metrics`
    removes Accelerate's padding). A stream (StreamOfBlocks) is read by one worker of the main process: Accelerate
    dispatches its batches to the others."""
    on_device, streamed = getattr(dataset, "on_device", False), isinstance(dataset, IterableDataset)
    if on_device:  # batches are cut on the device: nothing for workers to do, no host memory to pin
        num_workers, collate_fn = 0, lambda batch: batch
    elif streamed:  # one reader (more would each read the whole stream); the others never iterate theirs
        num_workers = 1 if PartialState().process_index == 0 else 0
    elif num_workers is None:
        num_workers = default_num_workers()
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EpochSampler(len(dataset), seed) if train and not streamed else None,
        drop_last=train,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available() and not on_device,
        persistent_workers=num_workers > 0 and not streamed,  # a stream's worker takes the epoch and resume point
        collate_fn=collate_fn,
        worker_init_fn=ignore_stop_signals,
        # an iterator draws its workers' seed from here, not from torch's global RNG: a resumed run's dropout draws
        # the masks the uninterrupted run drew, from the random state its checkpoint restored
        generator=torch.Generator().manual_seed(seed or 0),
    )


def default_num_workers() -> int:
    """The CPUs this node gives each process, less one for the training loop, at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(0, min(8, cpus // int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1))


class EpochSampler(Sampler):
    """Every sample once per epoch in an order of (seed, epoch) alone, whatever the layout: Accelerate deals its
    batches to the processes in turn, so a run resumed in any layout starts its epoch at the first sample not
    trained (`resume_at`). No `generator` attribute: Accelerate would reseed it."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed, self.epoch, self._resume = num_samples, seed, 0, (0, 0)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resume_at(self, epoch: int, sample: int) -> None:
        """Start `epoch` at position `sample` of its order (the samples before it were trained)."""
        self._resume = (epoch, sample)

    def order(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
        # 4 bytes a sample where it fits (23 MB at 5.8 million blocks): torch draws the same order in either dtype
        dtype = torch.int32 if self.num_samples < 2**31 else torch.int64
        return torch.randperm(self.num_samples, generator=generator, dtype=dtype)

    def _start(self) -> int:
        return self._resume[1] if self.epoch == self._resume[0] else 0

    def __iter__(self):
        # in slices: the whole order as a list of Python ints would cost about 36 bytes a sample (60 MB at 1.7 M);
        # chained by itertools, so that drawing a batch's indices runs no Python code of this file
        return itertools.chain.from_iterable(
            map(torch.Tensor.tolist, self.order(self.epoch)[self._start() :].split(65536))
        )

    def __len__(self) -> int:
        return self.num_samples - self._start()


def epoch_batches(dataloader, epoch: int, first_sample: int = 0):
    """An iterator over the batches of `epoch` from sample `first_sample` of its order on (an error it raises:
    `reading_failed`). The dataset's epoch is set here: Accelerate passes set_epoch on to our sampler, and then not
    to the dataset."""
    dataloader.set_epoch(epoch)  # Accelerate's loader counts its iterations by it, and passes it to our sampler
    sampler = dataloader.dataset if isinstance(dataloader.dataset, StreamOfBlocks) else dataloader
    while not isinstance(sampler, (EpochSampler, StreamOfBlocks)):  # DataLoaderShard -> BatchSamplerShard -> ours
        sampler = getattr(sampler, "batch_sampler", None) or getattr(sampler, "sampler", None)
        if sampler is None:
            raise TypeError("the training DataLoader needs an EpochSampler (common.make_dataloader(train=True))")
    sampler.resume_at(epoch, first_sample)
    datasets = [dataloader.dataset]  # and those it wraps (a Subset, a ConcatDataset, a user's wrapper): each seeded
    for dataset in datasets:  # transform augments this epoch, wherever it is
        datasets += [
            d for d in (getattr(dataset, "dataset", None), *getattr(dataset, "datasets", ())) if d is not None
        ]
        if hasattr(dataset, "set_epoch"):
            dataset.set_epoch(epoch)
    return iter(dataloader)


def reading_failed(err: Exception) -> list:
    """What an error met reading the training batches (`epoch_batches`) means: the end of a stream Accelerate
    dispatches (no more batches: []); a loader worker's RecipeError as its own line; anything else, itself."""
    if isinstance(err, RecipeError):  # met by a loader worker: its own line, not torch's report around it
        raise RecipeError(worker_error_line(str(err))) from None
    if isinstance(err, ValueError) and dispatched_nothing(err):
        return []
    raise err


def worker_error_line(message: str) -> str:
    """The line a DataLoader worker raised, from the message torch re-raises it with in the main process ("Caught
    RecipeError in DataLoader worker process 0. Original Traceback ... RecipeError: <line>"; torch's
    ExceptionWrapper.reraise, no public API); any other message as it is."""
    if "in DataLoader worker process" not in message:
        return message
    return message.rstrip().splitlines()[-1].split("RecipeError: ", 1)[-1]


def dispatched_nothing(err: ValueError) -> bool:
    """Whether Accelerate's DataLoaderDispatcher found no whole round of batches left in a stream as an iteration
    began (it raises this ValueError rather than StopIteration; no public API): the stream's end."""
    return str(err).startswith("Batch does not contain any data")


class StreamOfBlocks(IterableDataset):
    """Training samples made from a stream of rows as they are read (`datasets` streaming: a corpus that is never
    prepared on disk), in an order of (seed, epoch) alone: rows shuffled in a buffer of `shuffle_buffer`, then
    `make_blocks(each 1000 rows)` -> columns of samples. The main process reads it and Accelerate deals each round of
    batches to the processes, so N processes of b train what one of N x b would. `identity()`: the data's digest,
    for a checkpoint's (common.data.fingerprint)."""

    ROWS = 1000  # rows made into blocks at a time: as many as datasets.map's batch, so the blocks are prepared ones

    def __init__(self, rows, make_blocks, seed: int, shuffle_buffer: int, identity, timeout: int = 600):
        self.rows, self.make_blocks, self.seed, self.shuffle_buffer = rows, make_blocks, seed, shuffle_buffer
        self.identity, self.timeout, self.epoch = identity, timeout, 0
        self._resume = (0, 0, 0)  # (epoch, batches of rows read past, samples of the next batch skipped)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self):
        rows = self.rows.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer) if self.shuffle_buffer else self.rows
        rows.set_epoch(self.epoch)  # datasets reseeds the buffer and the shards' order with it
        return rows.iter(batch_size=self.ROWS)

    def resume_at(self, epoch: int, sample: int) -> None:
        """Start `epoch` at its sample `sample`. Where that is in the rows is known only by making the blocks before
        it: the main process does that now, outside any collective with a deadline (runtime.taking_turns: the others
        wait as long as it reads, knowing it works), then its loader reads the rows before it without making blocks.
        The cost of a resume grows with its position (docs/lm.md: Streaming)."""
        self._resume = (epoch, 0, 0)
        if not sample:
            return
        state = PartialState()
        with taking_turns(state, 0 if state.is_main_process else 1, PREPARERS[::2], self.timeout):
            if not state.is_main_process:  # only the main process reads the stream
                return
            tic, self.epoch, rows, left = time.perf_counter(), epoch, 0, sample
            for batch in self._batches():
                count = _samples_in(self.make_blocks(batch))
                if left < count:
                    break
                rows, left = rows + 1, left - count
                if (stop := stop_received()) is not None:  # this can take minutes: a stop is not kept waiting
                    raise stop
            self._resume = (epoch, rows, left)
            logger.info(
                f"resumed the stream at sample {sample:,} of epoch {epoch}: {rows * self.ROWS:,} rows read and made "
                f"into blocks again in {time.perf_counter() - tic:.1f} s"
            )

    def __iter__(self):
        _, rows, skip = self._resume if self._resume[0] == self.epoch else (self.epoch, 0, 0)
        for i, batch in enumerate(self._batches()):
            if i < rows:  # read, not tokenized: resume_at counted its blocks
                continue
            blocks = self.make_blocks(batch)
            count = _samples_in(blocks)
            for k in range(min(skip, count), count):
                yield {key: torch.tensor(column[k]) for key, column in blocks.items()}
            skip = max(0, skip - count)


def _samples_in(columns: dict) -> int:
    """The samples of a batch made as columns (every column holds one value a sample)."""
    return len(next(iter(columns.values()))) if columns else 0


class SeededTransform(Dataset):
    """A random `transform` (drawing from torch's RNG, as torchvision's do) seeded by (seed, epoch, index): a
    worker's own RNG stream would change with a resume or another number of workers. The epoch is in shared memory
    for persistent workers."""

    def __init__(self, dataset, transform, seed: int):
        self.dataset, self.transform, self.seed = dataset, transform, seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        sample, target = self.dataset[index]
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(
                ((self.seed * 1_000_003 + int(self._epoch)) * 1_000_003 + index) % 2**63
            )
            return self.transform(sample), target


def fingerprint(dataset, samples: int = 64) -> str:
    """A digest of the training data before augmentation: its size, its description (prepared blocks: the digest of
    what they are made from, common.prepared) and `samples` items spread over it, so that a checkpoint resumes only
    the data that wrote it."""
    base = dataset.dataset if isinstance(dataset, SeededTransform) else dataset
    if isinstance(base, StreamOfBlocks):  # not read here: as long as the stream
        return base.identity()
    digest = hashlib.sha256(str(len(base)).encode())
    if description := getattr(getattr(base, "info", None), "description", None):  # prepared blocks: their inputs
        digest.update(description.encode())
    for i in sorted({i * len(base) // samples for i in range(samples)}):
        digest.update(_bytes(tuple(t[i] for t in base.tensors) if isinstance(base, DeviceTensorDataset) else base[i]))
    return digest.hexdigest()[:16]


def _bytes(value) -> bytes:
    """A sample's contents: tensors, arrays and images by their bytes, dicts in key order, labels and text."""
    if isinstance(value, dict):
        return b"".join(_bytes(value[k]) for k in sorted(value))
    if isinstance(value, (tuple, list)):
        return b"".join(map(_bytes, value))
    if isinstance(value, torch.Tensor):  # its bytes, of any dtype (numpy has no bfloat16)
        value = value.detach().cpu().reshape(-1).view(torch.uint8).numpy()
    return value.tobytes() if hasattr(value, "tobytes") else repr(value).encode()


def _mix32(x):
    """A 32-bit integer hash (avalanching multiply-xorshift), on Python ints or int64 tensors."""
    for _ in range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B & 0xFFFFFFFF
    return (x >> 16) ^ x


def seeded_uniform(seed: int, epoch: int, index: torch.Tensor, draws: int) -> torch.Tensor:
    """(len(index), draws) numbers in [0, 1) on index's device, each a hash of (seed, epoch, sample, draw): the
    same whatever batch, process or run fetches the sample."""
    key = _mix32((_mix32(seed & 0xFFFFFFFF) + epoch) & 0xFFFFFFFF)
    per_sample = _mix32((index.long() + key) & 0xFFFFFFFF)
    bits = _mix32((per_sample[:, None] + torch.arange(draws, device=index.device) * 0x9E3779B9) & 0xFFFFFFFF)
    return (bits >> 8).float() / 2**24  # 24 bits: exact in float32


class DeviceTensorDataset(TensorDataset):
    """Tensors on the training device, a batch fetched in one indexing operation (CIFAR-10 is 150 MB as uint8),
    through a DataLoader and `accelerator.prepare` as any dataset. `transform(batch, uniforms)` gets `draws`
    numbers a sample from `seeded_uniform`."""

    on_device = True  # make_dataloader: no workers, no pinning, batches passed through

    def __init__(self, *tensors: torch.Tensor, transform=None, draws: int = 0, seed: int = 0):
        super().__init__(*tensors)  # which checks that they have one length
        self.transform, self.draws, self.seed, self.epoch = transform, draws, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitems__(self, indices):
        index = torch.as_tensor(indices, device=self.tensors[0].device)
        batch = tuple(t[index] for t in self.tensors)
        if self.transform is not None:
            batch = self.transform(batch, seeded_uniform(self.seed, self.epoch, index, self.draws))
        return batch

    def __getitem__(self, index):
        return tuple(t[0] for t in self.__getitems__([index]))
