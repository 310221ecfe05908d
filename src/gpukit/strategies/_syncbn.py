"""SyncBatchNorm for the CPU (gloo): torch's ``nn.SyncBatchNorm`` only runs on GPUs.

Statistics are the mean and biased variance over the whole global batch, computed with two
autograd-aware all-reduces (mean first, then the centred sum of squares, which is more
accurate than E[x^2] - E[x]^2); gradients flow back through them as in torch's version.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["HostSyncBatchNorm", "convert_sync_batchnorm"]


class _AllReduceSum(torch.autograd.Function):
    """Sum over processes; the gradient of each input is the sum of the outputs' gradients."""

    @staticmethod
    def forward(ctx: object, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out = grad.clone()
        dist.all_reduce(out)
        return out


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    return _AllReduceSum.apply(tensor)


class HostSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm whose training statistics span every process of the default group."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not (self.training and dist.is_available() and dist.is_initialized()):
            return super().forward(input)
        if dist.get_world_size() == 1:
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = torch.tensor(input.numel() / input.shape[1], dtype=input.dtype, device=input.device)
        total = _all_reduce_sum(torch.cat([input.sum(dims), count.reshape(1)]))
        n = total[-1]
        mean = total[:-1] / n
        centred = input - mean.reshape(shape)
        var = _all_reduce_sum((centred * centred).sum(dims)) / n
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = (
                    1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
                )
                self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
                unbiased = var.detach() * (n / (n - 1)).clamp(min=0)
                self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
        out = centred * torch.rsqrt(var + self.eps).reshape(shape)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace every BatchNorm in ``module`` by :class:`HostSyncBatchNorm`, keeping its state."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(
        module, HostSyncBatchNorm
    ):
        new = HostSyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine,
            module.track_running_stats,
        )
        # the same Parameter and buffer objects, so an optimizer built earlier still owns them
        if module.affine:
            with torch.no_grad():
                new.weight = module.weight
                new.bias = module.bias
        new.running_mean = module.running_mean
        new.running_var = module.running_var
        new.num_batches_tracked = module.num_batches_tracked
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module

