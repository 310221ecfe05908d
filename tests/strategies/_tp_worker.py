"""Worker for test_tensor_parallel_multiprocess.py, started by `gpukit run --cpu --nproc N` (gloo, CPU).

argv: <out dir> <strategy: "auto" (tensor groups only / replicated) or "fsdp"> <family,family,...>
<micro-batches per optimizer step> <activation checkpointing: "blocks" (each Block) or "none">.
For each model family it builds the model right after ``torch.manual_seed(FAMILY_SEED)`` (the test's
one-process reference does the same), trains it with ``Session(tensor_parallel=2)`` (SGD with momentum,
clipping that bites), and records: the batches each rank loaded, the first step's output (full), the
collectives of one forward and backward (torch's CommDebugMode), the final full parameters, the strategy's
layout; the small transformer is saved with ``session.save_checkpoint`` to <out>/ckpt (the Llama block of one
tensor group exported with ``export_pretrained`` to <out>/hf), and a one-process
checkpoint in <out>/single (when there) is resumed into the split MLP stack. The run of one tensor group
(strategy "auto") is ``Session(tensor_parallel="auto", fit=...)`` with a budget the MLP stack fits only split:
the degree fit chose (2) is what it trains with; the choice it made is recorded, and one more small
transformer's training steps are measured (``measure_step_memory``: this rank's peak) for the test to hold
against the planner's prediction. Writes <out>/rank<R>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import gpukit

N, SEQ, VOCAB, HIDDEN, BATCH, STEPS, CLIP, FAMILY_SEED = 16, 6, 16, 16, 2, 3, 0.05, 7


class Attention(nn.Module):
    """Custom attention (no nn.MultiheadAttention): q, k, v, out, and a head count it reshapes by."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.n_heads = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.n_heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = 4) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, a transformer block, an output head (untied)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.block = Block()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.embed(ids)))


class GPT2Attention(nn.Module):
    """GPT-2's attention with q, k and v as linears of their own (GPT-2's fused ``c_attn`` is left whole)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, self.n_head, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class GPT2MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.c_fc, self.act, self.c_proj = nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, hidden: int = HIDDEN, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn, self.mlp = GPT2Attention(hidden, heads), GPT2MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Style(nn.Module):
    """GPT-2's layout in nn.Linear: token and position embeddings, a pre-LN block, a final norm, and the
    output head tied to the token embedding (both left whole; the position embedding is split)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, HIDDEN), nn.Embedding(SEQ, HIDDEN)
        self.h = nn.ModuleList([GPT2Block()])
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                         attn_implementation="eager")
    return LlamaForCausalLM(config)


def make_model(family: str) -> nn.Module:
    torch.manual_seed(FAMILY_SEED)
    if family == "mlp":
        return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, 32), nn.ReLU(), nn.Linear(32, HIDDEN),
                             nn.Linear(HIDDEN, 32), nn.GELU(), nn.Linear(32, VOCAB))
    return {"block": TinyLM, "gpt2": GPT2Style}.get(family, llama)()


def make_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(123)
    ids = torch.randint(0, VOCAB, (N, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:], torch.arange(N))


def loss_of(model: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), logits


def full(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()


#: a budget with room for everything (the test plans the small transformer's tensor x2 rank with it)
FIT_BUDGET = "4GiB"
#: Session(tensor_parallel="auto", fit=...)'s budget in the run of one tensor group, per process: the MLP stack
#: (set up first, SGD with momentum, batch 2, fp32) is planned at 39,352 B per process under DDP x2 even at
#: micro-batch 1 and 17,256 B per rank split over a tensor group of 2, so fit must choose tensor_parallel=2
AUTO_FIT_BUDGET = 30_000


def example_ids() -> torch.Tensor:
    """One batch of token ids: what Session(fit=...) plans with, and what the measured steps run."""
    return make_data().tensors[0][:BATCH]


def train(session: gpukit.Session, family: str, checkpoint: Path | None = None, export: Path | None = None,
          fit: bool = False) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    model = make_model(family)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    fitting = fit and session.fit_choice is None  # the first model set up decides
    model, optimizer = session.setup(model, optimizer, **({"example_input": example_ids()} if fitting else {}))
    loader = session.setup_dataloader(make_data(), batch_size=BATCH, shuffle=False)
    record: dict = {"indices": [], "norms": []}
    for step, (ids, targets, idx) in enumerate(loader):
        if step == STEPS * session.accumulate_grad_batches:
            break
        record["indices"].append(idx.tolist())
        comm = CommDebugMode()
        with comm, session.accumulate(model):
            loss, logits = loss_of(model, ids, targets)
            session.backward(loss)
        counts = {str(k).rsplit(".", 1)[-1]: v for k, v in comm.get_comm_counts().items()}
        if step == 0:
            record["logits"] = full(logits)
            record["comms"] = counts
        if step == session.accumulate_grad_batches - 1:  # the micro-batch whose backward synchronises
            record["comms_at_sync"] = counts
        if session.step(optimizer, clip_grad_norm=CLIP):
            record["norms"].append(float(session.grad_norm))
    record["state"] = {n: full(p) for n, p in gpukit.unwrap_model(model).named_parameters()}
    if export is not None:  # a Hugging Face folder written from the split model (every rank calls it)
        from gpukit.checkpoint import export_pretrained

        export_pretrained(model, export)
    if checkpoint is not None:  # a sharded (DCP) checkpoint of the split model, loaded elsewhere by the test
        session.save_checkpoint(checkpoint, STEPS, model=model, optimizer=optimizer)
    record["in_hand"] = idx.tolist()  # the batch the loop stopped at
    record["gathered"] = session.gather_for_metrics(idx.to(session.device)).cpu()
    return record


def measured_peak(session: gpukit.Session) -> int:
    """This rank's peak in two training steps (Adam) of the small transformer split over the tensor group."""
    from gpukit.memory import forward_backward, measure_step_memory

    model = make_model("block")
    optimizer = torch.optim.Adam(model.parameters())
    model, optimizer = session.setup(model, optimizer)
    ids = example_ids()

    def step() -> None:
        with forward_backward():
            output = model(ids)
            session.backward(output.float().mean())  # the planner's loss: the mean of the output
        session.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    return measure_step_memory(model, ids, step_fn=step).peak_bytes


def main(out_dir: Path, strategy: str, families: list[str], accumulate: int, checkpointing: bool) -> None:
    one_group = strategy == "auto"
    # one group: the degree is fit's (AUTO_FIT_BUDGET: the MLP stack, set up first, fits only split in two)
    session = gpukit.Session(accelerator="cpu", strategy=strategy, tensor_parallel="auto" if one_group else 2,
                             seed=0, verbose=False, accumulate_grad_batches=accumulate,
                             activation_checkpointing={Block} if checkpointing else None,
                             fit=AUTO_FIT_BUDGET if one_group else None,
                             precision="32-true" if one_group else "auto")
    record: dict = {"layout_before_setup": session.strategy.layout}
    for family in families:
        record[family] = train(session, family, out_dir / "ckpt" if family == "block" else None,
                               out_dir / "hf" if family == "llama" and one_group else None, fit=one_group)
        record[family]["checkpointed"] = list(session.strategy.checkpointed)
    layout = session.strategy.layout
    record.update(layout=(layout.replicas, layout.shards, layout.tensor), name=session.strategy.name,
                  dp_rank=session.strategy.data_parallel_rank)
    if (out_dir / "single").exists():  # a checkpoint one process saved: resumed into the split MLP stack
        model = make_model("mlp")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model, optimizer = session.setup(model, optimizer)
        record["resumed_step"] = session.resume(out_dir / "single", model=model, optimizer=optimizer)
        record["resumed"] = {n: full(p) for n, p in gpukit.unwrap_model(model).named_parameters()}
    if one_group:
        choice = session.fit_choice
        record["fit"] = {"layout": choice.option.layout, "line": choice.option.session_line(),
                         "precision": choice.precision, "micro": choice.micro_batch, "chosen": choice.chosen,
                         "peak": choice.peak_bytes}
        record["measured_peak"] = measured_peak(session)
    session.barrier()
    torch.save(record, out_dir / f"rank{session.rank}.pt")
    session.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(","), int(sys.argv[4]), sys.argv[5] == "blocks")
