#!/usr/bin/env bash
# The servers the tests start on 127.0.0.1, from Debian's packages: PostgreSQL (a primary, a
# streaming standby of it), PgBouncer in front of it, and Redis beside it for the benchmark's
# comparisons. Installs whichever is missing when it can (root, apt-get); otherwise says what
# is missing, and the tests that need it are skipped, each naming it (pytest -ra).
set -euo pipefail
missing=()
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || command -v initdb >/dev/null \
  || missing+=(postgresql)
# (Debian puts pgbouncer in /usr/sbin, which a user's PATH may lack.)
command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v redis-server >/dev/null || missing+=(redis-server)
[ ${#missing[@]} -eq 0 ] && { echo "test servers: all present"; exit 0; }
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
  echo "test servers: installing Debian's ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # Debian starts what it installs; the tests start servers of their own on free ports.
  for service in postgresql pgbouncer redis-server; do
    command -v service >/dev/null && service "$service" stop >/dev/null 2>&1 || true
  done
else
  echo "test servers: missing ${missing[*]} (installing needs root and apt-get);" \
       "the tests that need them will be skipped, naming what is missing"
fi
