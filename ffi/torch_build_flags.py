"""Prints what CMake needs to build the CUDA bridge against the installed torch.

One CMake list: include dirs joined by '|', the library dir, the _GLIBCXX_USE_CXX11_ABI value.
Exits non-zero when torch is missing or has no CUDA build, so that AUTO skips the bridge.
"""
import sys

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit("torch is not installed")
if torch.version.cuda is None:
    sys.exit("torch is a CPU-only build")
print(";".join([
    "|".join(cpp_extension.include_paths()),
    cpp_extension.library_paths()[0],
    str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
]), end="")
