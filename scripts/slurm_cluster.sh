#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for trying and testing DepthBench's SLURM path
# (`snakemake --profile slurm`): this host is the only node, munged + slurmctld + slurmd run as
# root, jobs are tracked by process (proctrack/linuxproc) and allocated by CPU and memory
# (select/cons_tres). Needs root and Debian/Ubuntu (apt-get installs slurm-wlm and munge when
# missing). Idempotent: `start` on a running cluster only checks it.
#
#   scripts/slurm_cluster.sh start    install where missing, configure, start, wait until idle
#   scripts/slurm_cluster.sh stop     stop the daemons this script started
#   scripts/slurm_cluster.sh status   daemons, partitions and the queue
#
# Environment: DEPTHBENCH_SLURM_CPUS (the node's CPUs, default 2), DEPTHBENCH_SLURM_ACCOUNTING
# (`none`, the default, or `slurmdbd`: slurmdbd + MariaDB, so that `sacct` works).
# Partitions: `debug` (default) and `long`, both the whole node. A requeued job may start again
# after 5 s (AuthInfo cred_expire; SLURM's default is 120 s).
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by DepthBench scripts/slurm_cluster.sh"
STATE=/var/lib/depthbench-slurm         # pid files, spool, state, logs
CPUS=${DEPTHBENCH_SLURM_CPUS:-2}
ACCOUNTING=${DEPTHBENCH_SLURM_ACCOUNTING:-none}
NODE=$(hostname -s)
CHANGED=0                               # set when slurm.conf was (re)written: daemons restart

die() { echo "slurm_cluster.sh: $*" >&2; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
  local pkgs=()
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null || pkgs+=(slurm-wlm)
  command -v munged >/dev/null || pkgs+=(munge)
  if [ "$ACCOUNTING" = slurmdbd ]; then
    command -v slurmdbd >/dev/null || pkgs+=(slurmdbd)
    command -v mariadbd >/dev/null || pkgs+=(mariadb-server)
  fi
  [ ${#pkgs[@]} -eq 0 ] && return
  command -v apt-get >/dev/null || die "missing ${pkgs[*]} and no apt-get; install them by hand"
  echo "installing ${pkgs[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
}

write_config() {
  [ ! -e "$CONF" ] || grep -qF "$MARK" "$CONF" || die "$CONF exists and was not written by this script; not touching it"
  local mem storage
  # the node's memory in MB, less 10% for the system (jobs ask for --mem; cons_tres counts it)
  mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
  storage="AccountingStorageType=accounting_storage/none"
  [ "$ACCOUNTING" = slurmdbd ] && storage="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost"
  mkdir -p "$CONF_DIR" "$STATE"/{ctld,spool,log}
  cat >"$CONF.tmp" <<EOF
$MARK
ClusterName=depthbench
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job waits cred_expire + 1 s before it may start again (default 120 s)
AuthInfo=cred_expire=5
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
# run the main scheduling loop every 2 s (default 60 s): a requeued job starts when eligible
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
ReturnToService=2
# SIGTERM to SIGKILL on cancel, preemption or time-out (default 30 s)
KillWait=5
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$storage
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=long Nodes=$NODE Default=NO MaxTime=INFINITE State=UP
EOF
  if cmp -s "$CONF.tmp" "$CONF"; then rm "$CONF.tmp"; else mv "$CONF.tmp" "$CONF"; CHANGED=1; fi
}

start_munge() {
  alive /run/munge/munged.pid && return
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
  [ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || create-munge-key -f; chown munge:munge /etc/munge/munge.key; }
  if id munge >/dev/null 2>&1; then runuser -u munge -- munged; else munged --force; fi
}

start_slurmdbd() {
  local sock=/run/mysqld/mysqld.sock dbd_conf=$CONF_DIR/slurmdbd.conf
  if ! [ -S "$sock" ] || ! mariadb-admin ping >/dev/null 2>&1; then
    mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
    (mariadbd-safe --skip-syslog >/dev/null 2>&1 &)
    for _ in $(seq 60); do mariadb-admin ping >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'depthbench';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
  [ ! -e "$dbd_conf" ] || grep -qF "$MARK" "$dbd_conf" || die "$dbd_conf exists and was not written by this script"
  cat >"$dbd_conf" <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$STATE/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=depthbench
StorageLoc=slurm_acct_db
EOF
  chmod 600 "$dbd_conf"
  alive "$STATE/slurmdbd.pid" || slurmdbd
  for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
  sacctmgr -n list cluster format=cluster | grep -qw depthbench || sacctmgr -i add cluster depthbench >/dev/null
}

wait_idle() {
  for _ in $(seq 60); do
    sinfo -h -n "$NODE" -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)' && return
    sleep 0.5
  done
  scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true
  sleep 1
  sinfo -h -n "$NODE" -o %t | grep -qE '^(idle|mix|alloc)' || die "node $NODE not idle: $(sinfo -h -N -o '%t %E'); logs in $STATE/log"
}

start() {
  [ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"
  case "$ACCOUNTING" in none|slurmdbd) ;; *) die "DEPTHBENCH_SLURM_ACCOUNTING=$ACCOUNTING; valid: none, slurmdbd";; esac
  install_packages
  write_config
  start_munge
  [ "$ACCOUNTING" = slurmdbd ] && start_slurmdbd
  if [ "$CHANGED" = 1 ]; then stop_pid "$STATE/slurmd.pid"; stop_pid "$STATE/slurmctld.pid"; fi
  alive "$STATE/slurmctld.pid" || slurmctld
  alive "$STATE/slurmd.pid" || slurmd
  wait_idle
  echo "slurm cluster up: node $NODE, $CPUS CPUs, accounting $ACCOUNTING, partitions $(sinfo -h -o %P | tr '\n' ' ')" >&2
}

stop_pid() {  # stop the daemon whose pid file is $1, waiting until it has exited
  alive "$1" || return 0
  local pid
  pid=$(cat "$1")
  kill "$pid"
  for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  stop_pid "$STATE/slurmd.pid"
  stop_pid "$STATE/slurmctld.pid"
  stop_pid "$STATE/slurmdbd.pid"
  [ -s /run/mysqld/mysqld.pid ] && [ -e "$CONF_DIR/slurmdbd.conf" ] && mariadb-admin shutdown 2>/dev/null || true
  stop_pid /run/munge/munged.pid
  echo "slurm cluster stopped" >&2
}

status() {
  local name
  for name in slurmdbd slurmctld slurmd; do
    if alive "$STATE/$name.pid"; then echo "$name: running (pid $(cat "$STATE/$name.pid"))"; else echo "$name: stopped"; fi
  done
  if alive /run/munge/munged.pid; then echo "munged: running"; else echo "munged: stopped"; fi
  alive "$STATE/slurmctld.pid" || return 1
  sinfo
  squeue
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: $0 {start|stop|status}" ;;
esac
