"""gpu-check part `inference`: a model bigger than its GPU budget, placed, streamed and checked (issue 40).

A Llama-shaped model (random weights, saved as sharded safetensors) is loaded with
``gpukit.load_for_inference`` under a ``cuda:0`` budget of about half its bytes, the rest in pinned
CPU RAM and on disk, streamed one unit ahead on a side stream. Checked: the greedy tokens and the
logits equal the whole model's on the same GPU (bit-exact, fp32); the planner's predicted peak on
cuda:0 against ``torch.cuda.max_memory_allocated`` (goal: within 10%); measured tokens/s against the
plan's bound. A request longer than the plan is refused before it runs. Then with int8 Linear
weights (``weights="int8"``) under a ``cuda:0`` budget of a third of the float bytes (less than the
int8 model and its cache), the rest in pinned CPU RAM: logits and tokens bit-exact against the same swap
(``gpukit.inference.quantize_linear_weights``) applied to the whole model on the GPU, and the
predicted cuda:0 peak against the measured one. The dry run does the same on the CPU (execution on
the CPU, disk offload for the float model), tiny.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from _common import DRY, device, emit, guarded, judged, sync


def _model(folder: Path) -> int:
    import transformers

    layers, hidden, vocab = (4, 64, 256) if DRY else (16, 1024, 32000)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, max_shard_size="200MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _whole_outputs(folder: Path, batch: int, prompt: int, new: int,
                   weights: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, mask, logits, greedy tokens) of the whole model on the device (its Linears quantised as
    ``load_for_inference(weights=)`` does, when given); its memory is given back and the peak reset."""
    import transformers

    from gpukit.inference import quantize_linear_weights

    ids = torch.randint(0, 200, (batch, prompt), generator=torch.Generator().manual_seed(0)).to(device())
    mask = torch.ones_like(ids)
    whole = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device()).eval()
    if weights is not None:
        quantize_linear_weights(whole, weights)
    with torch.no_grad():
        logits = whole(ids).logits
        tokens = whole.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                pad_token_id=0)
    del whole
    if not DRY:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return ids, mask, logits, tokens


def offload(folder: Path, model_bytes: int) -> None:
    import gpukit
    from gpukit.inference import WorkloadError

    batch, prompt, new = (2, 8, 4) if DRY else (4, 256, 32)
    ids, mask, want_logits, want = _whole_outputs(folder, batch, prompt, new, None)
    budget = ({"cpu": model_bytes * 3 // 4, "disk": "1TiB"} if DRY else
              {"cuda:0": model_bytes // 2, "cpu": model_bytes // 4, "disk": "1TiB"})
    model = gpukit.load_for_inference(folder, max_memory=budget, batch_size=batch, prompt_len=prompt,
                                      new_tokens=new)
    plan = model.gpukit_inference.plan
    print(plan, flush=True)
    emit("placement", "info", detail=f"{len(plan.offloaded)} of {len(plan.device_map)} units offloaded; "
         + ", ".join(f"{d.name} {d.weights_bytes / 2**20:.0f} MiB" for d in plan.devices))
    with torch.no_grad():
        got_logits = model(ids).logits
        model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        sync()
        start = time.perf_counter()
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
        sync()
        elapsed = time.perf_counter() - start
    same = torch.equal(got, want) and torch.equal(got_logits, want_logits)
    emit("outputs equal the whole model's", "ok" if same else "fail",
         detail=f"tokens equal {torch.equal(got, want)}, logits max diff "
                f"{(got_logits - want_logits).abs().max().item():.3g}")
    measured = new / elapsed
    bound = plan.tokens_per_s_bound
    judged("tokens/s against the plan's bound", measured, "tokens/s", "reported", None,
           detail=f"bound {bound if bound is None else round(bound, 2)}")
    if not DRY:
        peak = torch.cuda.max_memory_allocated(0)
        predicted = plan.peak_bytes("cuda:0")
        judged("predicted peak on cuda:0", predicted / peak, "x measured", "within 10%", abs(predicted / peak - 1) <= 0.10,
               detail=f"predicted {predicted / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB")
    try:
        model.generate(ids, attention_mask=mask, max_new_tokens=new * 4, do_sample=False, pad_token_id=0)
        emit("a longer request than planned is refused", "fail", detail="it ran")
    except WorkloadError as exc:
        emit("a longer request than planned is refused", "ok", detail=str(exc)[:160])
    model.gpukit_inference.close()


def quantised(folder: Path, model_bytes: int) -> None:
    import gpukit

    batch, prompt, new = (2, 8, 4) if DRY else (4, 256, 32)
    ids, mask, want_logits, want = _whole_outputs(folder, batch, prompt, new, "int8")
    budget = {"cpu": model_bytes} if DRY else {"cuda:0": model_bytes // 3, "cpu": model_bytes}
    model = gpukit.load_for_inference(folder, max_memory=budget, batch_size=batch, prompt_len=prompt,
                                      new_tokens=new, weights="int8")
    plan = model.gpukit_inference.plan
    print(plan, flush=True)
    with torch.no_grad():
        got_logits = model(ids).logits
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    same = torch.equal(got, want) and torch.equal(got_logits, want_logits)
    emit("int8 weights: outputs equal the same quantisation whole", "ok" if same else "fail",
         detail=f"{len(plan.offloaded)} of {len(plan.device_map)} units offloaded; tokens equal "
                f"{torch.equal(got, want)}, logits max diff {(got_logits - want_logits).abs().max().item():.3g}")
    if not DRY:
        peak = torch.cuda.max_memory_allocated(0)
        predicted = plan.peak_bytes("cuda:0")
        judged("int8 weights: predicted peak on cuda:0", predicted / peak, "x measured", "within 10%",
               abs(predicted / peak - 1) <= 0.10,
               detail=f"predicted {predicted / 2**20:.0f} MiB, measured {peak / 2**20:.0f} MiB")
    model.gpukit_inference.close()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="gpu-check-inference-") as tmp:
        folder = Path(tmp) / "model"
        model_bytes = guarded("save the model", _model, folder)
        if model_bytes is not None:
            guarded("offload", offload, folder, model_bytes)
            guarded("int8 weights", quantised, folder, model_bytes)


if __name__ == "__main__":
    main()
