"""The gradient norm measured while the backward still runs (one CUDA device, no loss scaler).

The non-finite guard needs the global gradient norm before every optimizer step. Taken after the backward it is
one more pass over every fp32 gradient on the critical path (5 GB for 1.3B parameters, about 1% of the step on an
H200). Here the norms are taken on a side stream as autograd completes the gradients, so they run beside the
backward, and `norms()` only joins them. A hook per parameter notes its gradient; once the noted gradients hold
`chunk` elements, one multi-tensor norm kernel (`torch._foreach_norm`) takes them all: a few dozen launches per
step for a 1.3B model instead of one or more per parameter, which matters where the host is the bottleneck
(small micro-batches).

    overlap = OverlappedNorm(optimizers)   # hooks on every parameter the optimizers hold
    overlap.arm(last_micro_batch)          # before each forward: measure in this backward or not
    ... backward ...
    per_optimizer = overlap.norms()        # the main stream waits for the side stream; (norm, count) each
    overlap.remove()                       # the hooks leave the user's parameters
"""

from __future__ import annotations

import torch

CHUNK = 1 << 25  # elements per side-stream launch (128 MiB of fp32 gradients); 0: one launch per gradient


class OverlappedNorm:
    """Per-optimizer gradient norms, measured on a side stream by post-accumulate-grad hooks."""

    def __init__(self, optimizers: list, chunk: int = CHUNK):
        self.side = torch.cuda.Stream()
        self.armed = False
        self.chunk = chunk
        self.owner: dict[int, int] = {}  # id(parameter) -> index of its optimizer
        params = []
        for i, opt in enumerate(optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.requires_grad and id(p) not in self.owner:
                        self.owner[id(p)] = i
                        params.append(p)
        self.squares: list[list[torch.Tensor]] = [[] for _ in optimizers]  # per optimizer: partial sums
        self.counts = [0] * len(optimizers)  # per optimizer: gradients measured
        self.noted: list[list[torch.Tensor]] = [[] for _ in optimizers]  # gradients not yet launched
        self.noted_elements = 0
        self.handles = [p.register_post_accumulate_grad_hook(self._note) for p in params]

    def arm(self, measure: bool) -> None:
        """Whether the coming backward completes the gradients (the last micro-batch of a window)."""
        self.armed = measure
        if measure:
            self.squares = [[] for _ in self.squares]
            self.counts = [0] * len(self.counts)

    def _note(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self.noted[self.owner[id(param)]].append(param.grad)
        self.noted_elements += param.grad.numel()
        if self.noted_elements >= self.chunk:
            self._launch()

    def _launch(self) -> None:
        """Queues the norms of the noted gradients on the side stream, behind the main stream's work so far."""
        self.side.wait_stream(torch.cuda.current_stream())  # the noted gradients are complete on the main stream
        with torch.cuda.stream(self.side):
            for i, grads in enumerate(self.noted):
                if not grads:
                    continue
                for g in grads:
                    g.record_stream(self.side)  # its memory is not reused before the side stream has read it
                norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
                self.squares[i].append(torch.stack(norms).square().sum())
                self.counts[i] += len(grads)
        self.noted = [[] for _ in self.noted]
        self.noted_elements = 0

    def norms(self) -> list[tuple[torch.Tensor | None, int]]:
        """Per optimizer: the norm (None where no gradient arrived) and how many gradients it covers, ready on
        the main stream. Disarms."""
        if self.noted_elements or any(self.noted):
            self._launch()
        self.armed = False
        torch.cuda.current_stream().wait_stream(self.side)
        return [(torch.stack(s).sum().sqrt() if s else None, n) for s, n in zip(self.squares, self.counts)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
