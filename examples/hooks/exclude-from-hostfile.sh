#!/bin/sh
# A `vckpt supervise --on-exclude` hook: drop the suspect hosts from a hostfile (one host per line, the first
# word: "node-3 slots=8" as mpirun and DeepSpeed write it), so that the launch script's next start leaves them out.
#
#   vckpt supervise --run RUN --on-exclude 'examples/hooks/exclude-from-hostfile.sh hosts.txt {hosts}' -- ./launch.sh
#
# The hosts arrive as separate arguments ("$@"), never inside a string a shell parses, and vckpt has held each to
# RFC 1123's grammar (letters, digits, hyphens and dots; no space, no shell metacharacter, no leading '-').
set -eu
file=$1
shift
tmp=$(mktemp "$file.XXXXXX")
# Each host is a whole first word to drop, compared as a string (no pattern is built from a host name).
awk 'BEGIN { for (i = 1; i < ARGC - 1; i++) { gone[ARGV[i]] = 1; delete ARGV[i] } } !($1 in gone)' "$@" "$file" >"$tmp"
mv -f "$tmp" "$file"
