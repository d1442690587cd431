#!/usr/bin/env bash
# Slurm Epilog (slurm.conf: Epilog=/etc/slurm/epilog.d/rankguard.sh): removes this node's
# agent from the supervisor's agents file once no job of it is left on the node.
export RANKGUARD_AGENTS_FILE=${RANKGUARD_AGENTS_FILE:-/shared/rankguard/agents}
/opt/rankguard/deploy/slurm/rankguard-agents-file remove "$SLURM_JOB_ID" ||
    logger -t rankguard "epilog: could not remove $(hostname -s) from $RANKGUARD_AGENTS_FILE"
exit 0
