"""Text data and causal LMs for the LM recipes: local or hub datasets, tokenization, chat-prompt masking, packing
into fixed-length blocks; models and tokenizers from a hub id or a folder; the token-weighted loss and evaluation.

What `datasets`, transformers, the tokenizer or the chat template raise about the user's data or model becomes
one RecipeError naming the file (or dataset) and what to do; an operating-system error about a path is left to
common.exit_codes, which names the path and the option it came from."""

from __future__ import annotations

import argparse
import difflib
import logging
import math
import reprlib
from functools import partial
from itertools import chain
from pathlib import Path

import torch
import torch.nn.functional as F

from .args import at_least
from .data import make_dataloader, prepare_data_first
from .preemption import Preempted
from .runtime import RecipeError, causes, check_path, logger, one_line

IGNORE_INDEX = -100  # the label transformers' losses skip
LOCAL_FORMATS = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMAT_HINTS = {  # what a file that datasets cannot read in its format must be
    "json": 'each line must be one JSON object, such as {"text": "..."}',
    "csv": "it must be comma-separated with a header row naming the columns",
    "parquet": "write it again with a parquet writer (pandas, pyarrow, datasets)",
    "text": "it must be plain UTF-8 text",
}
MESSAGE_SHAPE = '{"role": ..., "content": "..."}'


# Arguments ----------------------------------------------------------------------------------------


def add_text_args(parser) -> None:
    """The data arguments of the causal-LM recipes (names from transformers' run_clm), and their rules."""
    d = parser.add_argument_group("data").add_argument
    d("--dataset_name", help="a hub dataset, or a local folder of data files")
    d("--dataset_config_name")
    d("--train_file", help="local .txt, .json, .jsonl, .csv or .parquet")
    d("--validation_file", help="in the format of --train_file")
    d("--validation_split_percentage", type="percentage", default=5, help="held out when there is no validation split")
    d("--text_column", default="text")
    d("--data_format", choices=["text", "chat"], default="text", help="chat: a `messages` column, prompts masked out")
    d("--block_size", type=at_least(2), help="default: min(model max length, 1024)")
    d("--preprocessing_num_workers", type="positive_int")
    parser.checks.append(_check_text_args)


def _check_text_args(parser, args) -> None:
    if args.dataset_name and (args.train_file or args.validation_file):
        parser.error("pass --dataset_name or --train_file (with --validation_file), not both")
    if not args.dataset_name and not args.train_file:
        parser.error(
            "no data: pass --train_file (local txt, json, jsonl, csv, parquet) or --dataset_name (hub or folder)"
        )
    if args.dataset_config_name and not args.dataset_name:
        parser.error("--dataset_config_name needs --dataset_name")
    for flag, path in (("--train_file", args.train_file), ("--validation_file", args.validation_file)):
        if path and Path(path).suffix.lower() not in LOCAL_FORMATS:
            parser.error(f"{flag} {path}: unknown format {Path(path).suffix!r}; use one of {', '.join(LOCAL_FORMATS)}")


def add_model_args(parser):
    """Where the model and tokenizer come from (names from transformers' run_clm); returns the argument group."""
    group = parser.add_argument_group("model")
    m = group.add_argument
    m("--model_name_or_path", help="pretrained weights: a hub id or a local folder")
    m("--config_name", help="or a new model, randomly initialized: the config of a hub id or local folder")
    m(
        "--config_overrides",
        type=config_overrides,
        help="with --config_name: e.g. hidden_size=4096,num_hidden_layers=32",
    )
    m("--tokenizer_name", help="default: --model_name_or_path or --config_name")
    m(
        "--resize_token_embeddings",
        action="store_true",
        help="grow the embeddings to a larger tokenizer (at their mean)",
    )
    m("--trust_remote_code", action="store_true", help="run the model repo's own code")
    parser.checks.append(_check_model_args)
    return group


def _check_model_args(parser, args) -> None:
    if bool(args.model_name_or_path) == bool(args.config_name):
        parser.error("pass --model_name_or_path (pretrained) or --config_name (from scratch), one of them")
    if args.config_overrides and not args.config_name:
        parser.error(
            "--config_overrides changes the config of --config_name (from scratch), not pretrained weights; "
            "pass --config_name instead of --model_name_or_path, or drop the overrides"
        )


def config_overrides(text):
    """An argparse type: key=value pairs, comma-separated, as transformers' update_from_string reads them."""
    if not all(key and eq and value for key, eq, value in (pair.partition("=") for pair in text.split(","))):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not key=value pairs separated by commas, such as hidden_size=4096,num_hidden_layers=32"
        )
    return text


def attn_implementation(text):
    """An argparse type: an attention implementation transformers knows (whether its package is installed is for
    transformers to say, when the model loads), or a hub kernel `org/repo`."""
    if text in ("eager", "sdpa"):  # the usual ones, without the seconds of importing transformers' models
        return text
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    names = ["eager", *ALL_ATTENTION_FUNCTIONS.keys()]
    if text not in names and "/" not in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an attention implementation; choose from {', '.join(names)}"
        )
    return text


# Data ---------------------------------------------------------------------------------------------


def _excerpt(value, limit=80) -> str:
    """A short repr of a user's value for an error line."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlist, r.maxdict, r.maxlevel = limit, limit, 4, 4, 3
    return r.repr(value)


def _not_utf8(err: UnicodeDecodeError) -> str:
    around = err.object[max(0, err.start - 20) : err.start + 20]
    return (
        f"not UTF-8 text (byte 0x{err.object[err.start]:02x} in {_excerpt(around)}); convert the file to UTF-8, "
        "e.g. iconv -f latin1 -t utf-8"
    )


def _stop_or_os_error(err: BaseException) -> None:
    """Re-raise, before `err` is taken for a fault of the user's data or model, a stop signal that landed while a
    library was loading (datasets wraps it in its own error), and an operating-system error about a path (a cache
    that cannot be written, say), which common.exit_codes says with the option the path came from."""
    found = causes(err)
    if stop := next((e for e in found if isinstance(e, Preempted)), None):
        raise stop
    if any(isinstance(e, OSError) and e.filename for e in found):
        raise err


def _load(source: str, builder: str, *load_args, path=None, **load_kwargs):
    """datasets.load_dataset(builder, ...) (a local file `path` read as the format `builder`), what it, pyarrow or
    pandas raise about the data as one line naming `source` and what to do. An operating-system error about a path
    (a cache that cannot be written, say) is left to common.exit_codes, which names the path and its option."""
    from datasets import load_dataset

    quiet = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")  # it logs its own error line first
    level, quiet.level = quiet.level, logging.CRITICAL
    try:
        return load_dataset(builder, *load_args, **load_kwargs)
    except Exception as err:
        _stop_or_os_error(err)
        found = causes(err)
        decode = next((e for e in found if isinstance(e, UnicodeDecodeError)), None)
        cause = next((e for e in found if type(e).__name__ != "DatasetGenerationError"), err)
        what = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}".rstrip(": ")
        if decode:
            why = _not_utf8(decode)
        # datasets has no one error for a file without rows: "corresponds to no data" for blank lines or a
        # header alone, a format's own error for an empty file
        elif path and ("corresponds to no data" in str(err) or Path(path).expanduser().stat().st_size == 0):
            why = "holds no rows; add data or pass another file"
        elif path:
            why = f"cannot be read as {builder} ({what}); {FORMAT_HINTS[builder]}"
        else:
            why = f"{what}; pass a hub dataset id (with network, or cached) or a folder of data files, or --train_file"
        raise RecipeError(f"{source}: {why}") from err
    finally:
        quiet.setLevel(level)


def data_sources(dataset_name=None, train_file=None, validation_file=None) -> dict:
    """How error messages name each split's data."""
    if dataset_name:
        return {split: f"--dataset_name {dataset_name} ({split} split)" for split in ("train", "validation")}
    held_out = f"the part of --train_file {train_file} held out for validation"
    return {
        "train": f"--train_file {train_file}",
        "validation": f"--validation_file {validation_file}" if validation_file else held_out,
    }


def load_raw_datasets(*, dataset_name=None, dataset_config_name=None, train_file=None, validation_file=None,
                      validation_split_percentage=5, seed=0):  # fmt: skip
    """A DatasetDict with `train` and `validation`, from the hub or local files; without a validation split,
    `validation_split_percentage` percent of train is held out (seeded)."""
    from datasets import DatasetDict

    if dataset_name:
        flag = f"--dataset_name {dataset_name}" + (
            f" --dataset_config_name {dataset_config_name}" if dataset_config_name else ""
        )
        if dataset_name.startswith(("/", ".", "~")):  # a folder: say so if it is not there
            check_path("--dataset_name", dataset_name, folder=True)
        raw = _load(flag, dataset_name, dataset_config_name)
        if "train" not in raw:
            raise RecipeError(f"{flag}: no train split (it has {', '.join(raw) or 'none'}); pass --train_file instead")
    else:
        raw = DatasetDict()
        for split, flag, path in (
            ("train", "--train_file", train_file),
            ("validation", "--validation_file", validation_file),
        ):
            if path:
                check_path(flag, path)
                fmt = LOCAL_FORMATS[Path(path).suffix.lower()]  # datasets never returns a split without rows
                raw[split] = _load(
                    f"{flag} {path}", fmt, path=path, data_files=str(Path(path).expanduser()), split="train"
                )
    if "validation" not in raw:
        try:
            split = raw["train"].train_test_split(test_size=validation_split_percentage / 100, seed=seed)
        except ValueError as err:  # a side would be empty
            source = f"--dataset_name {dataset_name}" if dataset_name else f"--train_file {train_file}"
            raise RecipeError(
                f"{source}: {len(raw['train'])} row(s) are too few to hold out {validation_split_percentage}% for "
                "validation; add rows, pass --validation_file, or change --validation_split_percentage"
            ) from err
        raw = DatasetDict(train=split["train"], validation=split["test"])
    return raw


def check_conversation(messages) -> None:
    """Refuse a conversation the chat template cannot render faithfully or that teaches nothing: a list of
    {"role": str, "content": str} messages with at least one assistant reply."""
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
    if not any(message["role"] == "assistant" for message in messages):
        raise RecipeError(f"no assistant message, so nothing to train on: {_excerpt(messages)}")


def chat_example(tokenizer, messages) -> dict:
    """A conversation tokenized with the tokenizer's chat template, only the assistant's replies labelled, so the
    loss never trains the model to write the user's prompts. Each reply is the text between the rendering of
    the conversation before it (with the generation prompt) and the rendering that includes it; tokens whose
    characters fall inside such a span keep their label."""
    from jinja2 import TemplateError

    check_conversation(messages)
    render = tokenizer.apply_chat_template
    try:
        text, spans = render(messages, tokenize=False), []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                before = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
                through = render(messages[: i + 1], tokenize=False)
                if not (text.startswith(before) and text.startswith(through)):
                    raise RecipeError(
                        "the tokenizer's chat template does not render conversations incrementally, so prompt "
                        "tokens cannot be masked; use --data_format text"
                    )
                spans.append((len(before), len(through)))
    except TemplateError as err:  # the template's own checks: roles that must alternate, a system message first
        raise RecipeError(f"the chat template rejects the conversation ({err}): {_excerpt(messages)}") from err
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        token if any(start <= a and b <= end for start, end in spans) else IGNORE_INDEX
        for token, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]
    return {"input_ids": encoded["input_ids"], "labels": labels}


def pack(examples: dict, block_size: int) -> dict:
    """The batch's examples concatenated and cut into blocks of `block_size` tokens (the rest dropped): no compute
    spent on padding."""
    joined = {key: list(chain.from_iterable(examples[key])) for key in ("input_ids", "labels")}
    usable = len(joined["input_ids"]) // block_size * block_size
    return {key: [ids[i : i + block_size] for i in range(0, usable, block_size)] for key, ids in joined.items()}


def tokenize_and_pack(
    raw, tokenizer, *, data_format: str, text_column: str, block_size: int, num_proc=None, sources=None
):
    """`raw` tokenized (text: `text_column` plus EOS; chat: the `messages` column, prompts masked) and packed into
    blocks, each split holding at least one block in which something is trained. `datasets` caches each step, so a
    process that runs this after the main one (prepare_data_first) loads the cache. `sources` names each split's
    data in error messages (data_sources)."""
    from datasets import DatasetDict

    sources = {split: f"the {split} split" for split in raw} | (sources or {})
    column = text_column if data_format == "text" else "messages"
    for split, data in raw.items():  # every split's, before the minutes of tokenizing the first
        if column not in data.column_names:
            columns = ", ".join(data.column_names)
            if data_format == "chat":
                raise RecipeError(
                    f"{sources[split]}: --data_format chat needs a column named messages: not in the data (columns: "
                    f"{columns}); pass --data_format text for plain text"
                )
            hint = "; it looks like chat data: pass --data_format chat" if "messages" in data.column_names else ""
            raise RecipeError(f"{sources[split]}: --text_column {column}: not in the data (columns: {columns}){hint}")
    if data_format == "chat" and not tokenizer.chat_template:
        raise RecipeError(
            f"the tokenizer {tokenizer.name_or_path} has no chat template, which --data_format chat renders "
            "conversations with; use a tokenizer that has one, or --data_format text"
        )

    def tokenize(batch, source):
        if data_format == "chat":
            try:
                rows = [chat_example(tokenizer, messages) for messages in batch[column]]
            except RecipeError as err:
                raise RecipeError(f"{source}: {err}; fix or remove that row") from None
            return {key: [row[key] for row in rows] for key in ("input_ids", "labels")}
        if bad := [text for text in batch[column] if not isinstance(text, str)]:
            raise RecipeError(
                f"{source}: a row's {column} is {_excerpt(bad[0])} ({type(bad[0]).__name__}), not text; remove or "
                "fill such rows, or pass the --text_column that holds the text"
            )
        eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]  # marks document ends
        texts = [text for text in batch[column] if text.strip()]  # a blank row is no document: no end to mark
        ids = [tokens + eos for tokens in tokenizer(texts)["input_ids"]] if texts else []
        return {"input_ids": ids, "labels": ids}

    packed = DatasetDict()
    for split, data in raw.items():
        try:
            tokenized = data.map(
                tokenize, batched=True, fn_kwargs={"source": sources[split]}, remove_columns=data.column_names,
                num_proc=num_proc, desc=f"tokenizing {split}",
            )  # fmt: skip
        except UnicodeDecodeError as err:  # the json loader keeps such bytes; reading the rows back fails
            raise RecipeError(f"{sources[split]}: {_not_utf8(err)}") from None
        if len(tokenized) == 0:  # whatever the file's size: no row holds text
            raise RecipeError(f"{sources[split]}: holds no text (no row has any); pass data that does")
        packed[split] = tokenized.map(
            pack, batched=True, fn_kwargs={"block_size": block_size}, num_proc=num_proc,
            desc=f"packing {split} into blocks of {block_size}",
        )  # fmt: skip
        if len(packed[split]) == 0:
            raise RecipeError(f"{sources[split]} holds fewer than {block_size} tokens; lower --block_size or add data")
        blocks = packed[split].with_format("numpy").iter(batch_size=1024)  # stops at the first block with a target
        if not any((b["labels"][:, 1:] != IGNORE_INDEX).any() for b in blocks):  # a mean over nothing: NaN, 1/0
            raise RecipeError(
                f"{sources[split]}: no block of {block_size} tokens holds a token to train on (an assistant's reply, "
                "in chat data); raise --block_size, or pass data with longer replies"
            )
    return packed.with_format("torch")


def lm_dataloaders(args, accelerator, tokenizer, config):
    """(train, eval, block_size): tokenized and packed once by the main process (the others read datasets'
    cache), in fixed-size blocks that need no padding."""
    from transformers import default_data_collator

    vocab = getattr(config, "vocab_size", None)
    if vocab and len(tokenizer) > vocab:  # ids past the embedding: an IndexError on CPU, a device assert on GPU
        raise RecipeError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {vocab} (config.vocab_size): "
            "pass --resize_token_embeddings to grow the embeddings to it, or --tokenizer_name with the tokenizer the "
            "model was trained with"
        )
    limits = [getattr(config, "max_position_embeddings", None), tokenizer.model_max_length]
    limit = min(n for n in limits if n and n < 1_000_000_000)  # what both the model and the tokenizer accept
    block_size = args.block_size or min(limit, 1024)
    if block_size > limit:
        raise RecipeError(
            f"--block_size {block_size} is larger than the model accepts ({limit}); pass --block_size {limit} or less"
        )
    with prepare_data_first(accelerator):
        raw = load_raw_datasets(
            dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=args.train_file,
            validation_file=args.validation_file, validation_split_percentage=args.validation_split_percentage,
            seed=args.seed,
        )  # fmt: skip
        data = tokenize_and_pack(
            raw, tokenizer, data_format=args.data_format, text_column=args.text_column, block_size=block_size,
            num_proc=args.preprocessing_num_workers,
            sources=data_sources(args.dataset_name, args.train_file, args.validation_file),
        )  # fmt: skip
    workers = 0 if args.dataloader_num_workers is None else args.dataloader_num_workers  # blocks are in memory
    loader = partial(make_dataloader, seed=args.seed, num_workers=workers, collate_fn=default_data_collator)
    return (
        loader(data["train"], args.per_device_train_batch_size, train=True),
        loader(data["validation"], args.per_device_eval_batch_size, train=False),
        block_size,
    )


# Models and tokenizers ----------------------------------------------------------------------------


def load_causal_lm(args, **model_kwargs):
    """(model, tokenizer) as add_model_args' arguments say: pretrained weights, or a new model from a config (and its
    overrides); the tokenizer of --tokenizer_name or of the model; the embeddings grown to the tokenizer with
    --resize_token_embeddings. Called once the Accelerator exists: under ZeRO-3, transformers then creates or loads
    the weights straight into their shards. What transformers raises is one line (_load_error)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    pretrained, trust, tokenizer, config = bool(args.model_name_or_path), args.trust_remote_code, None, None
    flag, source = (
        ("--model_name_or_path", args.model_name_or_path) if pretrained else ("--config_name", args.config_name)
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or source, trust_remote_code=trust)
        if pretrained:
            model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=trust, **model_kwargs)
        else:
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust)
            if args.config_overrides:
                config.update_from_string(args.config_overrides)
                config.validate()  # transformers' own check, which save_pretrained runs at the end of training
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust, **model_kwargs)
    except Exception as err:  # transformers, tokenizers, safetensors, json, a model's own code: whatever they raise
        _stop_or_os_error(err)
        if config is not None and args.config_overrides:  # the config loaded: its overrides are what failed
            raise _overrides_error(config, args, err) from err
        named = (
            ("--tokenizer_name", args.tokenizer_name) if tokenizer is None and args.tokenizer_name else (flag, source)
        )
        raise _load_error(*named, err, model_kwargs.get("attn_implementation"), tokenizer=tokenizer is None) from err
    if tokenizer.pad_token is None:  # packed blocks need no padding, but collators and generation do
        tokenizer.pad_token = tokenizer.eos_token
    vocab = getattr(model.config, "vocab_size", None)
    if args.resize_token_embeddings and vocab and len(tokenizer) > vocab:
        logger.info(
            f"--resize_token_embeddings: {vocab} -> {len(tokenizer)} embeddings, the new ones at the others' mean"
        )
        model.resize_token_embeddings(len(tokenizer))
    elif args.resize_token_embeddings:
        logger.info(
            f"--resize_token_embeddings: the model's {vocab} embeddings hold the tokenizer's {len(tokenizer)} tokens"
        )
    return model, tokenizer


def _load_error(flag: str, name: str, err: BaseException, attn_implementation=None, tokenizer=False) -> RecipeError:
    """The RecipeError for what from_pretrained or from_config raised: a folder that is not there (which
    transformers takes for a hub id) or lacks its config, damaged weights or config, an attention implementation
    that is not installed, remote code, a model that is not a causal LM, tokenizer files that do not load."""
    from safetensors import SafetensorError, safe_open

    text, folder = one_line(err), Path(name).expanduser()
    if local := name.startswith(("/", ".", "~")) or folder.exists():
        check_path(flag, name, folder=True)  # raises the path's own error, said plainly
    fix = (
        "pass the folder that save_pretrained wrote (config.json, the weights and the tokenizer files)"
        if local
        else "check the hub id, the network (or HF_HUB_OFFLINE and the cache), or pass a local folder"
    )
    if local and flag != "--tokenizer_name" and not (folder / "config.json").is_file():
        return RecipeError(f"{flag} {name}: no config.json in the folder; {fix}")
    if "trust_remote_code" in str(err):
        return RecipeError(
            f"{flag} {name}: the model runs code of its own repository; pass --trust_remote_code if you trust that "
            "code"
        )
    if "not a valid JSON" in text:
        return RecipeError(f"{flag} {name}: config.json is damaged ({text}); download or save the model again")
    if tokenizer and not isinstance(err, OSError):
        return RecipeError(
            f"{flag} {name}: its tokenizer cannot be loaded ({type(err).__name__}: {text}); pass a model folder or "
            "hub id whose tokenizer files load"
        )
    if isinstance(err, SafetensorError):
        damaged = []
        for path in sorted(folder.glob("*.safetensors")) if local else []:
            try:
                safe_open(path, framework="pt").__enter__()
            except Exception:
                damaged.append(path.name)
        return RecipeError(
            f"{flag} {name}: {', '.join(damaged) or 'its weights'} is damaged ({text}); download or save the model "
            "again"
        )
    if isinstance(err, ImportError) and attn_implementation not in (None, "eager", "sdpa"):
        return RecipeError(
            f"--attn_implementation {attn_implementation} cannot be used here ({text}); install what it needs, or "
            "pass --attn_implementation sdpa"
        )
    if "Unrecognized configuration class" in text:  # a vision, encoder-only, ... model
        return RecipeError(f"{flag} {name}: {text}; pass a causal language model")
    return RecipeError(f"{flag} {name}: {type(err).__name__}: {text}; {fix}")


def _overrides_error(config, args, err: BaseException) -> RecipeError:
    """The RecipeError for --config_overrides that update_from_string, the config's own check or from_config
    refused (`config`: the config they were applied to, its keys unchanged): a key the config lacks, a value not of
    the key's type, values that contradict each other or the rest of the config."""
    overrides, known = args.config_overrides, list(config.to_dict())
    for key in (pair.partition("=")[0] for pair in overrides.split(",")):
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            return RecipeError(
                f"--config_overrides {overrides}: {args.config_name}'s config has no {key}{hint}; pass keys of its "
                "config.json"
            )
    # huggingface_hub's validation error says nothing of its own: its cause is the readable one
    what = one_line(err.__cause__) if err.__cause__ else f"{type(err).__name__}: {one_line(err)}"
    return RecipeError(
        f"--config_overrides {overrides}: the model {args.config_name} builds from them does not run ({what}); "
        "give each key a value of its type in config.json, agreeing with the others and with the rest of the config"
    )


# Training and evaluation --------------------------------------------------------------------------


def target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """The tokens a causal LM is trained to predict in a batch: the labels after the first position (the model
    shifts them by one) not masked with -100. A step's loss is its mean over every target token of every
    micro-batch and process: transformers' causal-LM losses divide their sum by `num_items_in_batch`."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def window_tokens(accelerator, window) -> torch.Tensor:
    """The target tokens of a whole optimizer step, every micro-batch on every process (one scalar all-reduce, on
    the device: no host sync), at least 1, so that a step without any is a zero update rather than NaN."""
    return accelerator.reduce(sum(target_tokens(batch["labels"]) for batch in window), reduction="sum").clamp(min=1)


def evaluate_causal_lm(model, eval_dl, accelerator, stop=None) -> dict | None:
    """Token-weighted loss and perplexity over the whole eval set, each block counted once; None if `stop` (a
    common.StopOnSignal) reports a signal, which every process sees at the same batch."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in eval_dl:
            if stop is not None and stop.requested():
                model.train()
                return None
            logits, labels = model(input_ids=batch["input_ids"]).logits[:, :-1], batch["labels"][:, 1:]
            per_block = torch.stack(  # a row at a time: fp32 logits are large
                [
                    F.cross_entropy(row.float(), lab, ignore_index=IGNORE_INDEX, reduction="sum")
                    for row, lab in zip(logits, labels)
                ]
            )
            # gather_for_metrics drops the blocks Accelerate repeated to even out the last batch
            per_block, counts = accelerator.gather_for_metrics((per_block, (labels != IGNORE_INDEX).sum(-1)))
            loss_sum, tokens = loss_sum + per_block.sum().item(), tokens + counts.sum().item()
    model.train()
    return {"eval_loss": loss_sum / tokens, "perplexity": math.exp(min(loss_sum / tokens, 50)), "eval_tokens": tokens}


def flops_per_token(model, block_size: int, parameters: int) -> float:
    """Training FLOPs per token: 6N for the matrix multiplies plus the attention scores (PaLM, appendix B)."""
    return 6 * parameters + 12 * model.config.num_hidden_layers * model.config.hidden_size * block_size
