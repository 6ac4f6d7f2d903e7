#!/usr/bin/env bash
# Runs a command as background work, which gives way to everything else on the machine: `make process`
# runs the parallel tier so beside the tests that race a deadline. Nice alone does not reach far: with
# the kernel's autogroups (kernel.sched_autogroup_enabled), each session in the root cpu cgroup is
# weighed apart, and torchrun and ddpjob launch start every worker in a session of its own. So where
# this user may make one (root, cgroup v1), the command also runs in a cpu cgroup of weight 128 (in
# the root cgroup, every other session weighs 1024), below the caller's cgroup; its descendants stay
# in it whatever sessions they start. 128, not the least: held back to nothing, the tier's own time limits
# would starve while the serial tests keep both cores busy.
# SIGINT and SIGQUIT, which a shell without job control ignores in what it starts with `&`, get their
# default actions back, so that Ctrl-C reaches the command. With --normal, only that: for a command at
# normal priority that the caller starts with `&` too.
# Usage: tests/background.sh [--normal] COMMAND [ARGS...]
set -euo pipefail
if [ "${1:-}" = --normal ]; then
    shift
else
    cpu=/sys/fs/cgroup/cpu
    here=$(awk -F: '$2 ~ /(^|,)cpu(,|$)/ {print $3}' /proc/self/cgroup)
    parent=$cpu${here%/}
    [ -d "$parent" ] || parent=$cpu
    group=$parent/ddpjob-background
    if [ ! -f "$cpu/cpu.shares" ]; then
        echo "[background] no cgroup v1 cpu controller at $cpu: nice 19 only" >&2
    elif ! { mkdir -p "$group" && echo 128 > "$group/cpu.shares" && echo -1 > "$group/cpu.cfs_quota_us" \
        && echo $$ > "$group/cgroup.procs"; } 2>/dev/null; then
        echo "[background] cannot join a cpu cgroup at $group (root only): nice 19 only" >&2
    fi
    renice -n 19 -p $$ > /dev/null
fi
if env --default-signal=INT true 2>/dev/null; then
    exec env --default-signal=INT,QUIT "$@"
fi
exec python3 -c 'import os, signal, sys
for s in (signal.SIGINT, signal.SIGQUIT):
    signal.signal(s, signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])' "$@"
