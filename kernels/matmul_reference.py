"""The reference of every matmul in the course (kernels.matmul, kernels.split_k and the
batch-invariant matmul): PyTorch's act(a @ b + bias) in fp32 or fp64. A module of its own so
that the kernels which route to one another (kernels.matmul sends small outputs with a long K
to kernels.split_k) share it without importing each other."""

import torch


def _epilogue_ref(acc, bias, activation):
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    if activation == "gelu":
        return torch.nn.functional.gelu(acc)
    if activation == "relu":
        return torch.relu(acc)
    return acc


def matmul_ref(a: torch.Tensor, b: torch.Tensor, bias=None, activation=None) -> torch.Tensor:
    """PyTorch's act(a @ b + bias), computed in fp32 (fp64 for fp64 inputs), output in a's dtype.
    Reads M*K + K*N elements, writes M*N (plus a round trip of M*N for each of bias and act)."""
    compute = torch.promote_types(a.dtype, torch.float32)
    acc = a.to(compute) @ b.to(compute)
    return _epilogue_ref(acc, bias, activation).to(a.dtype)
