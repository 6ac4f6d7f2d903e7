# shellcheck shell=bash
# Sourced by the batch scripts: the CPUs to give srun's one task per node (srun does not inherit
# --cpus-per-task since Slurm 22.05). The job's --cpus-per-task when it set one; else the fewest CPUs
# any node of the allocation has (SLURM_JOB_CPUS_PER_NODE, e.g. "72(x2),36"): with --exclusive on a
# partition of mixed node sizes, the batch host's own count (SLURM_CPUS_ON_NODE) would make srun fail
# "More processors requested than permitted" on a smaller node. Else this node's; else nothing.
srun_cpus() {
    if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
        echo "$SLURM_CPUS_PER_TASK"
        return
    fi
    local fewest='' count counts
    IFS=, read -ra counts <<< "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-}}"
    for count in "${counts[@]}"; do
        count=${count%%(*}  # "72(x2)": 72 CPUs on each of 2 nodes
        if [[ $count =~ ^[0-9]+$ ]] && { [ -z "$fewest" ] || [ "$count" -lt "$fewest" ]; }; then
            fewest=$count
        fi
    done
    echo "$fewest"
}
