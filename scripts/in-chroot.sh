#!/usr/bin/env bash
# Runs a command as root inside a chroot (made by scripts/debian-chroot.sh) with /proc, /dev,
# /dev/pts and /dev/shm mounted and, with --bind, host folders bind-mounted. Needs root.
#
# Usage: scripts/in-chroot.sh [--bind HOST_DIR:CHROOT_DIR]... DIR COMMAND [ARG...]
#
# The mounts are made in a private mount and PID namespace (unshare): nothing shows on the
# host, no mount can leak onto the host's /dev/shm through shared propagation, and whatever
# the command leaves running inside (a server a failed test did not stop) is killed when it
# ends, or when this script is killed. A trap unmounts everything on any exit (failure, Ctrl-C, SIGTERM) all the same.
# The command runs in the foreground (a background job of a script would start with SIGINT
# ignored, and Python then never raises KeyboardInterrupt). Its exit status is this script's.
set -euo pipefail

binds=()
while [ $# -gt 0 ]; do
  case $1 in
    --bind) binds+=("$2"); shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { sed -n '/^# Usage:/p' "$0" >&2; exit 2; }
root=$(cd "$1" && pwd)
shift

if [ "${LOCKMGR_IN_CHROOT_NS:-}" != "$root" ]; then
  # Re-run this script as PID 1 of new namespaces (private mounts, own /proc).
  bind_args=()
  for b in "${binds[@]}"; do bind_args+=(--bind "$b"); done
  LOCKMGR_IN_CHROOT_NS=$root exec unshare --mount --propagation private --pid --fork --kill-child \
    "$0" "${bind_args[@]}" "$root" "$@"
fi

mounted=()
cleanup() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    umount -l "${mounted[$i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

mnt() {  # mnt TARGET MOUNT-ARGS...
  local target=$1
  shift
  [ -e "$target" ] || mkdir -p "$target"
  mount "$@" "$target"
  mounted+=("$target")
}
mnt "$root/proc" -t proc proc
mnt "$root/dev" --bind /dev
mnt "$root/dev/pts" -t devpts devpts -o newinstance,ptmxmode=0666,mode=620
mnt "$root/dev/shm" -t tmpfs shm -o mode=1777,nosuid,nodev
for b in "${binds[@]}"; do
  mnt "$root${b#*:}" --bind "${b%%:*}"
done
# Name resolution as the host has it (apt, pip).
cp -L /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
# The host's network may intercept TLS with a CA of its own (in its system bundle): pip and git
# inside then trust what the host trusts. The host's bundle is bind-mounted beside the chroot's
# own (which apt's ca-certificates must stay free to rewrite), and the host's variables that
# name a bundle are passed in, naming it.
bundle=/etc/ssl/certs/ca-certificates.crt
inside=/run/lockmgr-host-ca-certificates.crt
tls_env=()
if [ -f "$bundle" ]; then
  mkdir -p "$root/run"
  [ -e "$root$inside" ] || touch "$root$inside"
  mnt "$root$inside" --bind "$bundle"
  for var in SSL_CERT_FILE PIP_CERT REQUESTS_CA_BUNDLE CURL_CA_BUNDLE GIT_SSL_CAINFO; do
    [ -n "${!var:-}" ] && tls_env+=("$var=$inside")
  done
fi

# A clean environment: only what a login on that system would have, and the terminal.
chroot "$root" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "${tls_env[@]}" "$@" || exit
