"""What the recipes share, a module per concern: launch checks (runtime), arguments (args), data
loading (data), LR scaling and the schedule (scaling), the training step's bookkeeping (training),
checkpoints (checkpoint), one run per output folder (outputs), stopping on a signal (preemption) and
the results record (metrics); images and image models in common.vision, text data and causal LMs in
common.text. Nothing recipe-specific. This is what the recipes import; tests import what they test
from the submodules."""

from .args import training_parser
from .checkpoint import save_model
from .data import DeviceTensorDataset, SeededTransform, make_dataloader, prepare_data_first
from .metrics import count_parameters, mfu, parameters_per_process, tracker_config, write_results
from .outputs import prepare_output_dir
from .preemption import Preempted, StopOnSignal
from .runtime import DataError, RecipeError, check_launch, exit_codes, logger, process_group_kwargs, setup_logging
from .scaling import decay_groups, make_scheduler
from .training import Checkpoints, TrainLog, accumulation_windows, micro_batch, plan_run, target_tokens, window_tokens

__all__ = [
    "Checkpoints",
    "DataError",
    "DeviceTensorDataset",
    "Preempted",
    "RecipeError",
    "SeededTransform",
    "StopOnSignal",
    "TrainLog",
    "accumulation_windows",
    "check_launch",
    "count_parameters",
    "decay_groups",
    "exit_codes",
    "logger",
    "make_dataloader",
    "make_scheduler",
    "mfu",
    "micro_batch",
    "parameters_per_process",
    "plan_run",
    "prepare_data_first",
    "prepare_output_dir",
    "process_group_kwargs",
    "save_model",
    "setup_logging",
    "target_tokens",
    "tracker_config",
    "training_parser",
    "window_tokens",
    "write_results",
]
