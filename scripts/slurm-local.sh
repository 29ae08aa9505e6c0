#!/usr/bin/env bash
# A one-node Slurm cluster on 127.0.0.1 (munge, slurmctld, slurmd), for the engine tests and for
# trying `tilepilot submit --engine slurm` on a laptop. Needs root and Debian's slurmctld, slurmd,
# slurm-client and munge (installed here if missing).
#
#   scripts/slurm-local.sh start    # writes /etc/slurm/slurm.conf, starts the daemons, waits for the node
#   scripts/slurm-local.sh stop     # stops what start started (by pid)
set -euo pipefail
RUN=/run/tilepilot-slurm
H=$(hostname)

start() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
  fi
  mkdir -p "$RUN" /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  chown -R munge:munge /run/munge /var/lib/munge /var/log/munge
  cpus=$(nproc)
  cat >/etc/slurm/slurm.conf <<EOF
ClusterName=tilepilot-local
SlurmctldHost=$H(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MinJobAge=3600
NodeName=$H NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$H Default=YES MaxTime=INFINITE State=UP
EOF
  pgrep -x munged >/dev/null || { su -s /bin/sh munge -c munged 2>/dev/null || munged --force; }
  setsid slurmctld -D >/var/log/slurm/slurmctld.out 2>&1 < /dev/null & echo $! >"$RUN/slurmctld.pid"
  setsid slurmd -D >/var/log/slurm/slurmd.out 2>&1 < /dev/null & echo $! >"$RUN/slurmd.pid"
  for _ in $(seq 60); do
    sinfo -h -o %T 2>/dev/null | grep -qx idle && { echo "slurm-local: node $H idle, $cpus CPUs, partition debug"; return 0; }
    sleep 1
  done
  echo "slurm-local: the node did not come up; see /var/log/slurm/" >&2
  tail -5 /var/log/slurm/slurmctld.log /var/log/slurm/slurmd.log >&2 || true
  return 1
}

stop() {
  for d in slurmd slurmctld; do
    [ -f "$RUN/$d.pid" ] && kill "$(cat "$RUN/$d.pid")" 2>/dev/null || true
    rm -f "$RUN/$d.pid"
  done
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
