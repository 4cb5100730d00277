#!/usr/bin/env bash
# Set up .venv (only when needed), then start an agent in the foreground.
#
#   bash scripts/serve.sh [hixl-agent flags...]     # see: bash scripts/serve.sh --help
#
# An agent started without a master address runs the address-table registry (and the KV
# store's master) in-process, so this one command serves a single node.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/venv.sh
. "$root/scripts/venv.sh"
# serving needs hixl alone: no test tools (a venv made by scripts/test.sh serves as it is)
HIXL_EXTRAS=${HIXL_EXTRAS-} hixl_ensure_venv "$root"
exec "$root/.venv/bin/hixl-agent" "$@"
