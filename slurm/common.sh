# Sourced by every slurm/*.sbatch script; the job runs in the repo root (slurm/submit.sh passes --chdir).
set -euo pipefail
[[ -f pipeline/__main__.py ]] || { echo "error: the job must run in the specdraft repo root (sbatch --chdir=REPO)" >&2; exit 2; }

# sbatch exports the caller's environment, whose LANG is a locale that may not exist on this node:
# children get one that always does. The language pair travels as LANG_PAIR, never LANG.
export LANG=C.UTF-8 LC_ALL=C.UTF-8 PYTHONUNBUFFERED=1
# Compute nodes have no hub: every stage reads what `make prepare` cached on the login node (HF_HOME must be a
# filesystem both see), and names `make prepare` in one line when something is missing. HF_HUB_OFFLINE=0 lets
# a cluster with internet on its nodes fetch on demand.
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
PY=${SPECDRAFT_PYTHON:-.venv/bin/python}

# An array job runs PAIR_TASKS tasks per pair (distill: one per prompt shard; 1 elsewhere): task i takes
# the (i // PAIR_TASKS)-th word of LANG_PAIRS.
PAIR_TASKS=${PAIR_TASKS:-1}
if [[ -n ${SLURM_ARRAY_TASK_ID:-} && -n ${LANG_PAIRS:-} ]]; then
    read -r -a pairs <<<"$LANG_PAIRS"
    LANG_PAIR=${pairs[$((SLURM_ARRAY_TASK_ID / PAIR_TASKS))]:?"array task $SLURM_ARRAY_TASK_ID has no pair in LANG_PAIRS='$LANG_PAIRS'"}
fi
LANG_PAIR=${LANG_PAIR:-de-en}
echo "job ${SLURM_JOB_ID:-none} (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname): ${SLURM_JOB_NAME:-stage} lang=$LANG_PAIR"

# run_session COMMAND...: run COMMAND in a session of its own (its id in $session) and return COMMAND's
# exit status once EVERY process of that session has exited: a launcher (accelerate launch, torchrun)
# can die of a signal while its workers are still writing the checkpoint, and when a job step's main
# process exits, Slurm kills whatever is left of it.
run_session() {
    local status
    setsid "$@" &
    session=$!
    while :; do
        status=0
        wait "$session" || status=$?
        kill -0 "$session" 2>/dev/null || break  # exited, rather than a trap interrupting the wait
    done
    while pgrep -s "$session" >/dev/null; do sleep 1; done
    return "$status"
}

# run_requeueable COMMAND...: run the stage; when Slurm warns that the time limit is near
# (#SBATCH --signal=B:USR1@SECONDS reaches only this shell), stop it (training checkpoints and exits)
# and requeue the job, whose rerun resumes (stage directories are deterministic; training has
# resume=auto). The stage gets SIGTERM, which every stage handles; srun gets USR1, which it relays to
# every process of its step (it answers TERM by killing them), and training handles USR1 as TERM.
run_requeueable() {
    local status=0 time_up="" signal=TERM
    [[ $1 == srun ]] && signal=USR1
    trap 'echo "time limit near: stopping the stage to requeue"; time_up=1; kill -$signal "$session" || true' USR1
    run_session "$@" || status=$?
    trap - USR1
    if [[ -n $time_up && $status -ne 0 ]]; then
        echo "requeueing job $SLURM_JOB_ID (stage exited $status after checkpointing)"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}

# run_training STAGE OVERRIDES...: pretrain or finetune on every node of the allocation.
# One node: the stage itself (it starts `accelerate launch` for train.<stage>.num_processes > 1).
# Several nodes: srun runs slurm/train-node.sh once per node, each expanding its own SLURM_NODEID;
# the rendezvous address is the allocation's first node's.
run_training() {
    local stage=$1
    shift
    if ((${SLURM_NNODES:-1} == 1)); then
        run_requeueable "$PY" -m pipeline "$stage" "$@" "lang=$LANG_PAIR"
        return
    fi
    local head
    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    # The node's address as Slurm reaches it (NodeAddr: the node name itself unless the cluster says otherwise).
    MAIN_PROCESS_IP=$(scontrol show node "$head" | grep -oP 'NodeAddr=\K\S+')
    MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-$((20000 + SLURM_JOB_ID % 20000))}  # per job: two jobs on a node never share it
    export MAIN_PROCESS_IP MAIN_PROCESS_PORT
    # srun does not inherit the job's --cpus-per-task (Slurm >= 22.05): without it each node's ranks
    # would be bound to one CPU.
    run_requeueable srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
        --kill-on-bad-exit=1 slurm/train-node.sh "$stage" "$@" "lang=$LANG_PAIR"
}
