#!/usr/bin/env bash
# Submit the whole pipeline to Slurm as one dependency chain:
#
#   distill[LANG] (array)  ─aftercorr─┐
#   pretrain (once)        ─afterok───┴─> finetune[LANG] (array) ─aftercorr─> eval[LANG] (array)
#
#   slurm/submit.sh [--recipe NAME] [--langs "de-en fr-en"] [options] [key=value ...]
#
# Array task i of every stage handles the i-th pair, so finetune task i waits only for distill task i.
# With --distill-shards N, distill has N tasks per pair (task i: pair i // N, shard i % N) and finetune
# waits for the whole distill array (afterok).
# A failed stage cancels its dependents (the cluster needs DependencyParameters=kill_invalid_depend).
# Prints one `stage=JOBID` line per submitted job. The config is composed once per pair before anything
# is submitted, so a bad override fails here in one line instead of in a queued job.
#
# Every job asks for the GPUs of --gpus-per-node (distill: a vLLM replica per GPU; training: a rank per
# GPU; eval: a process per GPU) and, per GPU, --cpus-per-gpu CPUs and --mem-per-gpu memory, so that no
# two ranks share a core. A recipe that needs GPUs (needs_gpu: true) is refused without any, and so is
# any GPU job while the venv is a CPU build.
#
# Options (environment variable in brackets; sbatch's own SBATCH_* variables, e.g. SBATCH_ACCOUNT,
# SBATCH_TIMELIMIT, SBATCH_QOS, apply to every job too):
#   --recipe NAME         recipe [RECIPE, default local]
#   --langs "A B"         language pairs [LANG_PAIRS, default de-en]
#   --partition NAME      partition [SPECDRAFT_PARTITION, default: the cluster's default]
#   --gpus-per-node N     GPUs for every job, 0 for CPU nodes [SPECDRAFT_GPUS_PER_NODE, default: a node's
#                         GPUs (sinfo) for a recipe that needs them, else 0]
#   --cpus-per-gpu N      CPUs per GPU [SPECDRAFT_CPUS_PER_GPU, default 8]
#   --mem-per-gpu SIZE    memory per GPU, e.g. 64G [SPECDRAFT_MEM_PER_GPU, default 64G]
#   --cpus N              CPUs per job instead [SPECDRAFT_CPUS, default: per GPU, or the cluster's default]
#   --mem SIZE            memory per node instead [SPECDRAFT_MEM, default: per GPU, or the cluster's default]
#   --train-nodes N       nodes for pretrain and finetune [SPECDRAFT_TRAIN_NODES, default 1]
#   --distill-shards N    split each pair's prompts over N distill jobs, which finetune reads as one set
#                         [SPECDRAFT_DISTILL_SHARDS, default 1]
#   --time LIMIT          time limit of every job; training requeues itself and resumes [SPECDRAFT_TIME]
#   --log-dir DIR         job logs [SPECDRAFT_SLURM_LOGS, default runs/slurm]
#   --config-dir DIR      your own configs, laid out like conf/ [SPECDRAFT_CONFIG_DIR; the jobs inherit it]
#   --dry-run             print the sbatch command lines instead of submitting them
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
caller=$PWD
cd "$root"

recipe=${RECIPE:-local}
langs=${LANG_PAIRS:-de-en}
partition=${SPECDRAFT_PARTITION:-}
gpus=${SPECDRAFT_GPUS_PER_NODE:-}
cpus_per_gpu=${SPECDRAFT_CPUS_PER_GPU:-8}
mem_per_gpu=${SPECDRAFT_MEM_PER_GPU:-64G}
cpus=${SPECDRAFT_CPUS:-}
mem=${SPECDRAFT_MEM:-}
train_nodes=${SPECDRAFT_TRAIN_NODES:-1}
shards=${SPECDRAFT_DISTILL_SHARDS:-1}
time_limit=${SPECDRAFT_TIME:-}
log_dir=${SPECDRAFT_SLURM_LOGS:-runs/slurm}
dry_run=""
overrides=()

fail() { echo "error: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case $1 in
        --recipe) recipe=${2:?--recipe needs a value}; shift 2 ;;
        --langs) langs=${2:?--langs needs a value}; shift 2 ;;
        --partition) partition=${2:?--partition needs a value}; shift 2 ;;
        --gpus-per-node) gpus=${2:?--gpus-per-node needs a value}; shift 2 ;;
        --cpus-per-gpu) cpus_per_gpu=${2:?--cpus-per-gpu needs a value}; shift 2 ;;
        --mem-per-gpu) mem_per_gpu=${2:?--mem-per-gpu needs a value}; shift 2 ;;
        --cpus) cpus=${2:?--cpus needs a value}; shift 2 ;;
        --mem) mem=${2:?--mem needs a value}; shift 2 ;;
        --train-nodes) train_nodes=${2:?--train-nodes needs a value}; shift 2 ;;
        --distill-shards) shards=${2:?--distill-shards needs a value}; shift 2 ;;
        --time) time_limit=${2:?--time needs a value}; shift 2 ;;
        --log-dir) log_dir=${2:?--log-dir needs a value}; shift 2 ;;
        --config-dir) SPECDRAFT_CONFIG_DIR=$(cd "$caller" && cd "${2:?--config-dir needs a value}" && pwd) || fail "--config-dir $2 does not exist"
                      export SPECDRAFT_CONFIG_DIR; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        recipe=* | lang=*) fail "pass '$1' as --recipe/--langs, not as an override" ;;
        *=*) overrides+=("$1"); shift ;;
        *) fail "unknown argument '$1'; see slurm/submit.sh --help" ;;
    esac
done
read -r -a pairs <<<"$langs"
((${#pairs[@]})) || fail "--langs is empty"
[[ $gpus =~ ^[0-9]*$ && $train_nodes =~ ^[1-9][0-9]*$ && $shards =~ ^[1-9][0-9]*$ && $cpus_per_gpu =~ ^[1-9][0-9]*$ ]] ||
    fail "--gpus-per-node, --cpus-per-gpu, --train-nodes and --distill-shards take integers"
[[ $mem_per_gpu =~ ^[1-9][0-9]*[KMGT]?$ ]] || fail "--mem-per-gpu takes a size such as 64G"
[[ -n $dry_run ]] || command -v sbatch >/dev/null || fail "sbatch not found: run this on a Slurm login node (or start slurm/local-cluster.sh)"

# Validate every pair's config now (a distill shard's too), and learn whether finetune starts from pretrain
# (P-F) or not (F-only), whether the recipe needs GPUs, and whether the venv is a CPU build (make install's
# stamp, else torch's version suffix).
PY=${SPECDRAFT_PYTHON:-.venv/bin/python}
composed=$("$PY" -c '
import sys
from importlib.metadata import version
from pathlib import Path
from pipeline.config import ConfigError, FinetuneMode, compose_config
recipe, pairs, nodes, shards, overrides = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:]
sharded = [f"distill.num_shards={shards}", "distill.shard=0"] if shards > 1 else []
try:
    cfgs = [compose_config([f"recipe={recipe}", f"lang={pair}", *overrides, *sharded]) for pair in pairs]
    for stage in ("pretrain", "finetune"):
        if nodes > 1 and cfgs[0].train[stage].launch == "single":
            raise ConfigError(f"--train-nodes {nodes} needs a multi-process launch: pass train.{stage}.launch=ddp "
                              f"and train.{stage}.num_processes=<processes on all nodes>")
except ConfigError as exc:
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)
builds = [p.name.removeprefix(".installed-") for p in Path(sys.prefix).glob(".installed-*")]
torch = version("torch")
cpu_build = next((b for b in builds if "cpu" in b), None) or (f"torch=={torch}" if "+cpu" in torch else "-")
print(int(cfgs[0].train.finetune.mode == FinetuneMode.pretrain_finetune), int(any(c.needs_gpu for c in cfgs)), cpu_build)
' "$recipe" "$langs" "$train_nodes" "$shards" "${overrides[@]}")
read -r needs_pretrain needs_gpu cpu_build <<<"$composed"

# The most GPUs a node of the partition (or of the cluster's default one) has: sinfo's gres, e.g. gpu:h100:8.
node_gpus() {
    { sinfo -h -o '%P %G' 2>/dev/null || true; } | awk -v want="$partition" '
        (want == "" && $1 ~ /\*$/) || $1 == want {
            while (match($2, /gpu(:[^:,(]+)?:[0-9]+/)) {
                n = substr($2, RSTART, RLENGTH); sub(/.*:/, "", n)
                if (n + 0 > most) most = n + 0
                $2 = substr($2, RSTART + RLENGTH)
            }
        }
        END { print most + 0 }'
}
gpus_given=$gpus
if [[ -z $gpus ]]; then
    gpus=0
    ((needs_gpu)) && gpus=$(node_gpus)
fi
if ((needs_gpu && gpus == 0)); then
    fail "recipe $recipe needs GPUs (needs_gpu: true) but --gpus-per-node is 0$([[ -n $gpus_given ]] || echo " (sinfo lists no GPU on ${partition:-the default partition}'s nodes)"): pass --gpus-per-node N (a node's GPUs, e.g. 8)"
fi
if ((gpus > 0)) && [[ $cpu_build != - ]]; then
    refusal="$(dirname "$(dirname "$PY")") is a CPU build ($cpu_build, which make install picks where nvidia-smi finds no GPU) and cannot use the GPUs these jobs ask for: rm -rf .venv && make install EXTRAS=gpu,dev"
    [[ -n $dry_run ]] || fail "$refusal"
    echo "warning: $refusal (--dry-run: the lines anyway)" >&2
fi
if ((gpus > 0)); then
    cpus=${cpus:-$((gpus * cpus_per_gpu))}
    mem=${mem:-$((gpus * ${mem_per_gpu%[KMGT]}))${mem_per_gpu##*[0-9]}}
fi

common=(--parsable --open-mode=append --chdir="$root")
[[ -n $partition ]] && common+=(--partition="$partition")
[[ -n $cpus ]] && common+=(--cpus-per-task="$cpus")
[[ -n $mem ]] && common+=(--mem="$mem")
[[ -n $time_limit ]] && common+=(--time="$time_limit")
((gpus > 0)) && common+=(--gpus-per-node="$gpus")
# Array task i runs the pair i // PAIR_TASKS of LANG_PAIRS (slurm/common.sh): distill has a task per
# shard of each pair, the other stages one per pair.
array_of() {  # array_of TASKS_PER_PAIR: sets `array`, the options of an array job with that many tasks per pair
    array=(--array="0-$((${#pairs[@]} * $1 - 1))" --export="ALL,LANG_PAIRS=$langs,PAIR_TASKS=$1"
           --output="$log_dir/%x-%A_%a.out")
}
# Every stage after distill reads its N shards as one set: every job composes distill.num_shards=N.
args=("recipe=$recipe" "${overrides[@]}")
((shards > 1)) && args+=("distill.num_shards=$shards")
[[ -n $dry_run ]] || mkdir -p "$log_dir"

submitted=()
submit() {  # submit STAGE SBATCH-OPTIONS...: sets job_id and prints `STAGE=JOBID` (the command with --dry-run)
    local stage=$1
    shift
    if [[ -n $dry_run ]]; then
        local word line=()
        for word in sbatch "${common[@]}" "$@" "slurm/$stage.sbatch" "${args[@]}"; do
            [[ $word =~ ^[][A-Za-z0-9_./:=,%+@-]+$ ]] && line+=("$word") || line+=("${word@Q}")
        done
        echo "${line[*]}"
        job_id=${stage^^}_JOB  # what the dependents' lines name instead of a job id
        return
    fi
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

array_of "$shards"
submit distill "${array[@]}"
# Finetune reads every shard of its pair: with shards, it waits for the whole distill array.
after_distill=aftercorr:$job_id
((shards > 1)) && after_distill=afterok:$job_id
after_pretrain=""
if ((needs_pretrain)); then
    # Language independent: one job, run with the first pair (the pair does not enter its config hash).
    submit pretrain --nodes="$train_nodes" --export="ALL,LANG_PAIR=${pairs[0]}" --output="$log_dir/%x-%j.out"
    after_pretrain=",afterok:$job_id"
fi
array_of 1
submit finetune "${array[@]}" --nodes="$train_nodes" --dependency="$after_distill$after_pretrain"
submit eval "${array[@]}" --dependency="aftercorr:$job_id"
