"""examples/hf_llama_finetune.py: FSDP + bf16 + activation checkpointing on 2 CPU processes, then
the export is loaded with the installed transformers' from_pretrained and compared."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.requires_cpu_fsdp  # FSDP on gloo CPU processes: torch >= 2.7

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_llama_finetune.py"


@pytest.mark.slow
def test_llama_fine_tune_exports_what_from_pretrained_loads(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                                              "'gpukit[test]')")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--steps", "40"], env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "fsdp rank 0/2" in proc.stderr and "activation checkpointing on 2 block(s)" in proc.stderr
    assert "precision bf16-mixed" in proc.stderr
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "export", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(model).__name__ == "LlamaForCausalLM"
    saved = torch.load(tmp_path / "probe.pt", weights_only=True)
    with torch.no_grad():
        out = model(input_ids=saved["probe"], labels=saved["probe"])
    # trained under FSDP with bf16 parameters for compute: equal to bf16 rounding of logits up to ~8
    assert (out.logits - saved["logits"]).abs().max().item() < 0.1
    assert torch.equal(out.logits.argmax(-1), saved["logits"].argmax(-1))
    # the export holds the trained weights, not the initial ones: it counts (random init: ~4.85)
    assert saved["losses"][0] > 4.0 and out.loss.item() < 0.5
