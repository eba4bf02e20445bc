"""The arguments every recipe shares, named as in transformers' TrainingArguments. A recipe adds
its own, and states the defaults of its hyperparameters in one block at its top (HYPERPARAMETERS,
with a reason each), given to `parser.set_defaults`: `parse_args` refuses a recipe that leaves one
of the shared training hyperparameters (TRAINING_HYPERPARAMETERS) to chance.

Every value is checked when the arguments are parsed, by the `type=` beside it (`positive_int`,
`probability`, ...) or, for a rule between two arguments, in `parse_args`: a mistake costs one
`error:` line and exit code 2 before anything is loaded, launched or written. No parse error
repeats a value that looks like a credential.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import sys

LR_SCALING_RULES = ("linear", "sqrt", "none")


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one `error: ...` line (no usage block) and exit code 2, printed by
    the first process only (every process of a launch parses the same command line), with any
    credential in the message masked. `parse_args` refuses unknown arguments and combinations no
    single argument's type can see."""

    def parse_known_args(self, args=None, namespace=None):
        self._argv = [str(a) for a in (sys.argv[1:] if args is None else args)]
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        unset = [name for name in TRAINING_HYPERPARAMETERS if self.get_default(name) is None]
        if unset:  # a mistake in the recipe, not the user's
            raise TypeError(f"the recipe's HYPERPARAMETERS has no default for {', '.join(unset)}")
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(mask_words(extras))}{self._did_you_mean(extras)}")
        for action in self._actions:  # no option means anything by an empty value ('' would be the current folder)
            value = getattr(namespace, action.dest, None)
            if action.option_strings and any(isinstance(v, str) and not v.strip() for v in _listed(value)):
                self.error(f"argument {action.option_strings[0]}: must not be empty")
        if (
            namespace.warmup_steps
            and namespace.max_train_steps
            and namespace.warmup_steps >= namespace.max_train_steps
        ):
            self.error(
                f"--warmup_steps {namespace.warmup_steps} leaves no step after the warmup of --max_train_steps "
                f"{namespace.max_train_steps}; pass fewer warmup steps"
            )
        return namespace

    def _did_you_mean(self, extras) -> str:
        known = [option for action in self._actions for option in action.option_strings if option.startswith("--")]
        guesses = []
        for token in extras:
            if token.startswith("--"):
                guesses += difflib.get_close_matches(token.split("=", 1)[0], known, n=2, cutoff=0.75)
        if guesses:
            return f" (did you mean {' or '.join(dict.fromkeys(guesses))}?)"
        return f"; {self.prog} --help lists every option"

    def error(self, message):
        message = mask_secrets(message, getattr(self, "_argv", []))
        # The launcher's RANK: under `accelerate launch` every process would print the same line.
        self.exit(2, f"error: {message}\n" if os.environ.get("RANK", "0") == "0" else None)


# Credentials ------------------------------------------------------------------------------------
# Whole words of an option's name: hub_token and api_key are masked, tokenizer_name and max_tokens are not.
SECRET_NAMES = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|credentials?)($|_)", re.I)
SECRET_VALUES = re.compile(r"hf_[A-Za-z0-9]{20,}|(?<=://)[^/@\s]+:[^/@\s]+(?=@)")  # hub tokens, user:password@ in URLs


def mask_words(words) -> list:
    """Command-line words with credentials masked: the value of an option named like one (--hub_token X,
    --hub_token=X, --wandb-api-key X), and any hub token or URL password. The one rule for everything
    this project prints or writes: errors, launch.sh's command line, results.json, checkpoints, trackers."""
    shown, hide_next = [], False
    for word in map(str, words):
        if hide_next and not word.startswith("--"):
            shown.append("***")
            hide_next = False
            continue
        hide_next = False
        if word.startswith("-"):
            flag, eq, _ = word.partition("=")
            if SECRET_NAMES.search(flag.lstrip("-").replace("-", "_")):
                word, hide_next = (f"{flag}=***", False) if eq else (word, True)
        shown.append(SECRET_VALUES.sub("***", word))
    return shown


def mask_secrets(message: str, argv=()) -> str:
    """`message` with hub tokens, URL passwords and the values `mask_words` hides in `argv` masked."""
    argv = [str(a) for a in argv]
    secrets = set()
    for word, shown in zip(argv, mask_words(argv)):
        if shown == "***":
            secrets.add(word)
        elif shown.endswith("=***") and not word.endswith("=***"):
            secrets.add(word.partition("=")[2])
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:  # shorter ones would mask unrelated letters
            message = message.replace(secret, "***")
    return SECRET_VALUES.sub("***", message)


def public_args(args) -> dict:
    """The arguments as results.json, checkpoints and trackers record them: unset ones dropped,
    anything that looks like a credential masked (an argument named like one, a hub token, the
    password in a URL)."""
    shown = {}
    for name, value in vars(args).items():
        if value is None:
            continue
        if SECRET_NAMES.search(name) and not isinstance(value, bool):
            value = "***"
        elif isinstance(value, str):
            value = SECRET_VALUES.sub("***", value)
        shown[name] = value
    return shown


# --- argument types: each returns the value or raises ArgumentTypeError, which argparse prints as
# "error: argument --NAME: <message>".


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def _number(text, kind, wanted):
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'a whole number' if kind is int else 'a number'}; pass {wanted}"
        ) from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number; pass {wanted}")
    return value


def _ranged(kind, low=None, high=None, *, low_open=False, high_open=False, name=None):
    """An argparse type for numbers of `kind` in [low, high] (an open end when `*_open`)."""
    parts = []
    if low is not None:
        parts.append(f"{'greater than' if low_open else 'at least'} {low}")
    if high is not None:
        parts.append(f"{'below' if high_open else 'at most'} {high}")
    wanted = f"{'a whole number' if kind is int else 'a number'} {' and '.join(parts)}"

    def convert(text):
        value = _number(text, kind, wanted)
        if (low is not None and (value <= low if low_open else value < low)) or (
            high is not None and (value >= high if high_open else value > high)
        ):
            raise argparse.ArgumentTypeError(f"{text} is out of range: pass {wanted}")
        return value

    convert.__name__ = name or wanted
    return convert


def at_least(low: int):
    """An int type of at least `low`."""
    return _ranged(int, low)


positive_int = _ranged(int, 1, name="positive_int")
non_negative_int = _ranged(int, 0, name="non_negative_int")
positive_float = _ranged(float, 0, low_open=True, name="positive_float")
non_negative_float = _ranged(float, 0, name="non_negative_float")
# a fraction where both ends mean something (warmup over none or all steps)
probability = _ranged(float, 0, 1, name="probability")
# dropout, smoothing, momentum: 1 leaves nothing to learn
fraction_below_one = _ranged(float, 0, 1, high_open=True, name="fraction_below_one")
seed = _ranged(int, 0, 2**32, high_open=True, name="seed")  # what numpy's and torch's generators accept
percentage = _ranged(float, 0, 100, low_open=True, high_open=True)  # a held-out split: 0% and 100% leave a side empty
# Registered with each training_parser, so that a recipe names them: add_argument("--hflip", type="probability").
TYPES = {
    t.__name__: t
    for t in (
        positive_int,
        non_negative_int,
        positive_float,
        non_negative_float,
        probability,
        fraction_below_one,
        seed,
    )
}


def checkpointing_steps(text):
    """'epoch' or a number of steps >= 1."""
    if text == "epoch":
        return text
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of steps nor 'epoch'") from None
    if steps < 1:
        raise argparse.ArgumentTypeError(
            f"{text} is not a number of steps: pass 1 or more, or 'epoch'; to save no checkpoints, omit "
            "--checkpointing_steps"
        )
    return steps


# transformers' schedules that run from a warmup and a total length alone: not those that need a metric
# (reduce_lr_on_plateau) or extra arguments (cosine_with_min_lr, warmup_stable_decay).
SCHEDULES = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
)


def report_to(text):
    """'none', 'all' (every installed tracker), or one tracker accelerate knows, installed here."""
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    names = ["none", *(t.value for t in LoggerType)]
    if text not in names:
        raise argparse.ArgumentTypeError(f"{text!r} is not a tracker accelerate knows; choose from {', '.join(names)}")
    if text not in ("none", "all") and text not in {t.value for t in get_available_trackers()}:
        raise argparse.ArgumentTypeError(f"{text} is not installed here: pip install {text}, or pass --report_to none")
    return text


# The shared arguments whose defaults each recipe states itself, for its model and data.
TRAINING_HYPERPARAMETERS = (
    "output_dir",
    "per_device_train_batch_size",
    "per_device_eval_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "reference_batch_size",
    "lr_scaling",
    "lr_scheduler_type",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "num_train_epochs",
    "logging_steps",
)


def training_parser(recipe: str, description: str) -> argparse.ArgumentParser:
    """The shared arguments; `recipe`, the name checkpoints record (a copy renamed to train.py still
    resumes them), is set as args.recipe."""
    p = ArgumentParser(
        description=description, allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.set_defaults(recipe=recipe)
    for name, kind in TYPES.items():
        p.register("type", name, kind)
    t = p.add_argument_group("training (shared by every recipe)")
    t.add_argument("--output_dir")
    t.add_argument("--per_device_train_batch_size", type=positive_int)
    t.add_argument("--per_device_eval_batch_size", type=positive_int)
    t.add_argument("--gradient_accumulation_steps", type=positive_int)
    t.add_argument("--learning_rate", type=positive_float, help="for --reference_batch_size samples")
    t.add_argument(
        "--reference_batch_size", type=positive_int, help="the effective batch --learning_rate is meant for"
    )
    t.add_argument("--lr_scaling", choices=LR_SCALING_RULES, help="how the learning rate follows the effective batch")
    t.add_argument("--lr_scheduler_type", choices=SCHEDULES, help="transformers' schedule, over the samples trained")
    t.add_argument("--warmup_steps", type=non_negative_int, help="overrides --warmup_ratio")
    t.add_argument("--warmup_ratio", type=probability)
    t.add_argument("--weight_decay", type=non_negative_float, help="not applied to biases and norms")
    t.add_argument("--max_grad_norm", type=non_negative_float, help="0 disables clipping")
    t.add_argument("--num_train_epochs", type=positive_int)
    t.add_argument("--max_train_steps", type=positive_int, help="stop after this many optimizer steps")
    t.add_argument(
        "--checkpointing_steps",
        type=checkpointing_steps,
        help="save the full state every N optimizer steps, or 'epoch'; omit it to save no checkpoints",
    )
    t.add_argument("--resume_from_checkpoint", help="'latest' (in --output_dir) or a checkpoint-<step> folder")
    t.add_argument("--save_total_limit", type=positive_int, help="keep only the newest N checkpoints")
    t.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="start over in an --output_dir that holds an earlier run (its checkpoints are deleted)",
    )
    t.add_argument("--logging_steps", type=positive_int)
    t.add_argument(
        "--report_to", type=report_to, default="none", help="an accelerate tracker: tensorboard, wandb, ... or none"
    )
    t.add_argument("--dataloader_num_workers", type=non_negative_int, help="per process; default from the CPU count")
    t.add_argument(
        "--ddp_timeout",
        type=_ranged(int, 1, 365 * 86400),
        default=600,
        help="seconds before a stuck collective fails (at most a year)",
    )
    t.add_argument("--seed", type=seed, default=42)
    return p
