"""The arguments every recipe shares, named as in transformers' TrainingArguments; a recipe states its defaults in
one block (HYPERPARAMETERS). Values are checked at parsing, by `type=` and `parser.checks`: a mistake costs one
`error:` line and exit 2 before anything is loaded or written. Imports nothing heavy: launch.sh uses it."""

from __future__ import annotations

import argparse
import difflib
import math
import operator
import os
import re
import signal
import sys
from pathlib import Path

from .errors import RecipeError

LR_SCALING_RULES = ("linear", "sqrt", "none")
# transformers' schedules that run from a warmup and a length alone (not reduce_lr_on_plateau, which needs a
# metric, nor cosine_with_min_lr or warmup_stable_decay, which need more arguments)
SCHEDULES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
)  # fmt: skip
# The shared arguments whose defaults each recipe states itself, for its model and data.
TRAINING_HYPERPARAMETERS = (
    "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
    "learning_rate", "reference_batch_size", "lr_scaling", "lr_scheduler_type", "warmup_ratio", "weight_decay",
    "max_grad_norm", "num_train_epochs", "logging_steps",
)  # fmt: skip
STATUS_FILE_ENV = "RECIPE_STATUS_FILE"  # set by launch.sh: how the run ended (common.preemption), and who said why
WORLD_SIZE_ENV = "RECIPE_WORLD_SIZE"  # set by launch.sh: the processes it asked accelerate launch for
LAUNCH_SH_ENV = "RECIPE_LAUNCH_SH"  # set by launch.sh: its own path (the model card's command runs it again)


def first_to_say(code: int, everyone: bool = False) -> bool:
    """Whether this process says why it ends (exit `code`). Under launch.sh the first of its node's processes (in this
    attempt, under --max_restarts) to end with a line does: the others end because of it (torch's agent stops them,
    their collectives break); it records `code` beside launch.sh's status file. Elsewhere rank 0 (the launcher's
    RANK) does, or every process that met it (`everyone`)."""
    if (path := _said_file()) is None:
        return everyone or os.environ.get("RANK", "0") == "0"
    try:
        said = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    except OSError:  # launch.sh's folder gone: said twice rather than not at all
        return True
    os.write(said, f"{code}\n".encode())
    os.close(said)
    return True


def stop_name(signum: int) -> str:
    """The stop a signal stands for: launch.sh passes every stop on as SIGTERM and says, beside its status file, which
    it was (Ctrl-C, SIGUSR1, ...)."""
    path = os.environ.get(STATUS_FILE_ENV)
    try:
        if path and (name := Path(f"{path}.stop").read_text().strip()):
            return name
    except OSError:
        pass
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def restarted_after_mistake() -> bool:
    """Whether this process is a restart (--max_restarts) of an attempt that ended on a user's mistake (its line said,
    exit 2), which no restart mends."""
    try:
        return (path := _said_file(attempts_back=1)) is not None and path.read_text().strip() == "2"
    except OSError:
        return False


def _said_file(attempts_back: int = 0) -> Path | None:
    """Where the process that said why this attempt (or one `attempts_back`) ended records its code, under launch.sh
    (launcher.said_code reads it)."""
    path = os.environ.get(STATUS_FILE_ENV)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) - attempts_back
    return Path(f"{path}.said-{attempt}") if path and attempt >= 0 else None


class ParsedArgs(argparse.Namespace):
    """The arguments of one parse, and beside them (not among them: vars(), and so results.json, checkpoints and
    trackers, see the arguments alone) what the parse learned: `values_by_option`, each option's text value by its
    flag ({"--output_dir": "outputs/x"}: where a failing path came from, runtime.os_error_line), and
    `unused_arguments`, those that do nothing with the others (does_nothing_unless: OutputDir does not check their
    paths). Kept with the parse, not in this module: two parses in one process (tests, tests/warm.py's forks) never
    see each other's."""

    __slots__ = ("values_by_option", "unused_arguments")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.values_by_option, self.unused_arguments = {}, frozenset()


class ArgumentParser(argparse.ArgumentParser):
    """The one parser of every entry point (the recipes, launch.sh's doctor and selftest, the benchmarks and the
    scripts that make test data): errors are one `error:` line (no usage block), exit 2, printed by the first process
    only, credentials masked; unknown and empty arguments refused; a number's option takes one of TYPES (a bare int
    or float let nan, 0 and -1 through, to fail later inside a collective); then each `check(parser, args)`, which
    refuses with `parser.error(problem, fix, subject=...)` (RecipeError's fields) or by raising a RecipeError; then the
    relations declared between options (does_nothing_unless, requires, excludes), by one checker each."""

    checks = ()  # training_parser's, then each recipe's: check(parser, args)
    unless = ()  # (options, applies(args), why, fix): options given that would do nothing (does_nothing_unless)
    relations = ()  # (option, holds(args), problem, fix, subject): what an option needs (requires, excludes)

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # --num would be --num_processes, or --num_train_epochs tomorrow
        super().__init__(*args, **kwargs)
        for name, kind in TYPES.items():
            self.register("type", name, kind)

    def parse_args(self, args=None, namespace=None) -> ParsedArgs:
        if namespace is not None and not isinstance(namespace, ParsedArgs):  # what the parse learned would be args
            raise TypeError("pass a common.args.ParsedArgs as the namespace, or none")
        if bare := [(a.option_strings or [a.dest])[0] for a in self._actions if a.type in (int, float)]:
            raise TypeError(  # the script's mistake, met by its first parse (its tests'), not by its users
                f"{', '.join(bare)}: a bare int or float takes nan, inf and any sign; name one of common.args.TYPES "
                f"({', '.join(TYPES)})"
            )
        recipe = self.get_default("recipe") is not None  # training_parser's: each recipe states HYPERPARAMETERS
        unset = [name for name in TRAINING_HYPERPARAMETERS if recipe and self.get_default(name) is None]
        if unset:  # a mistake in the recipe, not the user's
            raise TypeError(f"the recipe's HYPERPARAMETERS has no default for {', '.join(unset)}")
        namespace, extras = self.parse_known_args(args, ParsedArgs() if namespace is None else namespace)
        if extras:
            known = [option for action in self._actions for option in action.option_strings]
            near = dict.fromkeys(g for word in extras for g in difflib.get_close_matches(word, known, 2, 0.75))
            hint = f" (did you mean {' or '.join(near)}?)" if near else f"; {self.prog} --help lists every option"
            self.error(f"unrecognized arguments: {' '.join(mask_words(extras))}{hint}", subject=extras[0])
        values_by_option = {}
        for action in self._actions:  # no option means anything by an empty value ('' would be the current folder)
            value = getattr(namespace, action.dest, None)
            values = value if isinstance(value, list) else [value]  # nargs="+"
            if action.option_strings and any(isinstance(v, str) and not v.strip() for v in values):
                self.error(f"argument {action.option_strings[0]}: must not be empty", subject=action.option_strings[0])
            if action.option_strings and isinstance(value, str):
                if value.startswith("~"):  # a shell expands ~ only at a word's start, not in --option=~/path
                    setattr(namespace, action.dest, value := os.path.expanduser(value))
                values_by_option[action.option_strings[0]] = value
        namespace.values_by_option = values_by_option  # before the checks: a failing path they meet is named too
        given = {word.partition("=")[0] for word in (sys.argv[1:] if args is None else args)}
        self._check_defaults(
            namespace, {self._option_string_actions[o].dest for o in given & self._option_string_actions.keys()}
        )
        for check in self.checks:
            try:
                check(self, namespace)
            except RecipeError as err:  # met by what a check calls (a file read, a model probed): the same line
                self.error(err)
        unused = set()
        for options, applies, why, fix in self.unless:
            if applies(namespace):
                continue
            unused.update(self._option_string_actions[o].dest for o in options)
            if named := [o for o in options if o in given]:
                self.error(
                    f"{' and '.join(named)} would do nothing {why}: drop {'it' if len(named) == 1 else 'them'}{fix}",
                    subject=named[0],
                )
        namespace.unused_arguments = frozenset(unused)
        for option, holds, problem, fix, subject in self.relations:
            if self._in_effect(option, namespace) and not holds(namespace):
                said = [text(namespace) if callable(text) else text for text in (problem, fix)]
                self.error(*said, subject=subject)
        return namespace

    def _in_effect(self, option: str | None, args) -> bool:
        """Whether `option` ("--flag": its value is set and not 0 or False; "--flag value": it has that value; None:
        always) is in effect in `args`."""
        if option is None:
            return True
        flag, _, value = option.partition(" ")
        got = getattr(args, self._option_string_actions[flag].dest)
        return str(got) == value if value else bool(got)

    def requires(self, option: str | None, holds, problem, fix=None, *, subject: str | None = "") -> None:
        """Refuse `option` in effect ("--flag", "--flag value", or None: any run) where `holds(args)` is false, as
        `problem` and `fix` (texts, or functions of the arguments that return them); the subject is `option`'s flag
        unless given."""
        if subject == "":  # not given: the option's own flag, if the relation names one
            subject = (option or "").partition(" ")[0] or None
        self.relations = [*self.relations, (option, holds, problem, fix, subject)]

    def excludes(self, option: str, other: str, problem, fix=None, *, subject: str | None = "") -> None:
        """Refuse `option` and `other` in effect together ("--flag" or "--flag value" each), as `problem`, `fix`."""
        self.requires(option, lambda args: not self._in_effect(other, args), problem, fix, subject=subject)

    def _check_defaults(self, namespace, given: set) -> None:
        """The defaults (a recipe's HYPERPARAMETERS, edited in a copy) checked and converted as if typed: argparse
        converts string defaults alone, and checks none against its choices."""
        options = {a.dest: a for a in self._actions if a.option_strings}
        if unknown := sorted(set(self._defaults) - set(options) - {"recipe"}):  # a key that would set nothing
            near = difflib.get_close_matches(unknown[0], options, 1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            self.error(f"the recipe's HYPERPARAMETERS has {unknown[0]}, which is no option of it{hint}")
        typed, defaults = [], []
        for dest, action in options.items():
            value = getattr(namespace, dest, None)
            if dest in given or value is None or action.nargs == 0:  # a flag's default: True or False
                continue
            defaults.append(dest)
            values = value if isinstance(value, list) else [value]
            typed += (
                [action.option_strings[0], *map(str, values)]
                if action.nargs
                else [f"{action.option_strings[0]}={value}"]
            )
        required = [a for a in self._actions if a.required]  # given already (a script's folder, its --out)
        self._checking_defaults = True
        try:
            for action in required:
                action.required = False
            checked = super().parse_known_args(typed, argparse.Namespace())[0]
        finally:
            self._checking_defaults = False
            for action in required:
                action.required = True
        for dest in defaults:
            setattr(namespace, dest, getattr(checked, dest))

    def does_nothing_unless(self, options, applies, why: str, fix: str = "") -> None:
        """Refuse `options` given on the command line where `applies(args)` is false (they would do nothing, `why`),
        naming `fix` (", or pass ...")."""
        self.unless = [*self.unless, (options, applies, why, fix)]

    _checking_defaults = False

    def error(self, message, fix: str | None = None, *, subject: str | None = None):
        """Refuse the arguments: `message` and `fix` are a RecipeError's problem and fix, `subject` the option (or a
        RecipeError whole, its fields kept). argparse's own errors ("argument --x: ...") name theirs. The SystemExit
        raised carries the refusal as its __cause__: whoever catches it (a test) reads the fields."""
        if isinstance(message, RecipeError):
            refusal = message
        else:
            named = re.match(r"argument ([^/:\s]+)|the following arguments are required: ([^,\s]+)", message)
            refusal = RecipeError(message, fix, subject=subject or (named and (named[1] or named[2])))
        line = str(refusal)
        if self._checking_defaults:
            line += "; it is the recipe's default: correct it in HYPERPARAMETERS, or pass the option"
        if first_to_say(2):  # every process parses the same line: said once
            self._print_message(f"error: {mask_secrets(line)}\n", sys.stderr)
        raise SystemExit(2) from refusal


# Credentials: the value of an option named like one, by whole words of its name (hub_token and api_key, not
# tokenizer_name), and anywhere a hub token or a URL's user:password@. The one rule for what this project prints
# or writes; an option's value appears in a parse error only as an unrecognized argument (mask_words).
SECRET_NAMES = re.compile(r"(^|_)(token|secret|password|passwd|api_?key|credentials?)($|_)", re.I)
SECRET_VALUES = re.compile(  # a token; a URL's user:password, also as a path keeps it (one slash)
    r"hf_[A-Za-z0-9]{20,}|(?<=://)[^/@\s]+:[^/@\s]+(?=@)|(?<=:/)[^/@\s]+:[^/@\s]+(?=@)"
)


def mask_secrets(text: str) -> str:
    return SECRET_VALUES.sub("***", text)


def _secret_option(word: str) -> bool:
    return word.startswith("-") and bool(SECRET_NAMES.search(word.lstrip("-").replace("-", "_")))


def mask_words(words) -> list:
    """Command-line words with credentials masked: --hub_token X, --api-key=X, any hub token or URL password."""
    words, shown = [str(w) for w in words], []
    for before, word in zip(["", *words], words):
        flag, eq, _ = word.partition("=")
        if eq and _secret_option(flag):
            word = f"{flag}=***"
        elif "=" not in before and _secret_option(before) and not word.startswith("--"):
            word = "***"
        shown.append(mask_secrets(word))
    return shown


def public_args(args) -> dict:
    """The arguments as results.json, checkpoints and trackers record them: unset dropped, credentials masked."""
    shown = {}
    for name, value in vars(args).items():
        if value is not None:
            secret = SECRET_NAMES.search(name) and not isinstance(value, bool)
            shown[name] = "***" if secret else mask_secrets(value) if isinstance(value, str) else value
    return shown


# Argument types: each returns the value or raises ArgumentTypeError, which argparse prints as
# "error: argument --NAME: <message>".


BOUNDS = {"at_least": operator.ge, "greater_than": operator.gt, "at_most": operator.le, "below": operator.lt}


def _ranged(kind, **bounds):
    """An argparse type for finite numbers of `kind` within `bounds` (BOUNDS' names: at_least=0, below=1, ...)."""
    noun = "a whole number" if kind is int else "a number"
    wanted = f"{noun} " + " and ".join(f"{name.replace('_', ' ')} {limit}" for name, limit in bounds.items())

    def convert(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}; pass {wanted}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number; pass {wanted}")
        if not all(BOUNDS[name](value, limit) for name, limit in bounds.items()):
            raise argparse.ArgumentTypeError(f"{text} is out of range: pass {wanted}")
        return value

    return convert


def at_least(low: int):
    return _ranged(int, at_least=low)


def key_value_pairs(text):
    """key=value pairs, comma-separated, as transformers' update_from_string reads them (--config_overrides)."""
    if not all(key and eq and value for key, eq, value in (pair.partition("=") for pair in text.split(","))):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not key=value pairs separated by commas, such as hidden_size=4096,num_hidden_layers=32"
        )
    return text


TYPES = {  # registered with every training_parser: a recipe names them, add_argument("--hflip", type="probability")
    "positive_int": _ranged(int, at_least=1),
    "non_negative_int": _ranged(int, at_least=0),
    "positive_float": _ranged(float, greater_than=0),
    "non_negative_float": _ranged(float, at_least=0),
    "probability": _ranged(float, at_least=0, at_most=1),  # both ends mean something (warmup over none or all steps)
    "fraction_below_one": _ranged(float, at_least=0, below=1),  # dropout, smoothing, momentum: 1 leaves nothing
    "seed": _ranged(int, at_least=0, below=2**32),  # what numpy's and torch's generators accept
    "percentage": _ranged(float, greater_than=0, below=100),  # a held-out split: neither side empty
    "seconds": _ranged(float, greater_than=0, at_most=365 * 86400),  # a wait: torch's timers hold a year, not 1e30
    "key_value_pairs": key_value_pairs,  # --config_overrides
}


def checkpointing_steps(text):
    """'epoch' or a number of steps >= 1."""
    if text == "epoch":
        return text
    if not re.fullmatch(r"[+-]?\d+", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a number of steps (1 or more) nor 'epoch'; to save no checkpoints, omit the option"
        )
    return int(text)


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


def _check_timeouts(parser, args) -> None:
    if args.hang_timeout is None:
        args.hang_timeout = min(300, args.ddp_timeout // 2)
    elif args.hang_timeout and args.hang_timeout >= args.ddp_timeout:
        parser.error(
            f"--hang_timeout {args.hang_timeout} is not below --ddp_timeout {args.ddp_timeout}: a stuck collective "
            "would fail first, unnamed", "pass a smaller --hang_timeout or a larger --ddp_timeout",
            subject="--hang_timeout",
        )  # fmt: skip


def training_parser(recipe: str, doc: str | None) -> ArgumentParser:
    """The shared arguments; `recipe` is the name checkpoints record (a copy renamed train.py still resumes them),
    `doc` the recipe's docstring, whose first line describes it."""
    p = ArgumentParser(
        description=(doc or recipe).strip().split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.set_defaults(recipe=recipe)
    p.checks = [_check_timeouts]
    _add_schedule_rules(p)
    t = p.add_argument_group("training (shared by every recipe)").add_argument
    # ~ as the inputs' paths take it: a shell leaves it as it is in --output_dir=~/x
    t("--output_dir")
    t("--per_device_train_batch_size", type="positive_int")
    t("--per_device_eval_batch_size", type="positive_int")
    t("--gradient_accumulation_steps", type="positive_int")
    t("--learning_rate", type="positive_float", help="for --reference_batch_size samples")
    t("--reference_batch_size", type="positive_int", help="the effective batch --learning_rate is meant for")
    t("--lr_scaling", choices=LR_SCALING_RULES, help="how the learning rate follows the effective batch")
    t("--lr_scheduler_type", choices=SCHEDULES, help="transformers' schedule, over the samples trained")
    t("--warmup_steps", type="non_negative_int", help="overrides --warmup_ratio")
    t("--warmup_ratio", type="probability")
    t("--weight_decay", type="non_negative_float", help="not applied to biases and norms")
    t("--max_grad_norm", type="non_negative_float", help="0 disables clipping")
    t("--num_train_epochs", type="positive_int")
    t("--max_train_steps", type="positive_int", help="train this many optimizer steps (overrides --num_train_epochs)")
    t("--eval_steps", type="positive_int", help="evaluate every N optimizer steps (default: at each epoch's end)")
    t("--checkpointing_steps", type=checkpointing_steps, help="save the full state every N steps, or 'epoch'")
    t("--resume_from_checkpoint", help="'latest' (in --output_dir) or checkpoint-<step>")
    t("--save_total_limit", type="positive_int", help="keep only the newest N checkpoints")
    t("--overwrite_output_dir", action="store_true", help="start over where an earlier run is (deletes what it wrote)")
    t("--logging_steps", type="positive_int")
    t("--report_to", type=report_to, default="none", help="an accelerate tracker: tensorboard, wandb, ... or none")
    t("--dataloader_num_workers", type="non_negative_int", help="per process; default from the CPU count")
    t(
        "--ddp_timeout",
        type=_ranged(int, at_least=1, at_most=365 * 86400),
        default=600,
        help="seconds before a stuck collective fails",
    )
    t(
        "--hang_timeout", type="non_negative_int",
        help="seconds without a step or evaluation batch after which the stalled process is named and the job ends "
        "(0: off; default: 300, at most half of --ddp_timeout); above your slowest step and evaluation batch",
    )  # fmt: skip
    t("--seed", type="seed", default=42)
    return p


def _add_schedule_rules(p) -> None:
    """How the learning-rate options relate: what does nothing, or cannot work, with the others given."""
    warmup = lambda a: a.warmup_ratio if a.warmup_steps is None else a.warmup_steps  # noqa: E731  --warmup_steps wins
    p.does_nothing_unless(
        ["--warmup_steps", "--warmup_ratio"], lambda a: a.lr_scheduler_type != "constant" or not warmup(a),
        "with --lr_scheduler_type constant (it has no warmup)", ", or pass --lr_scheduler_type constant_with_warmup",
    )  # fmt: skip
    p.requires(  # transformers' inverse_sqrt decays over its warmup: without one, over its own 10,000 steps
        "--lr_scheduler_type inverse_sqrt", warmup, "--lr_scheduler_type inverse_sqrt decays over its warmup's "
        "length, and there is no warmup", "pass --warmup_steps or --warmup_ratio above 0",
    )  # fmt: skip
    p.does_nothing_unless(
        ["--reference_batch_size"], lambda a: a.lr_scaling != "none",
        "with --lr_scaling none (no rate is scaled from it)", ", or pass --lr_scaling linear or sqrt",
    )  # fmt: skip
