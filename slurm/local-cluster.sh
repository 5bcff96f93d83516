#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests, CI and trying slurm/ out:
#
#   slurm/local-cluster.sh up DIR [NODES]   # start munged, slurmctld and NODES slurmd (default 1);
#                                           # conf, state and logs under DIR
#   export SLURM_CONF=DIR/slurm.conf       # what clients (sbatch, squeue, scontrol) need
#   slurm/local-cluster.sh down DIR         # cancel its jobs and stop its daemons
#
# NODES > 1 emulates a multi-node cluster on this one host (one slurmd per node, each on its own port,
# each offering the host's CPUs): enough to run multi-node jobs (srun, accelerate rendezvous) for real,
# not to add compute.
#
# Needs root and Debian's `munge slurmctld slurmd slurm-client procps` (see .ci/run). Works without
# systemd or cgroups: processes are tracked through /proc, nothing is bound or accounted. Every daemon runs detached
# with its stdio redirected (a daemon holding the caller's stdout would keep CI's log open forever).
# Ports: SLURMCTLD_PORT (6817) and SLURMD_PORT (6818).
set -euo pipefail

usage() { echo "usage: $0 up DIR [NODES] | down DIR" >&2; exit 2; }
[[ $# -ge 2 && $# -le 3 ]] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
nodes=${3:-1}
[[ $nodes =~ ^[1-9][0-9]*$ ]] || usage
slurmd_port=${SLURMD_PORT:-6818}
conf=$dir/slurm.conf
export SLURM_CONF=$conf

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "local-cluster: $what did not come up; logs in $dir/log" >&2
            tail -n 5 "$dir"/log/*.log >&2 || true
            exit 1
        fi
        sleep 0.5
    done
}

stop_pid() {  # stop_pid PIDFILE: TERM the daemon that wrote PIDFILE and wait for it to exit
    local file=$1 pid
    [[ -s $file ]] || return 0
    pid=$(<"$file")
    if kill "$pid" 2>/dev/null; then
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    fi
    rm -f "$file"
}

write_conf() {
    local host hardware i
    host=$(hostname -s)
    # This host's real CPUs, sockets and memory, for every node.
    hardware=$(slurmd -C | head -n 1 | sed "s/^NodeName=[^ ]* //")
    cat >"$conf" <<EOF
# Written by slurm/local-cluster.sh: a one-node cluster for tests.
ClusterName=specdraft-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job may start again cred_expire + 1 s after its previous run (default 120 s);
# starting it earlier by hand races the revoked credential of that run and fails the job.
AuthInfo=socket=$dir/munge-socket/munge.socket,cred_expire=30
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# No systemd, no cgroups: track job processes through /proc; no binding, no accounting daemon.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# One line per finished job (id, name, state, start and end time): sacct needs slurmdbd, this does not.
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# A job whose dependency can never be met (an upstream stage failed) is cancelled instead of pending forever.
DependencyParameters=kill_invalid_depend
# Schedule every second: dependency chains run about three times faster than with the defaults.
SchedulerParameters=sched_interval=1,bf_interval=1
# Reject a request the cluster can never satisfy (GPUs, more nodes) at submission instead of pending forever.
EnforcePartLimits=ALL
# Finished jobs stay visible to scontrol for an hour.
MinJobAge=3600
ReturnToService=2
MpiDefault=none
MailProg=/bin/true
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    for i in $(seq "$nodes"); do
        echo "NodeName=node$i NodeHostname=$host NodeAddr=127.0.0.1 Port=$((slurmd_port + i - 1)) $hardware State=UNKNOWN"
    done >>"$conf"
}

up() {
    for tool in munged slurmctld slurmd sbatch pgrep; do
        command -v $tool >/dev/null && continue
        echo "local-cluster: $tool not found; apt-get install munge slurmctld slurmd slurm-client procps" >&2
        exit 1
    done
    [[ $(id -u) -eq 0 ]] || { echo "local-cluster: needs root (SlurmUser=root)" >&2; exit 1; }
    mkdir -p "$dir"/{munge,munge-socket,state,spool,run,log}
    # munged refuses directories others can write to: key and log private, the socket's dir world-readable.
    chmod 0700 "$dir/munge" "$dir/log"
    chmod 0755 "$dir" "$dir/munge-socket"
    [[ -s $dir/munge/munge.key ]] || mungekey --create --keyfile="$dir/munge/munge.key"
    chmod 0600 "$dir/munge/munge.key"
    write_conf
    setsid munged --force --socket="$dir/munge-socket/munge.socket" --key-file="$dir/munge/munge.key" \
        --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
        </dev/null >>"$dir/log/munged.stdio.log" 2>&1
    wait_for 10 munged munge --socket="$dir/munge-socket/munge.socket" --no-input
    # -c: a fresh cluster; both daemons fork into the background themselves.
    setsid slurmctld -c -f "$conf" </dev/null >>"$dir/log/slurmctld.stdio.log" 2>&1
    wait_for 30 slurmctld scontrol ping
    for i in $(seq "$nodes"); do
        setsid slurmd -N "node$i" -f "$conf" </dev/null >>"$dir/log/slurmd-node$i.stdio.log" 2>&1
    done
    wait_for 60 "every node" bash -c "[[ \$(sinfo -h -N -t idle -o %N | wc -l) -eq $nodes ]]"
    echo "export SLURM_CONF=$conf"
}

down() {
    [[ -f $conf ]] || return 0
    if scontrol ping >/dev/null 2>&1; then
        scancel --full --quiet --user="$(id -un)" || true
        # Jobs get SIGTERM, then SIGKILL after KillWait; wait until none is left on the node.
        for _ in $(seq 120); do [[ -z $(squeue -h -t RUNNING,COMPLETING -o %i) ]] && break; sleep 0.5; done
    fi
    for pidfile in "$dir"/run/slurmd-*.pid; do stop_pid "$pidfile"; done
    stop_pid "$dir/run/slurmctld.pid"
    stop_pid "$dir/run/munged.pid"
}

case $action in
    up) up ;;
    down) down ;;
    *) usage ;;
esac
