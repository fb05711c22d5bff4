#!/usr/bin/env bash
# CPython 3.15 and 3.14 as Debian sid builds them (issue 25): no registry serves those
# interpreters as source, but sid's binary packages are served. This makes (or reuses) a
# minimal sid chroot with them, a compiler for the core, and the servers the tests start
# (Debian's postgresql, pgbouncer, redis-server). Needs root. About 2.5 GB.
#
# Usage: scripts/debian-sid-python.sh
# Environment: LOCKMGR_CACHE        cache folder (default $HOME/.cache/lockmgr, outside the
#                                   work tree)
#              LOCKMGR_SID_CHROOT   the chroot (default $LOCKMGR_CACHE/sid-chroot)
# Output: progress and timings on stderr; on stdout one line, the chroot's path.
# Run things inside it with scripts/in-sid-chroot.sh. A complete chroot (its marker file is
# written last) is reused at once.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${LOCKMGR_CACHE:-$HOME/.cache/lockmgr}
root=${LOCKMGR_SID_CHROOT:-$cache/sid-chroot}
LOCKMGR_APT_RECOMMENDS=0 "$here/debian-chroot.sh" sid "$root" \
  python3.15 python3.15-venv python3.15-dev python3.14 python3.14-venv python3.14-dev \
  gcc libc6-dev make git ca-certificates \
  postgresql pgbouncer redis-server
echo "$root"
