#!/usr/bin/env bash
# Makes (or reuses) a Debian chroot with debootstrap and installs packages into it with apt:
# the shared half of scripts/debian-sid-python.sh (CPython 3.14/3.15 from Debian sid, issue 25)
# and scripts/fresh-machine-check.sh (a clean bookworm). Needs root; installs debootstrap with
# apt-get when it is missing. debootstrap is given no mirror: it uses its own default.
#
# Usage: scripts/debian-chroot.sh SUITE DIR [PACKAGE...]
#   SUITE    a Debian suite debootstrap knows (sid, bookworm, ...)
#   DIR      the chroot's folder, outside the work tree (it is a few GB)
# Environment: LOCKMGR_APT_RECOMMENDS=0   install without Recommends (default: apt's default)
#
# Idempotent: DIR/.lockmgr-complete, written last, lists the packages installed; a chroot with
# that marker and the same packages is reused at once, a half-made one (debootstrap or apt
# interrupted) is finished or made again. Progress and timings on stderr.
set -euo pipefail

[ $# -ge 2 ] || { sed -n '/^# Usage:/,/^# Idempotent/p' "$0" >&2; exit 2; }
suite=$1
root=$2
shift 2
packages=("$@")
here=$(cd "$(dirname "$0")" && pwd)

log() { printf '[debian-chroot %s] %s\n' "$suite" "$*" >&2; }
timed() {
  local what=$1 start=$SECONDS
  shift
  log "$what..."
  "$@"
  log "$what took $((SECONDS - start))s"
}

[ "$(id -u)" = 0 ] || { log "error: needs root (debootstrap, chroot)"; exit 1; }

mkdir -p "$(dirname "$root")"
# Two runs at once (a CI run and an engineer) would build into the same folder: serialise.
exec 9>"$root.lock"
flock 9

marker=$root/.lockmgr-complete
wanted=$(printf '%s\n' "${packages[@]}" | sort -u)
if [ -f "$marker" ] && [ "$(cat "$marker")" = "$wanted" ]; then
  log "reusing $root"
  exit 0
fi

if ! command -v debootstrap >/dev/null; then
  timed "installing debootstrap" \
    sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null'
fi

if [ ! -f "$root/.lockmgr-debootstrapped" ]; then
  # A half-made chroot (interrupted debootstrap) is not resumable: start again. Nothing may be
  # mounted in it (scripts/in-chroot.sh mounts in a private namespace only).
  rm -rf --one-file-system "$root"
  mkdir -p "$root"
  timed "debootstrap --variant=minbase $suite" debootstrap --variant=minbase "$suite" "$root" >&2
  touch "$root/.lockmgr-debootstrapped"
fi

# sid's Release file can look expired to a machine whose clock is behind the archive's.
cat > "$root/etc/apt/apt.conf.d/99lockmgr" <<'CONF'
Acquire::Check-Valid-Until "false";
CONF
if [ "${LOCKMGR_APT_RECOMMENDS:-1}" = 0 ]; then
  echo 'APT::Install-Recommends "false";' >> "$root/etc/apt/apt.conf.d/99lockmgr"
fi
# Packages' maintainer scripts must not start services (PostgreSQL's main cluster, Redis) in
# the chroot: the tests start their own servers.
printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
chmod +x "$root/usr/sbin/policy-rc.d"

if [ ${#packages[@]} -gt 0 ]; then
  timed "apt-get install ${packages[*]}" "$here/in-chroot.sh" "$root" sh -c \
    'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null && apt-get clean' \
    sh "${packages[@]}" >&2
fi
printf '%s\n' "$wanted" > "$marker.tmp"
mv "$marker.tmp" "$marker"
log "ready: $root ($(du -sh --one-file-system "$root" | cut -f1))"
