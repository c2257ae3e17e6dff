#!/usr/bin/env bash
# Shared launcher behind slurm/drpo_*.sh and scripts/train_local_node.sh.
#
# Starts a Ray cluster (Slurm: head on the batch node and one worker per other node through
# srun; local: one head on this machine), waits until every GPU has registered, submits
# `python -m drpo_openrlhf.train ...` with `ray job submit`, streams its logs, and tears
# the cluster down on exit, failure, SIGTERM/SIGINT, and SIGUSR1 (Slurm's time-limit warning:
# the job is first asked to save the step it is on and stop, then the launcher requeues it so
# it resumes from that checkpoint).
# Every setting is an environment variable; docs/launch.md lists them.
#
# Usage (normally through a recipe): launch_ray_job.sh [extra train flags...]
# Internal, run by srun on each node: launch_ray_job.sh node head|worker ADDRESS
set -euo pipefail
shopt -s inherit_errexit

log() { printf '[launch %(%F %T)T] %s\n' -1 "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

# IPv4 address of this node: on $NET_IFACE when set (e.g. an InfiniBand interface, so Ray,
# NCCL and vLLM talk over it), else what the host name resolves to.
node_ip() {
  local ip
  if [[ -n ${NET_IFACE:-} ]]; then
    ip=$({ ip -o -4 addr show dev "$NET_IFACE" 2>/dev/null || true; } |
      awk '{split($4, a, "/"); print a[1]; exit}')
    [[ -n $ip ]] || die "no IPv4 address on interface NET_IFACE=$NET_IFACE on $(hostname)"
  else
    ip=$({ hostname --ip-address || true; } | awk '{print $1}')
    [[ -n $ip && $ip != 127.* ]] ||
      die "$(hostname) resolves to '${ip}'; set NET_IFACE to the interface the nodes share"
  fi
  printf '%s\n' "$ip"
}

# `node head IP` / `node worker HEAD_IP:PORT`: runs on one node while Ray runs there. SIGTERM
# (teardown below: under Slurm through scancel, never through srun, which answers SIGTERM
# with SIGKILL) goes to `ray start --block`, which stops the Ray processes it started. Ray's
# workers, vLLM engines and a job's driver are not among those: they end when they notice
# their raylet is gone, and a busy one may not. Every process started here carries a marker
# in its environment, so once `ray start` has ended (or been killed after 10 s) the ones left
# on this node are stopped too (what a cgroup-tracking Slurm does when a step ends;
# proctrack/linuxproc loses them once they are re-parented), and no other Ray of the user
# is touched.
run_node() {
  local role=$1 address=$2
  local -a args=(--num-gpus="$GPUS_PER_NODE")
  [[ -n ${SLURM_CPUS_ON_NODE:-} ]] && args+=(--num-cpus="$SLURM_CPUS_ON_NODE")
  args+=(--disable-usage-stats)
  local -a extra
  read -ra extra <<<"${RAY_START_ARGS:-}"
  if [[ $role == head ]]; then
    args=(--head --node-ip-address="$address" --port="$RAY_PORT" --dashboard-host="$address"
      --dashboard-port="$RAY_DASHBOARD_PORT" "${args[@]}")
  else
    [[ -n ${NET_IFACE:-} ]] && args=(--node-ip-address="$(node_ip)" "${args[@]}")
    args=(--address="$address" "${args[@]}")
  fi
  DRPO_RAY_NODE=$$-${EPOCHREALTIME/[.,]/}
  export DRPO_RAY_NODE
  ray start "${args[@]}" "${extra[@]}" --block &
  local ray_pid=$! rc=0 stopping=0
  export -n DRPO_RAY_NODE # only Ray's processes carry it, not the sweep's grep and sleep
  # In a Slurm step, scancel's SIGTERM reaches `ray start` itself; a second one would
  # interrupt its shutdown handler. Locally only this wrapper is signalled.
  trap 'stopping=1; [[ -n ${SLURM_STEP_ID:-} ]] || kill -TERM "$ray_pid" 2>/dev/null || true' \
    TERM INT
  while ((!stopping)) && kill -0 "$ray_pid" 2>/dev/null; do wait "$ray_pid" || rc=$?; done
  if ((stopping)); then
    # `ray start` gives each process it started 1 s to exit; bounded here all the same
    wait_exit 10 "$ray_pid"
    if kill -KILL "$ray_pid" 2>/dev/null; then
      log "$(hostname): ray start had not stopped after 10 s: killed it"
    fi
    rc=0 # `ray start --block` exits 1 on the SIGTERM that stops it
  fi
  stop_marked "DRPO_RAY_NODE=$DRPO_RAY_NODE"
  # As `ray stop` does: the head's address file would make a later plain ray.init() on this
  # node try to join the cluster that is gone.
  local address_file=${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/ray_current_cluster
  if [[ $role == head && $(cat "$address_file" 2>/dev/null) == "$address:$RAY_PORT" ]]; then
    rm -f "$address_file"
  fi
  exit "$rc"
}

# Waits until the processes $2... have exited or $1 seconds have passed.
wait_exit() {
  local deadline=$((SECONDS + $1)) pid
  for pid in "${@:2}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  done
}

# SIGTERM, then SIGKILL to what is still alive 5 s later, to every process whose environment
# holds the line $1.
stop_marked() {
  local marker=$1 waited
  local -a pids
  mapfile -t pids < <(marked_pids "$marker")
  ((${#pids[@]})) || return 0
  log "$(hostname): stopping ${#pids[@]} process(es) Ray left behind"
  kill -TERM "${pids[@]}" 2>/dev/null || true
  for ((waited = 0; waited < 10; waited++)); do
    sleep 0.5
    mapfile -t pids < <(marked_pids "$marker")
    ((${#pids[@]})) || return 0
  done
  log "$(hostname): ${#pids[@]} process(es) still alive after 5 s: SIGKILL"
  kill -KILL "${pids[@]}" 2>/dev/null || true
}

# Ids of the processes whose environment holds the line $1: one grep over every process's
# environment (a zombie's reads as empty; other users' cannot be read, so grep exits 2).
marked_pids() {
  { grep -lzxF -- "$1" /proc/[0-9]*/environ 2>/dev/null || true; } |
    sed 's|^/proc/||; s|/environ$||'
}

if [[ ${1:-} == node ]]; then
  run_node "$2" "$3"
fi

self=$(realpath "${BASH_SOURCE[0]}")
workers=()
repo_dir=$(dirname "$(dirname "$self")")

# ---------------------------------------------------------------------------------------------
# Settings. Recipes export the model-specific ones (MODEL, LR, ZERO_STAGE, micro batches).
# ---------------------------------------------------------------------------------------------
: "${MODEL:?MODEL (HF id or local path of the policy) is required}"
: "${LR:?LR is required}"
METHOD=${METHOD:-drpo}
LAMBDA=${LAMBDA:-0.1}
TAU=${TAU:-10}
DELTA=${DELTA:-1e-4}
BETA0=${BETA0:-1e3}
LENGTH_REWARD=${LENGTH_REWARD:-linear}
DRPO_MAX_LEN=${DRPO_MAX_LEN:-}
POSITIVE_REWARD=${POSITIVE_REWARD:-}
SHAPING_PARAMS=${SHAPING_PARAMS:-}
ROLLOUT_PROMPTS=${ROLLOUT_PROMPTS:-128}
N_SAMPLES=${N_SAMPLES:-8}
TRAIN_BATCH=${TRAIN_BATCH:-256}
MICRO_TRAIN_BATCH=${MICRO_TRAIN_BATCH:-1}
MICRO_ROLLOUT_BATCH=${MICRO_ROLLOUT_BATCH:-4}
# LONG=16k|32k: a recipe's long-response variant. Ring attention splits every packed
# micro-batch over 2 / 4 GPUs, so each GPU holds about as many tokens of it as in the 8k
# recipe (docs/launch.md, "Long responses"); MAX_NEW_TOKENS and RING_ATTN_SIZE still win.
LONG=${LONG:-}
case $LONG in
'') long_tokens=8192 long_ring=1 ;;
16k) long_tokens=16384 long_ring=2 ;;
32k) long_tokens=32768 long_ring=4 ;;
*) die "LONG must be 16k or 32k, got '$LONG'" ;;
esac
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-$long_tokens}
RING_ATTN_SIZE=${RING_ATTN_SIZE:-$long_ring}
PROMPT_MAX_LEN=${PROMPT_MAX_LEN:-1024}
TEMPERATURE=${TEMPERATURE:-0.6}
WEIGHT_DECAY=${WEIGHT_DECAY:-0.01}
ZERO_STAGE=${ZERO_STAGE:-3}
VLLM_TP=${VLLM_TP:-1}
VLLM_GPU_UTIL=${VLLM_GPU_UTIL:-0.6}
PACKING=${PACKING:-1}
COLOCATE=${COLOCATE:-1}
ATTN_IMPL=${ATTN_IMPL:-flash_attention_2}
MAX_STEPS=${MAX_STEPS:-1000}
NUM_EPISODES=${NUM_EPISODES:-}
SAVE_STEPS=${SAVE_STEPS:-20}
EVAL_STEPS=${EVAL_STEPS:-20}
EVAL_N_SAMPLES=${EVAL_N_SAMPLES:-4}
CKPT_MAX_NUM=${CKPT_MAX_NUM:-3}
SAVE_HF=${SAVE_HF:-0}
# OpenRLHF also keeps a full checkpoint of the best evaluation so far (best_global_stepN, one
# more ZeRO checkpoint on disk and a save at every new best, inside the step the time-limit
# grace must fit); off unless BEST_CKPT=1 (docs/launch.md)
BEST_CKPT=${BEST_CKPT:-0}
SEED=${SEED:-42}
DATA_DIR=${DATA_DIR:-$repo_dir/data}
TRAIN_DATA=${TRAIN_DATA:-$DATA_DIR/deepscaler.jsonl}
default_eval=$DATA_DIR/aime2024.jsonl,$DATA_DIR/aime2025.jsonl,$DATA_DIR/amc.jsonl
EVAL_DATA=${EVAL_DATA-$default_eval,$DATA_DIR/math500.jsonl}
REWARD_FUNC=${REWARD_FUNC:-drpo_openrlhf/rewards/math_reward.py}
OUTPUT_ROOT=${OUTPUT_ROOT:-$repo_dir/outputs}
PYTHON=${PYTHON:-python}
WANDB_PROJECT=${WANDB_PROJECT:-drpo}
EXTRA_ARGS=${EXTRA_ARGS:-}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}
RAY_POLL_INTERVAL=${RAY_POLL_INTERVAL:-5}
TEARDOWN_TIMEOUT=${TEARDOWN_TIMEOUT:-30}
# How many times `ray job submit` is tried when Ray's dashboard answers that the head has no
# job agent yet (see submit_job below); RAY_POLL_INTERVAL apart.
SUBMIT_ATTEMPTS=${SUBMIT_ATTEMPTS:-10}
REQUEUE_ON_TIMELIMIT=${REQUEUE_ON_TIMELIMIT:-1}
# How long the time-limit warning waits for the job to save its step and stop (0: no stop
# request, teardown at once). 240 s fits the recipes' warning (--signal=B:USR1@300): what
# follows is at most `ray job stop` (15 s) and the nodes' teardown (TEARDOWN_TIMEOUT 30 s, and
# 1 s to kill), so the requeue still comes about 14 s before Slurm's own kill at the limit.
STOP_GRACE_S=${STOP_GRACE_S:-240}
LAUNCH_MODE=${LAUNCH_MODE:-$([[ -n ${SLURM_JOB_ID:-} ]] && echo slurm || echo local)}

is_positive() { [[ $1 =~ ^[1-9][0-9]*$ ]]; }
for name in ROLLOUT_PROMPTS N_SAMPLES TRAIN_BATCH MICRO_TRAIN_BATCH MICRO_ROLLOUT_BATCH \
  MAX_NEW_TOKENS PROMPT_MAX_LEN RING_ATTN_SIZE VLLM_TP MAX_STEPS SAVE_STEPS EVAL_STEPS EVAL_N_SAMPLES \
  RAY_WAIT_TIMEOUT TEARDOWN_TIMEOUT SUBMIT_ATTEMPTS; do
  is_positive "${!name}" || die "$name must be a positive integer, got '${!name}'"
done
[[ $BEST_CKPT == [01] ]] || die "BEST_CKPT must be 0 or 1, got '$BEST_CKPT'"
[[ $STOP_GRACE_S =~ ^[0-9]+$ ]] ||
  die "STOP_GRACE_S must be a whole number of seconds, got '$STOP_GRACE_S'"

# ---------------------------------------------------------------------------------------------
# Cluster shape.
# ---------------------------------------------------------------------------------------------
case $LAUNCH_MODE in
slurm)
  : "${SLURM_JOB_ID:?slurm mode needs a Slurm job (sbatch); use scripts/train_local_node.sh}"
  mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
  ((${#nodes[@]} > 0)) || die "scontrol found no hosts in SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST"
  if [[ -n ${NNODES:-} && $NNODES != "${#nodes[@]}" ]]; then
    die "NNODES=$NNODES but the allocation has ${#nodes[@]} node(s): use sbatch --nodes=$NNODES"
  fi
  NNODES=${#nodes[@]}
  head_node=${SLURMD_NODENAME:-${nodes[0]}}
  for n in "${nodes[@]}"; do [[ $n == "$head_node" ]] || workers+=("$n"); done
  ((${#workers[@]} == NNODES - 1)) || die "batch host $head_node is not among ${nodes[*]}"
  gpus_alloc=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${gpus_alloc##*:}}
  job_name=${SLURM_JOB_NAME:-${RECIPE_NAME:-drpo}}
  ;;
local)
  [[ -z ${NNODES:-} || $NNODES == 1 ]] || die "local mode runs on one node (NNODES=$NNODES)"
  NNODES=1
  head_node=$(hostname)
  if [[ -z ${GPUS_PER_NODE:-} ]]; then
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
      IFS=, read -ra visible <<<"$CUDA_VISIBLE_DEVICES"
      GPUS_PER_NODE=${#visible[@]}
    else
      GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
  fi
  job_name=${RECIPE_NAME:-drpo}
  ;;
*) die "LAUNCH_MODE must be slurm or local, got '$LAUNCH_MODE'" ;;
esac
is_positive "${GPUS_PER_NODE:-}" ||
  die "cannot tell how many GPUs each node has (got '${GPUS_PER_NODE:-}'); set GPUS_PER_NODE"
world=$((NNODES * GPUS_PER_NODE))

# Colocated (the recipes): every GPU holds one DeepSpeed rank and, time-shared, a slice of a
# vLLM engine. COLOCATE=0: ACTOR_GPUS_PER_NODE GPUs of each node train, the others generate
# (also the layout of the CPU pipeline, whose vLLM cannot sleep). The batch arithmetic is
# checked by the entry point itself (preflight below).
case $COLOCATE in
1)
  actor_gpus_per_node=$GPUS_PER_NODE
  vllm_gpus=$world
  placement_args=(--train.colocate_all --vllm.enable_sleep --ds.enable_sleep)
  ;;
0)
  actor_gpus_per_node=${ACTOR_GPUS_PER_NODE:-$((GPUS_PER_NODE / 2))}
  ((actor_gpus_per_node >= 1 && actor_gpus_per_node < GPUS_PER_NODE)) ||
    die "COLOCATE=0 needs 1 <= ACTOR_GPUS_PER_NODE < GPUS_PER_NODE=$GPUS_PER_NODE," \
      "got '$actor_gpus_per_node'"
  vllm_gpus=$((NNODES * (GPUS_PER_NODE - actor_gpus_per_node)))
  placement_args=()
  ;;
*) die "COLOCATE must be 1 or 0, got '$COLOCATE'" ;;
esac
((vllm_gpus % VLLM_TP == 0)) ||
  die "$vllm_gpus GPUs cannot be split into vLLM engines of VLLM_TP=$VLLM_TP"

# ---------------------------------------------------------------------------------------------
# Method: DRPO (default), DisCO (DRPO without the length reward), or a shaped-reward baseline
# trained with OpenRLHF's PPO loss and group advantages.
# ---------------------------------------------------------------------------------------------
# POSITIVE_REWARD (--drpo.positive_reward, docs/positive_rewards.md) with each plugin file's
# path made absolute: the job runs in Ray's copy of the repository. Terms are joined by '+',
# each `[weight*]name` with name a built-in or `file.py[:function]`.
portable_positive_reward() {
  local -a terms out=()
  local term weight name path
  IFS=+ read -ra terms <<<"$1"
  for term in "${terms[@]}"; do
    weight='' name=$term
    if [[ $term == *'*'* ]]; then
      weight="${term%%\**}*" name=${term#*\*}
    fi
    path=${name%%:*}
    if [[ $path == *.py ]]; then
      [[ -f $path ]] || die "POSITIVE_REWARD: plugin file $path does not exist"
      name=$(realpath -m -- "$path")${name:${#path}}
    fi
    out+=("$weight$name")
  done
  (
    IFS=+
    echo "${out[*]}"
  )
}

method_args=()
case $METHOD in
drpo | disco)
  [[ $METHOD == disco ]] && LAMBDA=inf
  run_tag=${METHOD}_lam${LAMBDA}
  [[ $METHOD == disco ]] && run_tag=disco
  # group_norm only keeps OpenRLHF from building a critic (its default estimator is gae);
  # the DRPO loss does not use advantages.
  method_args=(--algo.advantage.estimator "${ESTIMATOR:-group_norm}"
    --drpo.lam "$LAMBDA" --drpo.tau "$TAU" --drpo.delta "$DELTA" --drpo.beta0 "$BETA0"
    --drpo.length_reward "$LENGTH_REWARD")
  [[ -n $DRPO_MAX_LEN ]] && method_args+=(--drpo.max_len "$DRPO_MAX_LEN")
  if [[ -n $POSITIVE_REWARD ]]; then
    positive=$(portable_positive_reward "$POSITIVE_REWARD")
    method_args+=(--drpo.positive_reward "$positive")
  fi
  ;;
rloo_lp | alp | hapo | l1_max | shorter_better | laser_d)
  default_estimator=group_norm
  [[ $METHOD == rloo_lp ]] && default_estimator=rloo
  run_tag=$METHOD${SHAPING_PARAMS:+_$SHAPING_PARAMS}
  method_args=(--algo.advantage.estimator "${ESTIMATOR:-$default_estimator}"
    --shaping.method "$METHOD")
  [[ -n $SHAPING_PARAMS ]] && method_args+=(--shaping.params "$SHAPING_PARAMS")
  ;;
*) die "unknown METHOD '$METHOD' (drpo disco rloo_lp alp hapo l1_max shorter_better laser_d)" ;;
esac

# ---------------------------------------------------------------------------------------------
# Paths. The job runs in Ray's copy of the repository, so user paths are made absolute here;
# they must be on storage every node sees.
# ---------------------------------------------------------------------------------------------
abs() { realpath -m -- "$1"; }
looks_local() { [[ $1 == /* || $1 == .* || $1 == *.json* || $1 == *.parquet || -e $1 ]]; }

[[ -e $MODEL ]] && MODEL=$(abs "$MODEL")
if looks_local "$TRAIN_DATA"; then
  [[ -f $TRAIN_DATA ]] || die "TRAIN_DATA=$TRAIN_DATA does not exist (python -m drpo_openrlhf.data)"
  TRAIN_DATA=$(abs "$TRAIN_DATA")
fi
eval_files=()
if [[ -n $EVAL_DATA ]]; then
  IFS=, read -ra eval_items <<<"$EVAL_DATA"
  for f in "${eval_items[@]}"; do
    if looks_local "$f"; then
      [[ -f $f ]] || die "eval set $f does not exist (set EVAL_DATA, or EVAL_DATA= to disable)"
      f=$(abs "$f")
    fi
    eval_files+=("$f")
  done
fi
EVAL_DATA=$(
  IFS=,
  echo "${eval_files[*]}"
)

sanitize() { tr -c 'A-Za-z0-9._-' '-' <<<"$1" | sed 's/-*$//'; }
# a long variant is its own run: it must not resume the 8k run's checkpoints
RUN_NAME=${RUN_NAME:-$(sanitize "${job_name}_${run_tag}${LONG:+_$LONG}")}
OUTPUT_ROOT=$(abs "$OUTPUT_ROOT")
RUN_DIR=$OUTPUT_ROOT/$RUN_NAME
CKPT_DIR=$(abs "${CKPT_DIR:-$RUN_DIR/ckpt}")
mkdir -p "$CKPT_DIR"

# With --ckpt.load_enable the entry point picks the newest *complete* checkpoint (DeepSpeed
# writes `latest` before every rank has finished; drpo_openrlhf/runtime/checkpoints.py)
# and logs "drpo_openrlhf: resuming from ...": the launcher leaves that choice to it.

# OpenRLHF ends an episode (a pass over the prompts) with whatever prompts are left; DRPO
# trains only the whole-group optimizer steps of such a short rollout (and logs what it left
# out): train on the first whole rollouts' worth of prompts so nothing is left out. Cover
# MAX_STEPS with whole episodes; --drpo.max_steps stops the run exactly there.
data_args=()
if [[ -f $TRAIN_DATA && $TRAIN_DATA == *.jsonl ]]; then
  n_prompts=$(grep -c . "$TRAIN_DATA" || true)
  steps_per_episode=$((n_prompts / ROLLOUT_PROMPTS))
  ((steps_per_episode > 0)) ||
    die "TRAIN_DATA=$TRAIN_DATA has $n_prompts prompts, fewer than ROLLOUT_PROMPTS=$ROLLOUT_PROMPTS"
  data_args=(--data.max_samples "$((steps_per_episode * ROLLOUT_PROMPTS))")
  NUM_EPISODES=${NUM_EPISODES:-$(((MAX_STEPS + steps_per_episode - 1) / steps_per_episode))}
  log "$n_prompts prompts: the first $((steps_per_episode * ROLLOUT_PROMPTS)) make" \
    "$steps_per_episode steps/episode; $NUM_EPISODES episode(s) =" \
    "$((NUM_EPISODES * steps_per_episode)) steps (MAX_STEPS=$MAX_STEPS)"
fi
[[ -n $NUM_EPISODES ]] || die "cannot count the prompts of TRAIN_DATA=$TRAIN_DATA; set NUM_EPISODES"
is_positive "$NUM_EPISODES" || die "NUM_EPISODES must be a positive integer, got '$NUM_EPISODES'"

# ---------------------------------------------------------------------------------------------
# The training command.
# ---------------------------------------------------------------------------------------------
train_args=(
  --actor.model_name_or_path "$MODEL"
  --actor.num_nodes "$NNODES" --actor.num_gpus_per_node "$actor_gpus_per_node"
  --vllm.num_engines "$((vllm_gpus / VLLM_TP))" --vllm.tensor_parallel_size "$VLLM_TP"
  --vllm.gpu_memory_utilization "$VLLM_GPU_UTIL" "${placement_args[@]}"
  --ds.zero_stage "$ZERO_STAGE" --ds.param_dtype bf16
  --ds.attn_implementation "$ATTN_IMPL" --actor.gradient_checkpointing_enable
  --data.prompt_dataset "$TRAIN_DATA" "${data_args[@]}"
  --data.input_key prompt --data.label_key label
  --data.apply_chat_template --data.max_len "$((PROMPT_MAX_LEN + MAX_NEW_TOKENS))"
  --rollout.max_new_tokens "$MAX_NEW_TOKENS"
  --rollout.batch_size "$ROLLOUT_PROMPTS" --rollout.n_samples_per_prompt "$N_SAMPLES"
  --rollout.micro_batch_size "$MICRO_ROLLOUT_BATCH"
  --rollout.temperature "$TEMPERATURE" --rollout.top_p 1.0
  --train.batch_size "$TRAIN_BATCH" --train.micro_batch_size "$MICRO_TRAIN_BATCH"
  --train.num_episodes "$NUM_EPISODES" --train.seed "$SEED" --drpo.max_steps "$MAX_STEPS"
  --actor.adam.lr "$LR" --actor.adam.betas 0.9 0.999 --actor.adam.weight_decay "$WEIGHT_DECAY"
  --actor.lr_scheduler constant --actor.lr_warmup_ratio 0 --actor.max_norm 1.0
  --algo.kl.init_coef 0
  --reward.remote_url "$REWARD_FUNC"
  --ckpt.path "$CKPT_DIR" --ckpt.load_enable --ckpt.save_steps "$SAVE_STEPS"
  --ckpt.max_num "$CKPT_MAX_NUM" --ckpt.output_dir "$RUN_DIR/model"
  --logger.logging_steps 1 --logger.tensorboard_dir "$RUN_DIR/tensorboard"
)
[[ $PACKING == 1 ]] && train_args+=(--ds.packing_samples)
if ((RING_ATTN_SIZE > 1)); then
  # OpenRLHF would turn packing on by itself; say so instead of running another layout
  [[ $PACKING == 1 ]] || die "RING_ATTN_SIZE=$RING_ATTN_SIZE needs PACKING=1: ring attention splits packed sequences"
  train_args+=(--ds.ring_attn_size "$RING_ATTN_SIZE")
fi
[[ $SAVE_HF == 1 ]] && train_args+=(--ckpt.save_hf)
if [[ -n $EVAL_DATA ]]; then
  train_args+=(--eval.dataset "$EVAL_DATA" --eval.steps "$EVAL_STEPS"
    --eval.temperature "$TEMPERATURE" --eval.n_samples_per_prompt "$EVAL_N_SAMPLES")
  [[ $BEST_CKPT == 1 ]] || train_args+=(--ckpt.best_metric_key none)
fi
# wandb logs when a key is in the environment (or WANDB=1 with a ~/.netrc login). OpenRLHF
# turns it on for any non-empty --logger.wandb.key and wandb then reads WANDB_API_KEY itself,
# so the secret never appears on a command line, in the Ray job record, or in wandb's config.
if [[ -n ${WANDB_API_KEY:-} || ${WANDB:-0} == 1 ]]; then
  train_args+=(--logger.wandb.key from-environment --logger.wandb.project "$WANDB_PROJECT"
    --logger.wandb.run_name "$RUN_NAME")
  [[ -n ${WANDB_ENTITY:-} ]] && train_args+=(--logger.wandb.org "$WANDB_ENTITY")
  [[ -n ${WANDB_GROUP:-} ]] && train_args+=(--logger.wandb.group "$WANDB_GROUP")
  # A requeued job continues the same wandb run.
  export WANDB_RUN_ID=${WANDB_RUN_ID:-$RUN_NAME} WANDB_RESUME=${WANDB_RESUME:-allow}
fi
read -ra extra_args <<<"$EXTRA_ARGS"
train_args+=("${method_args[@]}" "${extra_args[@]}" "$@")

# The value of the last `FLAG VALUE` / `FLAG=VALUE` among the arguments after $1 (argparse's
# choice when a trailing flag overrides the recipe's).
last_value() {
  local flag=$1 value="" next=0 arg
  for arg in "${@:2}"; do
    if ((next)); then
      value=$arg next=0
    elif [[ $arg == "$flag" ]]; then
      next=1
    elif [[ $arg == "$flag="* ]]; then
      value=${arg#*=}
    fi
  done
  printf '%s\n' "$value"
}
# The trainer looks for this file after every step (drpo_openrlhf/runtime/graceful_stop.py).
stop_file=$(last_value --ckpt.path "${train_args[@]}")/DRPO_STOP_REQUESTED

# Preflight: the entry point's own parser and checks (unknown flags, PPO-only flags, layouts
# that split prompt groups) on this node, in seconds, before any Ray node starts.
if [[ ${PREFLIGHT:-1} == 1 ]]; then
  check='import sys; from drpo_openrlhf.train import parse; parse(sys.argv[1:])'
  if ! problem=$(cd "$repo_dir" && "$PYTHON" -c "$check" "${train_args[@]}" 2>&1 >/dev/null); then
    die "invalid training command: ${problem##*$'\n'}"
  fi
fi

# ---------------------------------------------------------------------------------------------
# Environment for every node and the job.
# ---------------------------------------------------------------------------------------------
if [[ -n ${NET_IFACE:-} ]]; then
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$NET_IFACE}
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$NET_IFACE}
fi
export GPUS_PER_NODE RAY_PORT RAY_DASHBOARD_PORT
export NET_IFACE=${NET_IFACE:-} RAY_START_ARGS=${RAY_START_ARGS:-}
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

json_str() {
  local s=$1
  [[ $s != *[[:cntrl:]]* ]] || die "cannot pass a value with control characters to Ray: ${s@Q}"
  s=${s//\\/\\\\}
  printf '"%s"' "${s//\"/\\\"}"
}
# Forwarded explicitly (srun already exports the batch environment to every node, but the job
# record then shows the settings): NCCL/GLOO/HF/vLLM/wandb variables plus RAY_ENV_VARS, never
# anything that looks like a secret; secrets reach the processes through the node environment.
runtime_env_vars() {
  local -a names user_names
  local name key value sep=""
  mapfile -t names < <(compgen -e | grep -E '^(NCCL_|GLOO_|HF_|TRANSFORMERS_|VLLM_|WANDB_)' |
    grep -vxE 'VLLM_TP|VLLM_GPU_UTIL') # the launcher's own settings, unknown to vLLM
  read -ra user_names <<<"${RAY_ENV_VARS//,/ }"
  printf '{'
  for name in $(printf '%s\n' TOKENIZERS_PARALLELISM PYTHONUNBUFFERED "${names[@]}" \
    "${user_names[@]}" | sort -u); do
    [[ $name =~ (^|_)(KEY|TOKEN|SECRET|PASSWORD)(_|$) ]] && continue
    [[ -v $name ]] || continue
    key=$(json_str "$name")
    value=$(json_str "${!name}")
    printf '%s%s: %s' "$sep" "$key" "$value"
    sep=", "
  done
  printf '}'
}
RAY_ENV_VARS=${RAY_ENV_VARS:-}
env_json=$(runtime_env_vars)
repo_json=$(json_str "$repo_dir")
excludes='".git", ".venv", "outputs", "results", "wandb", "__pycache__", "*.safetensors", "*.pt"'
runtime_env="{\"working_dir\": $repo_json, \"excludes\": [$excludes], \"env_vars\": $env_json}"

# ---------------------------------------------------------------------------------------------
# Ray cluster, job, teardown.
# ---------------------------------------------------------------------------------------------
head_ip=127.0.0.1
[[ $LAUNCH_MODE == slurm ]] && head_ip=$(node_ip)
gcs=$head_ip:$RAY_PORT
dashboard=http://$head_ip:$RAY_DASHBOARD_PORT
submission_id=${RUN_NAME}-${SLURM_JOB_ID:-local}-${SLURM_RESTART_COUNT:-0}
node_pids=()
submit_pid=""
submit_err=""   # the current attempt's copy of `ray job submit`'s stderr
submit_err_fd="" # the pipe to its `tee`, open while an attempt runs
job_running=0
torn_down=0

# shellcheck disable=SC2329  # run by the traps below
teardown() {
  ((torn_down)) && return 0
  torn_down=1
  # a signal during a submission: its tee ends once the submit client does
  [[ -n $submit_err_fd ]] && exec {submit_err_fd}>&-
  [[ -n $submit_err ]] && rm -f -- "$submit_err"
  if ((job_running)); then
    log "stopping Ray job $submission_id"
    timeout 15 ray job stop --no-wait --address "$dashboard" "$submission_id" ||
      log "ray job stop failed"
    kill -TERM "$submit_pid" 2>/dev/null || true
  fi
  ((${#node_pids[@]})) || return 0
  log "stopping Ray on ${NNODES} node(s)"
  if [[ $LAUNCH_MODE == slurm ]]; then
    stop_slurm_nodes
  else
    kill -TERM "${node_pids[@]}" 2>/dev/null || true
  fi
  wait_exit "$TEARDOWN_TIMEOUT" "${node_pids[@]}"
  local alive=() pid
  for pid in "${node_pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive+=("$pid"); done
  if ((${#alive[@]})); then
    log "Ray still running after ${TEARDOWN_TIMEOUT}s: killing it"
    kill -TERM "${alive[@]}" 2>/dev/null || true # srun: SIGKILL to its step
    sleep 1
    kill -KILL "${alive[@]}" 2>/dev/null || true
  fi
  wait 2>/dev/null || true
}

# A SIGTERM to an srun client is not forwarded: srun prints "forcing job termination" and
# slurmd kills the step with SIGKILL, which would leave Ray's processes (raylet, GCS, workers)
# to whatever the site's process tracking does. So the SIGTERM goes to the steps' processes
# through Slurm (scancel without --full spares this batch shell): each `ray start --block`
# then stops the Ray processes it started, and only those. (`ray stop` would also stop every
# other Ray of the same user on the node.)
# shellcheck disable=SC2329  # run by teardown
stop_slurm_nodes() {
  scancel --signal=TERM "$SLURM_JOB_ID" || log "scancel --signal=TERM $SLURM_JOB_ID failed"
}

# The time-limit warning: ask the running job to stop at its next safe point with a checkpoint
# of its last finished step (the trainer drops a rollout whose update has not begun, else
# finishes that step: docs/reliability.md), and give it STOP_GRACE_S. A job that has not ended
# by then is stopped by the teardown, as without the request: the rerun resumes from its last
# complete checkpoint. A SIGTERM meanwhile still tears down at once.
# shellcheck disable=SC2329  # run by on_signal
stop_gracefully() {
  ((job_running && STOP_GRACE_S > 0)) || return 0
  if ! touch "$stop_file"; then
    log "could not write $stop_file: stopping the job without a last checkpoint"
    return 0
  fi
  log "asked the job to save its last finished step and stop ($stop_file);" \
    "waiting up to ${STOP_GRACE_S}s (STOP_GRACE_S)"
  # what the run measured (drpo_step_times.json beside the request), against the grace
  local advice='import sys; from drpo_openrlhf.runtime.graceful_stop import stop_advice
print(stop_advice(sys.argv[1], int(sys.argv[2])))'
  log "$(cd "$repo_dir" && "$PYTHON" -c "$advice" "${stop_file%/*}" "$STOP_GRACE_S" 2>&1 |
    tail -n 1)"
  local started=$SECONDS rc=0
  wait_exit "$STOP_GRACE_S" "$submit_pid"
  if kill -0 "$submit_pid" 2>/dev/null; then
    log "the job did not stop within ${STOP_GRACE_S}s: stopping it; the rerun resumes from" \
      "its last complete checkpoint"
    return 0
  fi
  wait "$submit_pid" || rc=$?
  job_running=0
  if ((rc == 0)); then
    log "the job ended (exit 0) $((SECONDS - started))s after the stop request"
  else
    log "the job failed (exit $rc) after the stop request; the rerun resumes from its last" \
      "complete checkpoint"
  fi
}

# shellcheck disable=SC2329  # run by the traps below
on_signal() {
  local name=$1 code=$2 requeue=0
  log "received SIG$name"
  [[ $name == USR1 && $LAUNCH_MODE == slurm && $REQUEUE_ON_TIMELIMIT == 1 ]] && requeue=1
  ((requeue)) && stop_gracefully
  teardown
  if ((requeue)); then
    log "time limit near: requeueing job $SLURM_JOB_ID (it resumes from the latest checkpoint)"
    scontrol requeue "$SLURM_JOB_ID" || log "scontrol requeue failed: resubmit the job to resume"
  fi
  exit "$code"
}
trap teardown EXIT
trap 'on_signal TERM 143' TERM
trap 'on_signal INT 130' INT
trap 'on_signal USR1 138' USR1

# Total GPUs the cluster knows, from `ray status` lines such as " 0.0/16.0 GPU" (0 while the
# head is not up yet; bounded because `ray status` retries for minutes when nothing listens).
registered_gpus() {
  { timeout 20 ray status --address "$gcs" 2>/dev/null || true; } |
    awk '$2 == "GPU" && $1 ~ /\// {split($1, a, "/"); n = a[2] + 0} END {print n + 0}'
}

wait_for_gpus() {
  local expected=$1 deadline=$((SECONDS + RAY_WAIT_TIMEOUT)) have pid
  log "waiting for $expected GPU(s) to register with Ray at $gcs"
  while :; do
    for pid in "${node_pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || die "a Ray node exited before the cluster was ready (see above)"
    done
    have=$(registered_gpus)
    ((have >= expected)) && break
    ((SECONDS < deadline)) ||
      die "timed out after ${RAY_WAIT_TIMEOUT}s: $have of $expected GPUs registered at $gcs" \
        "(nodes: $head_node ${workers[*]:-}); check the nodes' Ray logs, or raise RAY_WAIT_TIMEOUT"
    sleep "$RAY_POLL_INTERVAL"
  done
  log "$have GPU(s) registered"
}

log "mode=$LAUNCH_MODE nodes=$NNODES gpus/node=$GPUS_PER_NODE head=$head_node ($head_ip)" \
  "run=$RUN_NAME"
if [[ $LAUNCH_MODE == slurm ]]; then
  srun --overlap --nodes=1 --ntasks=1 -w "$head_node" bash "$self" node head "$head_ip" &
else
  bash "$self" node head "$head_ip" &
fi
node_pids+=("$!")
wait_for_gpus "$GPUS_PER_NODE"
if ((NNODES > 1)); then
  srun --overlap --nodes="$((NNODES - 1))" --ntasks="$((NNODES - 1))" --ntasks-per-node=1 \
    --exclude="$head_node" bash "$self" node worker "$gcs" &
  node_pids+=("$!")
  wait_for_gpus "$world"
fi

# Ray's dashboard gives the head node's job agent a hard-coded 10 s to show up
# (WAIT_AVAILABLE_AGENT_TIMEOUT in ray/dashboard/consts.py). A head whose GPUs have
# registered may still lack its agent (a loaded machine, a requeued job's fresh cluster), and
# the dashboard then answers HTTP 500 "No available agent to submit job, please try again
# later." before it has passed the submission to any agent: no job was created. That answer,
# and only that, is retried, with the same submission id (Ray refuses a second job with an id
# it already has, so a retry can never start a second job). Any other failure, a failed job
# included, ends the launch as before. Each attempt runs in the background like the job
# itself, so SIGTERM/SIGUSR1 are handled at once during attempts and the pauses between them.
NO_AGENT='Request failed with status code 500: No available agent to submit job'
# Sets submit_rc: the exit status of the last attempt.
submit_job() {
  local attempt tee_pid
  submit_err=$(mktemp "${TMPDIR:-/tmp}/drpo-submit.XXXXXX")
  for ((attempt = 1; ; attempt++)); do
    # the client's stderr still reaches ours, and a copy is kept to read its answer
    exec {submit_err_fd}> >(exec tee -- "$submit_err" >&2)
    tee_pid=$!
    ray job submit --address "$dashboard" --submission-id "$submission_id" \
      --runtime-env-json "$runtime_env" -- "$PYTHON" -m drpo_openrlhf.train "${train_args[@]}" \
      2>&"$submit_err_fd" &
    submit_pid=$!
    job_running=1
    submit_rc=0
    wait "$submit_pid" || submit_rc=$?
    job_running=0
    exec {submit_err_fd}>&-
    submit_err_fd=""
    wait "$tee_pid" || true
    if ((submit_rc == 0)) || ! grep -qF -- "$NO_AGENT" "$submit_err"; then
      break
    fi
    if ((attempt == SUBMIT_ATTEMPTS)); then
      log "Ray's dashboard found no job agent on the head in $attempt attempts" \
        "(SUBMIT_ATTEMPTS); check the head's Ray logs (dashboard_agent.log): another Ray on" \
        "that node holds the agent's port 52365 if it says 'address already in use' (then" \
        "set RAY_START_ARGS=--dashboard-agent-listen-port=PORT)"
      break
    fi
    log "attempt $attempt of $SUBMIT_ATTEMPTS: Ray's dashboard found no job agent on the head" \
      "within its 10 s (\"No available agent to submit job\"; no job was created):" \
      "submitting again in ${RAY_POLL_INTERVAL}s"
    sleep "$RAY_POLL_INTERVAL" &
    wait "$!"
  done
  rm -f -- "$submit_err"
  submit_err=""
}

log "submitting $submission_id to $dashboard"
submit_job
rc=$submit_rc
if ((rc == 0)); then
  log "job $submission_id finished"
else
  log "job $submission_id failed (exit $rc)"
fi
exit "$rc"
