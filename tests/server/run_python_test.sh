#!/usr/bin/env bash
# Runs one Python test of `kvlm serve` with the official `openai` client, installed from PyPI
# into a private venv shared by the server tests (created under a lock). Skipped with exit
# code 77 when a venv cannot be made or PyPI is unreachable.
# usage: bash tests/server/run_python_test.sh WORK_DIR SCRIPT.py ARGS...
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${1:?usage: run_python_test.sh WORK_DIR SCRIPT.py ARGS...}
script=${2:?usage: run_python_test.sh WORK_DIR SCRIPT.py ARGS...}
shift 2
mkdir -p "$work"
venv="$work/venv"
openai_pin="openai==3.54.0"
jsonschema_pin="jsonschema==4.23.0"  # structured_test.py validates outputs with it
(
  flock 9
  if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import openai, jsonschema" 2>/dev/null; then exit 0; fi
  rm -rf "$venv"
  python3 -m venv "$venv" >"$work/venv.log" 2>&1 || { echo "skipped: python3 -m venv failed ($(tail -n 1 "$work/venv.log"))"; exit 77; }
  if ! timeout 300 "$venv/bin/pip" install -q --disable-pip-version-check "$openai_pin" "$jsonschema_pin" >"$work/pip.log" 2>&1; then
    echo "skipped: PyPI not reachable ($(tail -n 1 "$work/pip.log"))"
    rm -rf "$venv"
    exit 77
  fi
) 9>"$work/venv.lock"
rc=$?
[ $rc -eq 0 ] || exit $rc
exec "$venv/bin/python" "$here/$script" "$@"
