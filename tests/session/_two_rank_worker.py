"""Worker for test_session_two_ranks.py: `gpukit run --cpu --nproc 2 _two_rank_worker.py OUT`.

One launch for several of issue 28's items, under DDP and then FSDP (a second Session in the same
process group); each rank writes what the test compares into OUT/rank<R>.pt. Errors expected on
both ranks are caught and their messages recorded, so one launch checks them all.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit
from gpukit.errors import ConfigurationError, DistributedError
from gpukit.monitor import CSVTracker

N_EVAL = 11  # samples that do not divide by 2 ranks
FEATURES, CLIP = 6, 0.05


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 2))


def train_data() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(32, FEATURES, generator=g), torch.randn(32, 2, generator=g), torch.arange(32))


def eval_data(n: int = N_EVAL) -> TensorDataset:
    return TensorDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))


def _error(fn) -> str | None:
    try:
        fn()
    except (ConfigurationError, DistributedError) as exc:
        return str(exc)
    return None


def gather_checks(session: gpukit.Session, out: dict) -> None:
    """Item 1: exactly the dataset, in order, whatever the batch size; and what cannot be gathered."""
    out["gathered"], out["mixed"] = {}, {}
    for batch_size in (1, 2, 3, 4):
        loader = session.setup_dataloader(eval_data(), batch_size=batch_size)
        values, words, mixed_values, mixed_words = [], [], [], []
        for x, idx in loader:
            values.append(session.gather_for_metrics(idx))
            words += session.gather_for_metrics([f"s{int(i)}" for i in idx])
            nested = session.gather_for_metrics({"x": x, "pair": (idx, idx * 2)})
            assert torch.equal(nested["pair"][1], nested["pair"][0] * 2) and torch.equal(nested["x"][:, 0].long(), nested["pair"][0])
            # issue 41.18: tensors and a list of per-sample objects in one dict
            mixed = session.gather_for_metrics({"idx": idx, "words": [f"s{int(i)}" for i in idx]})
            mixed_values.append(mixed["idx"])
            mixed_words += mixed["words"]
        out["gathered"][batch_size] = (torch.cat(values).tolist(), words)
        out["mixed"][batch_size] = (torch.cat(mixed_values).tolist(), mixed_words)
    loader = session.setup_dataloader(eval_data(), batch_size=3, shuffle=True)
    out["shuffled"] = torch.cat([session.gather_for_metrics(idx) for _, idx in loader]).tolist()
    out["shuffle_seed"] = loader.seed
    dropped = session.setup_dataloader(eval_data(), batch_size=2, even_batches="drop")
    out["dropped"] = torch.cat([session.gather_for_metrics(idx) for _, idx in dropped]).tolist()
    uneven = session.setup_dataloader(eval_data(), batch_size=3, even_batches=False)  # rank 1: 3 + 2
    out["uneven_sizes"] = torch.cat([session.gather_for_metrics(idx) for _, idx in uneven]).tolist()
    # rows of another length on each rank: padded with pad_index, or refused
    rows = torch.full((2, 3 + session.rank), session.rank)
    out["rows_error"] = _error(lambda: session.gather_for_metrics(rows))
    out["rows_padded"] = session.gather_for_metrics(rows, pad_index=-1).tolist()
    out["all_gather_error"] = _error(lambda: session.all_gather(torch.zeros(2 + session.rank)))
    out["all_gather_ok"] = session.all_gather(torch.tensor([session.rank])).tolist()  # the group still works


def uneven_training(session: gpukit.Session, out: dict) -> None:
    """Item 1: different batch counts per rank -- refused, then trained inside session.join."""
    torch.manual_seed(0)
    model = make_model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # 11 samples at batch size 1: rank 0 has 6 batches, rank 1 has 5
    loader = session.setup_dataloader(TensorDataset(*train_data()[:11]), batch_size=1, even_batches=False)
    out["uneven_refused"] = _error(lambda: next(iter(loader)))
    indices = []
    with session.join(model):
        for x, y, idx in loader:
            session.backward(nn.functional.mse_loss(model(x), y))
            session.step(optimizer)
            indices.append(idx.tolist())
    out["join_indices"] = indices
    out["join_params"] = {k: v.detach().clone() for k, v in gpukit.unwrap_model(model).state_dict().items()}


def norm_and_accumulation(session: gpukit.Session, out: dict) -> None:
    """Items 2 and 3: the global gradient norm at each step; windows that end with the loader (10
    batches, accumulation 4: 3 steps); the schedule in optimizer steps (item 4)."""
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = session.setup_scheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5))
    model, optimizer = session.setup(model, optimizer)
    session.accumulate_grad_batches = 4
    loader = session.setup_dataloader(TensorDataset(*train_data()[:20]), batch_size=1)  # 10 per rank
    out["norms"], out["indices"], out["stepped"] = [], [], []
    for x, y, idx in loader:
        with session.accumulate(model):
            session.backward(nn.functional.mse_loss(model(x), y))
        stepped = session.step(optimizer, clip_grad_norm=CLIP)
        scheduler.step()
        out["stepped"].append(stepped)
        out["indices"].append(idx.tolist())
        if stepped:
            out["norms"].append(float(session.grad_norm))
    out["lr"] = optimizer.param_groups[0]["lr"]
    session.accumulate_grad_batches = 1  # the loader's end closed the last window: settable again
    full = model.state_dict() if session.strategy.name != "fsdp" else {
        k: v.full_tensor() for k, v in model.state_dict().items()}
    out["params"] = {k.removeprefix("module."): v.detach().clone() for k, v in full.items()}


def first_and_trackers(session: gpukit.Session, out_dir: Path, out: dict) -> None:
    """Item 7 (rank 0 first; its error reaches rank 1) and item 8 (trackers on rank 0 only)."""
    marker = out_dir / "made_by_rank0"
    with session.main_process_first():
        if session.rank == 0:
            marker.write_text("data")
        out["saw_marker_in_block"] = marker.exists()

    def failing() -> None:
        with session.main_process_first():
            if session.rank == 0:
                raise ValueError("download failed")

    try:
        failing()
    except ValueError as exc:
        out["first_error"] = f"ValueError: {exc}"
    except DistributedError as exc:
        out["first_error"] = str(exc)


def seeding(out_dir: Path, out: dict) -> None:
    """Item 5: a global batch over 2 ranks; per-rank streams after setup; the same-stream warning."""
    session = gpukit.Session(accelerator="cpu", seed=7, seed_per_rank=True, global_batch_size=16,
                             micro_batch_size=2, verbose=False, log_with=CSVTracker(out_dir / "csv"))
    out["accumulate"] = session.accumulate_grad_batches
    model = make_model()
    out["init_weight"] = model[0].weight.detach().clone()  # built before setup: the same on both ranks
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    out["randint_after_setup"] = torch.randint(0, 10**6, (4,)).tolist()
    losses = []
    for _ in range(4):
        x = torch.randn(2, FEATURES)
        loss = model(x).pow(2).mean()
        session.backward(loss)
        session.step(optimizer)
        losses.append(loss.item())
    out["tracked_losses"] = losses
    session.close()  # not the group's owner: the group stays

    same = gpukit.Session(accelerator="cpu", seed=7, verbose=False)  # no seed_per_rank: a trap for randint
    model, optimizer = same.setup(make_model(), None), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = torch.randn(2, FEATURES)  # the same on every rank
        same.backward(model(x).pow(2).mean())
    out["same_stream_warnings"] = [str(w.message) for w in caught if "same first loss" in str(w.message)]


def meta_model(session: gpukit.Session, out: dict) -> None:
    """Item 10: a meta-device model under DDP / FSDP: allocated, initialised, the same on every rank."""
    with torch.device("meta"):
        model = make_model()
    model, optimizer = session.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    state = model.state_dict()
    if session.strategy.name == "fsdp":
        state = {k: v.full_tensor() for k, v in state.items()}
    out["meta_params"] = {k.removeprefix("module."): v.detach().clone() for k, v in state.items()}
    session.backward(model(torch.randn(2, FEATURES)).pow(2).mean())
    out["meta_stepped"] = session.step(optimizer)
    if session.strategy.name == "fsdp":  # torch's Join serves DDP only
        out["join_error"] = _error(lambda: session.join(model).__enter__())


def main(out_dir: Path) -> None:
    records: dict = {"ddp": {}, "fsdp": {}}
    ddp = gpukit.Session(accelerator="cpu", strategy="ddp", seed=0, verbose=False)  # joins the group
    warnings.warn("gpukit-test: the same on every rank")  # printed once (item 11)
    warnings.warn(f"gpukit-test: rank {ddp.rank} only")  # printed by each rank
    for strategy, out in records.items():
        # the FSDP session joins the DDP session's process group (same world size)
        session = ddp if strategy == "ddp" else gpukit.Session(accelerator="cpu", strategy="fsdp", seed=0,
                                                                 verbose=False)
        torch.manual_seed(0)
        norm_and_accumulation(session, out)
        gather_checks(session, out)
        meta_model(session, out)
        if strategy == "fsdp":
            session.close()  # not the group's owner: the group stays
    out = records["ddp"]
    uneven_training(ddp, out)
    first_and_trackers(ddp, out_dir, out)
    seeding(out_dir, out)  # sessions of their own, in the same process group
    ddp.close()
    torch.save(records, out_dir / f"rank{ddp.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
