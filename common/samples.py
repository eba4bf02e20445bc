"""Sample generations at each evaluation: greedy completions of a few prompts, written to <output_dir>/samples.jsonl
and TensorBoard. A run whose loss went down but whose chat template or masking is wrong looks like a success until
someone reads what the model writes; this shows it at every evaluation.

    held_out = with_samples(partial(evaluate_causal_lm, model, eval_dl, accelerator), out, model, tokenizer, position)
    loop = common.TrainingLoop(accelerator, args, plan, position, out, model, evaluate=held_out)

The prompts are --sample_prompts' (text: a .txt file, a prompt a line, or .jsonl rows with a "prompt"; chat: .jsonl
rows with "messages", rendered with the chat template and its generation prompt), or the first held-out rows (text:
the first tokens of a document; chat: a conversation up to its last assistant turn). Every process generates every
prompt: under ZeRO-3 and FSDP each forward gathers weights that all processes hold a shard of."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .checkpoint import apply_umask, read_state
from .runtime import RecipeError, check_path, decide_on_main, logger, one_line

SAMPLES_FILE = "samples.jsonl"
HELD_OUT_PROMPTS = 4  # the first held-out rows that make a prompt
PROMPT_TOKENS = 32  # of a held-out document: its first half, at most this many tokens
FIX_TEXT = 'pass a .txt file of one prompt a line, or a .jsonl file of {"prompt": "..."} rows'
FIX_CHAT = 'pass a .jsonl file of {"messages": [{"role": "user", "content": "..."}]} rows'


def add_sample_args(parser) -> None:
    """--sample_prompts and --max_new_tokens, the file checked when the arguments are parsed."""
    s = parser.add_argument_group("samples at each evaluation").add_argument
    s("--sample_prompts", help="prompts to complete at each evaluation into samples.jsonl (text: .txt, a prompt a "
      f"line, or .jsonl with a prompt field; chat: .jsonl with messages); default: the first {HELD_OUT_PROMPTS} "
      "held-out rows")  # fmt: skip
    s("--max_new_tokens", type="non_negative_int", default=20,  # transformers' examples' length (run_generation)
      help="tokens generated greedily per prompt at each evaluation; 0: no samples")  # fmt: skip
    parser.checks.append(_check_sample_args)
    parser.does_nothing_unless(["--sample_prompts"], lambda a: a.max_new_tokens, "with --max_new_tokens 0 (no "
                               "samples are generated)", ", or pass --max_new_tokens 20")  # fmt: skip


def _check_sample_args(parser, args) -> None:
    if not (args.sample_prompts and args.max_new_tokens):
        return
    allowed = (".jsonl",) if args.data_format == "chat" else (".txt", ".jsonl")  # by its name: before it is read
    if Path(args.sample_prompts).suffix.lower() not in allowed:
        fix = FIX_CHAT if args.data_format == "chat" else FIX_TEXT
        parser.error(f"--sample_prompts {args.sample_prompts}: not a {' or '.join(allowed)} file", fix,
                     subject="--sample_prompts")  # fmt: skip
    read_prompts(args.sample_prompts, args.data_format)  # its RecipeError is the parse's error


def read_prompts(path, data_format: str) -> list:
    """--sample_prompts' prompts: strings (text), or conversations to reply to (chat: each row's messages, less a
    last assistant reply, which is what the model writes)."""
    from .text import check_conversation

    flag, fix = f"--sample_prompts {path}", FIX_CHAT if data_format == "chat" else FIX_TEXT
    check_path("--sample_prompts", path)  # a .txt or .jsonl file: the parse checked its name (_check_sample_args)
    try:
        lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        raise RecipeError(
            f"{flag}: not UTF-8 text ({one_line(err)})",
            "convert the file, e.g. iconv -f latin1 -t utf-8",
            subject="--sample_prompts",
        ) from None
    prompts = []
    for number, line in ((n, line) for n, line in enumerate(lines, 1) if line.strip()):
        if Path(path).suffix.lower() == ".txt":
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise RecipeError(
                f"{flag}: line {number} is not JSON ({one_line(err)})", fix, subject="--sample_prompts"
            ) from None
        value = row.get("prompt" if data_format == "text" else "messages") if isinstance(row, dict) else None
        if data_format == "text":
            if not isinstance(value, str) or not value.strip():
                raise RecipeError(f'{flag}: line {number} has no text under "prompt"', fix, subject="--sample_prompts")
            prompts.append(value)
            continue
        try:
            check_conversation(value, needs_reply=False)
        except RecipeError as err:
            raise RecipeError(f"{flag}: line {number}: {err}", fix, subject="--sample_prompts") from None
        if not (conversation := before_last_reply(value)):
            raise RecipeError(
                f"{flag}: line {number} is a reply alone, with nothing to reply to", fix, subject="--sample_prompts"
            )
        prompts.append(conversation)
    if not prompts:
        raise RecipeError(f"{flag}: holds no prompts", fix, subject="--sample_prompts")
    return prompts


def before_last_reply(messages: list) -> list:
    """A conversation up to its last assistant turn (the whole of one that ends with another's)."""
    if messages and messages[-1].get("role") == "assistant":
        return messages[:-1]
    return messages


def held_out_prompts(args, tokenizer, config, count: int, room: int) -> list:
    """(shown, token ids) of the first `count` held-out rows that make a prompt of at most `room` tokens: a document's
    first half (at most PROMPT_TOKENS tokens), or a conversation up to its last assistant turn. Read as the run's data
    is: from the stream, or as the preparation kept them (a prepared folder older than that: the raw data again)."""
    from .text import block_size_for, load_raw_datasets, prepared_held_out_rows, read_streams

    if args.streaming:
        rows = read_streams(args)[0]["validation"].take(100)
    elif (rows := prepared_held_out_rows(args, tokenizer, block_size_for(args, tokenizer, config))) is not None:
        pass  # kept by the preparation: the corpus is not read again
    else:  # a prepared folder older than the file
        raw = load_raw_datasets(
            dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name, train_file=args.train_file,
            validation_file=args.validation_file, validation_split_percentage=args.validation_split_percentage,
            seed=args.seed, data_format=args.data_format, text_column=args.text_column,
        )  # fmt: skip
        rows = raw["validation"].select(range(min(100, len(raw["validation"]))))
    prompts = []
    for row in rows:
        if args.data_format == "chat":
            prompt = chat_prompt(tokenizer, before_last_reply(row["messages"]))
        elif isinstance(text := row[args.text_column], str) and text.strip():
            ids = tokenizer(text)["input_ids"]
            ids = ids[: min(PROMPT_TOKENS, max(1, len(ids) // 2))]
            prompt = (tokenizer.decode(ids, skip_special_tokens=True), ids)
        else:
            prompt = None
        if prompt and 0 < len(prompt[1]) <= room:
            prompts.append(prompt)
        if len(prompts) == count:
            break
    return prompts


def chat_prompt(tokenizer, messages):
    """(the rendered conversation with the template's generation prompt, its ids as training tokenizes a chat), or
    None for a conversation the template refuses or that is empty."""
    from jinja2 import TemplateError

    if not messages:
        return None
    try:
        shown = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError:
        return None
    return shown, tokenizer(shown, add_special_tokens=False)["input_ids"]


def prompts_for(args, tokenizer, config) -> list:
    """(shown, token ids) of every prompt; one line for a prompt or a length the model cannot take."""
    positions = getattr(config, "max_position_embeddings", None) or float("inf")
    room = positions - args.max_new_tokens  # for the prompt
    if room < 1:
        raise RecipeError(
            f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in the {positions} positions the "
            "model takes",
            f"pass --max_new_tokens {max(positions // 2, 1)} or less",
            subject="--max_new_tokens",
        )
    if not args.sample_prompts:
        prompts = held_out_prompts(args, tokenizer, config, HELD_OUT_PROMPTS, room)
        if not prompts:
            logger.warning("no held-out row makes a prompt for samples.jsonl: pass --sample_prompts")
        return prompts
    prompts = []
    for number, prompt in enumerate(read_prompts(args.sample_prompts, args.data_format), 1):
        if args.data_format == "chat":
            if (made := chat_prompt(tokenizer, prompt)) is None:
                raise RecipeError(
                    f"--sample_prompts {args.sample_prompts}: the chat template rejects conversation {number}",
                    "give it the roles and order the template takes",
                    subject="--sample_prompts",
                )
        else:
            made = (prompt, tokenizer(prompt)["input_ids"])
        if len(made[1]) > room:
            raise RecipeError(
                f"--sample_prompts {args.sample_prompts}: prompt {number} is {len(made[1])} tokens, and with "
                f"--max_new_tokens {args.max_new_tokens} it passes the {positions} positions the model takes",
                "shorten it, or lower --max_new_tokens",
                subject="--sample_prompts",
            )
        prompts.append(made)
    return prompts


def generate(accelerator, model, tokenizer, prompts: list, max_new_tokens: int) -> list:
    """The greedy completion of each prompt's ids (the new tokens to the first end of sequence, decoded), in one
    left-padded batch, on every process. The model is put in eval mode and back; no random numbers are drawn."""
    module = accelerator.unwrap_model(model)  # DDP's module, DeepSpeed's; FSDP2's own, whose forward gathers
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked; none without an EOS either
    width = max(len(ids) for _, ids in prompts)
    ids = torch.tensor([[pad] * (width - len(i)) + i for _, i in prompts], device=accelerator.device)
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for _, i in prompts], device=accelerator.device)
    training = module.training
    module.eval()
    try:
        # eagerly, also a model compiled in place (model.compile()): compiled for training's shapes, it would compile
        # again for each length generation feeds it (tens of seconds each, up to torch's recompile limit)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            out = module.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                pad_token_id=pad, synced_gpus=accelerator.num_processes > 1,  # each forward with every process
            )  # fmt: skip
    finally:
        module.train(training)
    eos = module.generation_config.eos_token_id
    ends = {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
    completions = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in ends), len(row))
        completions.append(tokenizer.decode(row[:end]))  # with the end token: whether the model stops shows
    return completions


def with_samples(evaluate, out, model, tokenizer, position):
    """`evaluate(stop)` followed, where it completed, by a greedy completion of each prompt at `position` (the run's
    position, which the training loop moves): rows in samples.jsonl and text in the trackers. A resumed run first drops
    the rows of the evaluations its checkpoint has not recorded, which it evaluates again."""
    args, accelerator = out.args, out.accelerator
    path = Path(args.output_dir) / SAMPLES_FILE
    if accelerator.is_main_process and out.resume_from is not None and path.exists():
        keep_recorded(path, read_state(out.resume_from).get("eval_history", []))
    if not args.max_new_tokens:
        return evaluate
    config = accelerator.unwrap_model(model).config
    prompts = decide_on_main(accelerator, lambda: prompts_for(args, tokenizer, config))
    if not prompts:
        return evaluate

    def evaluate_and_sample(stop):
        began = time.perf_counter()
        metrics = evaluate(stop)
        evaluated = time.perf_counter() - began
        if metrics is not None:
            began = time.perf_counter()
            completions = generate(accelerator, model, tokenizer, prompts, args.max_new_tokens)
            if accelerator.is_main_process:
                rows = [
                    {"step": position.step, "samples_seen": position.seen, "prompt": shown, "completion": completion}
                    for (shown, _), completion in zip(prompts, completions)
                ]
                with path.open("a", encoding="utf-8") as f:
                    f.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
                to_trackers(accelerator, rows, position.step)
            took = time.perf_counter() - began  # said against the evaluation's time: what the samples cost
            logger.info(
                f"step {position.step}: {len(prompts)} samples of up to {args.max_new_tokens} tokens in {took:.2f} s "
                f"({took / max(evaluated, 1e-9):.0%} of the evaluation's {evaluated:.2f} s), in {path}"
            )
        return metrics

    return evaluate_and_sample


def keep_recorded(path: Path, eval_history: list) -> None:
    """samples.jsonl with only the rows of the evaluations a checkpoint recorded (a resume evaluates the others
    again), rewritten whole through a temporary file."""
    recorded = {(e.get("step"), e.get("samples_seen")) for e in eval_history}
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:  # the last line of a run killed while writing it
            continue
        if isinstance(row, dict) and (row.get("step"), row.get("samples_seen")) in recorded:
            kept.append(line + "\n")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    apply_umask(tmp)
    os.replace(tmp, path)


def samples_written_by_a_run(path: Path) -> bool:
    """Whether `path` holds what with_samples writes (its first row read; a kill may cut the last one short): a file
    of the same name that is not may be a user's, which --overwrite_output_dir must not delete."""
    try:
        with path.open(encoding="utf-8") as f:
            first = f.readline()
        return not first or set(json.loads(first)) == {"step", "samples_seen", "prompt", "completion"}
    except (OSError, ValueError, TypeError):
        return False


def to_trackers(accelerator, rows: list, step: int) -> None:
    """Each sample as text, where a tracker shows text: TensorBoard's add_text (as indented blocks: Markdown would
    take a chat template's <|tags|> for HTML)."""
    if not any(tracker.name == "tensorboard" for tracker in accelerator.trackers):
        return
    writer = accelerator.get_tracker("tensorboard", unwrap=True)
    block = lambda text: "\n".join("    " + line for line in text.splitlines() or [""])  # noqa: E731
    for i, row in enumerate(rows):
        writer.add_text(
            f"samples/{i}", f"prompt:\n\n{block(row['prompt'])}\n\ncompletion:\n\n{block(row['completion'])}", step
        )
