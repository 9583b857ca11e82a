#!/usr/bin/env bash
# Open the book: JupyterLab on 127.0.0.1, rooted at the repository (chapters/, exercises/ and
# solutions/ all in its file browser), START_HERE.ipynb open first, with the settings in
# jupyterlab/user-settings (no news or update pop-ups). Installs what it needs on first use.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
python -m labkit.landing . >/dev/null   # the table of contents, from the chapters that exist
extra=()
[ "$(id -u)" = "0" ] && extra+=(--allow-root)  # containers often run as root
# The terminal runs bash with scripts/terminal-rc.sh, so `labkit` is on its PATH.
# Every save passes labkit.labsave first: a notebook the reader only read is written back byte for
# byte as it was (JupyterLab would add plotly PNGs and its own kernel's metadata).
exec jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. \
  --ServerApp.terminado_settings="shell_command=['bash','--rcfile','$PWD/scripts/terminal-rc.sh','-i']" \
  --LabApp.user_settings_dir="$PWD/jupyterlab/user-settings" \
  --LabApp.workspaces_dir="$PWD/build/jupyterlab-workspaces" \
  --LabApp.default_url=/lab/tree/START_HERE.ipynb \
  --ContentsManager.pre_save_hook=labkit.labsave.pre_save_hook \
  "${extra[@]}" START_HERE.ipynb "$@"
