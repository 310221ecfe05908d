"""Meta-device models on every strategy (issue 28, item 10): ``setup`` allocates them where they run
and initialises them with the model's own initialisers; loading real weights afterwards gives the
CPU-built model's outputs exactly (Hugging Face models too: their rotary buffers come from
``_init_weights``). DDP and FSDP with 2 processes: test_session_two_ranks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gpukit
from gpukit.errors import ConfigurationError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def _ids() -> torch.Tensor:
    return torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("options", [dict(), dict(strategy="dp", devices="cpu"), dict(precision="bf16-true")],
                         ids=["single", "dp", "bf16-true"])
def test_meta_model_is_allocated_initialised_and_trains(options: dict) -> None:
    session = gpukit.Session(accelerator="cpu", seed=0, verbose=False, **options)
    with torch.device("meta"):
        model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    inner = gpukit.unwrap_model(model)
    tensors = [*inner.parameters(), *inner.buffers()]
    assert not any(t.is_meta for t in tensors)
    assert all(torch.isfinite(t.float()).all() for t in tensors if t.is_floating_point())
    assert inner.head.weight is inner.embed.weight  # still tied after allocation
    assert torch.equal(inner.bn.running_var, torch.ones(8)) and torch.equal(inner.norm.weight.float(), torch.ones(8))
    assert inner.embed.weight.float().std() > 0.5  # nn.Embedding's N(0, 1), not zeros
    loss = model(_ids()).float().logsumexp(-1).mean()
    session.backward(loss)
    assert session.step(optimizer)


def test_meta_model_split_over_pipeline_stages() -> None:
    session = gpukit.Session(strategy="pipeline", devices=["cpu", "cpu"], seed=0, verbose=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = session.setup(model, optimizer)
    inner = gpukit.unwrap_model(model)
    assert all(not p.is_meta and torch.isfinite(p).all() for p in inner.parameters())
    session.backward(model(_ids()).logsumexp(-1).mean())
    assert session.step(optimizer)


def test_weights_loaded_after_setup_give_the_cpu_models_outputs() -> None:
    torch.manual_seed(1)
    reference = Net().eval()
    session = gpukit.Session(accelerator="cpu", verbose=False)
    with torch.device("meta"):
        model = Net()
    model = session.setup(model).eval()
    model.load_state_dict(reference.state_dict())
    assert torch.equal(model(_ids()), reference(_ids()))


def test_hugging_face_llama_on_meta_then_its_weights_matches_the_cpu_model() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers (in the test extra) is not installed")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(config).eval()
    session = gpukit.Session(accelerator="cpu", verbose=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = session.setup(model).eval()
    rotary = model.model.rotary_emb
    assert torch.equal(rotary.inv_freq, reference.model.rotary_emb.inv_freq)  # a non-persistent buffer
    model.load_state_dict(reference.state_dict())
    batch = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(batch).logits, reference(batch).logits)


def test_a_module_that_nothing_initialises_is_named() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("factor", torch.ones(3), persistent=False)  # made in __init__ only

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = Scale()

    session = gpukit.Session(accelerator="cpu", verbose=False)
    with torch.device("meta"):
        model = Model()
    with pytest.raises(ConfigurationError, match=r"nothing initialises scale\.factor.*reset_parameters"):
        session.setup(model)


def test_meta_model_resumed_from_a_checkpoint_gives_the_saved_models_outputs(tmp_path) -> None:
    torch.manual_seed(4)
    saved = Net().eval()
    gpukit.Session(accelerator="cpu", verbose=False).save_checkpoint(tmp_path, 5, model=saved)
    session = gpukit.Session(accelerator="cpu", verbose=False)
    with torch.device("meta"):
        model = Net()
    model = session.setup(model).eval()
    assert session.resume(tmp_path, model=model) == 5
    assert torch.equal(model(_ids()), saved(_ids()))
