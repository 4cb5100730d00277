# Sourced by scripts/test.sh and scripts/serve.sh: make the repo's .venv ready, once.
#
# Creates .venv (with $PYTHON, default python3) when it is missing or broken, and runs
# `pip install -e '.[test]'` only when the venv is new or pyproject.toml changed since the
# last install: a stamp file in the venv holds the hash of the pyproject.toml it installed.
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
    local want
    want=$(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)
    if [[ ! -f $stamp || $(<"$stamp") != "$want" ]]; then
        echo "installing hixl (editable) and its test tools into $venv" >&2
        (cd "$root" && PIP_NO_INPUT=1 "$venv/bin/python" -m pip install -q -e '.[test]' >&2)
        echo "$want" >"$stamp"
    fi
}
