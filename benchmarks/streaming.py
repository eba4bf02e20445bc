"""--streaming (common.data.StreamOfBlocks): how fast a stream makes training blocks, and what a resume costs as a
function of its position.

- throughput: one pass over a jsonl streamed as the LM recipes stream it (rows shuffled in the buffer, tokenized and
  packed into blocks of 1024) in tokens/s, against a plain `datasets.map` tokenization of the same file with the same
  tokenizer (a byte-level BPE trained here, 8192 tokens) and against reading the same blocks prepared ahead
  (memory-mapped, common.prepared);
- resume: seconds for a resume at 0, 1/4, 1/2 and 3/4 of the pass to reach its position (the main process makes the
  blocks before it again, then its loader reads the rows before it without tokenizing) and to deliver its first
  block.

Each measurement runs in a process of its own with a fresh datasets cache.

    python benchmarks/streaming.py                             # 32 MB
    python benchmarks/streaming.py --megabytes 256
    python benchmarks/streaming.py --smoke --out /tmp/bench    # seconds: keeps the script working

Writes <out>/streaming.json and streaming.md; with the default --out, the "Streaming" section of
benchmarks/README.md too.
"""

from __future__ import annotations

import json
import shutil
import sys
import time

from benchlib import REPO, in_fresh_process, machine_now, parser, publish
from prepare import measure_plain, prose_and_bpe

BLOCK = 1024


def _recipe_args(data: str, model: str, *extra) -> object:
    from accelerate import PartialState

    PartialState()  # which the recipes' logger needs
    sys.path.insert(0, str(REPO / "recipes"))
    import lm_finetune

    return lm_finetune.parse_args(
        ["--model_name_or_path", model, "--train_file", data, "--validation_file", data, "--block_size", str(BLOCK),
         "--max_eval_samples", "1", *extra]
    )  # fmt: skip


def _stream(data: str, model: str):
    from common.text import load_tokenizer, streamed_data

    args = _recipe_args(data, model, "--streaming", "--max_train_steps", "1")
    stream, _ = streamed_data(args, load_tokenizer(args)[0], BLOCK)
    return stream


def measure_stream(data: str, model: str) -> dict:
    """Seconds and tokens of one pass over the stream (shuffled, tokenized, packed, as the loader's worker reads)."""
    stream = _stream(data, model)
    tic, blocks = time.perf_counter(), sum(1 for _ in stream)
    return {"seconds": time.perf_counter() - tic, "tokens": blocks * BLOCK, "blocks": blocks}


def measure_prepared_read(data: str, model: str, folder: str) -> dict:
    """Seconds to read every block prepared ahead (prepared here first, not timed), as tensors."""
    from common.text import load_tokenizer, prepared_blocks

    args = _recipe_args(data, model, "--prepared_data_dir", folder)
    blocks, _ = prepared_blocks(args, load_tokenizer(args)[0], BLOCK)
    train = blocks["train"].with_format("torch")
    tic, count = time.perf_counter(), sum(1 for _ in train)
    return {"seconds": time.perf_counter() - tic, "tokens": count * BLOCK, "blocks": count}


def measure_resume(data: str, model: str, sample: int) -> dict:
    """Seconds to place the stream at `sample` (resume_at) and then to its first block."""
    stream = _stream(data, model)
    tic = time.perf_counter()
    stream.resume_at(0, sample)
    located = time.perf_counter() - tic
    next(iter(stream))
    return {"locate_seconds": located, "first_block_seconds": time.perf_counter() - tic - located}


def table(result: dict) -> str:
    t = result["throughput"]
    lines = [
        "### Streaming",
        "",
        f"Machine: {result['machine']}. Command: `{result['command']}`.",
        "",
        f"One pass over {result['megabytes']} MB of jsonl ({t['plain']['tokens']:,} tokens), a byte-level BPE of 8192 "
        f"tokens, blocks of {BLOCK}, each in a fresh process:",
        "",
        "| what | seconds | tokens/s | vs plain map |",
        "|---|---|---|---|",
    ]
    names = {
        "plain": "plain `datasets.map(tokenizer)` (no packing)",
        "stream": "`--streaming`: read, shuffled, tokenized, packed",
        "prepared": "reading the blocks prepared ahead (memory-mapped)",
    }
    for kind, row in t.items():
        rate = row["tokens"] / row["seconds"]
        lines.append(
            f"| {names[kind]} | {row['seconds']:.2f} | {rate:,.0f} | {t['plain']['seconds'] / row['seconds']:.2f}x |"
        )
    lines += [
        "",
        "A resume at a position of the pass (sample k of the epoch): the main process makes the blocks before it "
        "again, then its loader reads the rows before it without tokenizing:",
        "",
        "| position | samples | placing (s) | to the first block (s) |",
        "|---|---|---|---|",
    ]
    for row in result["resume"]:
        lines.append(f"| {row['fraction']:.2f} | {row['sample']:,} | {row['locate_seconds']:.2f} | "
                     f"{row['first_block_seconds']:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser():
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--megabytes", type="positive_float", default=32)
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.smoke:
        args.megabytes = 1
    work = args.work_dir or args.out / "work"
    data, model = prose_and_bpe(work, args.megabytes)
    machine = machine_now()
    throughput = {
        "plain": in_fresh_process(__file__, work, "plain", data, model),
        "stream": in_fresh_process(__file__, work, "stream", data, model),
        "prepared": in_fresh_process(__file__, work, "prepared", data, model, work / "prepared"),
    }
    shutil.rmtree(work / "prepared", ignore_errors=True)
    blocks = throughput["stream"]["blocks"]
    resume = []
    for fraction in (0, 0.25, 0.5, 0.75):
        sample = int(blocks * fraction)
        resume.append(
            {"fraction": fraction, "sample": sample, **in_fresh_process(__file__, work, "resume", data, model, sample)}
        )
    result = {
        "machine": machine,
        "command": " ".join(["python", "benchmarks/streaming.py", *sys.argv[1:]]),
        "megabytes": args.megabytes,
        "throughput": throughput,
        "resume": resume,
    }
    publish(args, "streaming", result, table(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_measure"]:
        kind, data, model, *rest = sys.argv[2:]
        if kind == "plain":
            got = measure_plain(data, model)
        elif kind == "stream":
            got = measure_stream(data, model)
        elif kind == "prepared":
            got = measure_prepared_read(data, model, rest[0])
        else:
            got = measure_resume(data, model, int(rest[0]))
        print(json.dumps(got))
    else:
        main()
