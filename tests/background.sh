#!/usr/bin/env bash
# Runs a command as background work, which gives way to everything else on the machine: `make process`
# runs the parallel tier so beside the tests that race a deadline. Nice alone does not reach far: with
# the kernel's autogroups (kernel.sched_autogroup_enabled), each session is weighed apart, and torchrun
# and ddpjob launch start every worker in a session of its own. So where this user may make one (root,
# cgroup v1), the command also runs in a cpu cgroup of weight 2, against 1024 for any other session;
# its descendants stay in it whatever sessions they start. SIGINT and SIGQUIT, which a shell without
# job control ignores in what it starts with `&`, get their default actions back, so Ctrl-C reaches it.
# Usage: tests/background.sh COMMAND [ARGS...]
set -euo pipefail
group=/sys/fs/cgroup/cpu/ddpjob-background
if [ -w /sys/fs/cgroup/cpu ] && { [ -d "$group" ] || mkdir "$group" 2>/dev/null; } \
    && echo 2 > "$group/cpu.shares" && echo $$ > "$group/cgroup.procs"; then
    :
else
    echo "[background] no cpu cgroup of our own here (not root, or cgroup v2): nice 19 only, which the" \
        "workers' own sessions escape while autogroups are on" >&2
fi
exec nice -n 19 env --default-signal=INT,QUIT "$@"
