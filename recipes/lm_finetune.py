"""Causal-LM fine-tuning: any transformers causal LM on local or hub text, from one CPU to many GPUs.

    accelerate launch --config_file accelerate_configs/8gpu.yaml recipes/lm_finetune.py \\
        --model_name_or_path Qwen/Qwen2.5-0.5B --dataset_name wikitext --dataset_config_name wikitext-2-raw-v1
    accelerate launch --config_file accelerate_configs/zero3.yaml recipes/lm_finetune.py ...   # or zero2, fsdp
    ./launch.sh lm_finetune --model_name_or_path ./my-model --train_file data.jsonl --text_column text
    ./launch.sh lm_finetune --model_name_or_path ./my-model --train_file chats.jsonl --data_format chat --lora_r 16

Text is packed into --block_size blocks; in chat mode the `messages` column is rendered with the
tokenizer's chat template and only the assistant's tokens are trained on. The learning rate is
given for --reference_batch_size sequences and scaled to the effective batch. --help lists all.

Measured: a 2-layer Llama (76k parameters) on counting text, 2 CPU processes of a 2-core VM: eval
loss from 3.0 to under 1.0 in 24 steps; DDP, ZeRO-2 and ZeRO-3 give the same loss curve to 1e-4.
GPU throughput and MFU: not measured yet in this repository.
"""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from common import RecipeError
from common.text import add_text_args, evaluate_causal_lm, flops_per_token, lm_dataloaders


def parse_args(argv=None):
    p = common.training_parser(__doc__.split("\n")[0])
    m = p.add_argument_group("model")
    m.add_argument("--model_name_or_path", required=True, help="a hub id or a local folder")
    m.add_argument("--torch_dtype", choices=["auto", "bfloat16", "float16", "float32"], default="float32",
                   help="weights' dtype; keep float32 with a bf16 accelerate config for mixed precision")
    m.add_argument("--attn_implementation", default="sdpa", help="sdpa, flash_attention_2, eager")
    m.add_argument("--gradient_checkpointing", action="store_true")
    m.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")
    m.add_argument("--trust_remote_code", action="store_true", help="run the model repo's own code")
    m.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0 trains all weights")
    m.add_argument("--lora_alpha", type=int, default=32)
    m.add_argument("--lora_dropout", type=float, default=0.0)
    m.add_argument("--lora_target_modules", nargs="+", default=["all-linear"])
    add_text_args(p)
    p.set_defaults(output_dir="outputs/lm", learning_rate=2e-5, reference_batch_size=64, lr_scaling="sqrt",
                   warmup_ratio=0.03, max_grad_norm=1.0)
    return common.parse(p, argv)


def load_model_and_tokenizer(args):
    name = args.model_name_or_path
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().is_dir():
        raise RecipeError(f"--model_name_or_path {name}: no such folder; pass a saved model's folder or a hub id")
    dtype = args.torch_dtype if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype)
    try:  # after make_accelerator: under ZeRO-3 the weights load straight into their shards
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation=args.attn_implementation,
                                                     trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as err:  # not found on the hub, no network, not a model folder
        raise RecipeError(f"--model_name_or_path {name}: {str(err).splitlines()[0]}") from err
    if tokenizer.pad_token is None:  # packed blocks need no padding, but collators and generation do
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def build_model(args, model):
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if args.lora_r:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as err:
            raise RecipeError("--lora_r needs peft: pip install -e '.[lora]'") from err
        targets = "all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                                 target_modules=targets, task_type="CAUSAL_LM"))
        if args.gradient_checkpointing:
            model.enable_input_require_grads()
    if args.torch_compile:  # in place, so state-dict names, checkpoints and save_pretrained stay unchanged
        model.compile()
    return model


@common.run
def main(argv=None):
    args = parse_args(argv)
    accelerator = common.make_accelerator(
        seed=args.seed, gradient_accumulation_steps=args.gradient_accumulation_steps, ddp_timeout=args.ddp_timeout,
        report_to=args.report_to, project_dir=args.output_dir, max_grad_norm=args.max_grad_norm)
    resume_from = common.prepare_output_dir(accelerator, args)

    model, tokenizer = load_model_and_tokenizer(args)
    train_dl, eval_dl, block_size = lm_dataloaders(args, accelerator, tokenizer, model.config)
    plan = common.plan_from_args(args, len(train_dl), accelerator.num_processes)

    model = build_model(args, model)
    parameters = common.count_parameters(model)
    flops = flops_per_token(model, block_size, parameters)
    optimizer = torch.optim.AdamW(common.decay_groups(model, args.weight_decay), lr=plan.learning_rate,
                                  fused=accelerator.device.type == "cuda")
    scheduler = common.make_scheduler(optimizer, args.lr_scheduler_type, plan)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)

    loop = common.TrainLoop(accelerator, args, plan, train_dl, scheduler)
    loop.resume(resume_from)
    accelerator.init_trackers("lm_finetune", config=common.tracker_config(args))
    metrics = {}
    for _ in loop.epochs():
        for batch in loop.batches():
            with accelerator.accumulate(model):
                loss = model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
                accelerator.backward(loss)
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
    summary = loop.finish(tokens_per_sample=block_size)
    record = common.run_record(
        accelerator, args, plan, **summary, **metrics, block_size=block_size, parameters=parameters,
        parameters_per_process=common.parameters_per_process(accelerator, model),
        mfu=common.mfu(accelerator, summary["steady_tokens_per_second"], flops) if summary["steady_tokens_per_second"] else None)
    common.write_results(accelerator, args.output_dir, record)
    accelerator.end_training()


if __name__ == "__main__":
    main()
