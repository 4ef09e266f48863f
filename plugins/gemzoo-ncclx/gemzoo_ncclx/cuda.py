"""CUDA transport: see cuda.py (built on first CUDA use)."""

def make_cuda_transport(pg, device):
    return False
