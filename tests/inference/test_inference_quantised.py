"""Quantised checkpoints are refused with what is supported, before a weight is cast without its scales."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from gpukit.errors import CheckpointError, ConfigurationError
from gpukit.inference import load_for_inference


def _build() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 8))


@pytest.mark.parametrize("stored", [torch.float8_e4m3fn, torch.int8], ids=["float8", "int8"])
def test_weights_stored_in_a_quantised_dtype_are_refused(tmp_path: Path, stored: torch.dtype) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().clone() for k, v in _build().state_dict().items()}
    state["0.weight"] = state["0.weight"].clamp(-100, 100).to(stored)  # as a quantised export stores it
    state["0.weight_scale"] = torch.ones(32, 1)  # its scales: gpukit does not apply them
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"'0\.weight' is stored as {stored}.*quantised.*Supported: weights stored as"):
        load_for_inference(_build, tmp_path / "model.safetensors", example_input=torch.randn(2, 32),
                           max_memory={"cpu": "1GiB"})


def test_a_hugging_face_folder_with_a_quantization_config_is_refused(llama_folder: tuple[Path, Any],
                                                                     tmp_path: Path) -> None:
    folder, _ = llama_folder
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    quantised = tmp_path / "quantised"
    quantised.mkdir()
    (quantised / "config.json").write_text(json.dumps(config))
    for shard in folder.glob("*.safetensors*"):
        (quantised / shard.name).symlink_to(shard)
    with pytest.raises(ConfigurationError, match="quantised model .*'bitsandbytes'.*not supported"):
        load_for_inference(quantised, batch_size=1, prompt_len=4, max_memory={"cpu": "100MiB"})
