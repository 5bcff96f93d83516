#!/usr/bin/env bash
# Submit the whole pipeline to Slurm as one dependency chain:
#
#   distill[LANG] (array)  ─aftercorr─┐
#   pretrain (once)        ─afterok───┴─> finetune[LANG] (array) ─aftercorr─> eval[LANG] (array)
#
#   slurm/submit.sh [--recipe NAME] [--langs "de-en fr-en"] [options] [key=value ...]
#
# Array task i of every stage handles the i-th pair, so finetune task i waits only for distill task i.
# A failed stage cancels its dependents (the cluster needs DependencyParameters=kill_invalid_depend).
# Prints one `stage=JOBID` line per submitted job. The config is composed once per pair before anything
# is submitted, so a bad override fails here in one line instead of in a queued job.
#
# Options (environment variable in brackets; sbatch's own SBATCH_* variables, e.g. SBATCH_ACCOUNT,
# SBATCH_TIMELIMIT, SBATCH_QOS, apply to every job too):
#   --recipe NAME         recipe [RECIPE, default local]
#   --langs "A B"         language pairs [LANG_PAIRS, default de-en]
#   --partition NAME      partition [SPECDRAFT_PARTITION, default: the cluster's default]
#   --gpus-per-node N     GPUs for every job, 0 for CPU nodes [SPECDRAFT_GPUS_PER_NODE, default 0]
#   --cpus N              CPUs per job [SPECDRAFT_CPUS, default: the cluster's default]
#   --train-nodes N       nodes for pretrain and finetune [SPECDRAFT_TRAIN_NODES, default 1]
#   --time LIMIT          time limit of every job; training requeues itself and resumes [SPECDRAFT_TIME]
#   --log-dir DIR         job logs [SPECDRAFT_SLURM_LOGS, default runs/slurm]
#   --config-dir DIR      your own configs, laid out like conf/ [SPECDRAFT_CONFIG_DIR; the jobs inherit it]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
caller=$PWD
cd "$root"

recipe=${RECIPE:-local}
langs=${LANG_PAIRS:-de-en}
partition=${SPECDRAFT_PARTITION:-}
gpus=${SPECDRAFT_GPUS_PER_NODE:-0}
cpus=${SPECDRAFT_CPUS:-}
train_nodes=${SPECDRAFT_TRAIN_NODES:-1}
time_limit=${SPECDRAFT_TIME:-}
log_dir=${SPECDRAFT_SLURM_LOGS:-runs/slurm}
overrides=()

fail() { echo "error: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --recipe) recipe=${2:?--recipe needs a value}; shift 2 ;;
        --langs) langs=${2:?--langs needs a value}; shift 2 ;;
        --partition) partition=${2:?--partition needs a value}; shift 2 ;;
        --gpus-per-node) gpus=${2:?--gpus-per-node needs a value}; shift 2 ;;
        --cpus) cpus=${2:?--cpus needs a value}; shift 2 ;;
        --train-nodes) train_nodes=${2:?--train-nodes needs a value}; shift 2 ;;
        --time) time_limit=${2:?--time needs a value}; shift 2 ;;
        --log-dir) log_dir=${2:?--log-dir needs a value}; shift 2 ;;
        --config-dir) SPECDRAFT_CONFIG_DIR=$(cd "$caller" && cd "${2:?--config-dir needs a value}" && pwd) || fail "--config-dir $2 does not exist"
                      export SPECDRAFT_CONFIG_DIR; shift 2 ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        recipe=* | lang=*) fail "pass '$1' as --recipe/--langs, not as an override" ;;
        *=*) overrides+=("$1"); shift ;;
        *) fail "unknown argument '$1'; see slurm/submit.sh --help" ;;
    esac
done
read -r -a pairs <<<"$langs"
((${#pairs[@]})) || fail "--langs is empty"
[[ $gpus =~ ^[0-9]+$ && $train_nodes =~ ^[1-9][0-9]*$ ]] || fail "--gpus-per-node and --train-nodes take integers"
command -v sbatch >/dev/null || fail "sbatch not found: run this on a Slurm login node (or start slurm/local-cluster.sh)"

# Validate every pair's config now, and learn whether finetune starts from pretrain (P-F) or not (F-only).
PY=${SPECDRAFT_PYTHON:-.venv/bin/python}
needs_pretrain=$("$PY" -c '
import sys
from pipeline.config import ConfigError, FinetuneMode, compose_config
recipe, pairs, nodes, overrides = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4:]
try:
    cfgs = [compose_config([f"recipe={recipe}", f"lang={pair}", *overrides]) for pair in pairs]
    for stage in ("pretrain", "finetune"):
        if nodes > 1 and cfgs[0].train[stage].launch == "single":
            raise ConfigError(f"--train-nodes {nodes} needs a multi-process launch: pass train.{stage}.launch=ddp "
                              f"and train.{stage}.num_processes=<processes on all nodes>")
except ConfigError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
print(int(cfgs[0].train.finetune.mode == FinetuneMode.pretrain_finetune))
' "$recipe" "$langs" "$train_nodes" "${overrides[@]}")

mkdir -p "$log_dir"
common=(--parsable --open-mode=append --chdir="$root")
[[ -n $partition ]] && common+=(--partition="$partition")
[[ -n $cpus ]] && common+=(--cpus-per-task="$cpus")
[[ -n $time_limit ]] && common+=(--time="$time_limit")
((gpus > 0)) && common+=(--gpus-per-node="$gpus")
# Array task i runs the i-th pair of LANG_PAIRS (slurm/common.sh).
array=(--array="0-$((${#pairs[@]} - 1))" --export="ALL,LANG_PAIRS=$langs" --output="$log_dir/%x-%A_%a.out")
args=("recipe=$recipe" "${overrides[@]}")

submitted=()
submit() {  # submit STAGE SBATCH-OPTIONS...: sets job_id and prints `STAGE=JOBID`
    local stage=$1
    shift
    if ! job_id=$(sbatch "${common[@]}" "$@" "slurm/$stage.sbatch" "${args[@]}"); then
        # No half-submitted chain left behind: a dependent would otherwise wait for a job that never comes.
        if ((${#submitted[@]})); then
            scancel "${submitted[@]}"
            echo "cancelled the jobs already submitted: ${submitted[*]}" >&2
        fi
        fail "sbatch refused the $stage job (its message is above)"
    fi
    submitted+=("$job_id")
    echo "$stage=$job_id"
}

submit distill "${array[@]}"
distill=$job_id
after_pretrain=""
if ((needs_pretrain)); then
    # Language independent: one job, run with the first pair (the pair does not enter its config hash).
    submit pretrain --nodes="$train_nodes" --export="ALL,LANG_PAIR=${pairs[0]}" --output="$log_dir/%x-%j.out"
    after_pretrain=",afterok:$job_id"
fi
submit finetune "${array[@]}" --nodes="$train_nodes" --dependency="aftercorr:$distill$after_pretrain"
submit eval "${array[@]}" --dependency="aftercorr:$job_id"
