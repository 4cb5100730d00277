# Sourced by scripts/test.sh and scripts/serve.sh: make the repo's .venv ready, once.
#
# Creates .venv (with $PYTHON, default python3) when it is missing or broken, and runs
# `pip install -e '.[$HIXL_EXTRAS]'` (default: test) only when the venv is new or pyproject.toml
# or the extras changed since the last install: a stamp file in the venv records both.
# Progress goes to stderr so that the caller's stdout stays its own.

hixl_ensure_venv() {
    local root=$1
    local venv="$root/.venv"
    local stamp="$venv/.hixl-installed"
    local python=${PYTHON:-python3}
    if ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "creating $venv with $("$python" --version 2>&1)" >&2
        "$python" -m venv --clear "$venv"
    fi
    local extras=${HIXL_EXTRAS:-test}  # CI adds "mooncake" and "torch" to measure against them
    local want
    want="$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1) $extras"
    if [[ ! -f $stamp || $(<"$stamp") != "$want" ]]; then
        echo "installing hixl (editable) with extras [$extras] into $venv" >&2
        (cd "$root" && PIP_NO_INPUT=1 "$venv/bin/python" -m pip install -q -e ".[$extras]" >&2)
        echo "$want" >"$stamp"
    fi
}
