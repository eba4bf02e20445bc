#!/usr/bin/env bash
# Launch a recipe under `accelerate launch` with the config that fits this host: ./launch.sh --help.
# scripts/launcher.py does the work, in a process group of its own that neither a terminal's Ctrl-C nor a kill of
# this shell's group (kill -9 -- -PGID) reaches: this shell passes stop signals on; killed outright, it leaves the
# launcher a SIGTERM from Linux (a parent-death signal). Either way the training processes stop at a checkpoint.
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@"  # `sh launch.sh`: the shell it is written for
set -u
ROOT="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")" && pwd)"  # through a link to it too
python="$(dirname "$(command -v accelerate || echo "$ROOT/.venv/bin/accelerate")")/python"  # accelerate's environment
if [[ ! -x "$python" ]]; then
  echo "launch.sh: error: accelerate not found: activate the environment (. .venv/bin/activate) or pip install -e ." >&2
  exit 2
fi
launcher="" stop="" code="$(mktemp 2>/dev/null)"  # the launcher's exit code, written by it (see the last lines)
trap 'rm -f "$code"' EXIT
for sig in TERM INT HUP USR1; do
  trap "stop=$sig; [[ -z \$launcher ]] || kill -s $sig \$launcher 2>/dev/null" "$sig"
done
# The launcher starts with these signals ignored; once its handlers are in place it sends USR2: a stop again.
trap '[[ -z "$stop" ]] || kill -s "$stop" "$launcher" 2>/dev/null' USR2
set -m  # the launcher's own process group
( trap '' TERM INT HUP USR1; exec env LAUNCH_SH_PID=$$ LAUNCH_SH_CODE="$code" "$python" "$ROOT/scripts/launcher.py" "$@" ) &
launcher=$!
while wait "$launcher"; rc=$?; kill -0 "$launcher" 2>/dev/null; do :; done  # a trapped signal ends `wait` early
wait "$launcher" 2>/dev/null && rc=0 || { again=$?; (( again == 127 )) || rc=$again; }  # its status, if it ended then
[[ -s "$code" ]] && rc=$(<"$code")  # bash 5.2's `wait` can lose the status of a child that ends during a trap (255)
exit "$rc"
