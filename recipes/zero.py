"""Train a causal LM that does not fit in one GPU's memory: DeepSpeed ZeRO-3, optionally offloaded.

    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/zero.py \\
        --config_name meta-llama/Llama-3.2-1B --config_overrides hidden_size=4096,num_hidden_layers=32 --train_file data.jsonl
    accelerate launch --config_file accelerate_configs/zero3_offload.yaml recipes/zero.py \\
        --model_name_or_path Qwen/Qwen2.5-7B --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1 --save_fp32

The Accelerator (and with it DeepSpeed's ZeRO-3 context) exists before the model, so the model is
built or loaded already partitioned: no process ever holds all of it. Before training, DeepSpeed's
memory estimate for ZeRO-2 and ZeRO-3, with and without offload, is printed for this model and
world size; results.json records it beside the measured peak memory of every process. The final
model is saved gathered in 16-bit (loads with from_pretrained); --save_fp32 adds an fp32 export
through DeepSpeed's zero_to_fp32. Also runs under zero2.yaml, DDP or FSDP, as a plain LM trainer.
"""

import shutil
from pathlib import Path

import torch
from accelerate.utils import DummyOptim, DummyScheduler
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM

import common
from common import RecipeError, logger
from common.args import nonempty
from common.text import (MODEL_LOAD_ERRORS, add_text_args, apply_config_overrides, check_model_folder, check_text_args,
                         config_overrides, evaluate_causal_lm, lm_dataloaders, load_tokenizer, model_load_error)


def parse_args(argv=None):
    p = common.training_parser(__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model_name_or_path", type=nonempty, help="pretrained weights: a hub id or a local folder")
    m.add_argument("--config_name", type=nonempty,
                   help="or train from scratch: the config of a hub id or local folder")
    m.add_argument("--config_overrides", type=config_overrides,
                   help="with --config_name: e.g. hidden_size=4096,num_hidden_layers=32")
    m.add_argument("--tokenizer_name", type=nonempty, help="default: --model_name_or_path or --config_name")
    m.add_argument("--gradient_checkpointing", action="store_true")
    m.add_argument("--save_fp32", action="store_true", help="also export fp32 weights via DeepSpeed's zero_to_fp32")
    add_text_args(p)
    p.set_defaults(output_dir="outputs/zero", learning_rate=1e-4, reference_batch_size=64, lr_scaling="sqrt",
                   warmup_ratio=0.03, max_grad_norm=1.0)
    args = common.parse(p, argv)
    if bool(args.model_name_or_path) == bool(args.config_name):
        p.error("pass --model_name_or_path (pretrained) or --config_name (from scratch), one of them")
    if args.config_overrides and not args.config_name:
        p.error("--config_overrides changes the config of --config_name (from scratch), not pretrained weights; "
                "pass --config_name instead of --model_name_or_path, or drop the overrides")
    check_text_args(p, args)
    return args


def build_model(args):
    """Called after make_accelerator: under ZeRO-3, transformers builds each layer straight into
    its shards (DeepSpeed's zero.Init), so a model larger than one device's memory can be created."""
    flag, source = ("--model_name_or_path", args.model_name_or_path) if args.model_name_or_path else \
        ("--config_name", args.config_name)
    check_model_folder(flag, source)
    if args.tokenizer_name:
        check_model_folder("--tokenizer_name", args.tokenizer_name, config=False)
        tokenizer = load_tokenizer("--tokenizer_name", args.tokenizer_name)
    else:
        tokenizer = load_tokenizer(flag, source)
    try:
        if args.model_name_or_path:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="sdpa")
        else:
            config = AutoConfig.from_pretrained(source)
            if args.config_overrides:
                config = apply_config_overrides(config, args.config_overrides, source)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except (*MODEL_LOAD_ERRORS, SafetensorError) as err:  # not found, offline, damaged weights, a foreign folder
        raise model_load_error(flag, source, err) from err
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, tokenizer


def log_memory_estimates(accelerator, model) -> dict:
    estimates = common.zero_memory_estimates(model, accelerator.num_processes)
    logger.info(f"DeepSpeed's model-state memory estimate for {estimates['parameters'] / 1e6:.1f}M parameters on "
                f"{estimates['num_nodes']} node(s) x {estimates['num_gpus_per_node']} device(s), activations not included:\n"
                + "\n".join(f"  {name:<24} {e['gpu_gb']:8.2f} GiB per device {e['cpu_gb']:8.2f} GiB CPU per node"
                             for name, e in estimates.items() if isinstance(e, dict)))
    return estimates


def build_optimizer(args, accelerator, model, plan):
    """The DeepSpeed config's optimizer and scheduler when it defines them (Accelerate's Dummy*
    stand-ins), else AdamW, which Accelerate swaps for DeepSpeed's CPU Adam when offloading."""
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config if accelerator.state.deepspeed_plugin else {}
    groups = common.decay_groups(model, args.weight_decay)
    if "optimizer" in ds_config:
        optimizer = DummyOptim(groups, lr=plan.learning_rate)
    else:
        optimizer = torch.optim.AdamW(groups, lr=plan.learning_rate, fused=accelerator.device.type == "cuda")
    if "scheduler" in ds_config:
        return optimizer, DummyScheduler(optimizer, total_num_steps=plan.max_train_steps, warmup_num_steps=plan.warmup_steps)
    return optimizer, common.make_scheduler(optimizer, args.lr_scheduler_type, plan)


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


@common.run
def main(argv=None):
    args = parse_args(argv)
    accelerator = common.make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps, ddp_timeout=args.ddp_timeout,
        report_to=args.report_to, project_dir=args.output_dir, max_grad_norm=args.max_grad_norm)
    resume_from = common.prepare_output_dir(accelerator, args)

    model, tokenizer = build_model(args)
    estimates = log_memory_estimates(accelerator, model)
    train_dl, eval_dl, block_size = lm_dataloaders(args, accelerator, tokenizer, model.config)
    plan = common.plan_from_args(args, len(train_dl), accelerator.num_processes)
    parameters = common.count_parameters(model)
    optimizer, scheduler = build_optimizer(args, accelerator, model, plan)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    loop = common.TrainLoop(accelerator, args, plan, train_dl, scheduler)
    loop.resume(resume_from)
    accelerator.init_trackers("zero", config=common.tracker_config(args))
    metrics = {}
    for _ in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)  # under DeepSpeed this also clips and steps at the boundary
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if loop.end_of_batch(loss):
                break
        metrics = evaluate_causal_lm(model, eval_dl, accelerator)
        loop.end_epoch(metrics)
    if not metrics:  # resumed from the final checkpoint: nothing left to train
        metrics = evaluate_causal_lm(model, eval_dl, accelerator)

    common.save_model(accelerator, model, args.output_dir, tokenizer)
    if args.save_fp32:
        export_fp32(accelerator, model, args.output_dir)
    record = common.run_record(
        accelerator, args, plan, **loop.finish(tokens_per_sample=block_size), **metrics, block_size=block_size,
        parameters=parameters, parameters_per_process=common.parameters_per_process(accelerator, model),
        memory_estimate=estimates)
    common.write_results(accelerator, args.output_dir, record)
    accelerator.end_training()


if __name__ == "__main__":
    main()
