"""Builds csrc/ into gemzoo._C with torch's cpp_extension and ninja.

Every csrc/<family>/*.cpp is compiled; *.cu files only where torch has CUDA. Set GEMZOO_NO_EXTENSION=1
to skip the build (gemzoo then falls back to torch code, see gemzoo/ops.py).
"""

import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("GEMZOO_NO_EXTENSION", "0") in ("", "0"):
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

    here = os.path.dirname(os.path.abspath(__file__))
    cpp = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    cuda = sorted(glob.glob(os.path.join("csrc", "**", "*.cu"), recursive=True))
    from torch.utils.cpp_extension import CUDA_HOME

    # CUDA sources wherever torch itself is a CUDA build and nvcc exists (no GPU needed at build time)
    with_cuda = (torch.version.cuda is not None and CUDA_HOME is not None) or os.environ.get("GEMZOO_FORCE_CUDA") == "1"
    if os.environ.get("GEMZOO_NO_CUDA", "0") not in ("", "0"):
        with_cuda = False
    extra = {
        # the torch version travels as bare tokens and is stringified in csrc/gemzoo_ops.cpp (no shell quoting)
        "cxx": ["-O3", "-fopenmp", "-std=c++17", f"-DGEMZOO_TORCH_VERSION_TOKENS={torch.__version__}"],
        "nvcc": ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_80,code=sm_80"],
    }
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):  # e.g. "9.0a": torch's cpp_extension turns it into -gencode flags
        extra["nvcc"] = ["-O3"]
    if cpp:
        if with_cuda and cuda:
            ext = CUDAExtension("gemzoo._C", cpp + cuda, include_dirs=[os.path.join(here, "csrc")],
                                extra_compile_args=extra, extra_link_args=["-fopenmp"],
                                define_macros=[("GEMZOO_WITH_CUDA", "1")])
        else:
            ext = CppExtension("gemzoo._C", cpp, include_dirs=[os.path.join(here, "csrc")],
                               extra_compile_args={"cxx": extra["cxx"]}, extra_link_args=["-fopenmp"])
        ext_modules = [ext]
        cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
