#!/usr/bin/env bash
# A "machine" of its own on this one, for the multi-machine tests (tests/test_multihost.py): runs COMMAND in new UTS
# and mount namespaces, with host name HOST and a /dev/shm of its own (a private tmpfs, gone with the namespace's
# last process), so that nothing shared-memory reaches across "hosts". It takes ssh's form, so MPICH's launcher can
# stand it in for ssh (-launcher ssh -launcher-exec tests/fake_host.sh); as with ssh, COMMAND's words are joined and
# read again by a shell. As root the namespaces are the kernel's plain ones; as another user they sit in a user
# namespace of their own (mapped to root inside, which may name hosts and mount), where the kernel allows that.
#                               Usage: fake_host.sh [-x ...] HOST COMMAND...
set -euo pipefail
while [[ "${1:-}" == -* ]]; do shift; done
host=${1:?usage: fake_host.sh [ssh options] HOST COMMAND...}
shift
user=()
[ "$(id -u)" = 0 ] || user=(--user --map-root-user)
exec unshare ${user[@]+"${user[@]}"} --uts --mount sh -c 'hostname "$1" && mount -t tmpfs -o size=256m,mode=1777 fake-host-shm /dev/shm &&
  shift && eval "exec $*"' fake_host.sh "$host" "$@"
