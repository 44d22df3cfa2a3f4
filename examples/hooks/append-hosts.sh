#!/bin/sh
# A `vckpt supervise --on-exclude` hook: append the suspect hosts to FILE, one a line, for the next submission
# (`sbatch --exclude="$(paste -sd, FILE)" ...`) or a person to read.
#
#   vckpt supervise --run RUN --on-exclude 'examples/hooks/append-hosts.sh excluded.txt {hosts}' -- srun ...
#
# The hosts arrive as separate arguments ("$@"), never inside a string a shell parses (see exclude-from-hostfile.sh).
set -eu
file=$1
shift
printf '%s\n' "$@" >>"$file"
