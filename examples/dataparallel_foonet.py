"""The classic FooNet DataParallel example, rewritten with gpukit.

The original sets ``CUDA_VISIBLE_DEVICES``, wraps ``nn.DataParallel(net)`` and moves the net
with ``.cuda()`` -- and fails with "module must have its parameters and buffers on device
cuda:1 (device_ids[0])" as soon as the first listed GPU is not cuda:0. Here the session puts
the model on the main GPU (the first one listed) itself:

    python examples/dataparallel_foonet.py                 # every visible GPU (or the CPU)
    python examples/dataparallel_foonet.py --gpus 1 0      # main GPU is cuda:1

Each replica prints the share of the batch it got. The outputs are gathered on the main GPU,
which therefore uses more memory; ``--loss-in-forward`` computes the loss inside each replica
(``ModelWithLoss``) so only one number per GPU is gathered. For real speed use DDP
(examples/ddp_train.py): DataParallel is limited by the GIL and re-copies the model each step.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit
from gpukit.strategies import ModelWithLoss


class FooNet(nn.Module):
    def __init__(self, neural_num: int, layers: int = 3) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(neural_num, neural_num, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        print(f"    batch size in forward: {x.size(0)} on {x.device}")
        for linear in self.linears:
            x = torch.relu(linear(x))
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", help="GPU indices, main first (default: all)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--loss-in-forward", action="store_true")
    args = parser.parse_args()

    session = gpukit.Session(devices=args.gpus or -1, strategy="dp", seed=0)
    net = FooNet(neural_num=3, layers=3)
    if args.loss_in_forward:
        net = ModelWithLoss(net, nn.functional.mse_loss)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model, optimizer = session.setup(net, optimizer)
    data = TensorDataset(torch.randn(64, 3), torch.randn(64, 3))
    loader = session.setup_dataloader(data, batch_size=args.batch_size, shuffle=True)

    for step, (inputs, labels) in enumerate(loader):
        if args.loss_in_forward:
            loss = model(inputs, target=labels).mean()  # one loss per replica
        else:
            outputs = model(inputs)
            session.print(f"step {step}: output {tuple(outputs.shape)} gathered on {outputs.device}")
            loss = nn.functional.mse_loss(outputs, labels)
        session.backward(loss)
        session.step(optimizer)
    session.print(f"done: {session.optimizer_steps} steps, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
