"""What the recipes share, a module per concern: a refusal as data (errors), the launch and environment refusals
(preflight), the Accelerator and exit codes (runtime), arguments and their relations (args), data order and loading
(data), the run's plan and LR schedule (plan), the training loop's bookkeeping (loop), checkpoints (checkpoint), one
run per output folder (outputs), stopping on a signal (preemption), a stalled process named (watchdog), what a run
reports (metrics), its model card (card) and an LM's generations at each evaluation (samples); images and image
models in common.vision, text data and causal LMs in common.text, a LoRA adapter in common.lora. Nothing
recipe-specific. This is what the recipes import; tests import what they test from the submodules."""

import importlib

# Each name the recipes use, and the module it lives in. Imported on first use (PEP 562), so that
# `common.args` (argument parsing, credential masking) loads without torch: launch.sh and a mistyped
# flag are answered in milliseconds.
_WHERE = {
    "OutputDir": "outputs",
    "RecipeError": "errors",
    "SeededTransform": "data",
    "TrainingLoop": "loop",
    "count_parameters": "metrics",
    "data_parallel_size": "tensor_parallel",
    "decay_groups": "plan",
    "exit_codes": "runtime",
    "make_accelerator": "runtime",
    "make_dataloader": "data",
    "mfu": "metrics",
    "parameters_per_process": "metrics",
    "plan_run": "plan",
    "training_parser": "args",
}
__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
