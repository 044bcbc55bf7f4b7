#!/usr/bin/env bash
# Gradescope runs this once, as root, in /autograder/source when it builds the autograder's image.
# It makes a virtualenv with the pinned Python packages (run_autograder grades with it) and the
# unprivileged user that student code runs as (tools/sandbox.py), then checks that this user can
# import torch from the venv and cannot read the grader's files.
#
# AUTOGRADER_ROOT (default /autograder), AUTOGRADER_VENV (default $AUTOGRADER_ROOT/venv),
# AUTOGRADER_PYTHON_BIN (a Python >= 3.11 that every user can read), GRADE_SANDBOX_USER (default
# grade-sandbox) and TORCH_INDEX (the index torch comes from; empty: pip's default index) move it
# elsewhere, e.g. to try it in a container.
set -euo pipefail
cd "$(dirname "$0")"
SOURCE=$(pwd)
ROOT=${AUTOGRADER_ROOT:-/autograder}
VENV=${AUTOGRADER_VENV:-$ROOT/venv}
SANDBOX_USER=${GRADE_SANDBOX_USER:-grade-sandbox}
# torch from the default package index is the CUDA build, several GB with its nvidia-* libraries
# and of no use in Gradescope's CPU-only container: the CPU-only wheel index instead
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}

recent() { "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }
PYTHON=${AUTOGRADER_PYTHON_BIN:-}
if [ -z "$PYTHON" ]; then
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null && recent "$candidate"; then
            PYTHON=$candidate
            break
        fi
    done
fi
if [ -z "$PYTHON" ]; then  # Gradescope's Ubuntu 22.04 image ships 3.10; 3.11 is in its archive
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3.11 python3.11-venv
    PYTHON=python3.11
fi
recent "$PYTHON" || { echo "setup.sh: $PYTHON is older than 3.11" >&2; exit 1; }

"$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --no-cache-dir --quiet)
"${pip[@]}" --upgrade pip
"${pip[@]}" torch==2.13.0 ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"${pip[@]}" -r requirements-autograder.txt
chmod -R go+rX "$VENV"
"$VENV/bin/python" -c 'import torch; print("setup.sh: torch", torch.__version__, "ready")'

if [ "$(id -u)" = 0 ]; then
    if ! id -u "$SANDBOX_USER" >/dev/null 2>&1; then
        useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
            "$SANDBOX_USER"
    fi
    chmod -R go-rwx "$SOURCE"  # the tests, the grader and any hidden file: root's alone
    as_sandbox() { su -s /bin/sh -c "$1" "$SANDBOX_USER"; }
    as_sandbox "cd / && '$VENV/bin/python' -c 'import torch'" || {
        echo "setup.sh: $SANDBOX_USER cannot run $VENV/bin/python with torch; give" \
            "AUTOGRADER_PYTHON_BIN a Python every user can read (not one under /root)" >&2
        exit 1
    }
    if as_sandbox "cat '$SOURCE/run_autograder'" >/dev/null 2>&1; then
        echo "setup.sh: $SANDBOX_USER can read $SOURCE; it must not" >&2
        exit 1
    fi
    echo "setup.sh: student code will run as $SANDBOX_USER"
fi
