#!/usr/bin/env bash
# Launch a recipe with the accelerate config that fits this host, and print the exact command.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIGS="$ROOT/accelerate_configs"

usage() {
  cat <<'USAGE'
Usage: ./launch.sh RECIPE [--config NAME] [--num_processes N] [--dry_run] [recipe arguments...]

Runs recipes/RECIPE.py under `accelerate launch`, choosing accelerate_configs/NAME.yaml from the
GPUs this host sees: 1gpu, 2gpu, 4gpu, 8gpu (other counts use 2gpu.yaml with --num_processes N).
With no GPU it starts N CPU processes (default 2) that form one gloo group (cpu.yaml with
ACCELERATE_USE_CPU=true). Everything else is passed to the recipe: ./launch.sh cifar --help.

  --config NAME       use accelerate_configs/NAME.yaml
  --num_processes N   processes on this node (at most the GPUs visible, on a GPU host)
  --dry_run           print the command and exit
  MASTER_PORT=P       environment: rendezvous port, when 29500 is taken by another job

Examples:
  ./launch.sh cifar
  ./launch.sh cifar --config 4gpu --num_train_epochs 30
  ./launch.sh cifar --num_processes 1 --dataset imagefolder --train_dir data/train --val_dir data/val
USAGE
}

die() { echo "launch.sh: error: $*" >&2; exit 2; }

# `key: value` from a flat accelerate YAML (comments and quotes stripped).
yaml_get() { sed -n "s/^$1:[[:space:]]*//p" "$2" | sed "s/[[:space:]]*#.*//; s/['\"]//g" | head -n 1; }

# GPUs this process may use: nvidia-smi's count, narrowed by CUDA_VISIBLE_DEVICES when it is set.
count_gpus() {
  local total=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    total=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [[ -n "${CUDA_VISIBLE_DEVICES+set}" ]]; then
    local visible=0
    if [[ -n "$CUDA_VISIBLE_DEVICES" && "$CUDA_VISIBLE_DEVICES" != "-1" ]]; then
      visible=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
    fi
    (( visible < total )) && total=$visible
  fi
  echo "$total"
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; -*) die "the first argument is the recipe name (see --help)" ;; esac
recipe="$1"; shift
script="$ROOT/recipes/$recipe.py"
if [[ ! -f "$script" ]]; then
  available=$(cd "$ROOT/recipes" && ls -- *.py | sed 's/\.py$//' | tr '\n' ' ')
  die "unknown recipe '$recipe' (available: ${available% })"
fi

config="" num_processes="" dry_run=0 recipe_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config) [[ $# -ge 2 ]] || die "--config needs a name"; config="$2"; shift 2 ;;
    --config=*) config="${1#*=}"; shift ;;
    --num_processes) [[ $# -ge 2 ]] || die "--num_processes needs a number"; num_processes="$2"; shift 2 ;;
    --num_processes=*) num_processes="${1#*=}"; shift ;;
    --dry_run) dry_run=1; shift ;;
    *) recipe_args+=("$1"); shift ;;
  esac
done
if [[ -n "$num_processes" && ! "$num_processes" =~ ^[1-9][0-9]*$ ]]; then
  die "--num_processes must be a positive integer, got '$num_processes'"
fi

gpus=$(count_gpus)
if [[ -z "$config" ]]; then
  if (( gpus == 0 )); then
    config=cpu
  elif [[ -f "$CONFIGS/${gpus}gpu.yaml" ]]; then
    config="${gpus}gpu"
  else
    config=2gpu; num_processes="${num_processes:-$gpus}"
  fi
fi
config_file="$CONFIGS/$config.yaml"
if [[ ! -f "$config_file" ]]; then
  available=$(cd "$CONFIGS" && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')
  die "unknown config '$config' (available: ${available% })"
fi

env_prefix=()
if [[ "$(yaml_get use_cpu "$config_file")" == "true" ]]; then
  # Without this variable a GPU-less launch trains N unsynchronised copies (see common/runtime.py).
  env_prefix=(ACCELERATE_USE_CPU=true)
else
  machines=$(yaml_get num_machines "$config_file"); machines=${machines:-1}
  wanted=${num_processes:-$(yaml_get num_processes "$config_file")}
  per_node=$(( ${wanted:-1} / machines ))
  if (( per_node > gpus )); then
    if (( gpus == 0 )); then
      die "config '$config' needs $per_node GPU(s) on this node but none is visible; use --config cpu to run on CPU"
    fi
    die "$per_node processes requested on this node but only $gpus GPU(s) are visible; pass --num_processes $gpus or a config for $gpus GPU(s)"
  fi
fi

accelerate_bin=$(command -v accelerate || true)
if [[ -z "$accelerate_bin" && -x "$ROOT/.venv/bin/accelerate" ]]; then
  accelerate_bin="$ROOT/.venv/bin/accelerate"
fi
[[ -n "$accelerate_bin" ]] || die "accelerate not found: activate the environment (. .venv/bin/activate) or pip install -e ."

cmd=("$accelerate_bin" launch --config_file "$config_file")
[[ -n "$num_processes" ]] && cmd+=(--num_processes "$num_processes")
[[ -n "${MASTER_PORT:-}" ]] && cmd+=(--main_process_port "$MASTER_PORT")
cmd+=("$script" ${recipe_args[@]+"${recipe_args[@]}"})

echo "+ ${env_prefix[*]:+${env_prefix[*]} }$(printf '%q ' "${cmd[@]}")" >&2
(( dry_run )) && exit 0
exec env ${env_prefix[@]+"${env_prefix[@]}"} "${cmd[@]}"
