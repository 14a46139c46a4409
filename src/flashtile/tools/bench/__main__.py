"""``python -m flashtile.tools.bench``: the same as ``flashtile bench``."""

import sys

from flashtile.tools.bench import main

sys.exit(main())
