"""The gradient norm measured while the backward still runs (one CUDA device, no loss scaler).

The non-finite guard needs the global gradient norm before every optimizer step. Taken after the backward it is
one more pass over every fp32 gradient on the critical path (5 GB for 1.3B parameters, about 1% of the step on an
H200). Here each parameter's norm is taken on a side stream as soon as autograd has accumulated its gradient, so
it runs beside the backward's matmuls, and `norms()` only joins them:

    overlap = OverlappedNorm(optimizers)   # hooks on every parameter the optimizers hold
    overlap.arm(last_micro_batch)          # before each forward: measure in this backward or not
    ... backward ...
    per_optimizer = overlap.norms()        # the main stream waits for the side stream; (norm, count) each
    overlap.remove()                       # the hooks leave the user's parameters
"""

from __future__ import annotations

import torch


class OverlappedNorm:
    """Per-optimizer gradient norms, measured on a side stream by post-accumulate-grad hooks."""

    def __init__(self, optimizers: list):
        self.side = torch.cuda.Stream()
        self.armed = False
        self.owner: dict[int, int] = {}  # id(parameter) -> index of its optimizer
        params = []
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad and id(p) not in self.owner:
                        self.owner[id(p)] = i
                        params.append(p)
        self.squares: list[list[torch.Tensor]] = [[] for _ in optimizers]
        self.handles = [p.register_post_accumulate_grad_hook(self._measure) for p in params]

    def arm(self, measure: bool) -> None:
        """Whether the coming backward completes the gradients (the last micro-batch of a window)."""
        self.armed = measure
        if measure:
            self.squares = [[] for _ in self.squares]

    def _measure(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self.side.wait_stream(torch.cuda.current_stream())  # the gradient is complete on the main stream
        grad = param.grad
        grad.record_stream(self.side)  # its memory is not reused before the side stream has read it
        with torch.cuda.stream(self.side):
            norm = torch.linalg.vector_norm(grad, dtype=torch.float32)
            self.squares[self.owner[id(param)]].append(norm * norm)

    def norms(self) -> list[tuple[torch.Tensor | None, int]]:
        """Per optimizer: the norm (None where no gradient arrived) and how many gradients it covers, ready on
        the main stream. Disarms."""
        self.armed = False
        torch.cuda.current_stream().wait_stream(self.side)
        return [(torch.stack(s).sum().sqrt() if s else None, len(s)) for s in self.squares]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
