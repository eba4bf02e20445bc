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
through DeepSpeed's zero_to_fp32. Also runs under zero2.yaml, DDP or FSDP, as a plain LM trainer.
"""

import os
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler, set_seed

import common
from common import RecipeError, logger
from common.text import (
    add_model_args,
    add_text_args,
    check_model_args,
    check_text_args,
    evaluate_causal_lm,
    lm_dataloaders,
    load_causal_lm,
)

RECIPE = "zero"  # checkpoints name the recipe that wrote them: a renamed copy still resumes them

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
    p = common.training_parser(__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    add_model_args(m)
    m.add_argument("--gradient_checkpointing", action="store_true")
    m.add_argument("--save_fp32", action="store_true", help="also export fp32 weights via DeepSpeed's zero_to_fp32")
    add_text_args(p)
    p.set_defaults(**HYPERPARAMETERS)
    args = p.parse_args(argv)
    check_model_args(p, args)
    check_text_args(p, args)
    return args


def build_model(args):
    """Called after make_accelerator: under ZeRO-3, transformers builds each layer straight into
    its shards (DeepSpeed's zero.Init), so a model larger than one device's memory can be created."""
    model, tokenizer = load_causal_lm(args, dtype=torch.float32, attn_implementation="sdpa")
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def memory_estimates(accelerator, model) -> dict:
    """DeepSpeed's own estimate of model-state memory (weights, gradients, Adam states; not
    activations) per GPU and per node's CPU, in GiB, for ZeRO-2 and ZeRO-3 with and without offload,
    for this run's processes spread over nodes as the launcher placed them; logged and returned."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as zero3
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as zero2

    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    where = {"num_gpus_per_node": per_node, "num_nodes": max(1, accelerator.num_processes // per_node)}
    total = common.count_parameters(model)
    largest = max(sum(getattr(p, "ds_numel", p.numel()) for p in m.parameters(recurse=False)) for m in model.modules())
    cases = {
        "zero2": zero2(total, cpu_offload=False, **where),
        "zero2_offload_optimizer": zero2(total, cpu_offload=True, **where),
        "zero3": zero3(total, largest, cpu_offload=False, **where)[:2],
        "zero3_offload_optimizer": zero3(total, largest, cpu_offload=True, cpu_offload_params=False, **where)[:2],
        "zero3_offload_all": zero3(total, largest, cpu_offload=True, **where)[:2],
    }
    estimates = {
        **where,
        "parameters": total,
        "largest_layer_parameters": largest,
        **{name: {"gpu_gb": gpu / 2**30, "cpu_gb": cpu / 2**30} for name, (cpu, gpu) in cases.items()},
    }
    logger.info(
        f"DeepSpeed's model-state memory estimate for {estimates['parameters'] / 1e6:.1f}M parameters on "
        f"{estimates['num_nodes']} node(s) x {estimates['num_gpus_per_node']} device(s), activations not included:\n"
        + "\n".join(
            f"  {name:<24} {e['gpu_gb']:8.2f} GiB per device {e['cpu_gb']:8.2f} GiB CPU per node"
            for name, e in estimates.items()
            if isinstance(e, dict)
        )
    )
    return estimates


def build_optimizer(args, accelerator, model, plan, progress):
    """The DeepSpeed config's optimizer and scheduler when it defines them (Accelerate's Dummy*
    stand-ins), else AdamW, which Accelerate swaps for DeepSpeed's CPU Adam when offloading."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config if accelerator.state.deepspeed_plugin else {}
    groups = common.decay_groups(model, args.weight_decay)
    if "optimizer" in ds_config:
        optimizer = DummyOptim(groups, lr=plan.learning_rate)
    else:
        optimizer = torch.optim.AdamW(groups, lr=plan.learning_rate, fused=accelerator.device.type == "cuda")
    if "scheduler" in ds_config:
        return optimizer, DummyScheduler(
            optimizer, total_num_steps=plan.max_train_steps, warmup_num_steps=plan.warmup_steps
        )
    return optimizer, common.make_scheduler(optimizer, args.lr_scheduler_type, plan, progress)


def export_fp32(accelerator, model, output_dir):
    """fp32 weights from the ZeRO shards, through DeepSpeed's own zero_to_fp32 converter."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    if not hasattr(model, "save_checkpoint"):
        raise RecipeError("--save_fp32 needs a DeepSpeed config (zero2.yaml, zero3.yaml, zero3_offload.yaml)")
    shards, target = Path(output_dir) / ".tmp-zero-shards", Path(output_dir) / "fp32"
    model.save_checkpoint(str(shards))  # every rank writes its partition
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        convert_zero_checkpoint_to_fp32_state_dict(str(shards), str(target), safe_serialization=True)
        accelerator.unwrap_model(model).config.save_pretrained(target)
        shutil.rmtree(shards)
        logger.info(f"saved fp32 weights to {target}")
    accelerator.wait_for_everyone()


def main(argv=None):
    args = parse_args(argv)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=args.output_dir,
        step_scheduler_with_optimizer=False,  # stepped below, once per optimizer step
        kwargs_handlers=[common.process_group_kwargs(args.ddp_timeout)],
    )
    common.setup_logging(accelerator)
    common.check_launch(accelerator, args.gradient_accumulation_steps, args.max_grad_norm)
    set_seed(args.seed)
    resume_from = common.prepare_output_dir(accelerator, args)

    model, tokenizer = build_model(args)
    estimates = memory_estimates(accelerator, model)
    train_dl, eval_dl, block_size = lm_dataloaders(args, accelerator, tokenizer, model.config)
    plan, progress = common.plan_run(args, len(train_dl.dataset), accelerator.num_processes, resume_from)
    parameters = common.count_parameters(model)
    optimizer, scheduler = build_optimizer(args, accelerator, model, plan, progress)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, scheduler
    )
    checkpoints = common.Checkpoints(accelerator, args, plan, RECIPE)
    if resume_from:
        checkpoints.restore(resume_from, optimizer, scheduler)
    accelerator.init_trackers(RECIPE, config=common.tracker_config(args))
    stop = common.StopOnSignal(accelerator)
    log = common.TrainLog(accelerator, plan, progress, args.logging_steps)

    metrics = {}
    for epoch in range(progress.epoch, plan.num_epochs):
        if progress.step >= plan.max_train_steps:  # resumed from the last step
            break
        for window in common.accumulation_windows(train_dl, args.gradient_accumulation_steps, epoch, progress):
            tokens = common.window_tokens(accelerator, window)  # the step's loss is its mean over these
            for i, batch in enumerate(window):
                with common.micro_batch(accelerator, model, last=i == len(window) - 1):
                    loss = model(input_ids=batch["input_ids"], labels=batch["labels"], num_items_in_batch=tokens).loss
                    # DeepSpeed divides by the accumulation steps and averages over processes; the loss
                    # is already this micro-batch's share of the step's mean: undo both. At the window's
                    # end DeepSpeed also clips and steps, inside backward
                    accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                log.add(loss * tokens, common.target_tokens(batch["labels"]))
            if args.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            progress.step += 1
            log.step(progress, window, scheduler.get_last_lr()[0])
            if checkpoints.due(progress.step):
                checkpoints.save(progress, log, model)
            if stop.requested():  # on every process at the same step
                raise common.Preempted(stop.signal, progress.step, checkpoints.save(progress, log, model))
            if progress.step >= plan.max_train_steps:
                break
        last = progress.step >= plan.max_train_steps  # a stop during the final evaluation lets it finish
        metrics = evaluate_causal_lm(model, eval_dl, accelerator, None if last else stop)
        if metrics is None:
            raise common.Preempted(stop.signal, progress.step, checkpoints.save(progress, log, model), "evaluation")
        log.end_epoch(epoch, progress.step, metrics)
        if checkpoints.each_epoch:
            checkpoints.save(progress, log, model)
    if not metrics:  # resumed from the final checkpoint: nothing left to train
        metrics = evaluate_causal_lm(model, eval_dl, accelerator)

    log.check_finite(progress.step, model)
    common.save_model(accelerator, model, args.output_dir, tokenizer)
    if args.save_fp32:
        export_fp32(accelerator, model, args.output_dir)
    common.write_results(
        accelerator,
        args,
        plan,
        **log.summary(progress, tokens_per_sample=block_size),
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
