"""Lightning's `grad_norm`: the gradient norm of each parameter and of all of them, to log from
`on_before_optimizer_step`:

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self.model, norm_type=2))
"""

from __future__ import annotations

import torch


def grad_norm(
    module: torch.nn.Module, norm_type: float | int | str, group_separator: str = "/"
) -> dict:
    """{"grad_<p>_norm/<name>": each parameter's gradient norm, "grad_<p>_norm_total": theirs}, for
    parameters that have a gradient here (under DeepSpeed ZeRO the engine keeps gradients in its own
    buffers, so none do)."""
    p = float(norm_type)
    if p <= 0:
        raise ValueError(
            f"norm_type={norm_type!r} is not valid: `norm_type` must be a positive number or "
            f"'inf' (infinity norm). Got {norm_type}"
        )
    norms = {
        f"grad_{p}_norm{group_separator}{name}": param.grad.detach().norm(p)
        for name, param in module.named_parameters()
        if param.grad is not None
    }
    if norms:
        norms[f"grad_{p}_norm_total"] = torch.stack([n.float() for n in norms.values()]).norm(p)
    return norms
