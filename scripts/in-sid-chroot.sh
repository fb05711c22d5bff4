#!/usr/bin/env bash
# Runs a command inside the Debian sid chroot of scripts/debian-sid-python.sh (made first if
# need be), with /proc, /dev, /dev/pts, /dev/shm mounted, this checkout bind-mounted at /src
# and a pip cache kept outside it; everything is unmounted when the command ends, fails or is
# interrupted (see scripts/in-chroot.sh). Needs root.
#
# Usage: scripts/in-sid-chroot.sh COMMAND [ARG...]
#   e.g. scripts/in-sid-chroot.sh python3.15 -VV
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
checkout=$(cd "$here/.." && pwd)
cache=${LOCKMGR_CACHE:-$HOME/.cache/lockmgr}
[ $# -ge 1 ] || { sed -n '/^# Usage:/,/^#   e.g./s/^# \{0,1\}//p' "$0" >&2; exit 2; }
root=$("$here/debian-sid-python.sh")
mkdir -p "$cache/sid-pip-cache"
exec "$here/in-chroot.sh" --bind "$checkout:/src" --bind "$cache/sid-pip-cache:/root/.cache/pip" \
  "$root" "$@"
