"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` with DeepSpeed's arguments, plain
torch optimizers that need no build.

A script constructs one over its param groups and hands it to ``deepspeed.initialize``, which
reads it into zfunc's Adam (zfunc.deepspeed.client: by these class names, Adam or AdamW by
``adam_w_mode``, each group's ``lr``, ``betas``, ``eps``, ``weight_decay``). Stepped by hand, as
in a plain PyTorch loop, ``step()`` is the Adam DeepSpeed's kernels compute: decoupled decay
(``adam_w_mode=True``, the default) or decay added to the gradient, and ``eps`` added after the
bias-corrected square root, as ``torch.optim.AdamW`` / ``Adam`` do.
"""
from __future__ import annotations

import math

import torch

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class _Adam(torch.optim.Optimizer):
    """The math both classes share; ``adam_w_mode`` picks AdamW (decoupled decay) or Adam (L2)."""

    def __init__(self, params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode):
        if amsgrad:
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant (as in DeepSpeed); "
                               "use torch.optim.Adam(amsgrad=True) outside zfunc")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.adam_w_mode = bool(adam_w_mode)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                state["step"] += 1
                t = state["step"]
                grad = p.grad.float()
                value = p.float()
                if decay and self.adam_w_mode:
                    value.mul_(1 - lr * decay)
                elif decay:
                    grad = grad.add(value, alpha=decay)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                c1 = 1 - beta1 ** t if group["bias_correction"] else 1.0
                c2 = 1 - beta2 ** t if group["bias_correction"] else 1.0
                denom = (v.sqrt() / math.sqrt(c2)).add_(eps)
                value.addcdiv_(m, denom, value=-lr / c1)
                if value is not p:
                    p.copy_(value)
        return loss


class FusedAdam(_Adam):
    """DeepSpeed's ``FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)``: see the module
    docstring. ``set_grad_none`` is what ``zero_grad()`` does by default in torch anyway."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0.0, amsgrad=False, set_grad_none=True):
        super().__init__(params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adam_w_mode)
        self.set_grad_none = set_grad_none


class DeepSpeedCPUAdam(_Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True, betas=(0.9,
    0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True)``:
    see the module docstring. Where the optimizer state lives is the config's business here
    (``offload_optimizer``), not the class's. ``fp32_optimizer_states=False`` (moments in the
    parameters' dtype) is refused by ``deepspeed.initialize``, which names zfunc's bf16 moments."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad, adamw_mode)
        self.fp32_optimizer_states = fp32_optimizer_states
