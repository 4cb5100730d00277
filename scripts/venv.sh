# Sourced by scripts/test.sh and scripts/serve.sh: make the repo's .venv ready, once.
#
# Creates .venv (with $PYTHON, default python3) when it is missing or broken, and runs
# `pip install -e '.[$HIXL_EXTRAS]'` (default: test; empty: none) only when the venv is new or pyproject.toml,
# setup.py, the C extension's source (hixl/_fastwire.c, built by that install when a compiler
# is there) or the extras changed since the last install: a stamp file in the venv records both.
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
    # unset: the test extras; empty (serve.sh): hixl alone, what serving needs.
    # CI adds "mooncake" and "torch" to measure against them
    local extras=${HIXL_EXTRAS-test}
    local hash have=""
    hash=$(cat "$root/pyproject.toml" "$root/setup.py" "$root/hixl/_fastwire.c" | sha256sum | cut -d' ' -f1)
    [[ -f $stamp ]] && have=$(<"$stamp")
    # hixl alone is in every install of this pyproject, whatever extras came with it
    if [[ $have != "$hash $extras" && ! ( -z $extras && $have == "$hash "* ) ]]; then
        echo "installing hixl (editable) with extras [$extras] into $venv" >&2
        (cd "$root" && PIP_NO_INPUT=1 "$venv/bin/python" -m pip install -q -e ".${extras:+[$extras]}" >&2)
        echo "$hash $extras" >"$stamp"
    fi
}
