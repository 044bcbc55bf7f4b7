#!/usr/bin/env bash
# Make (or repair) the virtualenv the Makefile uses, and say plainly what it does.
#
#   tools/venv.sh PYTHON VENV TORCH_INDEX REQUIREMENTS...
#
# - PYTHON must be >= 3.11 (the pinned numpy, matplotlib and ipykernel need it): one-line error.
# - A VENV made by another Python is removed and made again, never reused.
# - VENV/.make-stamp records the Python version and a hash of each requirements file once its
#   install has finished; a file whose line is missing or stale (edited, or an install that broke
#   off half-way) is installed again, so a half-installed venv is repaired before any use.
# - TORCH_INDEX (optional) is an extra package index used for torch alone, e.g. the CPU-only build.
# - A .pth file in the venv's site-packages puts the repository root on sys.path, so a Jupyter
#   kernel started anywhere (notebooks/ included) can `import mhc` without PYTHONPATH. A venv whose
#   .pth names another checkout is never repointed (that checkout's notebooks would import this
#   one's files): make stops with one line that says what to do.
set -euo pipefail
PYTHON=$1 VENV=$2 TORCH_INDEX=$3
shift 3
ROOT=$(cd "$(dirname "$0")/.." && pwd)

version=$("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null) || {
    echo "make: '$PYTHON' is not a working Python; install Python >= 3.11 and run" \
        "make PYTHON=python3.11" >&2
    exit 1
}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    echo "make: Python >= 3.11 is needed, '$PYTHON' is $version; run make PYTHON=python3.11" >&2
    exit 1
fi

want_python=$("$PYTHON" -V 2>&1)
stamp=$VENV/.make-stamp
if [ -e "$VENV" ] || [ -L "$VENV" ]; then
    have_python=$("$VENV/bin/python" -V 2>&1 || echo "no working python")
    if [ "$have_python" != "$want_python" ]; then
        echo "make: $VENV was made by '$have_python', not '$want_python': making it again"
        rm -rf "$VENV"
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "make: creating $VENV with $want_python"
    "$PYTHON" -m venv "$VENV"
    echo "python: $want_python" >"$stamp"
fi
[ -f "$stamp" ] || echo "python: $want_python" >"$stamp"

pip=("$VENV/bin/python" -m pip install --quiet)
for req in "$@"; do
    line="$req: $(sha256sum "$req" | cut -c1-16) torch-index=${TORCH_INDEX:-default}"
    if grep -qxF "$line" "$stamp"; then
        continue
    fi
    start=$SECONDS
    echo "make: installing $req into $VENV (the first time takes minutes: torch is large)"
    torch_pin=$(grep -E '^torch==' "$req" || true)
    if [ -n "$torch_pin" ] && [ -n "$TORCH_INDEX" ]; then
        "${pip[@]}" --extra-index-url "$TORCH_INDEX" "$torch_pin"
    fi
    "${pip[@]}" -r "$req"
    grep -v "^$req: " "$stamp" >"$stamp.new" || true
    echo "$line" >>"$stamp.new"
    mv "$stamp.new" "$stamp"
    echo "make: $req installed in $((SECONDS - start)) s"
done

site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
pth=$site/course_repository_root.pth
if [ -f "$pth" ] && [ "$(cat "$pth")" != "$ROOT" ]; then
    echo "make: $VENV belongs to the checkout $(cat "$pth"); run make there, give this checkout" \
        "its own (make VENV=.venv), or delete $pth to move $VENV here" >&2
    exit 1
fi
[ -f "$pth" ] || echo "$ROOT" >"$pth"
