"""Safetensors files transformers loads, and ``export_pretrained`` / ``gpukit ckpt export``.

The load side is the installed transformers (``from_pretrained``); its tests skip with a
reason where transformers is not installed (it is in the ``test`` extra).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import SmallNet

import gpukit
from gpukit.checkpoint import CheckpointManager, export_pretrained
from gpukit.checkpoint._formats import read_safetensors_header
from gpukit.errors import ConfigurationError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from cli_helpers import run_gpukit  # noqa: E402


def _metadata(path: Path) -> dict[str, str]:
    return read_safetensors_header(path, path.stat().st_size)["__metadata__"]


def _tiny_llama(seed: int = 0):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install "
                                                              "'gpukit[test]'): the from_pretrained side is untested")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(seed)
    try:
        return transformers, transformers.LlamaForCausalLM(config).eval()
    except ImportError as exc:  # a transformers newer than this torch (5.x needs torch >= 2.6)
        pytest.skip(f"transformers {transformers.__version__} does not run on torch {torch.__version__}: "
                    f"{str(exc).strip().splitlines()[0]}")


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(tokens).logits


def test_every_safetensors_file_carries_format_pt(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # transformers 4.x refuses a safetensors file whose metadata lacks {"format": "pt"}
    net = SmallNet()
    gpukit.save(net, tmp_path / "save.safetensors")
    torch.save({"module." + k: v for k, v in net.state_dict().items()}, tmp_path / "ddp.pt")  # a DDP save
    code, _, err = run_gpukit(capsys, "ckpt", "convert", "--strip-prefix", str(tmp_path / "ddp.pt"),
                              str(tmp_path / "convert.safetensors"))
    assert code == 0, err
    manager = CheckpointManager(tmp_path / "run")
    manager.save(1, model=net)
    code, _, err = run_gpukit(capsys, "ckpt", "export", str(tmp_path / "run"), str(tmp_path / "hf"),
                              "--select", "model", "--max-shard-size", "200")
    assert code == 0, err
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    for path in [tmp_path / "save.safetensors", tmp_path / "convert.safetensors", *shards]:
        meta = _metadata(path)
        assert meta["format"] == "pt", path
        assert meta["gpukit_version"] == gpukit.__version__


def test_model_export_sharded_loads_with_from_pretrained(tmp_path: Path) -> None:
    transformers, model = _tiny_llama()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    result = export_pretrained(model, tmp_path / "hf", max_shard_bytes=weight_bytes // 3)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert result["index"] == "model.safetensors.index.json" and len(result["files"]) >= 3
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == weight_bytes
    assert sorted(set(index["weight_map"].values())) == [Path(f).name for f in result["files"]]
    for name in result["files"]:  # no shard above the limit unless it is one tensor
        header = read_safetensors_header(Path(name), Path(name).stat().st_size)
        shard_bytes = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k != "__metadata__")
        assert shard_bytes <= weight_bytes // 3 or len(header) == 2
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(model, tokens), _logits(loaded, tokens))


def test_cli_export_of_a_training_checkpoint_replaces_an_earlier_export(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    transformers, model = _tiny_llama()
    model.config.save_pretrained(tmp_path / "original")
    compiled = torch.compile(model)  # saved with _orig_mod. prefixes stripped
    manager = CheckpointManager(tmp_path / "run")
    manager.save(5, model=compiled, optimizer=torch.optim.AdamW(model.parameters()))
    out = tmp_path / "export"
    code, stdout, err = run_gpukit(capsys, "ckpt", "export", str(tmp_path / "run"), str(out), "--select", "model",
                                   "--config", str(tmp_path / "original"), "--max-shard-size", "20KB")
    assert code == 0, err
    assert "shards + model.safetensors.index.json" in stdout and (out / "model.safetensors.index.json").exists()
    # the weights change; a second export with one file must not leave the old shards to be mixed in
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    manager.save(6, model=model)
    code, stdout, err = run_gpukit(capsys, "ckpt", "export", str(tmp_path / "run"), str(out), "--select", "model",
                                   "--config", str(tmp_path / "original" / "config.json"))
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(model, tokens), _logits(loaded, tokens))


def test_export_refuses_bad_input_with_what_to_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpukit.save(SmallNet(), tmp_path / "w.safetensors")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "a_file").write_text("x")
    cases = [
        (["--config", str(tmp_path / "bad.json")], "is not valid JSON"),
        (["--config", str(tmp_path / "list.json")], "holds a JSON list"),
        (["--config", str(tmp_path)], "has no config.json"),
        (["--max-shard-size", "lots"], "Invalid size 'lots'"),
        (["--max-shard-size", "0"], "give a positive number of bytes"),
    ]
    for args, expected in cases:
        code, _, err = run_gpukit(capsys, "ckpt", "export", str(tmp_path / "w.safetensors"), str(tmp_path / "o"),
                                  *args)
        assert code == 2 and err.startswith("gpukit: error:") and expected in err, (args, err)
        assert not (tmp_path / "o" / "model.safetensors").exists()
    code, _, err = run_gpukit(capsys, "ckpt", "export", str(tmp_path / "w.safetensors"), str(tmp_path / "a_file"))
    assert code == 2 and "it is a file" in err
    with pytest.raises(ConfigurationError, match="give a model, a state dict, or the path"):
        export_pretrained(42, tmp_path / "o")
    code, stdout, _ = run_gpukit(capsys, "ckpt", "export", str(tmp_path / "w.safetensors"), str(tmp_path / "o"))
    assert code == 0 and "has no config.json; from_pretrained needs one" in stdout
    assert not [p for p in (tmp_path / "o").iterdir() if p.name.startswith(".")]  # no temporary left
