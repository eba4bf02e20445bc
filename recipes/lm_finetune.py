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

from functools import partial

import torch
from accelerate.utils import set_seed

import common
from common import RecipeError
from common.lora import add_lora, peft_installed
from common.samples import add_sample_args, with_samples
from common.text import (
    add_lm_args,
    checkpoint_activations,
    evaluate_causal_lm,
    flops_per_token,
    lm_dataloaders,
    load_causal_lm,
    prepare_only,
    target_tokens,
    window_tokens,
)

# Hyperparameters: every default of this recipe, with its reason; each is the command-line flag of its name.
HYPERPARAMETERS = dict(
    per_device_train_batch_size=8,  # transformers' default: fits most models of a few billion parameters at 1024
    per_device_eval_batch_size=8,
    gradient_accumulation_steps=1,
    learning_rate=2e-5,  # fine-tuning pretrained weights with AdamW: 1e-5 to 5e-5 keeps what they know ...
    reference_batch_size=64,  # ... at 64 sequences a step; scaled from there to the effective batch
    lr_scaling="sqrt",  # Adam's rate grows with the square root of the batch (Malladi et al., 2022)
    lr_scheduler_type="cosine",
    warmup_ratio=0.03,  # the first steps' updates, from moments not yet estimated, are kept small
    weight_decay=0.0,  # transformers' default for fine-tuning
    max_grad_norm=1.0,  # transformers' default: one bad batch cannot wreck pretrained weights
    num_train_epochs=3,  # transformers' default
    lora_r=0,  # 0: all weights train; 8 to 64 trains a LoRA adapter instead
    lora_alpha=32,  # the adapter's scale is lora_alpha / lora_r
    lora_dropout=0.0,
    lora_target_modules=["all-linear"],  # every linear layer but the output head (peft's QLoRA setting)
    output_dir="outputs/lm",
    logging_steps=10,
)


def parse_args(argv=None):
    p = common.training_parser("lm_finetune", __doc__)
    m = add_lm_args(p)  # --model_name_or_path or --config_name, --tokenizer_name, ...; the data arguments
    add_sample_args(p)  # --sample_prompts, --max_new_tokens: greedy generations at each evaluation
    m.add_argument(
        "--torch_dtype",
        choices=["auto", "bfloat16", "float16", "float32"],
        default="float32",
        help="weights' dtype; keep float32 with a bf16 accelerate config for mixed precision",
    )
    m.add_argument(
        "--attn_implementation",
        help="sdpa, flash_attention_2, eager, ... (default: transformers', sdpa where the model has it)",
    )
    m.add_argument("--gradient_checkpointing", action="store_true")
    m.add_argument("--torch_compile", action="store_true", help="compile the model with torch.compile (inductor)")
    m.add_argument("--lora_r", type="non_negative_int", help="LoRA rank; 0 trains all weights")
    m.add_argument("--lora_alpha", type="positive_int")
    m.add_argument("--lora_dropout", type="fraction_below_one")
    m.add_argument(
        "--lora_target_modules",
        nargs="+",
        help="names of the model's linear layers (q_proj v_proj, or q_proj,v_proj), or all-linear",
    )
    p.set_defaults(**HYPERPARAMETERS)
    p.does_nothing_unless(
        ["--lora_alpha", "--lora_dropout", "--lora_target_modules"], lambda a: a.lora_r,
        "without --lora_r (the whole model trains)", ", or pass --lora_r 16 (8 to 64 is usual)",
    )  # fmt: skip
    p.excludes("--torch_dtype auto", "--config_name", "--torch_dtype auto is the dtype of pretrained weights, and "
               "--config_name has none: pass float32 (with a bf16 accelerate config for mixed precision), bfloat16 or "
               "float16")  # fmt: skip
    p.requires("--lora_r", peft_installed, "--lora_r needs peft: pip install -e '.[lora]'")
    p.excludes("--lora_r", "--config_name", "--lora_r trains an adapter on pretrained weights, and --config_name "
               "makes a new, random model: pass --model_name_or_path, or drop --lora_r")  # fmt: skip
    p.excludes("--resize_token_embeddings", "--lora_r", "--resize_token_embeddings adds embeddings that a LoRA "
               "adapter neither trains nor saves: drop --lora_r, or use the model's own tokenizer without "
               "--resize_token_embeddings")  # fmt: skip
    args = p.parse_args(argv)  # and the checks of common.text's arguments
    args.lora_target_modules = [name for names in args.lora_target_modules for name in names.split(",") if name]
    return args


def load_model_and_tokenizer(args):
    dtype = args.torch_dtype if args.torch_dtype == "auto" else getattr(torch, args.torch_dtype)
    return load_causal_lm(args, dtype=dtype, attn_implementation=args.attn_implementation)


def build_model(args, model):
    if args.gradient_checkpointing:
        checkpoint_activations(model)
    if args.lora_r:  # a LoRA adapter trains instead of the weights (peft)
        model = add_lora(model, args)
    if args.torch_compile:  # in place, so state-dict names, checkpoints and save_pretrained stay unchanged
        model.compile()
    return model


def main(argv=None):
    args = parse_args(argv)
    accelerator = common.make_accelerator(args)  # refuses a launch that would not train as one job
    deepspeed = accelerator.state.deepspeed_plugin.deepspeed_config if accelerator.state.deepspeed_plugin else {}
    if {"optimizer", "scheduler"} & set(deepspeed):  # else DeepSpeed's refusal, or the scheduler silently unused
        raise RecipeError(
            "the DeepSpeed config defines an optimizer or scheduler, and this recipe trains with its own AdamW and "
            "schedule; remove them from the config, or use recipes/zero.py, which takes them"
        )
    set_seed(args.seed)
    prepare_only(args, accelerator)  # --prepare_only: the data prepared, one `done:` line, exit 0; nothing else
    out = common.OutputDir(accelerator, args)  # claimed for this run; out.resume_from: a checkpoint or None

    model, tokenizer = load_model_and_tokenizer(args)  # after the Accelerator: under ZeRO-3 straight into shards
    train_dl, eval_dl, block_size = lm_dataloaders(args, accelerator, tokenizer, model.config)
    plan, position = common.plan_run(args, train_dl.dataset, common.data_parallel_size(accelerator), out.resume_from)

    model = build_model(args, model)
    parameters = common.count_parameters(model)
    flops = flops_per_token(model, block_size, parameters)
    optimizer = torch.optim.AdamW(
        common.decay_groups(model, args.weight_decay),
        lr=plan.learning_rate,
        fused=True,  # one kernel: CUDA and CPU
    )
    model, optimizer, train_dl, eval_dl = accelerator.prepare(model, optimizer, train_dl, eval_dl)
    if out.resume_from:
        out.load_checkpoint(model, optimizer)
    held_out = partial(evaluate_causal_lm, model, eval_dl, accelerator)
    held_out = with_samples(held_out, out, model, tokenizer, position)  # then greedy samples into samples.jsonl
    loop = common.TrainingLoop(accelerator, args, plan, position, out, model, evaluate=held_out)
    model.train()  # from_pretrained returns eval mode: dropout and gradient checkpointing would be off

    for step in loop.steps(train_dl, optimizer):  # the rate, the position, the log, stops, checkpoints, evaluations
        tokens = window_tokens(accelerator, step.batches)  # the step's target tokens on every process
        for batch in step.micro_batches():  # gradients reduced after the last one only
            loss = model(input_ids=batch["input_ids"], labels=batch["labels"], num_items_in_batch=tokens).loss
            # the loss is its share of the step's mean over `tokens`, whatever the split into processes
            step.backward(loss, items=target_tokens(batch["labels"]), of=tokens)
        if args.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        model.zero_grad()  # not optimizer.zero_grad: Accelerate's reads its signature at every step (45 us)
    metrics = loop.finish()  # the final evaluation; the loss and weights checked finite

    out.save_model(model, tokenizer)
    summary = loop.summary(tokens_per_sample=block_size)
    out.write_results(
        plan,
        **summary,
        **metrics,
        block_size=block_size,
        parameters=parameters,
        parameters_per_process=common.parameters_per_process(accelerator, model),
        mfu=common.mfu(accelerator, summary["steady_tokens_per_second"], flops),
    )
    accelerator.end_training()


if __name__ == "__main__":
    with common.exit_codes():  # a mistake of the user's: one error line, exit 2; a stop on a signal: exit 75
        main()
