"""``python -m evictlayers``: the same as the ``evictlayers`` command."""

import sys

from evictlayers.cli import main

sys.exit(main())
