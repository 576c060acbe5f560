"""``python -m fuel`` is the ``fuel`` command: same commands, same exit statuses."""

import sys

from fuel.console import main

sys.exit(main())
