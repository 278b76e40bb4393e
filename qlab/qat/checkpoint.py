"""Save and load a converted (quantized) TinyLM as what it is: integer codes and scales.

A converted TinyLM stores each block linear as its QTensor: codes of 4 bits or fewer
packed two per byte with qlab's one nibble order (qlab.pack_int4), fp16 scales, plus the
float32 tensors that stay float (embeddings, LayerNorms, learned activation steps). An
int4-g64 TinyLM is ~1.3 MB this way, against 7.5 MB for the fp32 checkpoint.

    save_quantized(convert(qat), "w3.pt", steps=300, ...)
    model, meta = load_quantized("w3.pt")      # a TinyLM of QuantLinear layers, eval mode
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from qlab.lm.model import TinyLM, TinyLMConfig
from qlab.packing import pack_int4, unpack_int4
from qlab.qat.lsq import LSQQuantizer
from qlab.qat.modules import DynamicQuantizer, QuantLinear, _set_module
from qlab.quantize import QTensor
from qlab.schemes import get_scheme

__all__ = ["save_quantized", "load_quantized"]


def _pack(qt: QTensor) -> dict:
    codes = qt.codes
    packed = qt.scheme.grid.bits <= 4 and codes.shape[-1] % 2 == 0
    return {
        "codes": pack_int4(codes) if packed else codes,
        "packed": packed,
        "signed": codes.dtype == torch.int8,
        "scales": qt.scales,
        "zero_points": qt.zero_points,
        "tensor_scale": qt.tensor_scale,
        "scheme": qt.scheme.name,
        "granularity": qt.granularity,
    }


def _unpack(d: dict) -> QTensor:
    codes = d["codes"]
    if d["packed"]:
        codes = unpack_int4(codes, signed=d["signed"])
        codes = codes if d["signed"] else codes.to(torch.uint8)
    return QTensor(codes=codes, scales=d["scales"], zero_points=d["zero_points"],
                   scheme=get_scheme(d["scheme"]), granularity=d["granularity"],
                   tensor_scale=d["tensor_scale"])


def _input_spec(q) -> dict | None:
    if q is None:
        return None
    if isinstance(q, DynamicQuantizer):
        return {"kind": "dynamic", "scheme": q.scheme.name, "granularity": q.granularity}
    return {"kind": "lsq", "scheme": q.scheme.name}


def _input_quantizer(spec: dict | None):
    if spec is None:
        return None
    if spec["kind"] == "dynamic":
        return DynamicQuantizer(spec["scheme"], spec["granularity"])
    return LSQQuantizer(spec["scheme"], "tensor")


def save_quantized(model: TinyLM, path, **meta) -> None:
    """Write a converted TinyLM (QuantLinear layers) as codes + scales + float tensors."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if not layers:
        raise ValueError("no QuantLinear in the model; save what qlab.qat.convert returned")
    for name, lin in layers.items():
        if get_scheme(lin.qweight.scheme.name) != lin.qweight.scheme:
            raise ValueError(f"{name}: scheme {lin.qweight.scheme.name!r} is not a named qlab "
                             "scheme; only named schemes can be saved")
    float_state = {k: v for k, v in model.state_dict().items()
                   if not any(k == f"{n}.weight" for n in layers)}
    torch.save({
        "config": asdict(model.cfg),
        "float": float_state,
        "linears": {n: _pack(lin.qweight) for n, lin in layers.items()},
        "inputs": {n: _input_spec(lin.input_quantizer) for n, lin in layers.items()},
        "meta": meta,
    }, path)


def load_quantized(path) -> tuple[TinyLM, dict]:
    """(converted TinyLM in eval mode, meta) from a file written by save_quantized."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = TinyLM(TinyLMConfig(**ckpt["config"]))
    for name, packed in ckpt["linears"].items():
        lin = model.get_submodule(name)
        _set_module(model, name, QuantLinear(_unpack(packed), None if lin.bias is None
                                             else lin.bias, _input_quantizer(ckpt["inputs"][name])))
    missing, unexpected = model.load_state_dict(ckpt["float"], strict=False)
    expected_missing = {f"{n}.weight" for n in ckpt["linears"]}
    if set(missing) != expected_missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match TinyLM (missing "
                         f"{sorted(set(missing) - expected_missing)}, unexpected {unexpected})")
    return model.eval(), ckpt["meta"]
