"""Tiny Hugging Face models saved as sharded safetensors (no download), for the inference tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from inference_models import tiny_llama


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tied-embedding Llama saved in several safetensors shards with their index, and the model itself."""
    model = tiny_llama()
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder, max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").exists()
    model.expected = {}  # what the whole model gives, computed once per module: see test_inference_load._expected
    return folder, model
