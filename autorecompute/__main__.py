"""``python -m autorecompute``: the command line (``autorecompute demo``, ``autorecompute plan``)."""
from autorecompute.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
