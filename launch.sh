#!/usr/bin/env bash
# Launch a recipe with the accelerate config that fits this host, and print the exact command.
set -euo pipefail

# A stop signal before the launcher starts (the handler below takes over then): nothing has been
# started that could save anything; one line says so. bash runs a trap once the command in progress
# returns, and the Python helpers run by `quietly` do not take the signal themselves (a terminal's
# Ctrl-C reaches them too): none is cut off mid-answer or prints a traceback.
stopped_early() {
  local by="SIG$1" code=$(( 128 + $(kill -l "$1") ))
  [[ "$1" == INT ]] && by="Ctrl-C"
  echo "launch.sh: stopped by $by before the processes started; nothing was saved (exit $code)" >&2
  exit "$code"
}
for sig in TERM INT HUP USR1; do
  trap "stopped_early $sig" "$sig"
done
quietly() { ( trap '' TERM INT HUP USR1; exec "$@" ); }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CONFIGS="$ROOT/accelerate_configs"

usage() {
  cat <<'USAGE'
Usage: ./launch.sh RECIPE [--config NAME] [--num_processes N] [--dry_run] [recipe arguments...]
       ./launch.sh doctor [--config NAME] [--num_processes N] [--dry_run] [--timeout S]

Runs recipes/RECIPE.py under `accelerate launch`, choosing accelerate_configs/NAME.yaml from the
GPUs this host sees: 1gpu, 2gpu, 4gpu, 8gpu (other counts use 2gpu.yaml with --num_processes N).
With no GPU it starts N CPU processes (default 2) that form one gloo group (cpu.yaml with
ACCELERATE_USE_CPU=true); --config zero2, zero3 or zero3_offload then runs DeepSpeed on CPU (N
processes, default 2, fp32), and fsdp is refused (FSDP needs GPUs). Everything else is passed to
the recipe: ./launch.sh cifar --help. The recipe's exit code is launch.sh's: 2 after a mistake,
named on one `error:` line.

`doctor` prints this node's GPUs, versions, topology and memory, then launches the same processes
a recipe would get and times an all-reduce across them (scripts/doctor.py).

Under Slurm, run one launch.sh per node with srun (slurm/*.sbatch do): each reads the node count,
its node rank and the head node from the step's SLURM_* variables and adds --num_machines,
--machine_rank, --main_process_ip/--main_process_port and the total --num_processes (c10d
rendezvous); --num_processes then counts the processes of one node.

  --config NAME       use accelerate_configs/NAME.yaml
  --num_processes N   processes on this node (at most the GPUs visible, on a GPU host)
  --max_restarts N    restart the processes up to N times when one fails; they resume from the
                      newest checkpoint in --output_dir (pair it with --checkpointing_steps)
  --dry_run           print the command and exit
  MASTER_PORT=P       environment: rendezvous port, when 29500 is taken by another job
                      (under Slurm the default is 20000 + job id % 10000, the same on every node)
  MASTER_ADDR=HOST    environment, several nodes: the node with SLURM_NODEID 0, when the first
                      name in the node list is not an address the other nodes can reach
  RDZV_TIMEOUT=S      environment, several nodes: seconds to wait for the head node, and for every
                      node to join (default 60)
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT=S
                      environment: seconds the launcher gives the processes to save a checkpoint
                      and exit after SIGTERM before it kills them (default here 120; torch's is 30)

Stopping: SIGTERM or SIGUSR1, sent to launch.sh or to every process of the job (as Slurm does),
or Ctrl-C, makes the recipe finish its optimizer step, save checkpoint-<step> and exit; launch.sh
exits 75 (130 after a Ctrl-C before training started: nothing to save). If launch.sh or its
launcher is killed outright (kill -9), the processes get SIGTERM from Linux and stop the same way.
A process that dies (killed, out of memory) ends the others within TORCH_ELASTIC_SHUTDOWN_TIMEOUT
on its node and within the recipe's --ddp_timeout on other nodes.

Examples:
  ./launch.sh cifar
  ./launch.sh cifar --config 4gpu --num_train_epochs 30
  ./launch.sh cifar --num_processes 1 --dataset imagefolder --train_dir data/train --val_dir data/val
  ./launch.sh doctor
USAGE
}

die() { echo "launch.sh: error: $*" >&2; exit 2; }
# A value as an error message shows it: in quotes, or as bash would quote it when it holds odd characters.
quoted() { if [[ "$1" =~ ^[A-Za-z0-9_./:=+-]*$ ]]; then echo "'$1'"; else printf '%q' "$1"; fi; }

# GPUs this process may use: nvidia-smi's count, narrowed by CUDA_VISIBLE_DEVICES when it is set
# and by the GPUs Slurm gave this node.
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
  if [[ "${SLURM_GPUS_ON_NODE:-}" =~ ^[0-9]+$ ]] && (( SLURM_GPUS_ON_NODE < total )); then
    total=$SLURM_GPUS_ON_NODE
  fi
  echo "$total"
}

# The first host of a Slurm node list, which may be compressed: gpu-[01-03,07],cpu1 -> gpu-01.
head_node() {
  if command -v scontrol >/dev/null 2>&1; then
    scontrol show hostnames "$1" | head -n 1
    return
  fi
  local first="" depth=0 c i
  for (( i = 0; i < ${#1}; i++ )); do  # up to the first comma outside brackets
    c=${1:i:1}
    case "$c" in "[") depth=1 ;; "]") depth=0 ;; ,) (( depth )) || break ;; esac
    first+=$c
  done
  sed 's/\[\([^],-]*\)[^]]*\]/\1/g' <<<"$first"  # each [range,...] -> the start of its first range
}

# A node other than the head waits here for the head's rendezvous port, so that an address, port
# or firewall that is wrong fails in RDZV_TIMEOUT seconds with a message, not torch's traceback.
wait_for_head() {
  local deadline=$(( SECONDS + $3 ))
  until timeout 5 bash -c 'exec 3<>"/dev/tcp/$0/$1"' "$1" "$2" 2>/dev/null; do
    (( SECONDS < deadline )) || die "node $machine_rank cannot reach the head node $1:$2 after $3 s;" \
      "check that the head's launcher started, that port $2 is free and open between the nodes (firewall)," \
      "that '$1' resolves to an address of the network the nodes share (or set MASTER_ADDR), and see ./launch.sh doctor"
    sleep 1
  done
}

[[ $# -ge 1 ]] || { usage >&2; exit 2; }
case "$1" in -h|--help) usage; exit 0 ;; -*) die "the first argument is the recipe name (see --help)" ;; esac
recipe="${1#recipes/}"; recipe="${recipe%.py}"; shift  # recipes/cifar.py works as well as cifar
available_recipes() { (cd "$ROOT/recipes" && ls -- *.py | sed 's/\.py$//' | tr '\n' ' ' | sed 's/ $//'); }
available_configs() { (cd "$CONFIGS" && ls -- *.yaml | sed 's/\.yaml$//' | tr '\n' ' ' | sed 's/ $//'); }
if [[ "$recipe" == doctor ]]; then
  script="$ROOT/scripts/doctor.py"
elif [[ "$recipe" =~ ^[A-Za-z0-9_][A-Za-z0-9_-]*$ && -f "$ROOT/recipes/$recipe.py" ]]; then
  script="$ROOT/recipes/$recipe.py"
else
  die "unknown recipe $(quoted "$recipe") (available: $(available_recipes), doctor)"
fi

# launch.sh's own options; everything else goes to the recipe.
config="" num_processes="" max_restarts="" dry_run=0 help=0 recipe_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --config|--num_processes|--max_restarts)
      # A missing value would otherwise take the next option as the value, or the recipe's argument.
      [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || die "$1 needs a value (see ./launch.sh --help)"
      declare "${1#--}=$2"; shift 2 ;;
    --config=*|--num_processes=*|--max_restarts=*)
      [[ -n "${1#*=}" ]] || die "${1%%=*} needs a value (see ./launch.sh --help)"
      name=${1%%=*}; declare "${name#--}=${1#*=}"; shift ;;
    --dry_run) dry_run=1; shift ;;
    -h|--help) help=1; shift ;;  # the recipe's options, from one process (every process would print them)
    *) recipe_args+=("$1"); shift ;;
  esac
done

# Every number launch.sh takes, from its options and the environment, checked here: a bad one would
# otherwise surface as a traceback of accelerate or torch, or as bash's arithmetic error.
whole() { [[ "$1" =~ ^[0-9]{1,6}$ ]] && echo $(( 10#$1 )); }  # at most 6 digits: no arithmetic overflow
check_number() {  # NAME VALUE MIN MAX WHAT
  local n
  n=$(whole "$2") && (( n >= $3 && n <= $4 )) || die "$1 must be $5, got $(quoted "$2")"
}
if [[ -n "$num_processes" ]]; then
  check_number --num_processes "$num_processes" 1 999999 "a positive integer (the processes on this node)"
  num_processes=$(whole "$num_processes")
fi
if [[ -n "$max_restarts" ]]; then
  check_number --max_restarts "$max_restarts" 0 999999 "a number of restarts (0 or more)"
  max_restarts=$(whole "$max_restarts")
fi
[[ -z "${MASTER_PORT:-}" ]] || check_number MASTER_PORT "$MASTER_PORT" 1 65535 "a TCP port number from 1 to 65535"
[[ -z "${RDZV_TIMEOUT:-}" ]] || check_number RDZV_TIMEOUT "$RDZV_TIMEOUT" 1 999999 "a positive number of seconds"
[[ -z "${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-}" ]] || check_number TORCH_ELASTIC_SHUTDOWN_TIMEOUT \
  "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT" 1 999999 "a positive number of seconds"
if [[ -n "${MASTER_ADDR:-}" && ! "$MASTER_ADDR" =~ ^[][A-Za-z0-9._:%-]+$ ]]; then
  die "MASTER_ADDR must be a host name or an IP address, got $(quoted "$MASTER_ADDR")"
fi
if [[ -n "$config" ]]; then
  name="${config#accelerate_configs/}"; name="${name%.yaml}"  # accelerate_configs/zero3.yaml works as well as zero3
  [[ "$name" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*$ && "$name" != *..* ]] ||
    die "unknown config $(quoted "$config"): a name from accelerate_configs/ (available: $(available_configs))"
  config=$name
fi

accelerate_bin=$(command -v accelerate || true)
if [[ -z "$accelerate_bin" && -x "$ROOT/.venv/bin/accelerate" ]]; then
  accelerate_bin="$ROOT/.venv/bin/accelerate"
fi
[[ -n "$accelerate_bin" ]] || die "accelerate not found: activate the environment (. .venv/bin/activate) or pip install -e ."
python_bin="$(dirname "$accelerate_bin")/python"  # the environment accelerate is installed in
[[ -x "$python_bin" ]] || python_bin=$(command -v python3) || die "python3 not found"
LAUNCHER="$ROOT/scripts/launcher.py"
(( help )) && exec "$python_bin" "$script" --help

# Under Slurm, nodes of this srun step (the batch script itself runs on the first node only).
nodes=1 machine_rank=0
if [[ -n "${SLURM_JOB_ID:-}" ]]; then
  nodes=${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}}
  [[ "$nodes" =~ ^[1-9][0-9]{0,5}$ ]] || die "cannot read the node count from SLURM_NNODES ('$nodes')"
  # Every node computes the same port, and two jobs sharing a node get different ones.
  if [[ -z "${MASTER_PORT:-}" && "$SLURM_JOB_ID" =~ ^[0-9]{1,12}$ ]]; then
    MASTER_PORT=$(( 20000 + 10#$SLURM_JOB_ID % 10000 ))
  fi
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
[[ -f "$config_file" ]] || die "unknown config '$config' (available: $(available_configs))"

# num_machines num_processes distributed_type use_cpu, read (and checked) by Python's YAML parser.
config_values=$(quietly "$python_bin" "$LAUNCHER" config "$config_file")
read -r machines config_processes distributed_type use_cpu <<<"$config_values"
per_node=$(( ${num_processes:-$config_processes} / machines ))
(( per_node >= 1 )) || per_node=1
(( nodes > 1 )) && per_node=${num_processes:-$per_node}  # launch.sh fills in the nodes itself

env_prefix=() on_cpu=0 deepspeed_on_cpu=0
if [[ "$use_cpu" == true ]]; then
  # Without this variable a GPU-less launch trains N unsynchronised copies (see common/runtime.py).
  env_prefix=(ACCELERATE_USE_CPU=true) on_cpu=1
elif (( gpus == 0 )) && [[ "$distributed_type" == DEEPSPEED ]]; then
  # DeepSpeed runs on CPU (its CPU accelerator, gloo), in fp32: try ZeRO on a laptop, same entry point.
  deepspeed_on_cpu=1 per_node=${num_processes:-2}
  (( nodes > 1 )) || num_processes=$per_node
  echo "launch.sh: no GPU visible: DeepSpeed runs on CPU, $per_node process(es) on this node," \
    "fp32 (--mixed_precision no)" >&2
elif (( gpus == 0 )) && [[ "$distributed_type" == FSDP ]]; then
  die "config '$config' is FSDP, which needs GPUs, and none is visible; on CPU, --config zero3 shards the model" \
    "with DeepSpeed instead, and --config cpu trains with plain data parallelism"
elif (( per_node > gpus )); then
  if (( gpus == 0 )); then
    die "config '$config' needs $per_node GPU(s) on this node but none is visible; use --config cpu to run on CPU"
  fi
  die "$per_node processes requested on this node but only $gpus GPU(s) are visible; pass --num_processes $gpus or a config for $gpus GPU(s)"
fi

cmd=("$accelerate_bin" launch --config_file "$config_file")
(( deepspeed_on_cpu )) && cmd+=(--mixed_precision no)  # the configs' bf16 is for GPUs
if (( nodes > 1 )); then
  # Read here, inside the srun step: in the batch script SLURM_NODEID is 0 on every node.
  [[ -n "${SLURM_STEP_ID:-}" ]] || die "this Slurm job has $nodes nodes but launch.sh runs outside srun, on one node;" \
    "start one launch.sh per node: srun --ntasks-per-node=1 ./launch.sh ... (see slurm/multi_node.sbatch)"
  tasks=${SLURM_STEP_NUM_TASKS:-$nodes}
  [[ "$tasks" =~ ^[0-9]{1,6}$ ]] || die "cannot read the task count from SLURM_STEP_NUM_TASKS ('$tasks')"
  (( tasks == nodes )) || die "the srun step runs $tasks tasks on $nodes nodes but launch.sh starts every process" \
    "of its node itself; use srun --ntasks-per-node=1"
  machine_rank=${SLURM_NODEID:-${SLURM_PROCID:-}}
  [[ "$machine_rank" =~ ^[0-9]{1,6}$ ]] && (( machine_rank < nodes )) ||
    die "cannot read this node's rank from SLURM_NODEID ('$machine_rank')"
  nodelist=${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}}
  head=${MASTER_ADDR:-$(head_node "$nodelist")}
  [[ -n "$head" ]] || die "no head node: SLURM_JOB_NODELIST is empty; set MASTER_ADDR"
  port=${MASTER_PORT:-29500} rdzv_timeout=${RDZV_TIMEOUT:-60}
  # c10d: the head hosts the rendezvous store (is_host, rather than guessing from host names) and
  # the nodes may start at different moments, up to RDZV_TIMEOUT apart.
  cmd+=(--num_processes "$(( per_node * nodes ))" --num_machines "$nodes" --machine_rank "$machine_rank"
        --main_process_ip "$head" --main_process_port "$port"
        --rdzv_backend c10d --rdzv_conf "is_host=$(( machine_rank == 0 )),join_timeout=$rdzv_timeout")
  # DeepSpeed's "standard" multi-node launcher is torchrun on every node, like DDP; its default
  # (pdsh) would ssh into the nodes from the head instead.
  [[ "$distributed_type" == DEEPSPEED ]] && cmd+=(--deepspeed_multinode_launcher standard)
else
  [[ -n "$num_processes" ]] && cmd+=(--num_processes "$num_processes")
  [[ -n "${MASTER_PORT:-}" ]] && cmd+=(--main_process_port "$MASTER_PORT")
  # One CPU process needs no process group: without --cpu, accelerate would wrap the model in a
  # DistributedDataParallel of one process, whose all-reduce buckets cost time (benchmarks/).
  # --max_restarts needs torchrun's agent and doctor times a group's all-reduce: both keep it.
  if (( on_cpu )) && [[ "$per_node" == 1 && -z "$max_restarts" && "$recipe" != doctor ]]; then
    cmd+=(--cpu)
  fi
fi
# Restarted processes resume from the newest checkpoint by themselves (common.prepare_output_dir).
[[ -n "$max_restarts" ]] && cmd+=(--max_restarts "$max_restarts")
cmd+=("$script" ${recipe_args[@]+"${recipe_args[@]}"})

# The command a user can run by hand, with anything that looks like a credential masked.
quietly "$python_bin" "$LAUNCHER" show ${env_prefix[@]+"${env_prefix[@]}"} "${cmd[@]}" >&2
(( dry_run )) && exit 0
if [[ "$recipe" == doctor ]]; then  # this node's report first: it needs no other node
  "$python_bin" "$script" --report --num_processes "$per_node" ${recipe_args[@]+"${recipe_args[@]}"}
fi
(( nodes > 1 && machine_rank > 0 )) && wait_for_head "$head" "$port" "${RDZV_TIMEOUT:-60}"

# What runs is that command's `accelerate launch`, inside scripts/launcher.py: the launcher then
# exits with the recipe's exit code (2: a mistake, named on one `error:` line; 75: stopped at a
# checkpoint) without torch's traceback of a failed child, and no training process outlives it.
#
# Stopping: SIGTERM or SIGUSR1 (preemption, scancel, Slurm's --signal), or Ctrl-C, must reach the
# recipe's processes, which finish their step, save a checkpoint and exit 75; the launchers in
# between must neither die of the signal first nor kill the recipe before its checkpoint is saved.
# So the launcher runs in a process group of its own, which a terminal's Ctrl-C does not reach,
# and this shell passes the first stop signal on to that group as SIGTERM: torchrun's agent sends
# it on to the processes and waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds for them (USR1 as TERM
# makes the agent shut down for good instead of restarting them under --max_restarts; a second
# TERM would cut its wait short). If this shell is killed outright, the launcher gets SIGTERM from
# Linux (scripts/launcher.py), with the same effect.
status_file=$(mktemp "${TMPDIR:-/tmp}/launch-status.XXXXXX")
trap 'rm -f "$status_file"' EXIT
export RECIPE_STATUS_FILE="$status_file" TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-120}"
set -m  # the launcher gets its own process group
( trap '' USR1
  exec env LAUNCH_SH_PID=$$ ${env_prefix[@]+"${env_prefix[@]}"} "$python_bin" "$LAUNCHER" run "${cmd[@]:2}" ) &
child=$!
set +m
stop_signal=""
stop() {  # ends with status 0: a trap's failure would end this shell (set -e) before the launcher
  if [[ -n "$stop_signal" ]]; then
    echo "launch.sh: stopping: waiting for the processes to save a checkpoint" \
      "(at most TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT s)" >&2
    return 0
  fi
  stop_signal=$1
  kill -s TERM -- -"$child" 2>/dev/null || true
}
for sig in TERM INT HUP USR1; do
  trap "stop $sig" "$sig"
done
rc=0
while :; do
  wait "$child" && rc=0 || rc=$?
  if ! kill -0 "$child" 2>/dev/null; then
    # A trapped signal also ends `wait` (rc 128+n), maybe just as the launcher exits: its own status.
    again=0
    wait "$child" 2>/dev/null || again=$?
    if (( again != 127 )); then rc=$again; fi  # 127: bash has already handed the status out
    break
  fi
done
case "$stop_signal" in INT) by="Ctrl-C" ;; "") by="a signal" ;; *) by="SIG$stop_signal" ;; esac
read -r status _ checkpoint <"$status_file" || true
if [[ "${status:-}" == preempted ]]; then
  echo "launch.sh: stopped by $by after saving $checkpoint;" \
    "run the same command with --resume_from_checkpoint latest to continue (exit 75)" >&2
  exit 75
fi
if [[ -n "$stop_signal" && "${status:-}" == finished ]]; then  # the stop came as the processes exited
  echo "launch.sh: the run had finished when $by came; its model and results.json are complete (exit 0)" >&2
  exit 0
fi
if [[ -n "$stop_signal" ]] && (( rc >= 128 )); then
  code=$(( 128 + $(kill -l "$stop_signal") ))
  echo "launch.sh: stopped by $by; the processes ended without saving a checkpoint (exit $code)" >&2
  exit "$code"
fi
exit "$rc"
