"""Fine-tune a (tiny) Hugging Face Llama with a Session: FSDP, bf16, activation checkpointing,
then export it as a folder ``from_pretrained`` loads.

The model is built from a config (no download), so this runs anywhere; swap in
``LlamaForCausalLM.from_pretrained(...)`` and your own data for a real fine-tune. It learns a
toy language: every sequence counts upwards (token t+1 follows token t, modulo the vocabulary).

    python examples/hf_llama_finetune.py --out llama-out                 # starts 2 processes itself
    gpukit run --cpu --nproc 2 examples/hf_llama_finetune.py --out llama-out   # the same, launched

Then, in any Python with transformers::

    AutoModelForCausalLM.from_pretrained("llama-out/export")

Needs transformers (pip install transformers).
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import torch

import gpukit
from gpukit.checkpoint import export_pretrained

VOCAB, SEQ = 128, 32


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def counting_data(samples: int, seed: int = 0) -> torch.utils.data.TensorDataset:
    starts = torch.randint(0, VOCAB, (samples, 1), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset((starts + torch.arange(SEQ)) % VOCAB)


def train(session: gpukit.Session, out: str, steps: int) -> dict[str, float]:
    torch.manual_seed(0)  # every rank builds the same model; FSDP then shards it
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = session.setup(model, optimizer)  # decoder layers become FSDP units
    loader = session.setup_dataloader(counting_data(256), batch_size=8, shuffle=True)
    batches = itertools.chain.from_iterable(loader for _ in itertools.count())  # epochs, set_epoch handled
    losses = []
    model.train()
    for _, (ids,) in zip(range(steps), batches):
        with session.autocast():
            loss = model(input_ids=ids, labels=ids).loss  # the model shifts the labels itself
        session.backward(loss)
        session.step(optimizer, clip_grad_norm=1.0)
        losses.append(session.all_reduce(loss.detach()).item())
    # The export gathers the FSDP shards (every rank takes part); rank 0 writes the folder.
    export_pretrained(model, Path(out) / "export")
    # Logits on a probe, computed by the trained model here, so a reader can check the export.
    probe = counting_data(2, seed=1).tensors[0]
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=probe.to(session.device)).logits.float().cpu()
    if session.is_main:
        torch.save({"probe": probe, "logits": logits, "losses": losses}, Path(out) / "probe.pt")
    session.print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps; exported to {out}/export")
    return {"first_loss": losses[0], "last_loss": losses[-1]}


def make_session(processes: int) -> gpukit.Session:
    return gpukit.Session(
        accelerator="cpu" if os.environ.get("GPUKIT_CPU") == "1" or not torch.cuda.is_available() else "auto",
        devices=processes, strategy="fsdp", precision="bf16-mixed", activation_checkpointing=True, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="llama-out", help="folder for the export and the probe logits")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=2, help="processes to start when not launched")
    args = parser.parse_args()
    launched = "RANK" in os.environ  # gpukit run / torchrun started this process
    world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) if launched else args.processes
    session = make_session(world)
    results = session.launch(train, args.out, args.steps)
    if session.is_main:
        print(f"per rank: {results}")


if __name__ == "__main__":
    main()
