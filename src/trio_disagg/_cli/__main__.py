"""``python -m trio_disagg._cli``: the ``trio-disagg`` command (the tests start it so)."""

import sys

from . import main

sys.exit(main())
