"""The arguments every recipe shares, named as in transformers' TrainingArguments. A recipe adds
its own and sets its defaults with `parser.set_defaults(learning_rate=..., ...)`."""

from __future__ import annotations

import argparse

from .scaling import LR_SCALING_RULES


def training_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, allow_abbrev=False)
    t = p.add_argument_group("training (shared by every recipe)")
    t.add_argument("--output_dir", default="outputs/run")
    t.add_argument("--per_device_train_batch_size", type=int, default=8)
    t.add_argument("--per_device_eval_batch_size", type=int, default=8)
    t.add_argument("--gradient_accumulation_steps", type=int, default=1)
    t.add_argument("--learning_rate", type=float, default=1e-3, help="for --reference_batch_size samples")
    t.add_argument("--reference_batch_size", type=int, default=64,
                   help="the effective batch --learning_rate is meant for")
    t.add_argument("--lr_scaling", choices=LR_SCALING_RULES, default="linear",
                   help="how the learning rate follows the effective batch")
    t.add_argument("--lr_scheduler_type", default="cosine", help="any transformers schedule name")
    t.add_argument("--warmup_steps", type=int, help="overrides --warmup_ratio")
    t.add_argument("--warmup_ratio", type=float, default=0.0)
    t.add_argument("--weight_decay", type=float, default=0.0, help="not applied to biases and norms")
    t.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    t.add_argument("--num_train_epochs", type=int, default=3)
    t.add_argument("--max_train_steps", type=int, help="stop after this many optimizer steps")
    t.add_argument("--checkpointing_steps", help="save the full state every N optimizer steps, or 'epoch'")
    t.add_argument("--resume_from_checkpoint", help="'latest' (in --output_dir) or a checkpoint-<step> folder")
    t.add_argument("--save_total_limit", type=int, help="keep only the newest N checkpoints")
    t.add_argument("--overwrite_output_dir", action="store_true",
                   help="start over in an --output_dir that holds an earlier run (its checkpoints are deleted)")
    t.add_argument("--logging_steps", type=int, default=10)
    t.add_argument("--report_to", default="none", help="an accelerate tracker: tensorboard, wandb, ... or none")
    t.add_argument("--dataloader_num_workers", type=int, help="per process; default from the CPU count")
    t.add_argument("--ddp_timeout", type=int, default=600, help="seconds before a stuck collective fails")
    t.add_argument("--seed", type=int, default=42)
    return p


def parse(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse, rejecting unknown arguments and values the parser's types cannot express."""
    args = parser.parse_args(argv)
    if args.checkpointing_steps not in (None, "epoch") and not args.checkpointing_steps.isdigit():
        parser.error("--checkpointing_steps takes a number of steps or 'epoch'")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        parser.error("--save_total_limit must be at least 1")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps", "logging_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args
