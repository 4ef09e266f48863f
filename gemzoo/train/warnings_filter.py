"""Third-party warnings a gemzoo run triggers that are known to be harmless, silenced unless ``gemzoo train
--verbose``. Each entry says why it can be ignored; anything not listed still shows.

torchrun's own notice about ``OMP_NUM_THREADS`` comes from the launcher, before gemzoo starts: set the variable
(``OMP_NUM_THREADS=1 torchrun ...``) to silence it.
"""

from __future__ import annotations

import logging
import warnings

# (category, message regex, why it is harmless)
KNOWN_WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (FutureWarning, r"HeuristicalStorageReservation is known to cause issues",
     "torchrec's planner estimates dense memory for its dry run; gemzoo plans small tables on the real devices"),
)

# (logger, message prefix, why it is harmless)
KNOWN_LOG_RECORDS: tuple[tuple[str, str, str], ...] = (
    ("torchrec.distributed.planner.types", "The topology was constructed directly",
     "the built-in planner gives torchrec the world size and device type itself; nothing is resolved later"),
    ("torchrec.distributed.planner.storage_reservations", "There is a known issue with TorchRec's dense tensor",
     "the same dry-run estimate as HeuristicalStorageReservation's warning"),
)


class _DropKnown(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_known_warnings() -> None:
    """Ignore the warnings and log records listed above for the rest of this process."""
    for category, message, _why in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    loggers: dict[str, list[str]] = {}
    for name, prefix, _why in KNOWN_LOG_RECORDS:
        loggers.setdefault(name, []).append(prefix)
    for name, prefixes in loggers.items():
        logging.getLogger(name).addFilter(_DropKnown(tuple(prefixes)))
