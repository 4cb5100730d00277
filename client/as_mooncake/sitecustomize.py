"""Run by Python at start-up in processes `hixl-as-mooncake` starts (its directory is
first on their PYTHONPATH): serve `mooncake.*` from hixl, then run the sitecustomize this
one hides. Never stops the interpreter from starting: a failure is one line on stderr."""

import sys

try:
    from hixl.client.as_mooncake import install, run_hidden_sitecustomize
except Exception as exc:  # noqa: BLE001 - start-up must go on
    print(f"hixl-as-mooncake: cannot import hixl: {exc!r}", file=sys.stderr)
else:
    try:
        install()
    except Exception as exc:  # noqa: BLE001
        print(f"hixl-as-mooncake: could not serve mooncake from hixl: {exc!r}",
              file=sys.stderr)
    try:
        run_hidden_sitecustomize()
    except Exception as exc:  # noqa: BLE001
        print(f"hixl-as-mooncake: the sitecustomize it hides failed: {exc!r}",
              file=sys.stderr)
