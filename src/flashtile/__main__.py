"""``python -m flashtile``: the same command line as the ``flashtile`` console script."""

from flashtile.cli import main

raise SystemExit(main())
