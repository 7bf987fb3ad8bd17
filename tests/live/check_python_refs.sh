#!/usr/bin/env bash
# Live check of the committed reference outputs against the real Python libraries: installs
# the pinned versions into a private venv (PyPI must be reachable; otherwise the test is
# skipped with exit code 77 and the committed files stand), then has each generator script
# regenerate its outputs in memory and compare them with the committed ones.
# usage: bash tests/live/check_python_refs.sh WORK_DIR
set -uo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/kvlm-live}
venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >/dev/null 2>&1 || { echo "live check skipped: python3 -m venv failed"; exit 77; }
fi
if ! timeout 300 "$venv/bin/pip" install -q --disable-pip-version-check "tokenizers==0.22.1" "jinja2==3.1.6" >"$work/pip.log" 2>&1; then
  echo "live check skipped: PyPI not reachable ($(tail -n 1 "$work/pip.log"))"
  exit 77
fi
status=0
"$venv/bin/python" "$here/tools/make_tokenizer_goldens.py" --check --shared "$here/../shared" || status=1
"$venv/bin/python" "$here/tools/make_template_goldens.py" --check || status=1
exit $status
