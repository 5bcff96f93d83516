#!/usr/bin/env bash
# One node's share of a multi-node pretrain/finetune job: `srun` runs it once per node (run_training in
# slurm/common.sh). It runs on that node, so SLURM_NODEID here is this node's own rank.
#   slurm/train-node.sh STAGE OVERRIDES...   (needs MAIN_PROCESS_IP, MAIN_PROCESS_PORT)
source slurm/common.sh
stage=$1
shift
# The stage passes these to its `accelerate launch` (pipeline/training/launch.py).
export SPECDRAFT_LAUNCH_ARGS="--num_machines $SLURM_NNODES --machine_rank $SLURM_NODEID \
--main_process_ip $MAIN_PROCESS_IP --main_process_port $MAIN_PROCESS_PORT"
echo "node $SLURM_NODEID of $SLURM_NNODES ($(hostname)): accelerate launch with main process $MAIN_PROCESS_IP:$MAIN_PROCESS_PORT"
# A preemption signal reaches every process of the step, this one too: outlive the workers' checkpoint.
trap 'echo "node $SLURM_NODEID: signalled; waiting for its processes to checkpoint and exit"' USR1 TERM
if ((SLURM_NODEID == 0)); then
    # The stage proper: manifest, tracker, accelerate launch as machine 0, completion marker.
    run_session "$PY" -m pipeline "$stage" "$@"
else
    # Every other node starts only its accelerate workers, with the same composed config; the stage's
    # bookkeeping stays with node 0, so nothing is written twice.
    status=0
    run_session "$PY" -c '
import os, sys
from omegaconf import OmegaConf
from pipeline.errors import USER_ERRORS
from pipeline.config import compose_config
from pipeline.device import check_slurm_gpus
from pipeline.prepare import offline_when_prepared
from pipeline.registry import REGISTRY
from importlib import import_module
from pipeline.models.provision import load_tokenizer, model_path
from pipeline.rundir import stage_dir
from pipeline.stages.finetune import cached_examples
from pipeline.training.data import write_pretrain_tokens
from pipeline.training.launch import accelerate_command, launch_env
from pipeline.workers import exit_on_preemption
stage, config_file, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
os.umask(0o077)  # the config file in a shared TMPDIR: readable by this user only
try:  # the checks the stage makes on node 0; the hub stays off here too once `make prepare` cached everything
    cfg = compose_config(overrides)
    check_slurm_gpus()
    offline_when_prepared(cfg)
    OmegaConf.save(cfg, config_file, resolve=True)
    # The data node 0 tokenizes before its launch: tokenized here or, under the cache'\''s lock, waited for, here and
    # not in torchrun'\''s rendezvous, whose store gives up after 600 s (C4, a large distill set take longer); a
    # requeued job finds it cached. Preempted meanwhile: exit 75, as node 0'\''s stage.
    with exit_on_preemption(f"{stage}: this node stopped before its training started"):
        if stage == "finetune":
            cached_examples(cfg, stage_dir(cfg, stage))
        elif stage == "pretrain":
            tokenizer = load_tokenizer(model_path(cfg.target, cfg.paths.models_dir))
            write_pretrain_tokens(cfg, tokenizer, cfg.train.pretrain.token_budget)
    # exec'\''d into the reaper below, so it watches this node'\''s shell (the srun task), not itself
    train = import_module(REGISTRY[stage].module).train
    command = accelerate_command(cfg, stage, train, config_file, stage_pid=os.getppid())
except USER_ERRORS as exc:
    sys.exit(f"error: {exc}")
os.execve(command[0], command, launch_env(cfg.train[stage].launch))
' "$stage" "${TMPDIR:-/tmp}/specdraft-$SLURM_JOB_ID-$stage-node$SLURM_NODEID.yaml" "$@" || status=$?
    # Preempted (75, EXIT_PREEMPTED in pipeline/workers.py: every worker checkpointed) is node 0's to
    # report, which requeues the job: a failure here would make srun (--kill-on-bad-exit) kill node 0's stage.
    ((status == 75)) && status=0
    exit "$status"
fi
