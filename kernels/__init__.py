"""Going Brrr From First Principles: the course's kernels and measuring tools.

Importing this package first fixes the mode (see `kernels.runtime`) before any Triton
kernel is defined.
"""

from kernels import runtime
from kernels.runtime import DEVICE, INTERPRET, ON_GPU, pick

__all__ = ["DEVICE", "INTERPRET", "ON_GPU", "pick", "runtime"]
__version__ = "0.1.0"
