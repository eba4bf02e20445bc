"""Text data for causal-LM recipes: local or hub datasets, tokenization, chat-prompt masking, and
packing into fixed-length blocks."""

from __future__ import annotations

from itertools import chain
from pathlib import Path

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
