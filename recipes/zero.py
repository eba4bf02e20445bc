"""Train a causal LM that does not fit in one GPU's memory: DeepSpeed ZeRO-3, optionally offloaded.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/zero.py \\
        --config_name meta-llama/Llama-3.2-1B --config_overrides hidden_size=4096,num_hidden_layers=32 \\
        --train_file data.jsonl
    accelerate launch --config_file accelerate_configs/zero3_offload.yaml recipes/zero.py \\
        --model_name_or_path Qwen/Qwen2.5-7B --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 \\
        --save_fp32

The Accelerator (and with it DeepSpeed's ZeRO-3 context) exists before the model, so the model is
built or loaded already partitioned: no process ever holds all of it. Before training, DeepSpeed's
memory estimate for ZeRO-2 and ZeRO-3, with and without offload, is printed for this model and
world size; results.json records it beside the measured peak memory of every process. The final
model is saved gathered in 16-bit (loads with from_pretrained); --save_fp32 adds an fp32 export
through DeepSpeed's zero_to_fp32. Also runs under zero2.yaml, DDP, FSDP, HSDP or tp.yaml (TP loads
--model_name_or_path split), as a plain LM trainer.
"""

import contextlib
import json
import os
from functools import partial
from pathlib import Path

import torch
from accelerate.utils import parse_flag_from_env, set_seed

import common
from common.checkpoint import export_fp32
from common.metrics import memory_estimates
from common.runtime import agree_deepspeed_optimizer
from common.samples import add_sample_args, with_samples
from common.text import (
    add_lm_args,
    checkpoint_activations,
    evaluate_causal_lm,
    lm_dataloaders,
    load_causal_lm,
    prepare_only,
    target_tokens,
    window_tokens,
)

# Hyperparameters: every default of this recipe, with its reason; each is the command-line flag of its name.
HYPERPARAMETERS = dict(
    per_device_train_batch_size=8,  # transformers' default; under ZeRO the weights leave room for activations
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=1,
    learning_rate=1e-4,  # AdamW for a model that is large or trained from a config: higher than fine-tuning's ...
    reference_batch_size=64,  # ... at 64 sequences a step; scaled from there to the effective batch
    lr_scaling="sqrt",  # Adam's rate grows with the square root of the batch (Malladi et al., 2022)
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,  # the first steps' updates, from moments not yet estimated, are kept small
    weight_decay=0.0,  # transformers' default
    max_grad_norm=1.0,  # transformers' default; DeepSpeed clips with it
    num_train_epochs=3,  # transformers' default
    output_dir="outputs/zero",
    logging_steps=10,
)


def parse_args(argv=None):
    p = common.training_parser("zero", __doc__)
    m = add_lm_args(p)  # --model_name_or_path or --config_name, --tokenizer_name, ...; the data arguments
    add_sample_args(p)  # --sample_prompts, --max_new_tokens: greedy generations at each evaluation
    m.add_argument("--gradient_checkpointing", action="store_true")
    m.add_argument("--save_fp32", action="store_true", help="also export fp32 weights via DeepSpeed's zero_to_fp32")
    p.set_defaults(**HYPERPARAMETERS)
    p.does_nothing_unless(["--lr_scheduler_type"], lambda a: "scheduler" not in deepspeed_config_file(),
                          "with a DeepSpeed config that defines its scheduler (it sets every step's rate)",
                          ", or delete the config's scheduler")  # fmt: skip
    p.requires("--save_fp32", lambda a: parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"), "--save_fp32 exports "
               "DeepSpeed's ZeRO shards: run with a DeepSpeed config (zero2, zero3, zero3_offload)")  # fmt: skip
    return p.parse_args(argv)  # and the checks of common.text's arguments


def deepspeed_config_file() -> dict:
    """The DeepSpeed config file accelerate launch names (ACCELERATE_DEEPSPEED_CONFIG_FILE), or {}."""
    with contextlib.suppress(KeyError, OSError, ValueError):  # a file DeepSpeed reads later says its error there
        return json.loads(Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())
    return {}


def build_model(args):
    """Called after make_accelerator: under ZeRO-3, transformers builds each layer straight into
    its shards (DeepSpeed's zero.Init), so a model larger than one device's memory can be created."""
    model, tokenizer = load_causal_lm(args, dtype=torch.float32)  # attention: transformers' choice, sdpa where it can
    if args.gradient_checkpointing:
        checkpoint_activations(model)
    return model, tokenizer


def build_optimizer(args, accelerator, model, plan, position):
    """The DeepSpeed config's optimizer and scheduler when it defines them (Accelerate's Dummy*
    stand-ins), else AdamW, which Accelerate swaps for DeepSpeed's CPU Adam when offloading, and no
    scheduler: the recipe sets the learning rate of every step itself."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config if accelerator.state.deepspeed_plugin else {}
    groups = common.decay_groups(model, args.weight_decay)
    agree_deepspeed_optimizer(ds_config, args, plan, position)  # its settings the plan's, or one line
    if "optimizer" in ds_config:  # (Accelerate has the stand-ins only where DeepSpeed is installed)
        from accelerate.utils import DummyOptim

        optimizer = DummyOptim(groups, lr=plan.learning_rate)
    else:
        optimizer = torch.optim.AdamW(groups, lr=plan.learning_rate, fused=True)  # one kernel: CUDA and CPU
    if "scheduler" in ds_config:
        from accelerate.utils import DummyScheduler

        return optimizer, DummyScheduler(optimizer, plan.max_train_steps, max(plan.warmup_steps, 1))
    return optimizer, None


def main(argv=None):
    args = parse_args(argv)
    accelerator = common.make_accelerator(args)  # refuses a launch that would not train as one job
    set_seed(args.seed)
    prepare_only(args, accelerator)  # --prepare_only: the data prepared, one `done:` line, exit 0; nothing else
    out = common.OutputDir(accelerator, args)  # claimed for this run; out.resume_from: a checkpoint or None

    model, tokenizer = build_model(args)
    estimates = memory_estimates(accelerator, model)  # DeepSpeed's, for ZeRO-2 and 3, logged and in results.json
    train_dl, eval_dl, block_size = lm_dataloaders(args, accelerator, tokenizer, model.config)
    plan, position = common.plan_run(args, train_dl.dataset, common.data_parallel_size(accelerator), out.resume_from)
    parameters = common.count_parameters(model)
    optimizer, ds_scheduler = build_optimizer(args, accelerator, model, plan, position)
    model, optimizer, train_dl, eval_dl, ds_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, ds_scheduler
    )
    if out.resume_from:
        out.load_checkpoint(model, optimizer)
    held_out = partial(evaluate_causal_lm, model, eval_dl, accelerator)
    held_out = with_samples(held_out, out, model, tokenizer, position)  # then greedy samples into samples.jsonl
    loop = common.TrainingLoop(accelerator, args, plan, position, out, model, evaluate=held_out)
    model.train()  # from_pretrained returns eval mode: dropout and gradient checkpointing would be off

    for step in loop.steps(train_dl, optimizer, ds_scheduler):  # ds_scheduler: a DeepSpeed config's own, or None
        tokens = window_tokens(accelerator, step.batches)  # the step's target tokens on every process
        for batch in step.micro_batches():  # gradients reduced after the last one only
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"], num_items_in_batch=tokens).loss
            # the loss is its share of the step's mean over `tokens`; at the window's end DeepSpeed clips and
            # steps inside backward
            step.backward(loss, items=target_tokens(batch["labels"]), of=tokens)
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        model.zero_grad()  # not optimizer.zero_grad: Accelerate's reads its signature at every step (45 us)
    metrics = loop.finish()  # the final evaluation; the loss and weights checked finite

    out.save_model(model, tokenizer)
    if args.save_fp32:
        export_fp32(accelerator, model, args.output_dir)
        out.record_written("fp32")  # --overwrite_output_dir and the next save remove it
    out.write_results(
        plan,
        **loop.summary(tokens_per_sample=block_size),
        **metrics,
        block_size=block_size,
        parameters=parameters,
        parameters_per_process=common.parameters_per_process(accelerator, model),
        memory_estimate=estimates,
    )
    accelerator.end_training()


if __name__ == "__main__":
    with common.exit_codes():  # a mistake of the user's: one error line, exit 2; a stop on a signal: exit 75
        main()
