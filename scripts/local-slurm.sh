#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, for fp4lab's tests (CI and local).
#
#   scripts/local-slurm.sh start    install slurm + munge if missing, configure, start, wait for the node
#   scripts/local-slurm.sh stop     cancel every job, stop slurmd, slurmctld (and slurmdbd/MariaDB), munged
#   scripts/local-slurm.sh status   print daemons and node state; exit 0 only when the node is idle
#
# Written for Debian 12 without systemd (a CI container), run as root. The daemons run as root
# (SlurmUser=root), so no state directory needs chown'ing; jobs still run as the submitting user.
#
# Environment (all optional):
#   SLURM_LOCAL_BASE         state, spool, pid and log directory       (default /var/lib/fp4lab-slurm)
#   SLURM_LOCAL_ACCOUNTING   none | slurmdbd                            (default none)
#       none:     no accounting daemon. `sacct` exits 1 in that case, and submitit then never learns that a
#                 job was cancelled or killed (job.result() can wait forever), so `start` installs a small
#                 sacct stand-in at /usr/local/bin/sacct that answers from slurmctld's job table
#                 (`squeue --states=all`; finished jobs stay there for MinJobAge=3600 s). `stop` removes it.
#       slurmdbd: also installs and starts MariaDB + slurmdbd for a real `sacct` (adds ~6 s of apt, ~1.5 s start).
#   SLURM_LOCAL_KEEP_STATE=1 keep slurmctld's saved jobs across a stop/start (default: start from a clean slate)
#   SLURM_LOCAL_WAIT         seconds `start` waits for the node to become idle (default 30)
#
# Settings the tests rely on (see tests/lab/test_slurm_local.py):
#   MaxArraySize=64       array indices must be < 64, so `--array=0-63` is the largest accepted array and
#                         `--array=0-64` is refused at submission: the orchestrator has to split big sweeps.
#   JobRequeue=1          batch jobs may be requeued (scontrol requeue, submitit's Checkpointable).
#   AuthInfo=cred_expire=10  a requeued job waits this long in PENDING(BeginTime) before it may run again;
#                         the default 120 s would make every requeue take minutes.
#   KillWait=5            seconds between SIGTERM and SIGKILL when a job is cancelled or times out.
#   MinJobAge=3600        finished jobs stay visible to `scontrol show job` / `squeue -t all` for an hour.
# Slurm checks time limits (and sends --signal=SIG@N warnings) only every ~30 s, so a `--time=1` job ends
# 60-90 s after it starts; a `--signal=USR1@N` with N >= the limit arrives within ~30 s of the start.
set -euo pipefail

BASE=${SLURM_LOCAL_BASE:-/var/lib/fp4lab-slurm}
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-none}
WAIT_S=${SLURM_LOCAL_WAIT:-30}
CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
SHIM=/usr/local/bin/sacct
SHIM_TAG="fp4lab local-slurm sacct stand-in"
MUNGE_PID=/run/munge/munged.pid
PARTITION=debug

log() { echo "local-slurm: $*"; }
die() { echo "local-slurm: error: $*" >&2; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (it installs packages and starts slurmctld/slurmd/munged); try: sudo $0 $*"
}

# A process counts as running unless it is gone or a zombie: in a container whose pid 1 does not reap,
# a SIGKILLed daemon stays a zombie, and `kill -0` still succeeds on it.
running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }  # the field after "(comm) " is the state letter
    [ "${stat%% *}" != Z ] && [ "${stat%% *}" != X ]
}

# pid from a pid file if that process is running and is the expected program, else nothing
live_pid() {  # $1 pid file, $2 process name
    local f=$1 name=$2 pid
    [ -s "$f" ] || return 1
    pid=$(tr -dc '0-9' <"$f")
    [ -n "$pid" ] && running "$pid" || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
    echo "$pid"
}

node_state() { sinfo -h -N -o '%T' 2>/dev/null | head -n1 || true; }

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# ---------------------------------------------------------------- install
pkg_installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

install_packages() {
    local want=(slurmctld slurmd slurm-client munge) missing=() p
    if [ "$ACCOUNTING" = slurmdbd ]; then want+=(slurmdbd mariadb-server); fi
    for p in "${want[@]}"; do pkg_installed "$p" || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    log "installing ${missing[*]} (apt-get, --no-install-recommends)"
    local t0=$SECONDS policy_added=0
    # Keep the packages' postinst from starting daemons with the default config (matters on hosts with
    # an init system; in a container invoke-rc.d refuses anyway).
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d && policy_added=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    local rc=0
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >"$BASE/log/apt.log" 2>&1; } || rc=$?
    [ $policy_added -eq 1 ] && rm -f /usr/sbin/policy-rc.d
    if [ $rc -ne 0 ]; then
        tail -n 20 "$BASE/log/apt.log" >&2 || true
        die "apt-get install ${missing[*]} failed (rc=$rc); full log: $BASE/log/apt.log"
    fi
    log "installed in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------- config
write_conf() {
    local host cpus mem detected
    host=$(hostname -s)
    # What slurmd itself detects: a node configured with more CPUs or memory than that is marked invalid.
    detected=$(slurmd -C 2>/dev/null | head -n1 || true)
    cpus=$(sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' <<<"$detected")
    mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$detected")
    [ -n "$cpus" ] || cpus=$(nproc)
    [ -n "$mem" ] || mem=$(awk '/^MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
    mem=$((mem * 90 / 100))  # leave headroom: RealMemory above what slurmd finds drains the node

    local acct
    if [ "$ACCOUNTING" = slurmdbd ]; then
        acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux"
    else
        acct="AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none"
    fi

    mkdir -p "$CONF_DIR"
    cat >"$CONF.tmp" <<EOF
# Written by fp4lab scripts/local-slurm.sh: single-node test cluster on $host. Regenerated on every start.
ClusterName=fp4lab-local
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$BASE/ctld
SlurmdSpoolDir=$BASE/spool
SlurmctldPidFile=$BASE/slurmctld.pid
SlurmdPidFile=$BASE/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/none
$acct
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
MaxArraySize=64
JobRequeue=1
KillWait=5
OverTimeLimit=0
MinJobAge=3600
InactiveLimit=0
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
    chmod 0644 "$CONF"
}

write_sacct_shim() {
    cat >"$SHIM.tmp" <<'EOF'
#!/usr/bin/env python3
# fp4lab local-slurm sacct stand-in (installed by scripts/local-slurm.sh, removed by its `stop`).
# The local cluster runs without accounting, where the real sacct only says "accounting storage is
# disabled". This answers the queries submitit makes (sacct -o JobID,State,NodeList --parsable2 -j ID ...)
# from slurmctld's own job table, which keeps finished jobs for MinJobAge seconds.
import subprocess
import sys

CODES = {"jobid": "%i", "jobidraw": "%A", "state": "%T", "nodelist": "%N", "jobname": "%j",
         "partition": "%P", "user": "%u", "elapsed": "%M", "timelimit": "%l", "reason": "%r"}


def main(argv):
    fields, ids, header, sep = ["JobID", "JobName", "Partition", "State"], [], True, "|"
    it = iter(argv)
    for arg in it:
        if arg in ("-o", "--format"):
            fields = next(it, "").split(",")
        elif arg.startswith("--format="):
            fields = arg.partition("=")[2].split(",")
        elif arg in ("-j", "--jobs"):
            ids += next(it, "").split(",")
        elif arg.startswith("--jobs="):
            ids += arg.partition("=")[2].split(",")
        elif arg in ("-n", "--noheader"):
            header = False
        elif arg in ("-P", "--parsable2", "-p", "--parsable"):
            sep = "|"
    fields = [f.split("%")[0] for f in fields if f]
    fmt = "|".join(CODES.get(f.lower(), "%i") for f in fields)
    rows = []
    # one squeue call per id: squeue rejects the whole request when one id is unknown
    for jid in [i for i in ids if i] or [None]:
        cmd = ["squeue", "--noheader", "--array", "--states=all", "--format=" + fmt]
        if jid:
            cmd.append("--jobs=" + jid)
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode == 0:
            rows += [line.strip().replace("|", sep) for line in out.stdout.splitlines() if line.strip()]
    if header:
        print(sep.join(fields))
    for row in rows:
        print(row)
    return 0


sys.exit(main(sys.argv[1:]))
EOF
    chmod 0755 "$SHIM.tmp"
    mv "$SHIM.tmp" "$SHIM"
}

remove_sacct_shim() {
    if [ -f "$SHIM" ] && grep -q "$SHIM_TAG" "$SHIM" 2>/dev/null; then rm -f "$SHIM"; fi
}

# ---------------------------------------------------------------- daemons
start_munge() {
    if [ ! -s /etc/munge/munge.key ]; then  # Debian's postinst normally creates it
        install -d -o munge -g munge -m 0700 /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
        chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    fi
    install -d -o munge -g munge -m 0755 /run/munge  # no systemd-tmpfiles here
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    munge_ok && return 0
    if [ -e "$MUNGE_PID" ] && ! live_pid "$MUNGE_PID" munged >/dev/null; then rm -f "$MUNGE_PID"; fi
    # --force: take over a socket left behind by a munged that was SIGKILLed
    runuser -u munge -- /usr/sbin/munged --force
    local i
    for i in $(seq 50); do munge_ok && return 0; sleep 0.1; done
    tail -n 20 /var/log/munge/munged.log >&2 || true
    die "munged did not come up"
}

start_accounting() {
    install -d -o mysql -g mysql /run/mysqld
    if ! mariadb-admin ping >/dev/null 2>&1; then
        nohup /usr/sbin/mariadbd --user=mysql >"$BASE/log/mariadb.log" 2>&1 &
        local i
        for i in $(seq 150); do mariadb-admin ping >/dev/null 2>&1 && break; sleep 0.1; done
        mariadb-admin ping >/dev/null 2>&1 || die "MariaDB did not come up; see $BASE/log/mariadb.log"
    fi
    mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm-local';
                GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
    cat >"$CONF_DIR/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm-local
StorageLoc=slurm_acct_db
LogFile=$BASE/log/slurmdbd.log
PidFile=$BASE/slurmdbd.pid
EOF
    chmod 0600 "$CONF_DIR/slurmdbd.conf"  # slurmdbd refuses a readable one
    if ! live_pid "$BASE/slurmdbd.pid" slurmdbd >/dev/null; then
        rm -f "$BASE/slurmdbd.pid"
        /usr/sbin/slurmdbd
        local i
        for i in $(seq 100); do sacctmgr -n show cluster >/dev/null 2>&1 && return 0; sleep 0.1; done
        die "slurmdbd did not answer; see $BASE/log/slurmdbd.log"
    fi
}

dump_logs() {
    local f
    for f in "$BASE/log/slurmctld.log" "$BASE/log/slurmd.log"; do
        [ -f "$f" ] && { echo "--- last lines of $f" >&2; tail -n 25 "$f" >&2; }
    done
    return 0
}

# Job steps (slurmstepd and the job's processes) outlive a SIGKILLed slurmd. With a wiped job table the
# new slurmctld hands out job ids from 1 again, and such a leftover step would report "job 1 done" for
# a new job 1. So when slurmd is down and the state is being wiped, end those process trees first.
kill_orphan_steps() {
    local steps tree
    steps=$(pgrep -x slurmstepd | tr '\n' ' ' || true)
    [ -n "${steps// /}" ] || return 0
    tree=$(ps -eo pid=,ppid= | awk -v roots="$steps" '
        BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
        { parent[$1] = $2 }
        END { grew = 1
              while (grew) { grew = 0
                  for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; grew = 1 } }
              for (p in keep) print p }')
    log "ending job steps left over from a previous cluster (slurmstepd $steps)"
    # shellcheck disable=SC2086
    kill -KILL $tree 2>/dev/null || true
}

cmd_start() {
    need_root start
    command -v apt-get >/dev/null || die "this script needs a Debian/Ubuntu machine (apt-get)"
    case $ACCOUNTING in none | slurmdbd) ;; *) die "SLURM_LOCAL_ACCOUNTING must be none or slurmdbd, not '$ACCOUNTING'" ;; esac
    local t0=$SECONDS
    mkdir -p "$BASE/log"
    install_packages

    local ctld_pid="" d_pid=""
    ctld_pid=$(live_pid "$BASE/slurmctld.pid" slurmctld || true)
    d_pid=$(live_pid "$BASE/slurmd.pid" slurmd || true)
    if [ -n "$ctld_pid" ] && [ -n "$d_pid" ] && munge_ok && [ "$(node_state)" = idle ]; then
        log "already running (slurmctld $ctld_pid, slurmd $d_pid, node $(hostname -s) idle); nothing to do"
        return 0
    fi

    if [ -z "$ctld_pid" ]; then
        # slurmctld is (re)starting: regenerate the config, and start from a clean job table unless asked.
        # A stale pid file (daemons SIGKILLed) is removed; slurmd is restarted too so both read one config.
        [ -n "$d_pid" ] && { kill "$d_pid" 2>/dev/null || true; wait_gone "$d_pid"; d_pid=""; }
        rm -f "$BASE/slurmctld.pid" "$BASE/slurmd.pid"
        if [ "${SLURM_LOCAL_KEEP_STATE:-0}" != 1 ]; then
            kill_orphan_steps
            rm -rf "$BASE/ctld" "$BASE/spool"
        fi
        mkdir -p "$BASE/ctld" "$BASE/spool"
        write_conf
    fi
    if [ "$ACCOUNTING" = none ]; then write_sacct_shim; else remove_sacct_shim; fi

    start_munge
    [ "$ACCOUNTING" = slurmdbd ] && start_accounting

    local i
    if [ -z "$ctld_pid" ]; then
        /usr/sbin/slurmctld || { dump_logs; die "slurmctld failed to start"; }
    fi
    for i in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    scontrol ping 2>/dev/null | grep -q UP || { dump_logs; die "slurmctld does not answer scontrol ping"; }
    if [ -z "$d_pid" ]; then
        rm -f "$BASE/slurmd.pid"
        /usr/sbin/slurmd || { dump_logs; die "slurmd failed to start"; }
    fi

    # wait for the node: idle is the goal; down/drained after an unclean stop is resumed once
    local state="" deadline=$((SECONDS + WAIT_S)) resumed=0
    while [ $SECONDS -lt $deadline ]; do
        state=$(node_state)
        case $state in
            idle) log "ready in $((SECONDS - t0)) s: node $(hostname -s) idle, partition $PARTITION, accounting=$ACCOUNTING"
                  return 0 ;;
            down* | drain* | fail*)
                if [ $resumed -eq 0 ] && [ -n "$(live_pid "$BASE/slurmd.pid" slurmd || true)" ]; then
                    scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
                    resumed=1
                fi ;;
        esac
        sleep 0.2
    done
    dump_logs
    sinfo -N -l >&2 || true
    die "node $(hostname -s) not idle after ${WAIT_S} s (state '${state:-unknown}'); logs in $BASE/log"
}

wait_gone() {  # wait up to 10 s for each pid to exit, then SIGKILL it
    local pid i
    for pid in "$@"; do
        for i in $(seq 50); do running "$pid" || break; sleep 0.2; done
        if running "$pid"; then
            log "pid $pid did not exit, sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

cmd_stop() {
    need_root stop
    local t0=$SECONDS pids="" p
    p=$(live_pid "$BASE/slurmd.pid" slurmd || true) && pids+=" $p"
    p=$(live_pid "$BASE/slurmctld.pid" slurmctld || true) && pids+=" $p"
    p=$(live_pid "$BASE/slurmdbd.pid" slurmdbd || true) && pids+=" $p"
    p=$(live_pid /run/mysqld/mysqld.pid mariadbd || true) && pids+=" $p"
    p=$(live_pid "$MUNGE_PID" munged || true) && pids+=" $p"
    pids=$(echo $pids)

    if [ -n "$(live_pid "$BASE/slurmctld.pid" slurmctld || true)" ]; then
        local jobs
        jobs=$(squeue -h -o '%A' 2>/dev/null | sort -u | tr '\n' ' ' || true)
        if [ -n "${jobs// /}" ]; then
            log "cancelling jobs: $jobs"
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            local i
            for i in $(seq 75); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
        fi
        scontrol shutdown >/dev/null 2>&1 || true  # stops slurmctld and slurmd
    fi
    p=$(live_pid "$BASE/slurmd.pid" slurmd || true) && [ -n "$p" ] && kill "$p" 2>/dev/null || true
    p=$(live_pid "$BASE/slurmdbd.pid" slurmdbd || true) && [ -n "$p" ] && kill "$p" 2>/dev/null || true
    mariadb-admin shutdown >/dev/null 2>&1 || true
    p=$(live_pid "$MUNGE_PID" munged || true) && [ -n "$p" ] && kill "$p" 2>/dev/null || true
    # shellcheck disable=SC2086
    [ -n "$pids" ] && wait_gone $pids
    rm -f "$BASE/slurmctld.pid" "$BASE/slurmd.pid" "$BASE/slurmdbd.pid"
    remove_sacct_shim
    if [ -n "$pids" ]; then log "stopped (pids $pids) in $((SECONDS - t0)) s"; else log "nothing was running"; fi
}

cmd_status() {
    local ctld d m state
    ctld=$(live_pid "$BASE/slurmctld.pid" slurmctld || echo -)
    d=$(live_pid "$BASE/slurmd.pid" slurmd || echo -)
    m=$(live_pid "$MUNGE_PID" munged || echo -)
    state=$( [ "$ctld" != - ] && node_state || true)
    echo "slurmctld: $ctld  slurmd: $d  munged: $m  node $(hostname -s): ${state:-unreachable}"
    if [ "$ctld" != - ]; then sinfo -N -o '%N %P %T %c %m' 2>/dev/null || true; fi
    [ "$state" = idle ]
}

case ${1:-} in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
