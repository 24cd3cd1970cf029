"""``python -m trio_disagg``: the ``trio-disagg`` command."""

import sys

from ._entry import main

sys.exit(main())
