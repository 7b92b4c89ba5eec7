"""The momentum both matrix optimizers share (training.md §1.1, §1.3): an fp32 buffer M <- mu*M + G and
the Nesterov look-ahead U = G + mu*M (or U = M without Nesterov, U = G without momentum)."""

from __future__ import annotations

import torch


def momentum_direction(state: dict, param: torch.Tensor, grad: torch.Tensor, mu: float, nesterov: bool) -> torch.Tensor:
    """grad: the fp32 gradient; state: the optimizer's per-parameter state (holds the buffer)."""
    if mu <= 0:
        return grad
    buf = state.get("momentum_buffer")
    if buf is None:
        buf = state["momentum_buffer"] = torch.zeros_like(
            param, dtype=torch.float32, memory_format=torch.preserve_format
        )
    elif buf.dtype != torch.float32:  # load_state_dict casts state to the param dtype
        buf = state["momentum_buffer"] = buf.to(torch.float32)
    buf.mul_(mu).add_(grad)
    return grad.add(buf, alpha=mu) if nesterov else buf
