#!/usr/bin/env bash
# Slurm Prolog (slurm.conf: Prolog=/etc/slurm/prolog.d/rankguard.sh): runs as root on each
# node of a job before it starts, and lists this node's agent for the cluster's supervisor
# service. RANKGUARD_AGENTS_FILE must be the supervisor's --agents-file, on a filesystem
# both see (or use PrologSlurmctld with the job's node list on the supervisor's host:
#   rankguard-agents-file add "$SLURM_JOB_ID" $(scontrol show hostnames "$SLURM_JOB_NODELIST")).
# A failing prolog drains the node, so monitoring trouble never blocks a job: exit 0.
export RANKGUARD_AGENTS_FILE=${RANKGUARD_AGENTS_FILE:-/shared/rankguard/agents}
/opt/rankguard/deploy/slurm/rankguard-agents-file add "$SLURM_JOB_ID" ||
    logger -t rankguard "prolog: could not add $(hostname -s) to $RANKGUARD_AGENTS_FILE"
exit 0
