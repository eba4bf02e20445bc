"""Text data and causal LMs for the LM recipes: datasets tokenized (chat prompts masked) and packed into blocks,
models from a hub id or a folder, the token-weighted loss. What the libraries raise about the user's data or model
becomes one RecipeError naming the file and the fix; an error about a path is left to common.runtime's line."""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import logging
import math
import os
import re
import reprlib
import shutil
import time
from functools import partial
from itertools import chain
from pathlib import Path

import torch
import torch.nn.functional as F

from . import prepared, tensor_parallel
from .args import at_least
from .data import make_dataloader, prepare_data_first
from .preemption import stop_before_training
from .runtime import RecipeError, RunFinished, causes, check_path, logger, one_line

IGNORE_INDEX = -100  # the label transformers' losses skip
LOCAL_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
COMPRESSED = (".gz", ".bz2", ".xz")  # datasets decompresses these as it reads (the standard library's codecs)
FORMAT_HINTS = {  # what a file that datasets cannot read in its format must be
    "json": 'each line must be one JSON object, such as {"text": "..."}',
    "csv": "it must be comma-separated with a header row naming the columns",
    "parquet": "write it again with a parquet writer (pandas, pyarrow, datasets)",
    "text": "it must be plain UTF-8 text",
}
MESSAGE_SHAPE = '{"role": ..., "content": "..."}'


# Arguments ----------------------------------------------------------------------------------------


def add_lm_args(parser):
    """The model and data arguments of the causal-LM recipes (names from transformers' run_clm) and their rules;
    returns the model group, for the recipe's own model options."""
    group = parser.add_argument_group("model")
    m = group.add_argument
    m("--model_name_or_path", help="pretrained weights: a hub id or a local folder")
    m("--config_name", help="or a new model, randomly initialized: the config of a hub id or local folder")
    m("--config_overrides", type="key_value_pairs", help="with --config_name, e.g. hidden_size=64,num_hidden_layers=2")
    m("--tokenizer_name", help="default: --model_name_or_path or --config_name")
    m("--resize_token_embeddings", action="store_true", help="grow the embeddings to a larger tokenizer")
    m("--trust_remote_code", action="store_true", help="run the model repo's own code")
    d = parser.add_argument_group("data").add_argument
    d("--dataset_name", help="a hub dataset, or a local folder of data files")
    d("--dataset_config_name")
    d("--train_file", help="local .txt, .json, .jsonl, .csv or .parquet, or one of them .gz, .bz2 or .xz compressed")
    d("--validation_file", help="in the format of --train_file")
    d("--validation_split_percentage", type="percentage", default=5, help="held out when there is no validation split")
    d("--text_column", default="text")
    d("--data_format", choices=["text", "chat"], default="text", help="chat: a `messages` column, prompts masked out")
    d("--block_size", type=at_least(2), help="default: min(model max length, 1024)")
    d("--preprocessing_num_workers", type="positive_int", help="processes that tokenize (default: the CPUs "
      f"available, 1 for data under {prepared.SMALL_DATA_BYTES // 2**20} MB)")  # fmt: skip
    d("--prepared_data_dir", help="where the tokenized blocks are kept and reused, shareable across runs and nodes "
      "(default: a folder named by the inputs in the datasets cache)")  # fmt: skip
    d("--prepare_only", action="store_true", help="prepare the data (e.g. on a CPU machine), then exit")
    d("--max_eval_samples", type="positive_int", help="evaluate on the first N blocks of the held-out set")
    d("--streaming", action="store_true", help="read and tokenize the training data as the run trains (datasets "
      "streaming): a corpus that does not fit the disk; needs --max_train_steps")  # fmt: skip
    parser.checks.append(_check_lm_args)
    parser.does_nothing_unless(["--num_train_epochs"], lambda a: not a.streaming, "with --streaming (a stream has no "
                               "length: --max_train_steps sets the run's)", ", or drop --streaming")  # fmt: skip
    parser.does_nothing_unless(["--prepared_data_dir", "--prepare_only", "--preprocessing_num_workers"],
                               lambda a: not a.streaming, "with --streaming (its blocks are made as the run reads "
                               "the data, never prepared)", ", or drop --streaming")  # fmt: skip
    parser.does_nothing_unless(["--text_column"], lambda a: a.data_format == "text", "with --data_format chat (its "
                               "conversations are read from the messages column)")  # fmt: skip
    parser.does_nothing_unless(["--config_overrides"], lambda a: a.config_name, "without --config_name (they change "
                               "its config, not pretrained weights)", ", or pass --config_name")  # fmt: skip
    parser.does_nothing_unless(["--dataset_config_name"], lambda a: a.dataset_name, "without --dataset_name")
    parser.does_nothing_unless(["--validation_split_percentage"], lambda a: not a.validation_file, "with "
                               "--validation_file (nothing is held out of --train_file)")  # fmt: skip
    return group


def _check_lm_args(parser, args) -> None:
    if bool(args.model_name_or_path) == bool(args.config_name):
        parser.error("pass --model_name_or_path (pretrained) or --config_name (from scratch), one of them",
                     subject="--model_name_or_path")  # fmt: skip
    if args.dataset_name and (args.train_file or args.validation_file):
        parser.error(
            "pass --dataset_name or --train_file (with --validation_file), not both", subject="--dataset_name"
        )
    if not args.dataset_name and not args.train_file:
        parser.error("no data: pass --train_file (txt, json, jsonl, csv, parquet) or --dataset_name (hub or folder)",
                     subject="--train_file")  # fmt: skip
    if args.streaming and not args.max_train_steps:
        parser.error("--streaming reads the data as it trains, so no epoch length is known to plan by: pass "
                     "--max_train_steps (the stream starts again when it ends)", subject="--streaming")  # fmt: skip
    if args.streaming and args.train_file and not args.validation_file:
        parser.error("--streaming cannot hold a share of a stream out for validation: pass --validation_file "
                     "(held-out rows in the format of --train_file), or drop --streaming",
                     subject="--streaming")  # fmt: skip
    for flag, path in (("--train_file", args.train_file), ("--validation_file", args.validation_file)):
        if path and Path(path).is_dir():  # of data files, or saved by save_to_disk
            parser.error(f"{flag} {path} is a folder: pass a file in it, or the folder as --dataset_name {path}",
                         subject=flag)  # fmt: skip
        if path and local_format(path) is None:
            parser.error(
                f"{flag} {path}: unknown format {Path(path).suffix!r}",
                f"use one of {', '.join(LOCAL_FORMATS)} (also compressed: {', '.join(COMPRESSED)})",
                subject=flag,
            )
        # here, not when the data loads: a mistyped path costs a second, not the loading of a model's weights
        path and check_path(flag, path)


def local_format(path) -> str | None:
    """datasets' builder for a local data file by its name (data.jsonl, data.jsonl.gz), or None."""
    suffixes = [suffix.lower() for suffix in Path(path).suffixes]
    if suffixes and suffixes[-1] in COMPRESSED:
        suffixes.pop()
    return LOCAL_FORMATS.get(suffixes[-1]) if suffixes else None


# Data ---------------------------------------------------------------------------------------------


def _excerpt(value, limit=80) -> str:
    """A short repr of a user's value for an error line."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxlevel = limit, limit, 4, 4, 3
    return r.repr(value)


def _not_utf8(err: UnicodeDecodeError) -> str:
    byte, around = err.object[err.start], err.object[max(0, err.start - 20) : err.start + 20]
    return f"not UTF-8 text (byte 0x{byte:02x} in {_excerpt(around)}); convert the file, e.g. iconv -f latin1 -t utf-8"


def _about_a_path(err: BaseException) -> bool:
    """Whether `err` is an error about a path (an unwritable cache: common.runtime's line names the option it came
    from), not a fault of the user's data or model."""
    return any(isinstance(e, OSError) and e.filename for e in causes(err))


def _load(source: str, builder: str, *load_args, **load_kwargs):
    """datasets.load_dataset, with what it, pyarrow or pandas raise about the data as one line naming `source`."""
    from datasets import load_dataset

    quiet = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")  # it logs its own error line first
    level, quiet.level = quiet.level, logging.CRITICAL
    path = load_kwargs.get("data_files")  # a local file
    try:
        return load_dataset(builder, *load_args, **load_kwargs)
    except Exception as err:
        if _about_a_path(err):
            raise
        raise _data_error(err, source, builder, path) from err
    finally:
        quiet.setLevel(level)


def _first_rows(source: str, builder: str, stream, path=None, count: int = 100):
    """The first `count` rows of a stream as a Dataset (a stream's data is read when iterated: what is wrong with
    the file is said here, as _load says it), or None when it holds no rows."""
    from datasets import Dataset

    try:
        rows = list(stream.take(count))
    except Exception as err:
        if _about_a_path(err):
            raise
        raise _data_error(err, source, builder, path) from err
    return Dataset.from_list(rows) if rows else None


def _data_error(err: BaseException, source: str, builder: str, path) -> RecipeError:
    """What datasets, pyarrow or pandas raised reading `source` (`path`: a local file) as one line."""
    found = causes(err)
    decode = next((e for e in found if isinstance(e, UnicodeDecodeError)), None)
    cause = next((e for e in found if type(e).__name__ != "DatasetGenerationError"), err)
    what = f"{type(cause).__name__}: {one_line(cause)}" if str(cause).strip() else type(cause).__name__
    if decode:
        why = _not_utf8(decode)
    # datasets has no one error for a file without rows: "corresponds to no data" for blank lines or a
    # header alone, a format's own error for an empty file
    elif path and ("corresponds to no data" in str(err) or Path(path).stat().st_size == 0):
        why = "holds no rows; add data or pass another file"
    elif path:
        why = f"cannot be read as {builder} ({what}); {FORMAT_HINTS[builder]}"
    elif Path(builder).is_dir() and "Cast" in type(cause).__name__:  # its data files are read as one table
        why = f"{what}; its data files must share one format and the same columns: move the others out of it"
    else:
        why = f"{what}; pass a hub dataset id (with network, or cached) or a folder of data files, or --train_file"
    return RecipeError(f"{source}: {why}", subject=option_of(source))


def data_sources(dataset_name=None, train_file=None, validation_file=None) -> dict:
    """How error lines name each split's data."""
    if dataset_name:
        return {split: f"--dataset_name {dataset_name} ({split} split)" for split in ("train", "validation")}
    held_out = f"the part of --train_file {train_file} held out for validation"
    return {
        "train": f"--train_file {train_file}",
        "validation": f"--validation_file {validation_file}" if validation_file else held_out,
    }


def option_of(source: str) -> str | None:
    """The option a data source's name says it came from ("--train_file t.jsonl" -> "--train_file"): a refusal's
    subject."""
    return named[0] if (named := re.search(r"--\w+", source)) else None


def load_raw_datasets(*, dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                      validation_split_percentage=5, seed=0, data_format=None, text_column="text"):  # fmt: skip
    """A DatasetDict with `train` and `validation`; without a validation split, `validation_split_percentage`
    percent of train is held out (seeded), once the columns of `data_format` (if given) are checked."""
    raw = read_sources(
        dataset_name=dataset_name, dataset_config_name=dataset_config_name, train_file=train_file,
        validation_file=validation_file, data_format=data_format, text_column=text_column,
    )  # fmt: skip
    return hold_out(raw, validation_split_percentage, seed, data_sources(dataset_name, train_file, validation_file))


def read_sources(*, dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                 data_format=None, text_column="text", streaming=False):  # fmt: skip
    """The splits as the data has them (a `train`, maybe a `validation`), their columns checked for `data_format`;
    `streaming`: as `datasets` streams, read when iterated, their columns checked on their first rows."""
    from datasets import DatasetDict

    sources = data_sources(dataset_name, train_file, validation_file)
    paths = {"train": train_file, "validation": validation_file}
    if dataset_name:
        flag = f"--dataset_name {dataset_name}"
        flag += f" --dataset_config_name {dataset_config_name}" if dataset_config_name else ""
        if dataset_name.startswith(("/", ".", "~")):  # a folder: say so if it is not there
            check_path("--dataset_name", dataset_name, folder=True)
        raw = _load(flag, dataset_name, dataset_config_name, streaming=streaming)
        if "train" not in raw:
            raise RecipeError(
                f"{flag}: no train split (it has {', '.join(raw) or 'none'}); pass --train_file instead",
                subject="--dataset_name",
            )
        builders = dict.fromkeys(raw, dataset_name)
    else:
        raw, builders = DatasetDict(), {}
        for split, path in paths.items():
            if path:
                check_path(f"--{split}_file", path)
                fmt = builders[split] = local_format(path)  # datasets never returns a split without rows
                bom = {"encoding": "utf-8-sig"} if fmt == "text" else {}  # a byte-order mark is no text (json: none)
                raw[split] = _load(
                    sources[split], fmt, data_files=str(path), split="train", streaming=streaming, **bom
                )
    checked = raw
    if streaming:  # a stream's rows are read as it is iterated: the first ones now, for what is wrong with them
        checked = DatasetDict()
        for split in [split for split in ("train", "validation") if split in raw]:
            checked[split] = _first_rows(sources[split], builders[split], raw[split], paths.get(split))
            if checked[split] is None:
                raise RecipeError(
                    f"{sources[split]}: holds no rows; add data or pass another file",
                    subject=option_of(sources[split]),
                )
    if data_format:
        check_columns(checked, data_format, text_column, sources)
    return raw


def hold_out(raw, validation_split_percentage, seed, sources):
    """`raw` with a `validation` split: its own, or `validation_split_percentage` percent of train (seeded)."""
    from datasets import DatasetDict

    if "validation" in raw:
        return raw
    try:
        split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
    except ValueError as err:  # a side would be empty
        rows = len(raw["train"])
        other = ", or another --validation_split_percentage" if rows > 1 else ""  # one row: no share mends it
        raise RecipeError(
            f"{sources['train']}: {rows} row(s) are too few to hold out {validation_split_percentage}% for "
            f"validation; add rows, or pass --validation_file{other}",
            subject="--validation_split_percentage",
        ) from err
    return DatasetDict(train=split["train"], validation=split["test"])


def check_conversation(messages, needs_reply: bool = True) -> None:
    """Refuse a conversation the chat template would render unfaithfully (a number or a list of parts as content),
    or, with `needs_reply` (training data, not a prompt), that teaches nothing (no assistant reply)."""
    if not isinstance(messages, list) or not messages:
        raise RecipeError(f"`messages` is {_excerpt(messages)}, not a list of {MESSAGE_SHAPE} messages")
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict):
            raise RecipeError(f"message {number} is {_excerpt(message)}, not an object {MESSAGE_SHAPE}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RecipeError(f"message {number} has no role: {_excerpt(message)}")
        if content is None and not message.get("tool_calls"):  # an assistant's tool call may come without text
            raise RecipeError(f"message {number} has no content: {_excerpt(message)}")
        if content is not None and not isinstance(content, str):
            fix = "join its text parts into one string" if isinstance(content, list) else "make it text"
            raise RecipeError(
                f"message {number}'s content is {_excerpt(content)} ({type(content).__name__}), not a string: {fix}"
            )
    if needs_reply and not any(message["role"] == "assistant" for message in messages):
        raise RecipeError(f"no assistant message, so nothing to train on: {_excerpt(messages)}")


def chat_example(tokenizer, messages) -> dict:
    """A conversation in the tokenizer's chat template, only the assistant's replies labelled: each reply is the
    text between the rendering of the turns before it (with the generation prompt) and the rendering through it.
    (transformers' return_assistant_tokens_mask needs {% generation %} markers, which most templates lack.)"""
    from jinja2 import TemplateError

    check_conversation(messages)
    render = tokenizer.apply_chat_template
    try:
        text, spans = render(messages, tokenize=False), []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                through = render(messages[: i + 1], tokenize=False)
                if i:
                    before = render(messages[:i], tokenize=False, add_generation_prompt=True)
                else:  # the reply opens the conversation: what the template puts before it (a header, a system prompt)
                    before = through[: max(through.rfind(message["content"]), 0)]
                if not (text.startswith(before) and text.startswith(through)):
                    raise RecipeError(
                        "the tokenizer's chat template does not render conversations incrementally, so prompt "
                        "tokens cannot be masked; use --data_format text",
                        subject="--data_format",
                    )
                spans.append((len(before), len(through)))
    except TemplateError as err:  # the template's own checks: roles that must alternate, a system message first
        raise RecipeError(f"the chat template rejects the conversation ({err}): {_excerpt(messages)}") from err
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [  # a token ending inside a reply is the reply's (" four" holds the space its prompt ends with)
        token if any(start < b <= end for start, end in spans) else IGNORE_INDEX
        for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]
    return {"input_ids": encoded["input_ids"], "labels": labels}


def pack(examples: dict, block_size: int) -> dict:
    """The examples concatenated and cut into blocks of `block_size` (the rest dropped): no compute on padding.
    Without labels (plain text), the labels are the token ids."""
    ids = list(chain.from_iterable(examples["input_ids"]))
    labels = list(chain.from_iterable(examples["labels"])) if "labels" in examples else ids
    usable = len(ids) // block_size * block_size
    return {key: [seq[i : i + block_size] for i in range(0, usable, block_size)] for key, seq in
            (("input_ids", ids), ("labels", labels))}  # fmt: skip


def token_table(tokens: dict):
    """An Arrow table of tokenized rows (a tokenize() result): lists of int32."""
    import pyarrow as pa

    return pa.table({key: pa.array(rows, pa.list_(pa.int32())) for key, rows in tokens.items()})


def pack_table(table, block_size: int):
    """pack() of an Arrow table, in Arrow: the same blocks, without making a Python int of each token."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    def flat(key):  # any vocabulary fits int32, and -100 for a masked label
        return pc.list_flatten(table.column(key)).combine_chunks().cast(pa.int32())

    ids = flat("input_ids")
    labels = flat("labels") if "labels" in table.column_names else ids
    usable = len(ids) // block_size * block_size
    offsets = pa.array(np.arange(0, usable + 1, block_size, dtype=np.int32))
    return pa.table({key: pa.ListArray.from_arrays(offsets, seq.slice(0, usable)) for key, seq in
                     (("input_ids", ids), ("labels", labels))})  # fmt: skip


def no_blocks(block_size: int):
    """The Arrow table of blocks of no rows, typed as pack_table makes them."""
    return pack_table(token_table({"input_ids": []}), block_size)


def check_columns(raw, data_format, text_column, sources) -> None:
    """Every split has the column its format reads (text: `text_column`; chat: messages)."""
    column = text_column if data_format == "text" else "messages"
    if without := [split for split, data in raw.items() if column not in data.column_names]:
        split, columns = without[0], raw[without[0]].column_names
        if other := [name for name in raw if name not in without]:  # what mends one split would break the other
            raise RecipeError(
                f"{sources[split]} has no {column} column (columns: {', '.join(columns)}), which "
                f"{sources[other[0]]} has: pass data of one format for both",
                subject=option_of(sources[split]),
            )
        missing = f"not in the data (columns: {', '.join(columns)})"
        if len(raw[split]) == 1 and (nested := [k for k, v in raw[split][0].items() if isinstance(v, list)]):
            raise RecipeError(  # a .json file of one object whose rows are a list in it
                f"{sources[split]}: no {column} column (columns: {', '.join(columns)}): its one row holds a list "
                f"under {nested[0]}; write one JSON object per line (.jsonl) instead",
                subject=option_of(sources[split]),
            )
        if data_format == "chat":
            fix = (
                "convert ShareGPT's conversations (from, value) to messages (role, content)"
                if "conversations" in columns
                else "pass --data_format text for plain text"
            )
            raise RecipeError(
                f"{sources[split]}: --data_format chat needs a column named messages: {missing}; {fix}",
                subject=option_of(sources[split]),
            )
        texts = [c for c in columns if getattr(raw[split].features[c], "dtype", None) in ("string", "large_string")]
        closest = texts if len(texts) == 1 else difflib.get_close_matches(column, texts, n=1)  # of the text columns
        hint = f"; pass --text_column {closest[0]}" if closest else ""
        if "messages" in columns:
            hint = "; it looks like chat data: pass --data_format chat"
        raise RecipeError(f"{sources[split]}: --text_column {column}: {missing}{hint}", subject="--text_column")


def _check_tokenizer(tokenizer, data_format) -> None:
    if data_format == "text" and tokenizer.eos_token_id is None:
        logger.warning(f"the tokenizer {tokenizer.name_or_path} has no EOS token: packed documents run together")
    if data_format == "chat" and not tokenizer.chat_template:
        raise RecipeError(
            f"the tokenizer {tokenizer.name_or_path} has no chat template, which --data_format chat renders "
            "conversations with; use a tokenizer that has one, or --data_format text",
            subject="--data_format",
        )


def ids_of(tokenizer):
    """texts -> their token ids, as tokenizer(texts)["input_ids"] makes them. A fast tokenizer's backend encodes
    without computing offsets (encode_batch_fast, about 1.5x as fast), used once it made the same ids as
    tokenizer() for the first batch's first rows (tokenizer() also sets the backend's truncation and special-token
    switches); otherwise, and for a slow tokenizer, tokenizer()."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    fast = None  # decided at the first batch

    def encode(texts: list) -> list:
        nonlocal fast
        if fast is None:
            sample = texts[:16]
            ids = tokenizer(sample, return_attention_mask=False)["input_ids"]
            fast = hasattr(backend, "encode_batch_fast") and [e.ids for e in backend.encode_batch_fast(sample)] == ids
        if not fast:
            return tokenizer(texts, return_attention_mask=False)["input_ids"]
        return [encoding.ids for encoding in backend.encode_batch_fast(texts)]

    return encode


def _tokenizer_for(tokenizer, data_format, column):
    """A datasets.map function: a batch of rows to token ids (text: plus EOS) and, for chat, labels (prompts
    masked); pack() makes plain text's labels."""
    encode = ids_of(tokenizer)

    def tokenize(batch, source):
        if data_format == "chat":
            try:
                rows = [chat_example(tokenizer, messages) for messages in batch[column]]
            except RecipeError as err:
                raise RecipeError(f"{source}: {err}; fix or remove that row", subject=option_of(source)) from None
            return {key: [row[key] for row in rows] for key in ("input_ids", "labels")}
        if bad := [text for text in batch[column] if not isinstance(text, str)]:
            raise RecipeError(
                f"{source}: a row's {column} is {_excerpt(bad[0])} ({type(bad[0]).__name__}), not text; remove or "
                "fill such rows, or pass the --text_column that holds the text",
                subject="--text_column",
            )
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]  # marks document ends
        texts = [text for text in batch[column] if text.strip()]  # a blank row is no document: no end to mark
        ids = encode(texts) if texts else []
        return {"input_ids": [tokens if tokens[-1:] == eos else tokens + eos for tokens in ids]}  # labels: the same

    return tokenize


def _blocks_of(data, tokenize, source, block_size, num_proc=None, cache=None):
    """(blocks, documents) of rows `data`: tokenized by `num_proc` processes, then packed by this one, in batches of
    1000 documents from the first (the rest of each batch dropped), so that the blocks do not depend on the workers.
    `cache`: a folder for datasets' files (else the datasets cache)."""
    files = (lambda name: {"cache_file_name": str(cache / name)}) if cache else (lambda name: {})
    try:
        tokenized = data.map(
            tokenize, batched=True, fn_kwargs={"source": source}, remove_columns=data.column_names,
            num_proc=num_proc if num_proc and num_proc > 1 else None, desc="tokenizing", **files("tokens.arrow"),
        )  # fmt: skip
    except UnicodeDecodeError as err:  # the json loader keeps such bytes; reading the rows back fails
        raise RecipeError(f"{source}: {_not_utf8(err)}", subject=option_of(source)) from None
    if len(tokenized) == 0:
        from datasets import Dataset

        return Dataset(no_blocks(block_size)), 0
    blocks = tokenized.with_format("arrow").map(
        pack_table, batched=True, fn_kwargs={"block_size": block_size}, desc=f"packing into blocks of {block_size}",
        **files("blocks.arrow"),
    )  # fmt: skip
    return blocks.with_format(None), len(tokenized)


def _trained_blocks(blocks, data_format) -> int:
    """Blocks holding a token to train on: all of plain text's; chat's, those with an assistant's token."""
    if data_format == "text" or len(blocks) == 0:
        return len(blocks)
    found = blocks.with_format("numpy").iter(batch_size=1024)
    return sum(int((b["labels"][:, 1:] != IGNORE_INDEX).any(1).sum()) for b in found)


def _check_split(source, documents, blocks, trained, block_size, train_rows=2) -> None:
    """A split's blocks are enough to train or evaluate on: text, at least one block, most with a target token.
    `train_rows`: the rows left to train on (a larger held-out share needs more than one)."""
    if documents == 0:  # whatever the file's size: no row holds text
        raise RecipeError(f"{source}: holds no text (no row has any); pass data that does", subject=option_of(source))
    if blocks == 0:
        more = " (a larger --validation_split_percentage)" if "held out" in source and train_rows > 1 else ""
        raise RecipeError(
            f"{source} holds fewer than {block_size} tokens; add data{more} or lower --block_size",
            subject=option_of(source),
        )
    if trained * 2 < blocks:  # none: a mean over nothing (NaN, 1/0); few: steps that learn nothing
        what = f"{'no' if not trained else f'only {trained} of {blocks}'} block(s) of {block_size}"
        why = (  # a larger block holds more replies only where the model takes one: not a fix at its limit
            f"{source}: {what} tokens hold a token to train on (an assistant's reply, in chat data); pass data "
            "whose replies are more of each conversation, or a larger --block_size if the model accepts one"
        )
        if not trained:
            raise RecipeError(why, subject=option_of(source))
        logger.warning(why)


def tokenize_and_pack(raw, tokenizer, *, data_format, text_column, block_size, num_proc=None, sources=None):
    """`raw` tokenized (text: `text_column` plus EOS; chat: `messages`, prompts masked) and packed, each split
    holding a block with a token to train on; `sources` names each split in error lines (data_sources)."""
    from datasets import DatasetDict

    sources = {split: f"the {split} split" for split in raw} | (sources or {})
    column = text_column if data_format == "text" else "messages"
    check_columns(raw, data_format, text_column, sources)  # before the minutes of tokenizing the first
    _check_tokenizer(tokenizer, data_format)
    tokenize = _tokenizer_for(tokenizer, data_format, column)
    packed = DatasetDict()
    for split, data in raw.items():
        packed[split], documents = _blocks_of(data, tokenize, sources[split], block_size, num_proc)
        trained = _trained_blocks(packed[split], data_format)
        _check_split(sources[split], documents, len(packed[split]), trained, block_size, len(raw["train"]))
    return packed.with_format("torch")


# Prepared data: tokenized once, reused -------------------------------------------------------------------------


def data_inputs(args, tokenizer, block_size, raw=None) -> dict:
    """What the blocks are made from, by content (common.prepared's manifest): local files by their sha256, a hub or
    folder dataset by datasets' fingerprints of `raw` (its splits before any is held out), the tokenizer's digest and
    the settings that change the blocks."""
    held_out = {"validation_split_percentage": args.validation_split_percentage, "seed": args.seed}
    inputs = {
        "version": prepared.FORMAT_VERSION,
        "tokenizer": prepared.tokenizer_identity(tokenizer),
        "block_size": block_size,
        "data_format": args.data_format,
        "text_column": args.text_column if args.data_format == "text" else None,
    }
    if args.dataset_name:  # a stream has no fingerprint: its name, and a local folder's files by their sha256
        fingerprints = {s: getattr(d, "_fingerprint", None) for s, d in raw.items() if s in ("train", "validation")}
        if args.streaming and Path(args.dataset_name).is_dir():
            folder = Path(args.dataset_name)  # its files, less a cache datasets may keep in it
            files = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.is_file())
            files = [p for p in files if ".cache" not in p.parts]
            fingerprints["files"] = {str(p): prepared.file_sha256(folder / p) for p in files}
        inputs["dataset"] = {"name": args.dataset_name, "config": args.dataset_config_name, **fingerprints}
        inputs["held_out"] = None if "validation" in raw else held_out
        return inputs
    for flag, path in (("train_file", args.train_file), ("validation_file", args.validation_file)):
        if path:
            check_path(f"--{flag}", path)
            inputs[flag] = {
                "format": local_format(path),
                "bytes": Path(path).stat().st_size,
                "sha256": prepared.file_sha256(path),
            }
    inputs["held_out"] = None if args.validation_file else held_out
    return inputs


@contextlib.contextmanager
def _one_progress_bar():
    """datasets' bars (one per map) hidden: the preparation draws one over the whole corpus."""
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _prepared_location(args, tokenizer, block_size) -> tuple:
    """(folder, inputs, digest, named, raw) of the run's prepared data: --prepared_data_dir, or the datasets cache's
    folder of the inputs' digest; `raw`: a hub dataset's splits (its fingerprints are datasets', from its cache)."""
    raw = None
    if args.dataset_name:
        raw = read_sources(
            dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
            data_format=args.data_format, text_column=args.text_column,
        )  # fmt: skip
    inputs = data_inputs(args, tokenizer, block_size, raw)
    digest = prepared.inputs_digest(inputs)
    named = bool(args.prepared_data_dir)
    folder = Path(args.prepared_data_dir).expanduser() if named else prepared.default_folder(digest)
    return folder, inputs, digest, named, raw


def prepared_held_out_rows(args, tokenizer, block_size) -> list | None:
    """The first held-out rows as the run's preparation kept them (prepared.HELD_OUT_ROWS, the column it reads):
    read in milliseconds whatever the corpus's size; None where the prepared folder predates them."""
    folder = _prepared_location(args, tokenizer, block_size)[0]
    path = folder / prepared.HELD_OUT_FILE
    if not path.is_file():
        return None
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def prepared_blocks(args, tokenizer, block_size):
    """(blocks, folder): the train and validation blocks from --prepared_data_dir (default: a folder of the datasets
    cache named by the inputs), prepared there first unless a run with the same inputs did."""
    folder, inputs, digest, named, raw = _prepared_location(args, tokenizer, block_size)
    sources = data_sources(args.dataset_name, args.train_file, args.validation_file)
    _check_tokenizer(tokenizer, args.data_format)
    manifest = prepared.find_prepared(folder, inputs, named)
    if manifest is None:
        with prepared.one_preparation(folder, digest, args.ddp_timeout):
            manifest = prepared.find_prepared(folder, inputs, named)  # prepared by another run while this one waited
            if manifest is None:
                if raw is None:
                    raw = read_sources(
                        train_file=args.train_file, validation_file=args.validation_file,
                        data_format=args.data_format, text_column=args.text_column,
                    )  # fmt: skip
                raw = hold_out(raw, args.validation_split_percentage, args.seed, sources)
                manifest = _prepare(folder, digest, inputs, raw, tokenizer, args, block_size, sources)
                return prepared.load_prepared(folder, manifest), folder
    splits, rows = manifest["splits"], manifest["splits"]["train"]["rows"]
    for split, counts in splits.items():  # its warnings, as the run that prepared it said them
        _check_split(sources[split], counts["documents"], counts["blocks"], counts["trained"], block_size, rows)
    logger.info(
        f"reusing the prepared data in {folder}: {splits['train']['blocks']:,} train and "
        f"{splits['validation']['blocks']:,} validation blocks of {block_size} tokens"
    )
    return prepared.load_prepared(folder, manifest), folder


def _prepare(folder, digest, inputs, raw, tokenizer, args, block_size, sources) -> dict:
    """`raw` tokenized and packed into `folder`, in chunks each saved when done: a preparation interrupted resumes at
    the first chunk it had not finished. Returns the manifest."""
    column = args.text_column if args.data_format == "text" else "messages"
    tokenize = _tokenizer_for(tokenizer, args.data_format, column)
    size, nbytes = prepared.chunk_bytes(), {split: prepared.text_bytes(data) for split, data in raw.items()}
    workers = args.preprocessing_num_workers or prepared.default_workers(sum(nbytes.values()))
    # Chunks are contiguous shards of a split's rows, each packed alone: a chunk's last tokens, fewer than
    # block_size, are dropped (as those of each batch of 1000 documents are). A corpus of one chunk's size or less
    # is one chunk, packed as it was before chunks.
    chunks = {split: max(1, math.ceil(nbytes[split] / size)) for split in raw}
    partial = prepared.partial_folder(folder, digest)
    partial.mkdir(parents=True, exist_ok=True)
    keys = [(split, i) for split in raw for i in range(chunks[split])]
    done = {(split, i): prepared.read_part(partial / split / f"part-{i:05d}") for split, i in keys}
    finished = [info for info in done.values() if info]
    if finished:
        logger.info(f"resuming the preparation in {partial}: {len(finished)} of {len(done)} chunks done")
    else:
        logger.info(f"preparing the data in {folder} ({sum(nbytes.values()) / 2**20:,.1f} MB, {workers} worker(s))")
    progress = prepared.Progress(
        sum(nbytes.values()), sum(i["bytes"] for i in finished), sum(i["blocks"] for i in finished) * block_size,
        desc="tokenizing",
    )  # fmt: skip
    splits, rows = {}, len(raw["train"])
    with progress, _one_progress_bar():  # the bar closed first: a line saying why stands on its own
        for split in ("validation", "train"):  # the held-out split first: too little of it is said in seconds
            parts, data, n = [], raw[split], chunks[split]
            progress.bar.set_description(f"tokenizing {split}")
            for i in range(n):
                path = partial / split / f"part-{i:05d}"
                if (info := done[split, i]) is None:
                    chunk = data.shard(n, i, contiguous=True) if n > 1 else data
                    work = partial / "work"  # datasets' files of this chunk; its blocks are saved as the part
                    shutil.rmtree(work, ignore_errors=True)
                    work.mkdir()
                    blocks, documents = _blocks_of(chunk, tokenize, sources[split], block_size, workers, work)
                    counts = {
                        "rows": len(chunk), "bytes": prepared.text_bytes(chunk), "documents": documents,
                        "blocks": len(blocks), "trained": _trained_blocks(blocks, args.data_format),
                    }  # fmt: skip
                    blocks.info.description = prepared.describe_blocks(inputs, split)  # the checkpoints' data identity
                    info = prepared.write_part(path, blocks, counts)
                    shutil.rmtree(work)
                    progress.add(counts["bytes"], counts["blocks"] * block_size)
                    # a stop that came while the pool forked was raised where Python ignores it: end here, not later
                    if (stop := stop_before_training()) is not None:
                        raise stop
                parts.append(info)
            totals = {key: sum(p[key] for p in parts) for key in ("rows", "documents", "blocks", "trained")}
            _check_split(sources[split], totals["documents"], totals["blocks"], totals["trained"], block_size, rows)
            splits[split] = {**totals, "tokens": totals["blocks"] * block_size, "parts": parts}
    seconds = progress.close()
    held_out = (
        raw["validation"].select_columns([column]).select(range(min(prepared.HELD_OUT_ROWS, len(raw["validation"]))))
    )
    (partial / prepared.HELD_OUT_FILE).write_text(  # the samples' default prompts, without reading the corpus again
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in held_out), encoding="utf-8"
    )
    manifest = {
        "version": prepared.FORMAT_VERSION, "digest": digest, "inputs": inputs, "splits": splits,
        "sources": {split: sources[split] for split in splits}, "tokenizer": tokenizer.name_or_path,
        "workers": workers, "seconds": round(seconds, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }  # fmt: skip
    prepared.install(partial, folder, manifest)
    logger.info(f"prepared {splits['train']['tokens']:,} train tokens into {folder} in {seconds:.0f} s")
    return manifest


def block_size_for(args, tokenizer, config) -> int:
    """--block_size, or the model's limit (at most 1024); refused above what the model accepts."""
    limits = [getattr(config, "max_position_embeddings", None), tokenizer.model_max_length]
    positions, advised = (n if n and n < 1_000_000_000 else math.inf for n in limits)  # a tokenizer's: 1e30 if unset
    block_size = args.block_size or min(positions, advised, 1024)
    if block_size > positions:
        raise RecipeError(
            f"--block_size {block_size} is larger than the model accepts ({positions}, its config's "
            f"max_position_embeddings); pass --block_size {positions} or less",
            subject="--block_size",
        )
    if block_size > advised:  # as run_clm, the model's positions decide
        logger.warning(f"--block_size {block_size} is above the tokenizer's model_max_length ({advised})")
    return block_size


def prepare_only(args, accelerator) -> None:
    """With --prepare_only: the data prepared (the tokenizer and config loaded, no weights), then the run ends with
    one `done:` line naming the folder (RunFinished, exit 0), before --output_dir is claimed. Else nothing."""
    if not args.prepare_only:
        return
    tokenizer, config = load_tokenizer(args)
    block_size = block_size_for(args, tokenizer, config)
    with prepare_data_first(accelerator, args.ddp_timeout):
        data, folder = prepared_blocks(args, tokenizer, block_size)
    raise RunFinished(
        f"prepared {len(data['train']):,} train and {len(data['validation']):,} validation blocks of {block_size} "
        f"tokens in {folder}; train with the same data arguments (and --prepared_data_dir {folder})"
    )


def lm_dataloaders(args, accelerator, tokenizer, config):
    """(train, eval, block_size): the prepared blocks (common.prepared), prepared by the main process first (the others
    find them ready), memory-mapped; --max_eval_samples: the first N held-out blocks."""
    from transformers import default_data_collator

    block_size = block_size_for(args, tokenizer, config)
    if args.streaming:  # read by every process, as it trains: nothing prepared first
        train, data = streamed_data(args, tokenizer, block_size)
    else:
        with prepare_data_first(accelerator, args.ddp_timeout):
            data, _ = prepared_blocks(args, tokenizer, block_size)
    if args.max_eval_samples:
        data["validation"] = data["validation"].select(range(min(args.max_eval_samples, len(data["validation"]))))
    data = data.with_format("torch")
    workers = args.dataloader_num_workers or 0  # the blocks are memory-mapped: no worker by default
    loader = partial(make_dataloader, seed=args.seed, num_workers=workers, collate_fn=default_data_collator)
    train = loader(train if args.streaming else data["train"], args.per_device_train_batch_size, train=True)
    return train, loader(data["validation"], args.per_device_eval_batch_size, train=False), block_size


# Streaming: blocks made as the run reads the data ---------------------------------------------------------------

STREAM_SHUFFLE_BUFFER = 10_000  # rows: each epoch's order is the shards' and a buffer's shuffle of them (datasets)


def read_streams(args) -> tuple[dict, dict]:
    """(train and validation streams, sources) with --streaming (`datasets` streaming), their columns checked on their
    first rows; a --train_file's held-out file is required when the arguments are parsed, a dataset's split here."""
    sources = data_sources(args.dataset_name, args.train_file, args.validation_file)
    streams = read_sources(
        dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=args.train_file,
        validation_file=args.validation_file, data_format=args.data_format, text_column=args.text_column,
        streaming=True,
    )  # fmt: skip
    if "validation" not in streams:
        raise RecipeError(
            f"{sources['validation'].rsplit(' (', 1)[0]} has no validation split, and --streaming cannot hold a share "
            "of a stream out; drop --streaming (5% is held out), or pass its files as --train_file and "
            "--validation_file",
            subject="--streaming",
        )
    return streams, sources


def _blocks_of_rows(batch: dict, tokenize, source: str, block_size: int) -> dict:
    """A batch of a stream's rows tokenized and packed, as _blocks_of packs each 1000 documents."""
    return pack(tokenize(batch, source), block_size)


def streamed_data(args, tokenizer, block_size):
    """(train StreamOfBlocks, DatasetDict(validation=blocks)) with --streaming: the held-out blocks read now (the first
    --max_eval_samples of them), in memory; the training blocks made as the run reads them."""
    import pyarrow as pa
    from datasets import Dataset, DatasetDict

    from .data import StreamOfBlocks

    streams, sources = read_streams(args)
    _check_tokenizer(tokenizer, args.data_format)
    column = args.text_column if args.data_format == "text" else "messages"
    tokenize = _tokenizer_for(tokenizer, args.data_format, column)
    held_out, documents, count = [], 0, 0  # in Arrow: 4 bytes a token, where Python's ints take 18 times that
    for batch in streams["validation"].iter(batch_size=1000):
        tokens = tokenize(batch, sources["validation"])
        documents += len(tokens["input_ids"])
        held_out.append(pack_table(token_table(tokens), block_size))
        count += held_out[-1].num_rows
        if args.max_eval_samples and count >= args.max_eval_samples:
            break
    held_out = pa.concat_tables(held_out) if held_out else no_blocks(block_size)
    validation = Dataset(held_out.slice(0, args.max_eval_samples))
    trained = _trained_blocks(validation, args.data_format)
    _check_split(sources["validation"], documents, len(validation), trained, block_size)

    def identity() -> str:  # the inputs of the training blocks: another --validation_file resumes the same run
        inputs = data_inputs(args, tokenizer, block_size, streams)
        for key in ("validation_file", "held_out"):
            inputs.pop(key, None)
        return prepared.inputs_digest({**inputs, "streamed": STREAM_SHUFFLE_BUFFER})[:16]

    make = partial(_blocks_of_rows, tokenize=tokenize, source=sources["train"], block_size=block_size)
    train = StreamOfBlocks(streams["train"], make, args.seed, STREAM_SHUFFLE_BUFFER, identity, args.ddp_timeout)
    logger.info(
        f"streaming {sources['train']}: blocks of {block_size} tokens made as the run reads it (rows shuffled in a "
        f"buffer of {STREAM_SHUFFLE_BUFFER:,}); {len(validation):,} validation blocks"
    )
    return train, DatasetDict(validation=validation)


# Models and tokenizers ----------------------------------------------------------------------------


def checkpoint_activations(model) -> None:
    """--gradient_checkpointing: activations recomputed in the backward pass (transformers' activation_checkpointing,
    named gradient_checkpointing before 5.2x); the config's use_cache stays the model's."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_causal_lm(args, **model_kwargs):
    """(model, tokenizer) as add_lm_args' arguments say. Called once the Accelerator exists: under ZeRO-3,
    transformers then creates or loads the weights straight into their shards."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    source, trust, tokenizer, config = args.model_name_or_path or args.config_name, args.trust_remote_code, None, None
    flag = "--model_name_or_path" if args.model_name_or_path else "--config_name"  # the option `source` came from
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust)  # first: the tokenizer reads it too
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or source, trust_remote_code=trust)
        if args.model_name_or_path:
            split = tensor_parallel.load_kwargs(config, source)  # under tp.yaml: split as it loads, or refused
            model = AutoModelForCausalLM.from_pretrained(
                source, config=config, trust_remote_code=trust, **model_kwargs, **split
            )
        else:
            if any(Path(source).glob("*.safetensors")):  # as run_clm: its config alone
                logger.warning(f"--config_name {source}: a new model from its config; its weights are not loaded")
            if args.config_overrides:
                base = copy.deepcopy(config)
                config.update_from_string(args.config_overrides)
                config.validate()  # transformers' own check, which save_pretrained runs at the end of training
                _check_runs(base, config)
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust, **model_kwargs)
    except RecipeError:  # tensor_parallel's refusal, said as it is
        raise
    except Exception as err:  # transformers, tokenizers, safetensors, json, a model's own code: whatever they raise
        if _about_a_path(err):
            raise
        raise _not_loaded(
            err, args, model_kwargs.get("attn_implementation"), config, tokenizer, (flag, source)
        ) from err
    if tokenizer.pad_token is None:  # packed blocks need no padding, but collators and generation do
        tokenizer.pad_token = tokenizer.eos_token
    _fit_vocabulary(model, tokenizer, args)
    if not is_causal(model):
        raise RecipeError(
            f"{flag} {source}: {type(model).__name__} lets each position see the ones after it (an encoder such as "
            "BERT, not a causal LM), so it would learn to copy its targets; pass a decoder model (GPT-2, Llama, ...)",
            subject=flag,
        )
    return tensor_parallel.shards_in_place(model), tokenizer  # after is_causal's forward: the shards, for an optimizer


def _not_loaded(err: Exception, args, attn, config, tokenizer, origin: tuple) -> RecipeError:
    """What a failure of load_causal_lm means, from how far it got (`config`, `tokenizer`: None until loaded); `origin`
    the model's (option, source)."""
    # --attn_implementation not installed, unknown, or not the model's (Mamba's sdpa)
    attn_failed = tokenizer is not None and (
        isinstance(err, ImportError) or re.search("attn_impl|scaled_dot_product", str(err))
    )
    if attn not in (None, "eager") and attn_failed:
        return RecipeError(
            f"--attn_implementation {attn} cannot be used here ({one_line(err)}); install what it needs, or leave "
            "the option out (transformers picks sdpa where the model has it, else eager)",
            subject="--attn_implementation",
        )
    if tokenizer is not None and args.config_overrides:  # config and tokenizer loaded: the overrides failed
        return _overrides_error(config, args, err)
    part = "config" if config is None else "tokenizer" if tokenizer is None else "model"
    if part == "tokenizer" and args.tokenizer_name:
        return _load_error("--tokenizer_name", args.tokenizer_name, err, part)
    return _load_error(*origin, err, part)


def _fit_vocabulary(model, tokenizer, args) -> None:
    """Refuses a tokenizer with ids past the model's embeddings (an IndexError on CPU, a device assert on GPU), or
    grows the embeddings to it with --resize_token_embeddings."""
    vocab = getattr(model.config, "vocab_size", None)
    if not vocab or len(tokenizer) <= vocab:
        return
    if not args.resize_token_embeddings:
        fix = (  # a new model is built at the size asked; trained weights are grown
            f"pass --config_overrides vocab_size={len(tokenizer)} to build the new model at its size"
            if args.config_name
            else "pass --resize_token_embeddings to grow the embeddings to it, or --tokenizer_name with the "
            "tokenizer the model was trained with"
        )
        raise RecipeError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab} (config.vocab_size): "
            f"{fix}",
            subject="--tokenizer_name",
        )
    logger.info(f"--resize_token_embeddings: {vocab} -> {len(tokenizer)} embeddings, the new ones at their mean")
    model.resize_token_embeddings(len(tokenizer))


def load_tokenizer(args):
    """(tokenizer, config) as load_causal_lm loads them, without the weights: what --prepare_only needs."""
    from transformers import AutoConfig, AutoTokenizer

    source, trust = args.model_name_or_path or args.config_name, args.trust_remote_code
    flag = "--model_name_or_path" if args.model_name_or_path else "--config_name"
    part = "config"
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
        part = "tokenizer"
        if args.tokenizer_name:
            flag, source = "--tokenizer_name", args.tokenizer_name
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust)
    except Exception as err:
        if _about_a_path(err):
            raise
        raise _load_error(flag, source, err, part) from err
    if args.config_overrides:  # they may set max_position_embeddings, which bounds --block_size
        try:
            config.update_from_string(args.config_overrides)
        except Exception as err:
            raise _overrides_error(config, args, err) from err
    if tokenizer.pad_token is None:  # as load_causal_lm: the same tokenizer, the same identity
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer, config


def _check_runs(base, config) -> None:
    """Overrides config.validate passes can build a model that does not run (4 heads in 3 key-value groups) or holds
    nothing (hidden_size=0): a forward of two tokens on the meta device (shapes alone, no memory; the class itself,
    not from_config, which ZeRO-3 would partition) finds them before training. Blamed on the overrides only where
    the config without them runs so: an op meta tensors lack, a kernel that wants bf16 (MoE experts) prove nothing,
    nor does a model of remote code (not in transformers' table)."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    def forward(config):
        with torch.device("meta"):  # a copy: building a model records its attention in the config
            model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](copy.deepcopy(config))
            if not any(p.numel() for p in model.parameters()):
                raise ValueError("it holds no weights")
            model(input_ids=torch.ones(1, 2, dtype=torch.long))

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    try:
        forward(base)
    except Exception:
        return
    forward(config)


def is_causal(model) -> bool:
    """Whether the first position's output ignores the second token, on the loaded model (True where it cannot run
    here: weights sharded by ZeRO-3, a forward that needs more)."""
    if any(p.numel() == 0 or p.device.type == "meta" for p in model.parameters()):
        return True
    # fsdp_cpu_ram_efficient_loading: only a node's first process holds the weights until FSDP sends them; elsewhere
    # they are a placeholder (uninitialized memory under transformers 5.4), whose outputs say nothing
    efficient = os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in ("1", "true")
    if efficient and os.environ.get("LOCAL_RANK", "0") != "0":
        return True
    training = model.training
    try:
        with torch.no_grad():
            logits = model.eval()(input_ids=torch.tensor([[1, 2], [1, 3]])).logits
        return torch.allclose(logits[0, 0], logits[1, 0], atol=1e-4, rtol=1e-3)
    except Exception:  # the first step will say what the model needs
        return True
    finally:
        model.train(training)


def _load_error(flag: str, name: str, err: BaseException, part: str) -> RecipeError:
    """One line for what loading the model's `part` (config, tokenizer, model) raised, with the fix for its cause."""
    from safetensors import SafetensorError

    text, folder = one_line(err), Path(name)
    if local := name.startswith(("/", ".", "~")) or folder.exists():
        check_path(flag, name, folder=True)  # a folder that is not there, which transformers takes for a hub id
    fix = "pass the folder that save_pretrained wrote" if local else "check the hub id and the network (or the cache)"
    if local and (folder / "adapter_config.json").is_file() and not (folder / "config.json").is_file():
        try:
            base = f" {json.loads((folder / 'adapter_config.json').read_text())['base_model_name_or_path']}"
        except (OSError, ValueError, KeyError, TypeError):
            base = " (adapter_config.json's base_model_name_or_path)"
        merged = (
            f"the adapter merged into it, --model_name_or_path {folder / 'merged'}"  # a LoRA run of lm_finetune's
            if (folder / "merged" / "config.json").is_file()
            else "the folder of the adapter merged into it (peft's merge_and_unload, then save_pretrained)"
        )
        why = (
            f"a LoRA adapter (adapter_config.json), not a model; pass its base model, --model_name_or_path{base}, or "
        )
        why += merged
    elif local and flag != "--tokenizer_name" and not (folder / "config.json").is_file():
        why = f"no config.json in the folder; {fix}"  # transformers says it lacks a model_type
    elif "trust_remote_code" in str(err):
        why = "the model runs code of its own repository; pass --trust_remote_code if you trust that code"
    elif part == "config" and not isinstance(err, OSError):
        why = f"its config.json is not valid ({type(err).__name__}: {text}); correct it, or {fix}"
    elif part == "tokenizer" and not isinstance(err, OSError):
        why = f"its tokenizer cannot be loaded ({type(err).__name__}: {text}); pass one whose tokenizer files load"
    elif isinstance(err, SafetensorError):  # it does not name the file
        why = f"its safetensors weights are damaged ({text}); download or save the model again"
    elif "ignore_mismatched_sizes" in text:  # transformers' report above lists the tensors (MISMATCH)
        why = (
            "its weights do not fit its config.json (the tensors marked MISMATCH above): the config was edited or "
            f"belongs to another model; restore the config.json saved with these weights, or {fix}"
        )
    elif "Unrecognized configuration class" in text:  # a vision, encoder-only, ... model
        why = f"{text}; pass a causal language model"
    else:
        why = f"{type(err).__name__}: {text}; {fix}"
    return RecipeError(f"{flag} {name}: {why}", subject=flag)


def _overrides_error(config, args, err: BaseException) -> RecipeError:
    """One line for --config_overrides that update_from_string, config.validate or from_config refused (`config`
    keeps its keys: update_from_string refuses an unknown one)."""
    overrides, known = args.config_overrides, list(config.to_dict())
    unknown = [key for key in (pair.partition("=")[0] for pair in overrides.split(",")) if key not in known]
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        why = f"{args.config_name}'s config has no {unknown[0]}{hint}; pass keys of its config.json"
    else:  # huggingface_hub's validation error says nothing of its own: its cause is the readable one
        what = one_line(err.__cause__) if err.__cause__ else f"{type(err).__name__}: {one_line(err)}"
        why = (
            f"the model {args.config_name} builds from them does not run ({what}); give each key a value of its "
            "type in config.json, agreeing with the others and with the rest of the config"
        )
    return RecipeError(f"--config_overrides {overrides}: {why}", subject="--config_overrides")


# Training and evaluation --------------------------------------------------------------------------


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens a causal LM is trained to predict: labels not -100, after the first position (the model shifts
    them). A step's loss is their mean over the whole step: transformers divides by `num_items_in_batch`."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def window_tokens(accelerator, window) -> torch.Tensor:
    """The target tokens of every micro-batch of an optimizer step on every process (an all-reduce on the device,
    no host sync), at least 1: a step without any is a zero update, not NaN."""
    return accelerator.reduce(sum(target_tokens(batch["labels"]) for batch in window), reduction="sum").clamp(min=1)


def evaluate_causal_lm(model, eval_dl, accelerator, stop=None) -> dict | None:
    """Token-weighted loss and perplexity over the eval set, each block once; None if `stop` (a StopOnSignal)
    reports a signal, which every process sees at the same batch."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in eval_dl:
            if stop is not None and stop.requested():
                model.train()
                return None
            logits, labels = model(input_ids=batch["input_ids"]).logits[:, :-1], batch["labels"][:, 1:]
            # a row at a time, as fp32 logits are large; cross_entropy skips the -100 labels
            per_block = torch.stack([F.cross_entropy(x.float(), y, reduction="sum") for x, y in zip(logits, labels)])
            counts = (labels != IGNORE_INDEX).sum(-1)
            # every block once: the blocks Accelerate repeated to even out the last batch dropped, and under tensor
            # parallelism one copy of a TP group's shared blocks
            per_block, counts = tensor_parallel.gather_for_metrics(accelerator, (per_block, counts))
            loss_sum, tokens = loss_sum + per_block.sum().item(), tokens + counts.sum().item()
    model.train()
    return {"eval_loss": loss_sum / tokens, "perplexity": math.exp(min(loss_sum / tokens, 50)), "eval_tokens": tokens}


def flops_per_token(model, block_size: int, parameters: int) -> float:
    """Training FLOPs per token: 6N for the matrix multiplies plus the attention scores (PaLM, appendix B)."""
    return 6 * parameters + 12 * model.config.num_hidden_layers * model.config.hidden_size * block_size
