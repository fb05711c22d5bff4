#!/usr/bin/env bash
# Proves the README's two commands on a fresh machine without PostgreSQL or Redis (issue 25):
# a clean Debian bookworm made with debootstrap --variant=minbase, with only what a fresh
# machine of this kind has (python3 3.11, python3-venv, python3-pip, python3-dev, gcc, g++,
# make, git, ca-certificates), a clone of the repository, then the commands of the README's
# first ```sh block, each run verbatim with `bash -c` in a fresh virtual environment, timed.
# Needs root (debootstrap, chroot; the test command's scripts/test-servers.sh installs the
# servers with apt-get as root).
#
# Usage: scripts/fresh-machine-check.sh [--keep] [--cold] [REPOSITORY [REF]]
#   REPOSITORY  what to clone (default: this checkout's repository); REF what to check out
#               (default: its HEAD)
#   --keep      keep the throwaway copy of the chroot afterwards (its path is printed)
#   --cold      no download caches: apt's and pip's caches start empty, as on a fresh machine
#               (by default they are kept outside, in LOCKMGR_CACHE, and reused)
# Environment: LOCKMGR_CACHE  cache folder (default $HOME/.cache/lockmgr, outside the work tree)
#
# The clean chroot is made once and cached (scripts/debian-chroot.sh); each check runs in a
# throwaway copy of it, so what the test command installs never reaches the cache. Inside,
# first PostgreSQL and Redis are shown to be absent. Debian's Python refuses `pip install` into
# the system (PEP 668, externally managed), so the commands run in `python3 -m venv .venv &&
# . .venv/bin/activate`, as a fresh user must; that refusal is shown first. The environment
# sets LOCKMGR_REQUIRE_SERVERS=1, so a real-server test fails rather than skips if a server is
# missing, and PYTEST_ADDOPTS=-ra, so any skip prints its reason. Service start-up is disabled
# in the chroot (policy-rc.d) as it is not a booted machine: the tests start their own servers.
# Exit status: 0 when every command succeeded.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${LOCKMGR_CACHE:-$HOME/.cache/lockmgr}
keep=0
cold=0
while [ $# -gt 0 ]; do
  case $1 in
    --keep) keep=1 ;;
    --cold) cold=1 ;;
    -h | --help) sed -n '/^# Usage:/,/^# Environment/s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "unknown option: $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
repository=${1:-$(cd "$here/.." && pwd)}
ref=${2:-HEAD}

phase_started=$SECONDS
took() { printf '=== %s took %ss\n' "$1" "$((SECONDS - phase_started))"; phase_started=$SECONDS; }

printf '=== the clean bookworm chroot (cached)\n'
base=$cache/bookworm-fresh
"$here/debian-chroot.sh" bookworm "$base" \
  python3 python3-venv python3-pip python3-dev gcc g++ make git ca-certificates
took "the clean bookworm chroot"

printf '=== a throwaway copy of it\n'
run=$cache/bookworm-fresh-run
rm -rf --one-file-system "$run"
cp -a "$base" "$run"
[ "$keep" = 1 ] || trap 'rm -rf --one-file-system "$run"' EXIT
took "the copy"

printf '=== cloning %s (%s)\n' "$repository" "$ref"
git clone -q --no-hardlinks "$repository" "$run/root/lockmgr"
git -C "$run/root/lockmgr" checkout -q --detach "$ref"
git -C "$run/root/lockmgr" log --oneline -1
# The README's first ```sh block: its commands, one a line.
awk '/^```sh$/ {inside = 1; next} inside && /^```/ {exit} inside && NF' \
  "$run/root/lockmgr/README.md" > "$run/root/readme-commands"
printf 'the README'"'"'s commands:\n'; sed 's/^/    /' "$run/root/readme-commands"
[ "$(wc -l < "$run/root/readme-commands")" -ge 2 ] || { echo "no commands found in README.md" >&2; exit 1; }
took "the clone"

binds=()
if [ "$cold" = 0 ]; then
  mkdir -p "$cache/bookworm-apt-archives/partial" "$cache/bookworm-pip-cache"
  binds=(--bind "$cache/bookworm-apt-archives:/var/cache/apt/archives"
         --bind "$cache/bookworm-pip-cache:/root/.cache/pip")
fi

status=0
"$here/in-chroot.sh" "${binds[@]}" "$run" env LOCKMGR_REQUIRE_SERVERS=1 PYTEST_ADDOPTS=-ra \
  bash -uo pipefail -c '
cd /root/lockmgr
echo "=== a fresh machine: $(. /etc/os-release; echo "$PRETTY_NAME"), $(python3 -V), $(nproc) cores"
if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb redis-server pgbouncer; then
  echo "not a fresh machine: a PostgreSQL or Redis server is installed" >&2; exit 1
fi
echo "no PostgreSQL, no pgbouncer, no Redis"
first=$(sed -n 1p /root/readme-commands)
echo "=== the first command outside a virtual environment (Debian refuses system installs):"
bash -c "$first" 2>&1 | head -n 4
echo "=== so, as a fresh user must: python3 -m venv .venv && . .venv/bin/activate"
python3 -m venv .venv && . .venv/bin/activate || exit 1
failed=0
n=0
while IFS= read -r command; do
  n=$((n + 1))
  echo "=== README command $n, verbatim: $command"
  started=$SECONDS
  bash -c "$command" </dev/null 2>&1 | tee "/root/readme-command-$n.log"
  rc=${PIPESTATUS[0]}
  echo "=== README command $n: exit status $rc after $((SECONDS - started))s"
  [ "$rc" = 0 ] || failed=1
done < /root/readme-commands
exit "$failed"
' || status=$?
took "the README's commands"
if [ "$status" = 0 ]; then
  echo "=== fresh-machine check: PASSED"
else
  echo "=== fresh-machine check: FAILED (exit status $status)"
fi
[ "$keep" = 1 ] && echo "the chroot is kept at $run"
exit "$status"
