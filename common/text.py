"""Text data for causal-LM recipes: local or hub datasets, tokenization, chat-prompt masking, and
packing into fixed-length blocks."""

from __future__ import annotations

import math
from itertools import chain
from pathlib import Path

import torch
import torch.nn.functional as F

from .data import make_dataloader, prepare_data_first
from .runtime import RecipeError

IGNORE_INDEX = -100  # the label transformers' losses skip
LOCAL_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def load_raw_datasets(*, dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                      validation_split_percentage=5, seed=0):
    """A DatasetDict with `train` and `validation`, from the hub or from local files.

    With no validation split, `validation_split_percentage` percent of train is held out (seeded).
    """
    from datasets import DatasetDict, load_dataset

    if dataset_name:
        raw = load_dataset(dataset_name, dataset_config_name)
    elif train_file:
        files = {"train": train_file, **({"validation": validation_file} if validation_file else {})}
        for split, path in files.items():
            if not Path(path).is_file():
                raise RecipeError(f"--{split}_file {path}: no such file")
        suffix = Path(train_file).suffix
        if suffix not in LOCAL_FORMATS:
            raise RecipeError(f"--train_file {train_file}: unknown format {suffix!r}; use one of {', '.join(LOCAL_FORMATS)}")
        raw = load_dataset(LOCAL_FORMATS[suffix], data_files={k: str(v) for k, v in files.items()})
    else:
        raise RecipeError("no data: pass --dataset_name (hub) or --train_file (local txt, json, jsonl, csv, parquet)")
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    return raw


def chat_example(tokenizer, messages) -> dict:
    """Tokenize a conversation with the tokenizer's chat template; only assistant replies are
    labelled, so the loss never trains the model to write the user's prompts.

    Each assistant reply is located as the text between the rendering of the conversation before
    it (with the generation prompt) and the rendering that includes it; tokens whose characters
    fall inside such a span keep their label.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise RecipeError("the tokenizer's chat template does not render conversations incrementally, "
                              "so prompt tokens cannot be masked; use --data_format text")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        token if any(start <= a and b <= end for start, end in spans) else IGNORE_INDEX
        for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]
    return {"input_ids": encoded["input_ids"], "labels": labels}


def pack(examples: dict, block_size: int) -> dict:
    """Concatenate the batch's examples and cut them into blocks of `block_size` tokens (the
    remainder is dropped), so no compute is spent on padding."""
    joined = {key: list(chain.from_iterable(examples[key])) for key in ("input_ids", "labels")}
    usable = len(joined["input_ids"]) // block_size * block_size
    return {key: [ids[i : i + block_size] for i in range(0, usable, block_size)] for key, ids in joined.items()}


def max_block_size(tokenizer, config) -> int:
    """The longest sequence both the model and the tokenizer accept."""
    limits = [getattr(config, "max_position_embeddings", None), tokenizer.model_max_length]
    return min(limit for limit in limits if limit and limit < 1_000_000_000)


def tokenize_and_pack(raw, tokenizer, *, data_format: str, text_column: str, block_size: int, num_proc=None):
    """Tokenize `raw` (text: `text_column` plus EOS; chat: the `messages` column, prompts
    masked) and pack into blocks. `datasets` caches each step, so a process that runs this after
    the main one (see prepare_data_first) loads the cache instead of recomputing it."""
    column = text_column if data_format == "text" else "messages"
    columns = raw["train"].column_names
    if column not in columns:
        flag = "--text_column" if data_format == "text" else "--data_format chat needs a column named"
        raise RecipeError(f"{flag} {column}: not in the data (columns: {', '.join(columns)})")

    def tokenize(batch):
        if data_format == "chat":
            rows = [chat_example(tokenizer, messages) for messages in batch[column]]
            return {key: [row[key] for row in rows] for key in ("input_ids", "labels")}
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]  # marks document ends
        ids = [tokens + eos for tokens in tokenizer(batch[column])["input_ids"]]
        return {"input_ids": ids, "labels": ids}

    tokenized = raw.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc, desc="tokenizing")
    packed = tokenized.map(pack, batched=True, fn_kwargs={"block_size": block_size}, num_proc=num_proc,
                           desc=f"packing into blocks of {block_size}")
    for split in ("train", "validation"):
        if len(packed[split]) == 0:
            raise RecipeError(f"the {split} split holds fewer than {block_size} tokens; lower --block_size or add data")
    return packed.with_format("torch")


def add_text_args(parser) -> None:
    """The data arguments of the causal-LM recipes (names from transformers' run_clm)."""
    d = parser.add_argument_group("data")
    d.add_argument("--dataset_name", help="a hub dataset, or a local folder of data files")
    d.add_argument("--dataset_config_name")
    d.add_argument("--train_file", help="local .txt, .json, .jsonl, .csv or .parquet")
    d.add_argument("--validation_file")
    d.add_argument("--validation_split_percentage", type=int, default=5, help="held out when there is no validation split")
    d.add_argument("--text_column", default="text")
    d.add_argument("--data_format", choices=["text", "chat"], default="text",
                   help="chat: a `messages` column rendered with the chat template, prompts masked out of the loss")
    d.add_argument("--block_size", type=int, help="default: min(model max length, 1024)")
    d.add_argument("--preprocessing_num_workers", type=int)


def lm_dataloaders(args, accelerator, tokenizer, config):
    """(train, eval, block_size): tokenized and packed once by the main process (the others read
    datasets' cache), in fixed-size blocks that need no padding."""
    from transformers import default_data_collator

    vocab = getattr(config, "vocab_size", None)
    if vocab and len(tokenizer) > vocab:  # ids past the embedding: an IndexError on CPU, a device assert on GPU
        raise RecipeError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab} (config.vocab_size): "
            "use the tokenizer saved with the model (--tokenizer_name), or resize the model's embeddings to it first"
        )
    limit = max_block_size(tokenizer, config)
    block_size = args.block_size or min(limit, 1024)
    if block_size > limit:
        raise RecipeError(f"--block_size {block_size} is larger than the model accepts ({limit}); pass --block_size {limit} or less")
    with prepare_data_first(accelerator):
        raw = load_raw_datasets(dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
                                train_file=args.train_file, validation_file=args.validation_file,
                                validation_split_percentage=args.validation_split_percentage, seed=args.seed)
        data = tokenize_and_pack(raw, tokenizer, data_format=args.data_format, text_column=args.text_column,
                                 block_size=block_size, num_proc=args.preprocessing_num_workers)
    workers = 0 if args.dataloader_num_workers is None else args.dataloader_num_workers  # blocks are in memory
    train = make_dataloader(data["train"], args.per_device_train_batch_size, train=True, num_workers=workers,
                            collate_fn=default_data_collator)
    evals = make_dataloader(data["validation"], args.per_device_eval_batch_size, train=False, num_workers=workers,
                            collate_fn=default_data_collator)
    return train, evals, block_size


def evaluate_causal_lm(model, eval_dl, accelerator, stop=None) -> dict | None:
    """Token-weighted loss and perplexity over the whole eval set, each block counted once; None if
    `stop` (a common.StopOnSignal) reports a signal, which every process sees at the same batch."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in eval_dl:
            if stop is not None and stop.requested():
                model.train()
                return None
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            per_block = torch.stack([F.cross_entropy(row.float(), lab, ignore_index=IGNORE_INDEX, reduction="sum")
                                     for row, lab in zip(logits, labels)])  # a row at a time: fp32 logits are large
            # gather_for_metrics drops the blocks Accelerate repeated to even out the last batch
            per_block, counts = accelerator.gather_for_metrics((per_block, (labels != IGNORE_INDEX).sum(-1)))
            loss_sum += per_block.sum().item()
            tokens += counts.sum().item()
    model.train()
    eval_loss = loss_sum / tokens
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50)), "eval_tokens": tokens}


def flops_per_token(model, block_size: int, parameters: int) -> float:
    """Training FLOPs per token: 6N for the matrix multiplies plus the attention scores (PaLM, appendix B)."""
    config = model.config
    return 6 * parameters + 12 * config.num_hidden_layers * config.hidden_size * block_size
