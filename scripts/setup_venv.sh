#!/usr/bin/env bash
# Create the project virtualenv ($1, default .venv) with torch and moekit[test].
# A machine whose python3 already has a CUDA torch keeps it (system site packages);
# elsewhere the CPU build torch==2.13.0 is installed.
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "setup: using the existing CUDA torch of $PY"
    "$PY" -m venv --system-site-packages "$VENV"
else
    "$PY" -m venv "$VENV"
    echo "setup: no CUDA torch found; installing the CPU build torch==2.13.0"
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
fi
"$VENV/bin/python" -m pip install -q -e ".[test]"
touch "$VENV/.ready"
