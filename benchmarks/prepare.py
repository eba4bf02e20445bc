"""Prepared LM data (common.prepared): how fast a corpus is prepared, and what a training run that starts from
prepared data costs at a small and a large corpus.

- throughput: the preparation (hashing, reading the jsonl, tokenizing, packing, saving the parts) in tokens/s at 1
  and 2 workers, against a plain `datasets.map` tokenization of the same jsonl with the same tokenizer (a
  byte-level BPE trained here on the generated text, 8192 tokens), each in a fresh process and datasets cache;
- start-up: seconds from launching lm_finetune (one process, the tiny model of scripts/make_tiny_lm.py) to the end
  of a 1-step run (eval on 8 blocks, save) with the blocks prepared ahead, and the peak RSS of a 50-step run, at
  each corpus size.

    python benchmarks/prepare.py                                   # 64 MB throughput; start-up at 10 and 300 MB
    python benchmarks/prepare.py --sizes_mb 10 1000                # 1 GB as well
    python benchmarks/prepare.py --smoke --out /tmp/bench          # seconds: keeps the script working

Writes <out>/prepare.json and prepare.md; with the default --out, the "Prepared data" section of
benchmarks/README.md too.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import BIN, REPO, in_fresh_process, machine_now, parser, publish


def write_prose(path: Path, megabytes: float, seed: int = 0) -> Path:
    """A jsonl of English-like documents (Zipf-distributed invented words, 50 to 400 a document)."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(20000)]
    weights = [1 / (rank + 1) for rank in range(len(words))]
    target = int(megabytes * 2**20)
    with open(path, "w") as f:
        written = 0
        while written < target:
            text = " ".join(rng.choices(words, weights, k=rng.randint(50, 400))).capitalize() + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            written += len(line)
    return path


def write_bpe_model(folder: Path, corpus: Path) -> Path:
    """A byte-level BPE tokenizer of 8192 tokens trained on `corpus`, beside a tiny Llama config of that vocabulary
    (--prepare_only loads the config and the tokenizer, no weights)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    lines = (json.loads(line)["text"] for _, line in zip(range(2000), open(corpus)))
    backend.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=8192, special_tokens=["<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", model_max_length=1024).save_pretrained(folder)
    LlamaConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=1024).save_pretrained(folder)  # fmt: skip
    return folder


def prose_and_bpe(work: Path, megabytes: float) -> tuple[Path, Path]:
    """(jsonl, tokenizer folder): `megabytes` of generated prose in `work`, and a byte-level BPE trained on it."""
    work.mkdir(parents=True, exist_ok=True)
    data = write_prose(work / "prose.jsonl", megabytes)
    return data, write_bpe_model(work / "bpe", data)


def write_counting(path: Path, megabytes: float, unit: Path) -> Path:
    """The tiny model's counting text, repeated to `megabytes`."""
    text = unit.read_text()
    with open(path, "w") as f:
        for _ in range(max(1, int(megabytes * 2**20 / len(text)))):
            f.write(text)
    return path


# One measurement, in a process of its own (a fresh datasets cache, nothing imported before) --------------------


def cpu_seconds() -> float:
    """CPU seconds of this process's threads (a tokenizer's own) and of its children that ended (a pool's workers)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure_plain(data: str, model: str) -> dict:
    """Seconds and tokens of a plain datasets.map tokenization of `data` (as run_clm does it, one process)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    tic, cpu = time.perf_counter(), cpu_seconds()
    raw = load_dataset("json", data_files=data, split="train")
    tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])
    seconds, cpu = time.perf_counter() - tic, cpu_seconds() - cpu
    tokens = sum(len(ids) for batch in tokenized.iter(10000) for ids in batch["input_ids"])
    return {"seconds": seconds, "cpu_seconds": cpu, "tokens": tokens}


def measure_prepared(data: str, model: str, folder: str, workers: int) -> dict:
    from accelerate import PartialState

    from common.text import load_tokenizer, prepared_blocks

    PartialState()
    sys.path.insert(0, str(REPO / "recipes"))
    import lm_finetune

    args = lm_finetune.parse_args(
        ["--model_name_or_path", model, "--train_file", data, "--validation_split_percentage", "1",
         "--block_size", "1024", "--prepared_data_dir", folder, "--preprocessing_num_workers", str(workers)]
    )  # fmt: skip
    tokenizer, _ = load_tokenizer(args)
    tic, cpu = time.perf_counter(), cpu_seconds()
    blocks, _ = prepared_blocks(args, tokenizer, 1024)
    seconds, cpu = time.perf_counter() - tic, cpu_seconds() - cpu
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    blocks = len(blocks["train"]) + len(blocks["validation"])
    return {"seconds": seconds, "cpu_seconds": cpu, "blocks": blocks, "manifest": manifest}


def throughput(work: Path, megabytes: float, repeats: int) -> list:
    data, model = prose_and_bpe(work, megabytes)
    rows, tokens = [], None
    for kind, workers in (("plain", 1), ("prepared", 1), ("prepared", 2)):
        seconds, busy = [], []
        for _ in range(repeats):
            shutil.rmtree(work / "prepared", ignore_errors=True)
            got = in_fresh_process(__file__, work, kind, data, model, work / "prepared", workers)
            seconds.append(got["seconds"])
            busy.append(got["cpu_seconds"] / got["seconds"])
            tokens = got.get("tokens", tokens)  # the corpus's tokens, as the plain map counts them
        rows.append({"kind": kind, "workers": workers, "seconds": statistics.median(seconds), "runs": seconds,
                     "cores_busy": statistics.median(busy)})  # fmt: skip
    shutil.rmtree(work / "prepared", ignore_errors=True)
    for row in rows:
        row["tokens_per_second"] = tokens / row["seconds"]
        row["vs_plain"] = rows[0]["seconds"] / row["seconds"]
    return [{"megabytes": megabytes, "tokens": tokens, **row} for row in rows]


def private_mb(pid: int) -> int:
    """A process's private resident memory (RssAnon) in MB; 0 once it has ended."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) // 1024 for line in f if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


def run_recipe(args: list, env: dict) -> tuple[float, int, int]:
    """(wall seconds, peak RSS in MB, peak private memory in MB) of lm_finetune in one process. RSS also counts the
    pages of memory-mapped files the process has touched (the kernel maps up to 64 KB around each page read), which
    the node's processes share and the kernel drops under pressure; private memory (RssAnon, read every 20 ms) is
    what the process holds itself."""
    with tempfile.TemporaryFile("w+") as stderr:
        tic, private = time.perf_counter(), 0
        proc = subprocess.Popen([str(BIN / "python"), str(REPO / "recipes/lm_finetune.py"), *map(str, args)],
                                env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)  # fmt: skip
        while (ended := os.wait4(proc.pid, os.WNOHANG))[0] == 0:
            private = max(private, private_mb(proc.pid))
            time.sleep(0.02)
        _, status, usage = ended
        seconds = time.perf_counter() - tic
        if status:
            stderr.seek(0)
            raise SystemExit(f"lm_finetune {args} failed:\n{stderr.read()[-3000:]}")
    return seconds, usage.ru_maxrss // 1024, private


def start_up(work: Path, sizes: list, steps: int) -> list:
    sys.path.insert(0, str(REPO / "scripts"))
    from make_tiny_lm import write_tiny_lm

    lm = write_tiny_lm(work / "tiny_lm")
    env = {**os.environ, "HF_DATASETS_CACHE": str(work / "cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    rows = []
    for megabytes in sizes:
        data = write_counting(work / f"counting-{megabytes}.jsonl", megabytes, lm["train"])
        folder = work / f"prepared-{megabytes}"
        shutil.rmtree(folder, ignore_errors=True)
        base = ["--model_name_or_path", lm["model"], "--train_file", data, "--validation_file", lm["validation"],
                "--block_size", "32", "--prepared_data_dir", folder, "--max_eval_samples", "8"]  # fmt: skip
        prepared_in, _, _ = run_recipe([*base, "--prepare_only", "--output_dir", work / "unused"], env)
        manifest = json.loads((folder / "manifest.json").read_text())
        again = ["--overwrite_output_dir", "--output_dir", work / "run"]
        first, rss_first, private_first = run_recipe([*base, *again, "--max_train_steps", "1"], env)
        _, rss, private = run_recipe([*base, *again, "--max_train_steps", steps], env)
        rows.append({
            "megabytes": megabytes, "train_blocks": manifest["splits"]["train"]["blocks"],
            "prepare_seconds": prepared_in, "prepare_workers": manifest["workers"],
            "startup_seconds": first, "peak_rss_mb_1_step": rss_first, "peak_rss_mb": rss,
            "peak_private_mb_1_step": private_first, "peak_private_mb": private, "steps": steps,
        })  # fmt: skip
        data.unlink()
        shutil.rmtree(folder)
    return rows


def table(result: dict) -> str:
    lines = [
        "### Prepared data",
        "",
        f"Machine: {result['machine']}. Command: `{result['command']}`.",
        "",
        f"Preparation throughput, {result['throughput'][0]['megabytes']:g} MB of jsonl, a byte-level BPE of 8192 "
        "tokens, each from a fresh process and datasets cache (reading the jsonl included):",
        "",
        "| what | workers | seconds | tokens/s | vs plain map | cores busy |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["throughput"]:
        what = "plain `datasets.map(tokenizer)`" if row["kind"] == "plain" else "preparation (`--prepare_only`)"
        lines.append(f"| {what} | {row['workers']} | {row['seconds']:.1f} | {row['tokens_per_second']:,.0f} | "
                     f"{row['vs_plain']:.2f}x | {row['cores_busy']:.2f} |")  # fmt: skip
    lines += [
        "",
        "Training from prepared data (tiny model, 1 process): start-up is launch to the end of a 1-step run (eval on "
        "8 blocks, save); the training process's peak RSS, and of it its private memory (RssAnon: RSS less the pages "
        f"of memory-mapped files it touched), over a {result['start_up'][0]['steps']}-step run:",
        "",
        "| corpus | train blocks | prepared in (s) | start-up (s) | peak RSS (MB) | peak private (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["start_up"]:
        prepared = f"{row['prepare_seconds']:.0f} ({row['prepare_workers']} workers)"
        size, blocks = f"{row['megabytes']:g} MB", f"{row['train_blocks']:,}"
        lines.append(f"| {size} | {blocks} | {prepared} | {row['startup_seconds']:.1f} | "
                     f"{row['peak_rss_mb']:,} | {row['peak_private_mb']:,} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser():
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--throughput_mb", type="positive_float", default=64)
    p.add_argument("--sizes_mb", type="positive_float", nargs="+", default=[10, 300])
    p.add_argument("--steps", type="positive_int", default=50)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.smoke:
        args.throughput_mb, args.sizes_mb, args.steps = 1, [1, 2], 3
    repeats = args.repeats or 1
    work = args.work_dir or args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    machine = machine_now()
    result = {
        "machine": machine,
        "command": " ".join(["python", "benchmarks/prepare.py", *sys.argv[1:]]),
        "throughput": throughput(work, args.throughput_mb, repeats),
        "start_up": start_up(work, args.sizes_mb, args.steps),
    }
    publish(args, "prepare", result, table(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_measure"]:
        kind, data, model, folder, workers = sys.argv[2:7]
        if kind == "plain":
            got = measure_plain(data, model)
        else:
            got = measure_prepared(data, model, folder, int(workers))
        print(json.dumps({k: v for k, v in got.items() if k != "manifest"}))
    else:
        main()
