#!/usr/bin/env bash
# Shared launcher behind slurm/drpo_*.sh and scripts/train_local_node.sh.
#
# Starts a Ray cluster (Slurm: head on the batch node and one worker per other node through
# srun; local: one head on this machine; a head that exits before it is ready is started once
# more, naming why), waits until every GPU has registered, submits
# `python -m drpo_openrlhf.train ...` with `ray job submit`, streams its logs, and tears
# the cluster down on exit, failure, SIGTERM/SIGINT, and SIGUSR1 (Slurm's time-limit warning:
# the job is first asked to save the step it is on and stop, then the launcher requeues it so
# it resumes from that checkpoint).
# Every setting is an environment variable; docs/launch.md lists them. The training command is
# built from them by drpo_openrlhf/runtime/recipe.py.
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
    # --include-dashboard=true: every submission goes through the dashboard, so one that does
    # not start fails the head's start (by default Ray only logs it, and the head would run on
    # until `ray job submit` found nothing listening). --runtime-env-agent-port: else the
    # agent picks one, which the head's Ray Client server asks the GCS for; the GCS knows it
    # once the raylet has registered, which `ray start` starts only after the dashboard is
    # up, and the client server waits a hard-coded 30 s for it (get_node_with_retry in
    # ray/_private/services.py), then exits, and `ray start --block` stops the head with it:
    # a dashboard slower than that took the head down, whatever its own timeout.
    args=(--head --node-ip-address="$address" --port="$RAY_PORT" --dashboard-host="$address"
      --dashboard-port="$RAY_DASHBOARD_PORT" --include-dashboard=true
      --runtime-env-agent-port="$RAY_RUNTIME_ENV_AGENT_PORT" "${args[@]}")
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
# Settings of the launch itself. The training command's (MODEL, LR, METHOD, ...; the recipes
# export the model-specific ones) are read by drpo_openrlhf/runtime/recipe.py below.
# ---------------------------------------------------------------------------------------------
PYTHON=${PYTHON:-python}
RAY_PORT=${RAY_PORT:-6379}
RAY_DASHBOARD_PORT=${RAY_DASHBOARD_PORT:-8265}
RAY_WAIT_TIMEOUT=${RAY_WAIT_TIMEOUT:-600}
RAY_POLL_INTERVAL=${RAY_POLL_INTERVAL:-5}
TEARDOWN_TIMEOUT=${TEARDOWN_TIMEOUT:-30}
# Ray's own settings for a slow dashboard, with more time than Ray's defaults: each of the
# dashboard's module processes gets 30 s to start (then the dashboard fails, Ray 2.55's
# ray/dashboard/consts.py) and `ray start` waits 60 s for the dashboard
# (ray/_private/ray_constants.py). Under load (a test suite beside the job, a busy login node)
# the modules took longer: "Module MetricsHead failed to start. Timeout after 30.0 seconds".
# The second must exceed the first: the dashboard is up once its slowest module is.
: "${RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT:=120}"
: "${RAY_DASHBOARD_STARTUP_TIMEOUT_S:=180}"
# the head's runtime-env agent's port (see run_node); empty: a free one, chosen at each start
RAY_RUNTIME_ENV_AGENT_PORT=${RAY_RUNTIME_ENV_AGENT_PORT:-}
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
for name in RAY_WAIT_TIMEOUT TEARDOWN_TIMEOUT SUBMIT_ATTEMPTS RAY_DASHBOARD_STARTUP_TIMEOUT_S; do
  is_positive "${!name}" || die "$name must be a positive integer, got '${!name}'"
done
[[ $STOP_GRACE_S =~ ^[0-9]+$ ]] ||
  die "STOP_GRACE_S must be a whole number of seconds, got '$STOP_GRACE_S'"
[[ $RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT =~ ^[0-9]+([.][0-9]+)?$ ]] ||
  die "RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT must be a number of seconds," \
    "got '$RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT'"
[[ -z $RAY_RUNTIME_ENV_AGENT_PORT ]] || is_positive "$RAY_RUNTIME_ENV_AGENT_PORT" ||
  die "RAY_RUNTIME_ENV_AGENT_PORT must be a port number, got '$RAY_RUNTIME_ENV_AGENT_PORT'"

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

# ---------------------------------------------------------------------------------------------
# The training command, the run's directory and the job's environment, from the settings:
# drpo_openrlhf/runtime/recipe.py prints them as assignments (it reports a refused setting
# itself). Relative paths are the ones of the directory the launcher runs in.
# ---------------------------------------------------------------------------------------------
run_name="" ckpt_dir="" stop_file="" runtime_env="" train_args=()
plan=$(workdir=$PWD && cd "$repo_dir" && "$PYTHON" -m drpo_openrlhf.runtime.recipe \
  "$NNODES" "$GPUS_PER_NODE" "$job_name" "$workdir" "$@") || exit 1
eval "$plan"
mkdir -p "$ckpt_dir"

# Preflight: the entry point's own parser and checks (unknown flags, PPO-only flags, layouts
# that split prompt groups) on this node, in seconds, before any Ray node starts.
if [[ ${PREFLIGHT:-1} == 1 ]]; then
  check='import sys; from drpo_openrlhf.train import parse; parse(sys.argv[1:])'
  if ! problem=$(cd "$repo_dir" && "$PYTHON" -c "$check" "${train_args[@]}" 2>&1 >/dev/null); then
    die "invalid training command: ${problem##*$'\n'}"
  fi
fi

export GPUS_PER_NODE RAY_PORT RAY_DASHBOARD_PORT
export RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT RAY_DASHBOARD_STARTUP_TIMEOUT_S
export NET_IFACE=${NET_IFACE:-} RAY_START_ARGS=${RAY_START_ARGS:-}

# ---------------------------------------------------------------------------------------------
# Ray cluster, job, teardown.
# ---------------------------------------------------------------------------------------------
head_ip=127.0.0.1
[[ $LAUNCH_MODE == slurm ]] && head_ip=$(node_ip)
gcs=$head_ip:$RAY_PORT
dashboard=http://$head_ip:$RAY_DASHBOARD_PORT
submission_id=${run_name}-${SLURM_JOB_ID:-local}-${SLURM_RESTART_COUNT:-0}
node_pids=()
submit_pid=""
submit_err=""   # the current attempt's copy of `ray job submit`'s stderr
submit_err_fd="" # the pipe to its `tee`, open while an attempt runs
job_running=0
torn_down=0
head_out=$(mktemp "${TMPDIR:-/tmp}/drpo-head.XXXXXX") # a copy of the head step's output
head_tee=""                                           # the `tee` that writes it

# shellcheck disable=SC2329  # run by the traps below
teardown() {
  ((torn_down)) && return 0
  torn_down=1
  # a signal during a submission: its tee ends once the submit client does
  [[ -n $submit_err_fd ]] && exec {submit_err_fd}>&-
  [[ -n $submit_err ]] && rm -f -- "$submit_err"
  rm -f -- "$head_out"
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

# Waits until $1 GPUs have registered; returns 1 as soon as a Ray node has exited.
wait_for_gpus() {
  local expected=$1 deadline=$((SECONDS + RAY_WAIT_TIMEOUT)) have pid
  log "waiting for $expected GPU(s) to register with Ray at $gcs"
  while :; do
    for pid in "${node_pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || return 1
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

# Starts the head's node step in the background (node_pids[0]: the head comes first, alone).
# Its output reaches our stderr as it comes (stdout too: `ray start` prints its errors about
# exited processes there), and a copy is kept in $head_out to say why the head ended if it
# does: the copy's `tee` ignores the SIGINT/SIGTERM meant for the launcher and Ray (a `tee`
# gone would leave the node's teardown writing into a closed pipe) and ends when the step's
# output does. On this node (the batch host under Slurm) a free port is chosen for the head's
# runtime-env agent, unless RAY_RUNTIME_ENV_AGENT_PORT names one.
start_head() {
  local head_out_fd agent_port=$RAY_RUNTIME_ENV_AGENT_PORT
  [[ -n $agent_port ]] || agent_port=$("$PYTHON" -c 'import socket
s = socket.socket()
s.bind(("", 0))
print(s.getsockname()[1])')
  : >"$head_out"
  exec {head_out_fd}> >(trap '' INT TERM && exec tee -- "$head_out" >&2)
  head_tee=$!
  if [[ $LAUNCH_MODE == slurm ]]; then
    RAY_RUNTIME_ENV_AGENT_PORT=$agent_port srun --overlap --nodes=1 --ntasks=1 -w "$head_node" \
      bash "$self" node head "$head_ip" >&"$head_out_fd" 2>&1 &
  else
    RAY_RUNTIME_ENV_AGENT_PORT=$agent_port bash "$self" node head "$head_ip" >&"$head_out_fd" 2>&1 &
  fi
  node_pids=("$!")
  exec {head_out_fd}>&-
}

# Why the head's `ray start` ended, in one line, from the copy of its output: the dashboard's
# module that did not start (Ray prints the last lines of dashboard.log), else a raylet that
# did not register in time, else the Ray processes that exited, else the last line it printed
# (srun's own lines aside).
head_exit_cause() {
  wait_exit 5 "$head_tee"
  local text found
  text=$(sed 's/\x1b\[[0-9;]*m//g' -- "$head_out" 2>/dev/null || true)
  found=$({ grep -oE 'Module [A-Za-z0-9_]+ failed to start\..*' <<<"$text" || true; } | head -n 1)
  if [[ -n $found ]]; then
    echo "its dashboard did not start: $found (RAY_DASHBOARD_SUBPROCESS_MODULE_WAIT_READY_TIMEOUT)"
    return 0
  fi
  if grep -qF 'Failed to start the dashboard' <<<"$text"; then
    echo "its dashboard did not start within ${RAY_DASHBOARD_STARTUP_TIMEOUT_S}s" \
      "(RAY_DASHBOARD_STARTUP_TIMEOUT_S)"
    return 0
  fi
  if grep -qF 'The current node timed out during startup' <<<"$text"; then
    echo "its raylet did not register with the GCS within the 30 s Ray allows" \
      "(hard-coded in ray/_private/node.py; a loaded node can be that slow)"
    return 0
  fi
  found=$({ grep -oE '[A-Za-z_]+ \[exit code=[^]]*\]' <<<"$text" || true; } | paste -sd, -)
  if [[ -n $found ]]; then
    echo "Ray processes exited: ${found//,/, }"
    return 0
  fi
  found=$({ grep -v -e '^[[:space:]]*$' -e '^srun: ' <<<"$text" || true; } | tail -n 1)
  echo "ray start: ${found:-no output}"
}

log "mode=$LAUNCH_MODE nodes=$NNODES gpus/node=$GPUS_PER_NODE head=$head_node ($head_ip)" \
  "run=$run_name"
# A head that exits before its GPUs have registered is started once more (a loaded node may
# be slower than a dashboard's timeouts once), naming why; a second exit stops the launch.
start_head
if ! wait_for_gpus "$GPUS_PER_NODE"; then
  log "Ray's head exited before its GPUs registered: $(head_exit_cause); starting it again, once"
  start_head
  wait_for_gpus "$GPUS_PER_NODE" ||
    die "Ray's head exited again before its GPUs registered: $(head_exit_cause); its Ray logs" \
      "on $head_node (session_latest/logs under ${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray) say more"
fi
if ((NNODES > 1)); then
  srun --overlap --nodes="$((NNODES - 1))" --ntasks="$((NNODES - 1))" --ntasks-per-node=1 \
    --exclude="$head_node" bash "$self" node worker "$gcs" &
  node_pids+=("$!")
  wait_for_gpus "$world" || die "a Ray node exited before the cluster was ready (see above)"
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
