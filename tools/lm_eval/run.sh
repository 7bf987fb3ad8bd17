#!/usr/bin/env bash
# lm-evaluation-harness against `kvlm serve`, once per KV cache mode (see tools/lm_eval/README.md).
#
#   tools/lm_eval/run.sh [--python PY] [--venv DIR] [--wheels DIR] [--no-install] --out DIR [run.py options]
#
# Makes (once) a venv with --system-site-packages and installs lm-evaluation-harness into it
# from local wheels only (pip --no-index --find-links DIR; scripts/fetch-lm-eval-wheels puts
# them in .carry/wheels), then runs tools/lm_eval/run.py with the venv's python. When the kvlm
# binary lacks shared libraries and .carry/debs exists (the GPU machine), unpacks those Debian
# packages as scripts/gpu-check does and sets LD_LIBRARY_PATH. --no-install uses PY as it is.
# Everything else goes to run.py: --kvlm, --model, --modes, --tasks, --limit, --device, --api, ...
set -euo pipefail
LM_EVAL_VERSION=0.4.13
root=$(cd "$(dirname "$0")/../.." && pwd)
python=python3
venv=/tmp/kvlm-lm-eval-venv
wheels=$root/.carry/wheels
install=1
pass=()
kvlm=""
die() { echo "error: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --python) python=${2:?--python needs a value}; shift 2 ;;
    --venv) venv=${2:?--venv needs a value}; shift 2 ;;
    --wheels) wheels=${2:?--wheels needs a value}; shift 2 ;;
    --no-install) install=0; shift ;;
    --kvlm) kvlm=${2:?--kvlm needs a value}; pass+=("$1" "$2"); shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; echo; exec python3 "$root/tools/lm_eval/run.py" --help ;;
    *) pass+=("$1"); shift ;;
  esac
done

# lm_eval: reuse the venv when it already holds the pinned version
has_lm_eval() {
  "$1" - "$LM_EVAL_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
import lm_eval, datasets, tenacity, aiohttp  # noqa: F401  what run.py and local-completions need
sys.exit(0 if version("lm_eval") == sys.argv[1] else 1)
EOF
}
if [ $install = 0 ]; then
  py=$(command -v "$python") || die "--python $python not found"
  has_lm_eval "$py" || die "$py cannot import lm_eval==$LM_EVAL_VERSION (with datasets, tenacity, aiohttp); drop --no-install to make a venv"
else
  py=$venv/bin/python
  if ! [ -x "$py" ] || ! has_lm_eval "$py"; then
    if ! ls "$wheels"/lm_eval-"$LM_EVAL_VERSION"-*.whl >/dev/null 2>&1; then
      die "no lm_eval-$LM_EVAL_VERSION wheel in $wheels: run scripts/fetch-lm-eval-wheels on a machine with network (and carry .carry), or pass --wheels DIR"
    fi
    command -v "$python" >/dev/null || die "--python $python not found"
    echo "[lm_eval/run] making $venv ($("$python" -V 2>&1), --system-site-packages) and installing lm_eval $LM_EVAL_VERSION from $wheels"
    "$python" -m venv --system-site-packages "$venv" || die "could not make the venv $venv"
    # --system-site-packages reaches the base interpreter's packages only; when $python is
    # itself a venv (the GPU machine's python3 is /opt/torch/.venv/bin/python3), a .pth file
    # puts its site-packages on the new venv's path too, after the venv's own.
    "$python" -c 'import site; print("\n".join(site.getsitepackages()))' \
      >"$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_kvlm_parent_env.pth"
    if ! "$py" -m pip install -q --disable-pip-version-check --no-index --find-links "$wheels" \
        "lm_eval[api]==$LM_EVAL_VERSION" 2>"$venv/pip-install.err"; then
      cat "$venv/pip-install.err" >&2
      echo "[lm_eval/run] WARNING: pip could not resolve lm_eval[api]==$LM_EVAL_VERSION from $wheels plus the system's packages" \
           "(above). Installing every wheel in $wheels with --no-deps instead; pip check says:" >&2
      "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps "$wheels"/*.whl ||
        die "installing the wheels with --no-deps failed too"
      "$py" -m pip check >&2 || true
    fi
    has_lm_eval "$py" || die "lm_eval $LM_EVAL_VERSION still does not import in $venv: $("$py" -c 'import lm_eval' 2>&1 | tail -1)"
  fi
fi

# The kvlm binary's shared libraries (GPU machine: the Debian packages carried in .carry/debs)
[ -n "$kvlm" ] || kvlm=${KVLM:-}
if [ -z "$kvlm" ]; then
  for d in build-gpu build build-cpu; do [ -x "$root/$d/kvlm" ] && { kvlm=$root/$d/kvlm; break; }; done
fi
if [ -n "$kvlm" ] && [ -x "$kvlm" ] && ldd "$kvlm" 2>/dev/null | grep -q "not found"; then
  deps=/tmp/kvlm-deps
  if [ -d "$root/.carry/debs" ]; then
    mkdir -p "$deps"
    for f in "$root"/.carry/debs/*.deb; do dpkg -x "$f" "$deps"; done
  fi
  lib=$deps/usr/lib/x86_64-linux-gnu
  export LD_LIBRARY_PATH=$lib/openblas-pthread:$lib:${LD_LIBRARY_PATH:-}
  if ldd "$kvlm" | grep "not found" >&2; then
    die "$kvlm misses the shared libraries above (on the GPU machine: carry .carry with the debs of scripts/fetch-gpu-deps)"
  fi
fi

exec "$py" "$root/tools/lm_eval/run.py" "${pass[@]}"
