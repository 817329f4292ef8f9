"""``python -m lightning_hookdiag report LOG_DIR ...``: the same command line as the ``hookdiag`` script."""

from lightning_hookdiag.report._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
