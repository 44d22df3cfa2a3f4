#!/bin/sh
# A Node-Problem-Detector custom plugin (and a Slurm epilog's test): is this node named by an open SDC incident?
# VCKPT_RUNS: the run URLs to ask, space separated. Exit 0 healthy, 1 suspect, other codes unknown (NPD's
# convention): 2 usage, 3 a store that cannot be read, 8 an open incident that cannot be trusted and could have
# named this node (a person looks; the node is never reported healthy meanwhile). One line on stdout, which NPD
# shows as the condition's message.
# shellcheck disable=SC2086  # the runs are words on purpose
exec vckpt node-health ${VCKPT_HOST:+--host "$VCKPT_HOST"} $VCKPT_RUNS
