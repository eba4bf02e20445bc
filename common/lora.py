"""A LoRA adapter on a causal LM (peft), from the recipes' --lora_* options: the adapter's layers named, checked
against the model's, and refused in one line where peft would fail in a traceback or train an adapter larger than its
layers."""

from __future__ import annotations

import importlib.util

import torch

from .errors import RecipeError


def peft_installed(args=None) -> bool:
    """Whether peft, which --lora_r trains an adapter with, is installed: asked when the arguments are parsed."""
    return importlib.util.find_spec("peft") is not None


def add_lora(model, args):
    """`model` with a LoRA adapter of rank --lora_r on --lora_target_modules (or all-linear: every linear layer but
    the output head); with --gradient_checkpointing, the inputs' gradients enabled (the frozen embeddings give none,
    and checkpointed layers would then have none to recompute from)."""
    from peft import LoraConfig, get_peft_model  # installed: the parse refused --lora_r without it (peft_installed)

    targets = "all-linear" if args.lora_target_modules == ["all-linear"] else args.lora_target_modules
    linear = _linear_layer_names(model)  # before peft adds its own
    try:
        model = get_peft_model(
            model,
            LoraConfig(
                r=args.lora_r,
                lora_alpha=args.lora_alpha,
                lora_dropout=args.lora_dropout,
                target_modules=targets,
                task_type="CAUSAL_LM",
            ),
        )
    except ValueError as err:  # no module of those names, or one LoRA cannot wrap
        raise _targets_not_found(err, linear, args) from err
    from peft.tuners.lora import LoraLayer

    a, b = min(((m.in_features, m.out_features) for m in model.modules() if isinstance(m, LoraLayer)), key=min)
    rank = min(a, b)
    if args.lora_r > rank:  # a rank above the layer's own adds weights and nothing else
        raise RecipeError(
            f"--lora_r {args.lora_r} is above the rank of the smallest adapted layer ({a} x {b}), so the adapter "
            f"would hold more weights than it can use; pass --lora_r {rank} or less (8 to 64 is usual)",
            subject="--lora_r",
        )
    if args.gradient_checkpointing:
        model.enable_input_require_grads()
    return model


def _linear_layer_names(model) -> list:
    """The names LoRA can target: of each linear layer but the output head (all-linear leaves it out: it is tied to
    the embeddings in many models)."""
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    head, kinds = model.get_output_embeddings(), (torch.nn.Linear, Conv1D)
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, kinds) and m is not head})


def _targets_not_found(err: ValueError, linear: list, args) -> RecipeError:
    """--lora_target_modules that peft could not adapt, with the model's `linear` layers to choose from."""
    found = (
        "no module of that name" if type(err).__name__ == "NoMatchingPeftModuleError" else "not a layer LoRA can wrap"
    )
    return RecipeError(
        f"--lora_target_modules {' '.join(args.lora_target_modules)}: {found} in {args.model_name_or_path}; name its "
        f"linear layers ({', '.join(linear)}) or pass all-linear",
        subject="--lora_target_modules",
    )
