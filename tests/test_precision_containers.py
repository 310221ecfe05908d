"""Every precision keeps the model's output containers: a Hugging Face ``ModelOutput`` (so
``model(**batch).loss`` works), namedtuples, dataclasses and dict/list subclasses.

The "-true" precisions cast floating-point outputs back to fp32 on the way out; they used to
rebuild every dict subclass as a plain dict, so ``model(**batch).loss`` raised AttributeError --
also when ``Session(fit=...)`` chose bf16-true by itself.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

import gpukit
from gpukit.precision import _cast

transformers = pytest.importorskip("transformers", reason="transformers (in the test extra) is not installed")

PRECISIONS = ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]


def _tiny_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _plain_loss(precision: str) -> float:
    """The same forward in plain torch: autocast for "-mixed", 16-bit weights for "-true"."""
    model, batch = _tiny_llama(), _batch()
    if precision.endswith("-mixed"):
        dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float16
        with torch.autocast("cpu", dtype=dtype):
            return model(**batch).loss.item()
    if precision != "32-true":
        model.to(torch.bfloat16 if precision.startswith("bf16") else torch.float16)
    return model(**batch).loss.float().item()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_hf_model_output_keeps_its_type_under_every_precision(precision: str) -> None:
    session = gpukit.Session(accelerator="cpu", precision=precision, verbose=False)
    model = session.setup(_tiny_llama())
    with session.autocast():
        out = model(**_batch())
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert out.loss is out["loss"]  # attribute and key are the same tensor, as in transformers
    assert out.loss.dtype == torch.float32 or precision.endswith("-mixed")
    # the loss is the plain-torch loss of that precision (fp32 cast back: up to the 16-bit rounding)
    tolerance = 0.0 if precision == "32-true" else 2e-2
    assert out.loss.item() == pytest.approx(_plain_loss(precision), abs=tolerance)
    session.backward(out.loss)  # the loss trains


def test_fit_choosing_bf16_true_on_a_tiny_llama_still_gives_a_model_output(tmp_path: Path) -> None:
    model = _tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters())
    # a budget the fp32 plan (about 450 KiB) does not fit: fit chooses a 16-bit "-true" precision
    session = gpukit.Session(accelerator="cpu", fit="300KiB", verbose=False, record=tmp_path / "record",
                             log_with=gpukit.monitor.CSVTracker(tmp_path / "csv"))
    model, optimizer = session.setup(model, optimizer, example_input=_batch())
    assert session.precision.name.endswith("-true") and session.precision.name != "32-true"
    (bf16,) = [d for d in session.auto_settings if d.name == "bf16"]  # no "tensor cores" on the CPU
    assert bf16.on and bf16.reason == f"precision='auto' on the CPU: {session.precision.name}, chosen by fit to fit the budget"
    out = model(**_batch())
    assert type(out).__name__ == "CausalLMOutputWithPast"
    session.backward(out.loss)
    session.step(optimizer)
    session.close()
    # what the run reports is what ran, not the 32-true the record's header and the settings said
    # before fit chose at setup
    from gpukit.report import read_record, summarize

    assert summarize(read_record(tmp_path / "record")).precision == session.precision.name
    (config,) = (tmp_path / "csv").rglob("config.json")
    assert json.loads(config.read_text())["gpukit"]["precision"] == session.precision.name


class Pair(NamedTuple):
    logits: torch.Tensor
    count: int


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: list[torch.Tensor]
    name: str = "x"


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor


class Tagged(dict):  # a dict subclass with state of its own
    def __init__(self, *args: Any, tag: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tag = tag


def test_cast_keeps_every_container_type_and_casts_the_tensors_inside() -> None:
    t = torch.ones(2, dtype=torch.float32)
    ints = torch.arange(3)
    value = {
        "pair": Pair(t, 3),
        "data": Output(t, [t, ints]),
        "frozen": Frozen(t),
        "ordered": collections.OrderedDict(a=t),
        "tagged": Tagged(a=t, tag="kept"),
        "default": collections.defaultdict(list, a=[t]),
        "tuple": (t, ints),
    }
    out = _cast(value, torch.bfloat16)
    assert type(out["pair"]) is Pair and out["pair"].logits.dtype == torch.bfloat16 and out["pair"].count == 3
    assert type(out["data"]) is Output and out["data"].logits.dtype == torch.bfloat16
    assert out["data"].extra[0].dtype == torch.bfloat16 and out["data"].extra[1].dtype == torch.int64
    assert out["data"].name == "x"
    assert type(out["frozen"]) is Frozen and out["frozen"].logits.dtype == torch.bfloat16
    assert type(out["ordered"]) is collections.OrderedDict and out["ordered"]["a"].dtype == torch.bfloat16
    assert type(out["tagged"]) is Tagged and out["tagged"].tag == "kept"
    assert out["tagged"]["a"].dtype == torch.bfloat16
    assert type(out["default"]) is collections.defaultdict and out["default"].default_factory is list
    assert out["default"]["a"][0].dtype == torch.bfloat16
    assert type(out["tuple"]) is tuple and out["tuple"][1] is ints
    # the input is left as it was
    assert value["data"].logits.dtype == torch.float32 and value["tagged"]["a"].dtype == torch.float32


def test_an_encoder_decoders_generate_runs_its_encoder_at_the_mixed_precision() -> None:
    """``generate`` runs an encoder-decoder's encoder by itself (``get_encoder()(...)``), outside the
    model's forward: at "bf16-mixed" it computed in fp32, while the decoder's steps ran in bf16."""
    config = transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config)
    seen: list[tuple[str, bool, torch.dtype]] = []
    for name, sub in model.named_modules():
        if isinstance(sub, nn.Linear) and name.startswith("model."):
            part = name.split(".")[1]  # "encoder" / "decoder"
            sub.register_forward_hook(
                lambda m, a, o, part=part: seen.append((part, torch.is_autocast_enabled("cpu"), o.dtype)))
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same generate in plain torch
        expected = model.generate(ids, max_new_tokens=3, do_sample=False, num_beams=1)
    seen.clear()
    session = gpukit.Session(accelerator="cpu", precision="bf16-mixed", verbose=False)
    model = session.setup(model)
    out = model.generate(ids, max_new_tokens=3, do_sample=False, num_beams=1, return_dict_in_generate=True,
                         output_scores=True)
    assert torch.equal(out.sequences, expected)
    assert type(out).__name__.startswith("Generate") and out.scores[0].dtype == torch.float32
    assert {part for part, _, _ in seen} == {"encoder", "decoder"}
    assert {(autocast, dtype) for _, autocast, dtype in seen} == {(True, torch.bfloat16)}
    assert "generation_config" in inspect.signature(model.generate).parameters  # generate's own arguments
    # set up again at 32-true: generate is the class's again, and runs in fp32
    model = gpukit.Session(accelerator="cpu", precision="32-true", verbose=False).setup(model)
    assert "generate" not in vars(model) and "forward" not in vars(model)
    seen.clear()
    model.generate(ids, max_new_tokens=2, do_sample=False, num_beams=1)
    assert {(autocast, dtype) for _, autocast, dtype in seen} == {(False, torch.float32)}
