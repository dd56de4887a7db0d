"""``python -m shrinkwrap``: the same as the ``shrinkwrap`` command."""

from .cli import main

if __name__ == "__main__":  # spawned measuring subprocesses import this module; they must not rerun it
    raise SystemExit(main())
