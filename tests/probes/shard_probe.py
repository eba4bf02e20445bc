"""Launched in N processes: record which training samples each process receives per epoch, and
which eval samples the gathered metrics count, through the recipe's own loaders.

    accelerate launch ... tests/probes/shard_probe.py OUT.json RECIPE_ARGS... [--- MORE_ARGS...]...

Each `---` starts another probe in the same launch, of RECIPE_ARGS followed by the arguments after it (one launch
probes both input paths: the processes and their group are the same, only the loaders differ).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import itertools  # noqa: E402

import torch  # noqa: E402
from accelerate.utils import gather_object  # noqa: E402
from conftest import load_recipe  # noqa: E402

import common  # noqa: E402
from common.data import DeviceTensorDataset, epoch_batches  # noqa: E402

out, argv = sys.argv[1], sys.argv[2:]
segments, current = [], []
for word in argv:  # RECIPE_ARGS, then each `---` group appended to them
    if word == "---":
        segments.append(current)
        current = []
    else:
        current.append(word)
segments.append(current)
cifar = load_recipe()
accelerator = common.make_accelerator(cifar.parse_args(segments[0]))
record = {"world_size": accelerator.num_processes, "probes": []}
for extra in [[], *segments[1:]]:
    args = cifar.parse_args([*segments[0], *extra])
    train_dl, eval_dl, _ = cifar.get_dataloaders(args, accelerator)
    on_device = isinstance(train_dl.dataset, DeviceTensorDataset)
    # Label every sample with its index, so a batch's labels say which samples it holds.
    for dataset in (train_dl.dataset, eval_dl.dataset):
        if isinstance(dataset, DeviceTensorDataset):  # --data_on_device: (images, labels) tensors
            dataset.tensors = (dataset.tensors[0], torch.arange(len(dataset), device=dataset.tensors[1].device))
        else:  # an ImageFolder, the training one inside its SeededTransform
            folder = getattr(dataset, "dataset", dataset)
            folder.samples = [(path, i) for i, (path, _) in enumerate(folder.samples)]
    train_dl, eval_dl = accelerator.prepare(train_dl, eval_dl)
    probe = {"on_device": on_device, "train": [], "eval": []}
    for epoch in range(2):  # as the recipe iterates: windows of one optimizer step
        batches, mine = epoch_batches(train_dl, epoch), []
        while window := list(itertools.islice(batches, args.gradient_accumulation_steps)):
            mine += [i for _, labels in window for i in labels.tolist()]
        probe["train"].append(gather_object([mine]))  # one list per process
    for _, labels in eval_dl:
        probe["eval"] += accelerator.gather_for_metrics(labels).tolist()
    record["probes"].append(probe)
if accelerator.is_main_process:
    Path(out).write_text(json.dumps(record))
# Destroys the process group, as the recipes do: gloo left to the interpreter's exit can abort.
accelerator.end_training()
