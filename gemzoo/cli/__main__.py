"""``python -m gemzoo.cli``: the ``gemzoo`` command (e.g. under ``torchrun ... -m gemzoo.cli train``)."""

import sys

from gemzoo.cli.main import main

sys.exit(main())
