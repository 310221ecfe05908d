"""gpu-check part `precision`: one small transformer trained under each precision, against fp32.

Same seed, data and steps for 32-true, bf16-mixed, 16-mixed and bf16-true; each curve's final
loss is compared with fp32's (within 15% or 0.05), and under 16-mixed one step's loss is made
inf: GradScaler must skip that optimizer step (weights unchanged) and training go on.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from _common import DRY, device, emit, guarded

STEPS = 6 if DRY else 120
INF_STEP = 3 if DRY else 40
VOCAB, SEQ, CLASSES, WIDTH = 64, 16 if DRY else 32, 8, 32 if DRY else 128


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (STEPS, 64, SEQ), generator=generator)
    labels = (tokens[:, :, 0] + tokens[:, :, 1]) % CLASSES  # learnable from the first two tokens
    return tokens, labels


def curve(precision: str, inject_inf: bool = False) -> tuple[list[float], list[bool]]:
    import gpukit

    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = gpukit.Session(devices=device(), precision=precision, verbose=False)
    model, optimizer = session.setup(model, optimizer)
    tokens, labels = data()
    losses, stepped = [], []
    for i in range(STEPS):
        scale = float("inf") if inject_inf and i == INF_STEP else 1.0
        before = [p.detach().clone() for p in model.parameters()] if scale != 1.0 else None
        loss = session.run_step(lambda b: F.cross_entropy(model(b[0]).float(), b[1]) * scale, (tokens[i], labels[i]))
        stepped.append(bool(session.step(optimizer)))
        losses.append(float(loss))
        if before is not None:
            same = all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
            emit(f"{precision}: inf step skipped", "ok" if not stepped[-1] and same else "fail",
                 detail=f"step returned {stepped[-1]}, weights unchanged {same}")
    return losses, stepped


def main() -> None:
    reference = guarded("32-true curve", curve, "32-true")
    if reference is None:
        return
    ref = reference[0]
    learned = "ok" if ref[-1] < ref[0] else "fail"
    emit("32-true", "info" if DRY else learned, ref[-1], "loss", f"first {ref[0]:.3f} (a dry run is too short to learn)"
         if DRY else f"first {ref[0]:.3f}")
    for precision in ("bf16-mixed", "16-mixed", "bf16-true"):
        inject = precision == "16-mixed"
        got = guarded(f"{precision} curve", curve, precision, inject)
        if got is None:
            continue
        losses, stepped = got
        finite = [(a, b) for a, b in zip(losses, ref) if a == a and abs(a) != float("inf")]
        gap = max(abs(a - b) for a, b in finite) if finite else float("nan")
        close = abs(losses[-1] - ref[-1]) <= max(0.15 * ref[-1], 0.05)
        emit(precision, "ok" if close else "warn", losses[-1], "loss",
             f"fp32 {ref[-1]:.4f}; largest gap along the curve {gap:.4f}; {STEPS - sum(stepped)} step(s) skipped")


if __name__ == "__main__":
    main()
