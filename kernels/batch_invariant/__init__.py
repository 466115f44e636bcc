"""Chapter 5: batch-invariant kernels and `batch_invariant_mode()`, one package behind one face.

mode.py                the context manager and its torch.library routes (ROUTED_OPS)
rows.py                row reductions in one fixed order: rms_norm, mean, softmax
full_k_matmul.py       a matmul that reduces the whole K in one program: no split-K
split_kv_attention.py  attention split over keys at fixed positions, not by batch size
harness.py             the bitwise harness that tests any op for batch invariance
controls.py            negative controls the harness must catch (split-K, atomics)
"""

from kernels.batch_invariant.full_k_matmul import matmul, matmul_ref
from kernels.batch_invariant.mode import ROUTED_OPS, batch_invariant_mode, enabled
from kernels.batch_invariant.rows import mean, rms_norm, rms_norm_ref, softmax
from kernels.batch_invariant.split_kv_attention import attention, attention_ref

__all__ = [
    "rms_norm",
    "rms_norm_ref",
    "matmul",
    "matmul_ref",
    "attention",
    "attention_ref",
    "mean",
    "softmax",
    "batch_invariant_mode",
    "enabled",
    "ROUTED_OPS",
]
