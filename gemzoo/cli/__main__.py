"""``python -m gemzoo.cli``: the ``gemzoo`` command (e.g. under ``torchrun ... -m gemzoo.cli train``)."""

import sys

try:
    from gemzoo.cli.main import main
except KeyboardInterrupt:  # Ctrl-C while the interpreter starts (a torchrun worker gets it too): no traceback
    sys.exit(130)

sys.exit(main())
