import os

import torch

# Triton kernels run on CPU only under the interpreter; it must be set before the kernels are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
