"""Third-party warnings a gemzoo run triggers that are known to be harmless, silenced unless ``--verbose``.

Each entry names the warning and why it can be ignored; anything not listed still shows.
"""

from __future__ import annotations

import warnings

# (category, message regex, module regex or "", why it is harmless)
KNOWN_HARMLESS: tuple[tuple[type[Warning], str, str, str], ...] = (
    (UserWarning, r".*TypedStorage is deprecated.*", "",
     "torch's own storage internals, reached by torchrec and safetensors; no gemzoo code uses TypedStorage"),
    (FutureWarning, r".*torch\.distributed\._shard.*", "",
     "torchrec still imports torch's legacy sharding module; the planner does not use it"),
    (UserWarning, r".*No device id is provided via `init_process_group` or `barrier`.*", "",
     "gloo (CPU) groups take no device id; the NCCL groups are given theirs"),
    (UserWarning, r".*Attempted to get default timeout for nccl backend.*", "",
     "the process groups set their timeout explicitly"),
    (UserWarning, r".*fbgemm_gpu.*", "",
     "torchrec probes for fbgemm_gpu's CUDA ops on CPU-only installs and falls back to torch"),
    (DeprecationWarning, r".*", r"(torchrec|fbgemm_gpu|torch\.distributed\.checkpoint)(\.|$)",
     "deprecations inside torchrec and fbgemm_gpu: theirs to fix, nothing a run can change"),
)


def quiet_known_warnings() -> None:
    """Ignore the warnings in ``KNOWN_HARMLESS`` for the rest of this process."""
    for category, message, module, _why in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
