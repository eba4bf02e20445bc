"""The LM recipes' training input against their models: tokens/s of the DataLoader the recipe builds over prepared
blocks of 1024 (common.text.lm_dataloaders, then accelerator.prepare, one process, batches of 8), against the
tokens/s a training step (forward, backward, AdamW, on one block) of the tiny test model and of a ~100M-parameter
Llama takes on this machine. The loader is not the bottleneck while its rate is above the model's.

    python benchmarks/loader.py                                   # 64 MB of generated prose, prepared, then read
    python benchmarks/loader.py --smoke --out /tmp/bench          # seconds: keeps the script working

Writes <out>/loader.json and loader.md; with the default --out, the "Loader" section of benchmarks/README.md too.
"""

from __future__ import annotations

import json
import shutil
import sys
import time

from benchlib import REPO, in_fresh_process, machine_now, parser, publish
from prepare import prose_and_bpe

# Model shapes (hidden, intermediate, layers, heads): the tests' tiny Llama, and GPT-2 small's width and depth (about
# 100M parameters with the BPE's 8192 tokens).
MODELS = {"tiny": (64, 128, 2, 4), "~100M": (768, 2048, 12, 12)}


def measure(data: str, model: str, folder: str, steps: int) -> dict:
    import torch
    from accelerate import Accelerator
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(REPO / "recipes"))
    import lm_finetune

    from common.text import lm_dataloaders, load_tokenizer

    args = lm_finetune.parse_args(
        ["--model_name_or_path", model, "--train_file", data, "--validation_split_percentage", "1",
         "--block_size", "1024", "--per_device_train_batch_size", "8", "--prepared_data_dir", folder]
    )  # fmt: skip
    accelerator = Accelerator(cpu=True)
    tokenizer, _ = load_tokenizer(args)
    train_dl, _, block_size = lm_dataloaders(args, accelerator, tokenizer, AutoConfig.from_pretrained(model))
    batches = iter(accelerator.prepare(train_dl))
    next(batches)  # the loader's start: not its rate
    tic, tokens = time.perf_counter(), 0
    for _ in range(min(100 * steps, len(train_dl) - 3)):  # two batches left for the models
        tokens += next(batches)["input_ids"].numel()
    loader = tokens / (time.perf_counter() - tic)
    models = {}
    for name, (hidden, intermediate, layers, heads) in MODELS.items():
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
            num_attention_heads=heads, max_position_embeddings=block_size,
        )  # fmt: skip
        net = LlamaForCausalLM(config)
        optimizer = torch.optim.AdamW(net.parameters())
        batch = {key: value[:1] for key, value in next(batches).items()}  # one block: seconds a step on a CPU
        n = steps * (10 if name == "tiny" else 1)
        for i in range(n + 1):  # the first step warms up, untimed
            if i == 1:
                tic = time.perf_counter()
            net(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        rate = n * batch["input_ids"].numel() / (time.perf_counter() - tic)
        models[name] = {"parameters": sum(p.numel() for p in net.parameters()), "tokens_per_second": rate}
    return {"loader_tokens_per_second": loader, "block_size": block_size, "models": models}


def table(result: dict) -> str:
    loader = result["loader_tokens_per_second"]
    lines = [
        "### Loader",
        "",
        f"Machine: {result['machine']}. Command: `{result['command']}`.",
        "",
        f"The training DataLoader over prepared blocks of {result['block_size']} ({result['megabytes']} MB of "
        "jsonl; lm_dataloaders, then accelerator.prepare, one process, batches of 8) against a training step of "
        "each model shape on one of its blocks, in the same process:",
        "",
        "| what | parameters | tokens/s | loader over it |",
        "|---|---|---|---|",
        f"| the DataLoader | | {loader:,.0f} | |",
    ]
    for name, row in result["models"].items():
        lines.append(f"| {name} model: forward, backward, AdamW | {row['parameters'] / 1e6:.1f}M | "
                     f"{row['tokens_per_second']:,.0f} | {loader / row['tokens_per_second']:,.1f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def build_parser():
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--megabytes", type="positive_float", default=64)
    return p


def main() -> None:
    args = build_parser().parse_args()
    megabytes, steps = (1, 1) if args.smoke else (args.megabytes, 3)
    work = args.work_dir or args.out / "work"
    data, model = prose_and_bpe(work, megabytes)
    shutil.rmtree(work / "loader", ignore_errors=True)
    machine = machine_now()
    got = in_fresh_process(__file__, work, "loader", data, model, work / "loader", steps)
    shutil.rmtree(work / "loader", ignore_errors=True)
    result = {
        "machine": machine,
        "command": " ".join(["python", "benchmarks/loader.py", *sys.argv[1:]]),
        "megabytes": megabytes,
        **got,
    }
    publish(args, "loader", result, table(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--_measure"]:
        _, data, model, folder, steps = sys.argv[2:7]
        print(json.dumps(measure(data, model, folder, int(steps))))
    else:
        main()
