#!/usr/bin/env bash
# Open the book: JupyterLab at chapters/, on 127.0.0.1 only. Installs what it needs on first use.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/env.sh
extra=()
[ "$(id -u)" = "0" ] && extra+=(--allow-root)  # containers often run as root
exec jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.root_dir=. "${extra[@]}" chapters/ "$@"
