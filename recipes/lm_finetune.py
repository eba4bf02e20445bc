"""Causal-LM fine-tuning: any transformers causal LM on local or hub text, from one CPU to many GPUs.

    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/lm_finetune.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1
    ./launch.sh lm_finetune --model_name_or_path ./my-model --train_file data.jsonl --text_column text
    ./launch.sh lm_finetune --model_name_or_path ./my-model --train_file chats.jsonl --data_format chat --lora_r 16

Text is packed into --block_size blocks; in chat mode the `messages` column is rendered with the
tokenizer's chat template and only the assistant's tokens are trained on. The learning rate is
given for --reference_batch_size sequences and scaled to the effective batch. --help lists all.
"""

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, default_data_collator
from tqdm.auto import tqdm

import common
from common import RecipeError, logger
from common.text import IGNORE_INDEX, load_raw_datasets, max_block_size, tokenize_and_pack


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model_name_or_path", required=True, help="a hub id or a local folder")
    p.add_argument("--torch_dtype", choices=["auto", "bfloat16", "float16", "float32"], default="float32",
                   help="weights' dtype; keep float32 with a bf16 accelerate config for mixed precision")
    p.add_argument("--attn_implementation", default="sdpa", help="sdpa, flash_attention_2, eager")
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--trust_remote_code", action="store_true", help="run the model repo's own code")
    p.add_argument("--dataset_name", help="a hub dataset")
    p.add_argument("--dataset_config_name")
    p.add_argument("--train_file", help="local .txt, .json, .jsonl, .csv or .parquet")
    p.add_argument("--validation_file")
    p.add_argument("--validation_split_percentage", type=int, default=5)
    p.add_argument("--text_column", default="text")
    p.add_argument("--data_format", choices=["text", "chat"], default="text",
                   help="chat: a `messages` column, prompts masked out of the loss")
    p.add_argument("--block_size", type=int, help="default: min(model max length, 1024)")
    p.add_argument("--preprocessing_num_workers", type=int)
    p.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains all weights")
    p.add_argument("--lora_alpha", type=int, default=32)
    p.add_argument("--lora_dropout", type=float, default=0.0)
    p.add_argument("--lora_target_modules", nargs="+", default=["all-linear"])
    p.add_argument("--output_dir", default="outputs/lm")
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=2e-5, help="for --reference_batch_size sequences")
    p.add_argument("--reference_batch_size", type=int, default=64)
    p.add_argument("--lr_scaling", choices=common.LR_SCALING_RULES, default="sqrt")
    p.add_argument("--lr_scheduler_type", default="cosine", help="any transformers schedule name")
    p.add_argument("--warmup_steps", type=int, help="overrides --warmup_ratio")
    p.add_argument("--warmup_ratio", type=float, default=0.03)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    p.add_argument("--num_train_epochs", type=int, default=3)
    p.add_argument("--max_train_steps", type=int, help="stop after this many optimizer steps")
    p.add_argument("--checkpointing_steps", help="save state every N optimizer steps, or 'epoch'")
    p.add_argument("--resume_from_checkpoint", help="'latest' or a checkpoint-<step> folder")
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--report_to", default="none", help="an accelerate tracker: tensorboard, wandb, ... or none")
    p.add_argument("--dataloader_num_workers", type=int, default=0, help="blocks are in memory already")
    p.add_argument("--ddp_timeout", type=int, default=600, help="seconds before a stuck collective fails")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    if args.checkpointing_steps not in (None, "epoch") and not args.checkpointing_steps.isdigit():
        p.error("--checkpointing_steps takes a number of steps or 'epoch'")
    return args


def load_model_and_tokenizer(args):
    name = args.model_name_or_path
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise RecipeError(f"--model_name_or_path {name}: no such folder; pass a saved model's folder or a hub id")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            name, dtype=args.torch_dtype if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype),
            attn_implementation=args.attn_implementation, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:  # not found on the hub, no network, not a model folder
        raise RecipeError(f"--model_name_or_path {name}: {str(err).splitlines()[0]}") from err
    if tokenizer.pad_token is None:  # packed blocks need no padding, but collators and generation do
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def get_dataloaders(args, accelerator, tokenizer, config):
    limit = max_block_size(tokenizer, config)
    block_size = args.block_size or min(limit, 1024)
    if block_size > limit:
        raise RecipeError(f"--block_size {block_size} is larger than the model accepts ({limit}); pass --block_size {limit} or less")
    with common.prepare_data_first(accelerator):
        raw = load_raw_datasets(dataset_name=args.dataset_name, dataset_config_name=args.dataset_config_name,
                                train_file=args.train_file, validation_file=args.validation_file,
                                validation_split_percentage=args.validation_split_percentage, seed=args.seed)
        data = tokenize_and_pack(raw, tokenizer, data_format=args.data_format, text_column=args.text_column,
                                 block_size=block_size, num_proc=args.preprocessing_num_workers)
    make = lambda split, batch, train: common.make_dataloader(  # noqa: E731
        data[split], batch, train=train, num_workers=args.dataloader_num_workers, collate_fn=default_data_collator)
    return make("train", args.per_device_train_batch_size, True), make("validation", args.per_device_eval_batch_size, False), block_size


def build_model(args, model):
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if args.lora_r:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as err:
            raise RecipeError("--lora_r needs peft: pip install -e '.[lora]'") from err
        targets = args.lora_target_modules[0] if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
    return model


def evaluate(model, eval_dl, accelerator):
    """Token-weighted loss and perplexity over the whole eval set, each block counted once."""
    model.eval()
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for batch in eval_dl:
            logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            per_block = torch.stack([F.cross_entropy(row.float(), lab, ignore_index=IGNORE_INDEX, reduction="sum")
                                     for row, lab in zip(logits, labels)])  # one row at a time: fp32 logits are large
            per_block, counts = accelerator.gather_for_metrics((per_block, (labels != IGNORE_INDEX).sum(-1)))
            loss_sum += per_block.sum().item()
            tokens += counts.sum().item()
    model.train()
    eval_loss = loss_sum / tokens
    return {"eval_loss": eval_loss, "perplexity": math.exp(min(eval_loss, 50)), "eval_tokens": tokens}


@common.run
def main(argv=None):
    args = parse_args(argv)
    accelerator = common.make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps,
        ddp_timeout=args.ddp_timeout, report_to=args.report_to, project_dir=args.output_dir,
        max_grad_norm=args.max_grad_norm)
    resume_from = common.resolve_checkpoint(args.output_dir, args.resume_from_checkpoint)

    model, tokenizer = load_model_and_tokenizer(args)
    train_dl, eval_dl, block_size = get_dataloaders(args, accelerator, tokenizer, model.config)
    plan = common.plan_training(
        num_batches=len(train_dl), per_device_batch_size=args.per_device_train_batch_size,
        num_processes=accelerator.num_processes, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, reference_batch_size=args.reference_batch_size,
        lr_scaling=args.lr_scaling, num_train_epochs=args.num_train_epochs,
        max_train_steps=args.max_train_steps, warmup_steps=args.warmup_steps, warmup_ratio=args.warmup_ratio)
    logger.info(f"{accelerator.num_processes} process(es) x {args.per_device_train_batch_size} x {block_size} tokens x "
                f"{args.gradient_accumulation_steps} accumulation = {plan.effective_batch_size * block_size} tokens per step; "
                f"learning rate {args.learning_rate} at batch {args.reference_batch_size} -> {plan.learning_rate:.4g} "
                f"({args.lr_scaling}); {plan.max_train_steps} steps, {plan.warmup_steps} warmup")

    model = build_model(args, model)
    n_params = common.count_parameters(model)
    cfg = model.config
    flops_per_token = 6 * n_params + 12 * cfg.num_hidden_layers * cfg.hidden_size * block_size  # PaLM, appendix B
    optimizer = torch.optim.AdamW(common.decay_groups(model, args.weight_decay), lr=plan.learning_rate,
                                  fused=accelerator.device.type == "cuda")
    scheduler = common.make_scheduler(optimizer, args.lr_scheduler_type, plan)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    step, start_epoch, skip_batches = 0, 0, 0
    checkpoint_every = int(args.checkpointing_steps) if (args.checkpointing_steps or "").isdigit() else 0
    must_match = {"world_size": accelerator.num_processes, "per_device_train_batch_size": args.per_device_train_batch_size,
                  "gradient_accumulation_steps": args.gradient_accumulation_steps}
    run_info = {**must_match, "effective_batch_size": plan.effective_batch_size, "args": vars(args)}
    if resume_from:
        state = common.load_checkpoint(accelerator, resume_from, must_match)
        step, start_epoch, skip_batches = state["step"], state["epoch"], state["batches_in_epoch"]

    def save_checkpoint(epoch, batches_in_epoch):  # saved with the position to resume from
        if batches_in_epoch == len(train_dl):  # a finished epoch resumes at the start of the next
            epoch, batches_in_epoch = epoch + 1, 0
        common.save_checkpoint(accelerator, args.output_dir, step,
                               {"epoch": epoch, "batches_in_epoch": batches_in_epoch, **run_info})

    accelerator.init_trackers("lm_finetune", config={k: str(v) for k, v in vars(args).items() if v is not None})

    progress = tqdm(total=plan.max_train_steps, initial=step, disable=not accelerator.is_local_main_process,
                    mininterval=0.1 if sys.stderr.isatty() else 30)  # batch logs (Slurm) get a line per 30 s
    loss_sum, loss_count, train_loss, metrics, history = torch.zeros((), device=accelerator.device), 0, float("nan"), {}, []
    train_seconds, start_step = 0.0, step
    for epoch in range(start_epoch, plan.num_epochs):
        if step >= plan.max_train_steps:  # resumed from the last checkpoint
            break
        common.set_epoch(train_dl, epoch)
        batches = accelerator.skip_first_batches(train_dl, skip_batches) if skip_batches else train_dl
        batches_in_epoch, skip_batches, tic = skip_batches, 0, time.perf_counter()
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            batches_in_epoch += 1
            loss_sum += loss.detach()
            loss_count += 1
            if not accelerator.sync_gradients:
                continue
            scheduler.step()
            step += 1
            progress.update(1)
            if step % args.logging_steps == 0 or step == plan.max_train_steps or batches_in_epoch == len(train_dl):
                train_loss = accelerator.reduce(loss_sum / loss_count, reduction="mean").item()
                loss_sum.zero_()
                loss_count = 0
                history.append({"step": step, "train_loss": train_loss, "lr": scheduler.get_last_lr()[0]})
                accelerator.log(history[-1], step=step)
                progress.set_postfix(loss=f"{train_loss:.4f}")
            if checkpoint_every and step % checkpoint_every == 0:
                save_checkpoint(epoch, batches_in_epoch)
            if step >= plan.max_train_steps:
                break
        train_seconds += time.perf_counter() - tic
        metrics = evaluate(model, eval_dl, accelerator)
        accelerator.log({**metrics, "epoch": epoch}, step=step)
        logger.info(f"epoch {epoch}: step {step}, train_loss {train_loss:.4f}, eval_loss {metrics['eval_loss']:.4f}, "
                    f"perplexity {metrics['perplexity']:.2f} ({metrics['eval_tokens']} tokens)")
        if args.checkpointing_steps == "epoch":
            save_checkpoint(epoch, batches_in_epoch)
        if step >= plan.max_train_steps:
            break
    progress.close()
    if not metrics:  # resumed from the final checkpoint: nothing left to train
        metrics = evaluate(model, eval_dl, accelerator)

    common.save_model(accelerator, model, args.output_dir)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(args.output_dir)
    tokens_per_second = (step - start_step) * plan.effective_batch_size * block_size / train_seconds if train_seconds else None
    record = common.run_record(
        accelerator, args, plan, steps=step, epochs=round(step / plan.steps_per_epoch, 2), train_loss=train_loss,
        **metrics, block_size=block_size, tokens_per_second=tokens_per_second, parameters=n_params,
        parameters_per_process=common.parameters_per_process(accelerator, model),
        mfu=common.mfu(accelerator, tokens_per_second, flops_per_token) if tokens_per_second else None, log_history=history)
    common.write_results(accelerator, args.output_dir, record)
    accelerator.end_training()


if __name__ == "__main__":
    main()
