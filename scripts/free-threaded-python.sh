#!/usr/bin/env bash
# Builds a free-threaded CPython 3.13 ("3.13t", PEP 703, ./configure --disable-gil) to test
# and benchmark lockmgr without the GIL (issue 13). No package registry serves a free-threaded
# interpreter, but Debian trixie's source package python3.13 carries the upstream tarball, so
# this fetches it with apt from the mirror this machine already uses and builds it.
#
# Usage: scripts/free-threaded-python.sh [--tsan] [--rebuild | --cached]
#   --tsan      also build a second interpreter configured --with-thread-sanitizer
#               (for `make tsan`); the last line printed is then that one's path. Run it,
#               and anything built for it, with CPython's own races suppressed:
#               TSAN_OPTIONS=suppressions=<cache>/python3.13t-tsan/share/tsan/suppressions_free_threading.txt
#   --rebuild   throw away cached interpreters and build again
#   --cached    build nothing: exit 0 if the interpreters asked for are cached and work,
#               1 if a run would have to build one (.ci/run reports its caches cold or warm)
# Environment: LOCKMGR_CACHE   where sources and interpreters live
#                              (default $HOME/.cache/lockmgr, outside the work tree)
#
# Output: progress and timings on stderr; on stdout one line, the interpreter's path:
#   <cache>/python3.13t/bin/python3.13t (or <cache>/python3.13t-tsan/bin/python3.13t with --tsan).
# A cached interpreter that still works is reused, so a second run takes about a second.
set -euo pipefail
# Functions here return their answers through $(...); without this a failure inside one would be
# ignored there (bash drops errexit in command substitutions) and the script would go on.
shopt -s inherit_errexit

usage() { sed -n '/^# Usage:/,/^# A cached/s/^# \{0,1\}//p' "$0"; }

tsan=0
rebuild=0
cached_only=0
while [ $# -gt 0 ]; do
  case $1 in
    --tsan) tsan=1 ;;
    --rebuild) rebuild=1 ;;
    --cached) cached_only=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "unknown argument: $1" >&2; usage >&2; exit 2 ;;
  esac
  shift
done

cache=${LOCKMGR_CACHE:-$HOME/.cache/lockmgr}
plain_prefix=$cache/python3.13t
tsan_prefix=$cache/python3.13t-tsan
# The source package lives in trixie; the host may be an older Debian (bookworm has no 3.13).
suite=trixie
package=python3.13
jobs=$(nproc)

log() { printf '[free-threaded-python] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# Runs a step and reports its duration, so slow steps on the shared 2-core machine show up.
timed() {
  local what=$1 start=$SECONDS
  shift
  log "$what..."
  "$@"
  log "$what took $((SECONDS - start))s"
}

mkdir -p "$cache"
# Two engineers (or a CI run and an engineer) may run this at once on the same machine:
# serialise them so neither sees the other's half-installed interpreter.
exec 9>"$cache/.lock"
flock 9

work=$(mktemp -d)
# Everything temporary, including the deb-src entry below, lives in $work; removing it on any
# exit (success, failure, Ctrl-C) is what takes the entry away again.
trap 'rm -rf "$work"' EXIT

# An interpreter "works" when it starts, is a free-threaded build with the GIL actually off,
# and has the modules lockmgr's tests and pip need (ssl for downloads, ctypes, compression).
# PYTHON_GIL is unset so a caller's setting cannot hide a build that turns the GIL back on.
works() {
  local python=$1
  [ -x "$python" ] || return 1
  env -u PYTHON_GIL "$python" - >/dev/null 2>&1 <<'PY'
import sys, sysconfig
assert sysconfig.get_config_var("Py_GIL_DISABLED") == 1
assert not sys._is_gil_enabled()
import ctypes, ssl, zlib, lzma, bz2, sqlite3, venv, ensurepip  # noqa: F401
PY
}

# --- build dependencies --------------------------------------------------------------------
# Only what is missing is installed, so a prepared machine is left untouched.
build_deps=(build-essential xz-utils libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev
  libsqlite3-dev libreadline-dev)
install_build_deps() {
  local missing=() pkg
  for pkg in "${build_deps[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' ||
      missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "missing build dependencies (run as root or install): ${missing[*]}"
  log "installing ${missing[*]}"
  # A fresh machine's package lists may be empty or stale; this is the ordinary system update.
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
}

# --- the mirror this machine uses -----------------------------------------------------------
# Prints the URI of the machine's Debian archive entry on the first line and, if that entry has
# one, its Signed-By field (deb822 form, verbatim, so an inline key block survives) after it.
# The entry chosen is the one for the host's own release codename with component main: that
# is the main archive, not -security or -updates (which live under other paths or suites) nor
# a third-party repository.
machine_debian_source() {
  local codename file
  # shellcheck source=/dev/null
  codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
  [ -n "$codename" ] || die "cannot tell this machine's release codename from /etc/os-release"

  # One-line format: deb [opt=value ...] URI SUITE COMPONENT...
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    awk -v codename="$codename" '
      { sub(/#.*/, "") }
      $1 != "deb" && $1 != "deb-src" { next }
      {
        signed = ""
        i = 2
        if ($i ~ /^\[/) {   # options, possibly spread over several fields: [ a=b c=d ]
          opts = ""
          while (i <= NF) { opts = opts " " $i; if ($i ~ /\]$/) { i++; break } i++ }
          gsub(/[\[\]]/, "", opts)
          n = split(opts, o, " ")
          for (k = 1; k <= n; k++) if (tolower(o[k]) ~ /^signed-by=/) signed = substr(o[k], 11)
        }
        uri = $i; suite = $(i + 1)
        if (suite != codename) next
        for (k = i + 2; k <= NF; k++) if ($k == "main") {
          print uri
          if (signed != "") print "Signed-By: " signed
          exit 0
        }
      }' "$file"
  done > "$work/source"
  if [ -s "$work/source" ]; then first_entry < "$work/source"; return 0; fi

  # deb822 format: stanzas separated by blank lines, "Field: value", continuation lines indented.
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    awk -v codename="$codename" '
      function has(list, word,   n, w, k) {
        n = split(list, w, /[ \t]+/)
        for (k = 1; k <= n; k++) if (w[k] == word) return 1
        return 0
      }
      function finish(   n, u) {
        if (types != "" && (has(types, "deb") || has(types, "deb-src")) &&
            has(suites, codename) && has(components, "main") && tolower(enabled) != "no") {
          n = split(uris, u, /[ \t]+/)
          for (k = 1; k <= n; k++) if (u[k] != "") { print u[k]; break }
          if (signed != "") printf "%s", signed
          found = 1
          exit 0
        }
        types = uris = suites = components = enabled = signed = ""; field = ""
      }
      /^#/ { next }
      /^[ \t]*$/ { finish(); next }
      /^[ \t]/ {   # continuation of the previous field (multi-line Signed-By key block)
        if (field == "signed-by") signed = signed $0 "\n"
        else if (field == "uris") uris = uris " " $0
        else if (field == "suites") suites = suites " " $0
        else if (field == "components") components = components " " $0
        next
      }
      {
        field = tolower(substr($0, 1, index($0, ":") - 1))
        value = substr($0, index($0, ":") + 1); sub(/^[ \t]+/, "", value)
        if (field == "types") types = value
        else if (field == "uris") uris = value
        else if (field == "suites") suites = value
        else if (field == "components") components = value
        else if (field == "enabled") enabled = value
        else if (field == "signed-by") signed = "Signed-By:" (value == "" ? "" : " " value) "\n"
      }
      END { if (!found) finish() }' "$file"
  done > "$work/source"
  [ -s "$work/source" ] || die "no Debian '$codename' entry with component main in /etc/apt/sources.list{,.d}"
  first_entry < "$work/source"
}

# Several files may match; keeps the first entry: its URI line and the Signed-By field right
# after it, with that field's indented continuation lines (an inline key block).
first_entry() {
  awk 'NR == 1 { print; next }
       NR == 2 && /^Signed-By:/ { on = 1; print; next }
       on && /^[ \t]/ { print; next }
       { exit }'
}

# --- the upstream tarball -------------------------------------------------------------------
# apt is pointed at a private configuration for this: the temporary deb-src entry, the package
# lists it downloads and apt's caches all live in $work. The machine's own sources, lists and
# caches are never written, so apt is left exactly as it was and nothing needs undoing -- not
# even when this script fails half-way, and not for another engineer's apt-get running meanwhile.
fetch_source() {
  local source uri apt_opts
  source=$(machine_debian_source)
  uri=$(head -n 1 <<<"$source")
  mkdir -p "$work/sources.list.d" "$work/lists/partial" "$work/cache" "$work/download"
  : > "$work/sources.list"
  {
    echo "Types: deb-src"
    echo "URIs: $uri"
    echo "Suites: $suite"
    echo "Components: main"
    tail -n +2 <<<"$source"
  } > "$work/sources.list.d/lockmgr-$suite-src.sources"
  log "temporary entry: deb-src $uri $suite main$(grep -q '^Signed-By:' <<<"$source" && echo ' (keyring from the machine'"'"'s entry)')"
  apt_opts=(
    -o "Dir::Etc::SourceList=$work/sources.list"
    -o "Dir::Etc::SourceParts=$work/sources.list.d"
    -o "Dir::State::Lists=$work/lists"
    -o "Dir::Cache=$work/cache"
    -o "Acquire::Languages=none"
  )
  # apt downloads as the unprivileged _apt user when run as root; let it write here.
  chmod 755 "$work"
  if [ "$(id -u)" -eq 0 ] && id _apt >/dev/null 2>&1; then
    chown _apt "$work/lists/partial" "$work/download"
  fi
  timed "apt-get update (trixie deb-src only)" apt-get "${apt_opts[@]}" update -qq
  # --download-only: just the .dsc and tarballs, checked against the signed index; no unpacking.
  (cd "$work/download" && timed "apt-get source --download-only $package" \
    apt-get "${apt_opts[@]}" source -qq --download-only "$package")
  mv "$work"/download/"${package}"_*.orig.tar.xz "$work"/download/"${package}"_*.dsc "$cache/src/"
}

# Prints the path of the cached upstream tarball, fetching it first if there is none.
tarball() {
  local found
  mkdir -p "$cache/src"
  found=$(find "$cache/src" -maxdepth 1 -name "${package}_*.orig.tar.xz" | sort -V | tail -n 1)
  if [ -z "$found" ]; then
    fetch_source >&2   # stdout is this function's answer: keep apt's chatter off it
    found=$(find "$cache/src" -maxdepth 1 -name "${package}_*.orig.tar.xz" | sort -V | tail -n 1)
  fi
  [ -n "$found" ] || die "apt-get source did not produce ${package}_*.orig.tar.xz"
  echo "$found"
}

# --- the build ------------------------------------------------------------------------------
# Unpacks the tarball once into $cache/src/Python-<version>; both builds run out of tree from it.
unpacked_source() {
  local tar version dir
  tar=$(tarball)
  version=$(basename "$tar" | sed -E "s/^${package}_(.*)\.orig\.tar\.xz$/\1/")
  dir=$cache/src/Python-$version
  if [ ! -f "$dir/configure" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    timed "unpacking $(basename "$tar")" tar -xJf "$tar" -C "$dir" --strip-components=1
  fi
  echo "$dir"
}

# Runs a command with its output appended to $build_log (make prints thousands of lines); on
# failure shows the end of the log, which is where the reason is.
logged() {
  "$@" >>"$build_log" 2>&1 && return 0
  log "failed: $*; the end of $build_log:"
  tail -n 40 "$build_log" >&2
  return 1
}

# build PREFIX [extra configure options...]
# Optimisation: the default release flags (-O3, NDEBUG), without --enable-optimizations (PGO
# runs the test suite: 20+ minutes on 2 cores) or LTO (a long single-threaded link). That keeps
# the build to a few minutes and is what the GIL-off-vs-RLock ratios need: both sides of each
# comparison run on the same interpreter. --disable-test-modules: CPython's own test suite is
# not needed, and skipping it saves install time and ~100 MB.
build() {
  local prefix=$1 src build_dir name
  shift
  name=$(basename "$prefix")
  install_build_deps
  src=$(unpacked_source)
  build_dir=$cache/build/$name
  build_log=$cache/build/$name.log
  rm -rf "$build_dir" "$prefix" "$build_log"
  mkdir -p "$build_dir"
  log "build log: $build_log"
  (
    cd "$build_dir"
    # nice: the machine's 2 cores are shared with other engineers' work.
    timed "configure $name" logged nice -n 10 "$src/configure" --prefix="$prefix" \
      --disable-gil --disable-test-modules "$@"
    timed "make -j$jobs $name" logged nice -n 10 make -j"$jobs"
    timed "make install $name" logged nice -n 10 make install
  )
  rm -rf "$build_dir"
}

# The TSAN interpreter runs itself during the build (sysconfig, the module checks), so
# CPython's own known races must be suppressed from the start; the suppression files are kept
# in the prefix for `make tsan`, which needs the same TSAN_OPTIONS.
tsan_options() {
  echo "suppressions=$1/share/tsan/suppressions_free_threading.txt"
}
build_tsan() {
  local src
  src=$(unpacked_source)
  mkdir -p "$cache/build"
  install -D -m 644 "$src/Tools/tsan/suppressions_free_threading.txt" \
    "$cache/build/tsan-suppressions.txt"
  TSAN_OPTIONS="suppressions=$cache/build/tsan-suppressions.txt${TSAN_OPTIONS:+ $TSAN_OPTIONS}" \
    build "$tsan_prefix" --with-thread-sanitizer
  install -D -m 644 -t "$tsan_prefix/share/tsan" "$src"/Tools/tsan/*.txt
}

if [ "$rebuild" -eq 1 ]; then
  rm -rf "$plain_prefix" "$tsan_prefix"
fi
if [ "$cached_only" -eq 1 ]; then
  works "$plain_prefix/bin/python3.13t" || exit 1
  [ "$tsan" -eq 0 ] || TSAN_OPTIONS=$(tsan_options "$tsan_prefix") works "$tsan_prefix/bin/python3.13t"
  exit
fi

total_start=$SECONDS
if works "$plain_prefix/bin/python3.13t"; then
  log "cached: $plain_prefix/bin/python3.13t"
else
  build "$plain_prefix"
  works "$plain_prefix/bin/python3.13t" || die "the build at $plain_prefix does not work"
fi
result=$plain_prefix/bin/python3.13t

if [ "$tsan" -eq 1 ]; then
  if TSAN_OPTIONS=$(tsan_options "$tsan_prefix") works "$tsan_prefix/bin/python3.13t"; then
    log "cached: $tsan_prefix/bin/python3.13t"
  else
    build_tsan
    TSAN_OPTIONS=$(tsan_options "$tsan_prefix") works "$tsan_prefix/bin/python3.13t" || die "the build at $tsan_prefix does not work"
  fi
  result=$tsan_prefix/bin/python3.13t
fi
log "done in $((SECONDS - total_start))s"
echo "$result"
