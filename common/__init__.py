"""What every recipe shares: the Accelerator and its launch checks, data loading defaults, batch
and learning-rate arithmetic, checkpoints, and the results record. Nothing recipe-specific."""

from .args import parse, training_parser
from .checkpoint import (checkpoint_damage, complete_checkpoints, load_checkpoint, prepare_output_dir, resolve_checkpoint,
                         save_checkpoint, save_model, write_json)
from .loop import TrainLoop
from .data import (DeviceTensorDataset, SeededTransform, default_num_workers, make_dataloader, prepare_data_first,
                   seeded_uniform, set_epoch)
from .metrics import (count_parameters, mfu, parameters_per_process, peak_memory_gb, public_args, run_record,
                      tracker_config, write_results, zero_memory_estimates)
from .preemption import PREEMPTED_EXIT_CODE, Preempted
from .runtime import DataError, RecipeError, check_process_group, library_versions, logger, make_accelerator, run
from .scaling import (LR_SCALING_RULES, TrainingPlan, decay_groups, effective_batch_size, make_scheduler,
                      plan_from_args, plan_training, scale_lr)

__all__ = [
    "LR_SCALING_RULES",
    "PREEMPTED_EXIT_CODE",
    "DataError",
    "Preempted",
    "checkpoint_damage",
    "complete_checkpoints",
    "prepare_output_dir",
    "public_args",
    "tracker_config",
    "DeviceTensorDataset",
    "RecipeError",
    "SeededTransform",
    "TrainLoop",
    "TrainingPlan",
    "check_process_group",
    "count_parameters",
    "decay_groups",
    "default_num_workers",
    "effective_batch_size",
    "library_versions",
    "load_checkpoint",
    "logger",
    "make_accelerator",
    "make_dataloader",
    "make_scheduler",
    "mfu",
    "parameters_per_process",
    "parse",
    "peak_memory_gb",
    "plan_from_args",
    "plan_training",
    "prepare_data_first",
    "resolve_checkpoint",
    "run",
    "run_record",
    "save_checkpoint",
    "save_model",
    "scale_lr",
    "seeded_uniform",
    "set_epoch",
    "training_parser",
    "write_json",
    "write_results",
    "zero_memory_estimates",
]
