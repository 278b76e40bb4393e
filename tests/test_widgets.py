"""qlab.widgets: drive the widgets programmatically (no browser) and check them against qlab."""

import math

import pytest
import torch

import qlab
from qlab import cost, formats, metrics
from qlab.widgets import (
    DecodeCalculator,
    FormatExplorer,
    GranularityExplorer,
    check_prediction,
    decode_summary,
    describe_value,
    explorer_data,
    group_grid,
    kv_explorer,
    make_weights,
    measure,
)
from qlab.widgets.decode import summary_html
from qlab.widgets.granularity import (
    FAMILIES,
    FORMAT_GRANULARITY,
    GRANULARITIES,
    format_label,
    scheme_for,
)

PNG = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ granularity explorer


@pytest.fixture(scope="module")
def explorer():
    return GranularityExplorer()


def test_make_weights_is_seeded_and_has_the_outliers():
    a, b = make_weights(20.0), make_weights(20.0)
    assert torch.equal(a, b) and a.shape == (64, 512) and a.dtype == torch.float32
    assert int((a.abs() >= 20 * 0.02).sum()) == 8
    assert not torch.equal(make_weights(20.0, seed=1), a)
    clean = make_weights(0.0)
    assert float(clean.abs().max()) < 6 * 0.02  # no outlier beyond a Gaussian's reach
    assert torch.equal(
        clean.flatten()[a.flatten().abs() < 0.3], a.flatten()[a.abs().flatten() < 0.3]
    )


def test_readout_follows_the_bits_slider(explorer):
    explorer.family.value = "int"
    explorer.granularity.value = 128
    explorer.outliers.value = 20.0
    explorer.bits.value = 4
    text4, rmse4, png4 = explorer.readout.value, explorer.rmse, explorer.image.value
    assert "RMSE = " in text4 and "int4" in text4
    explorer.bits.value = 3
    assert explorer.readout.value != text4 and "int3" in explorer.readout.value
    assert explorer.rmse > 1.5 * rmse4  # one bit fewer: about twice the step
    png = bytes(explorer.image.value)
    assert png.startswith(PNG) and png != bytes(png4)
    # the number shown is qlab's
    w = make_weights(20.0)
    expected = metrics.rmse(w, qlab.fake_quantize(w, "int3", 128))
    assert explorer.rmse == pytest.approx(float(expected), rel=1e-12)
    assert f"{float(expected):.3e}" in explorer.readout.value
    explorer.bits.value = 4


def test_granularity_and_outliers_move_the_error(explorer):
    explorer.family.value = "int"
    explorer.bits.value = 4
    errors = []
    for g in GRANULARITIES:
        explorer.granularity.value = g
        errors.append(explorer.rmse)
    assert errors[0] > 3 * errors[-1]  # tensor vs g16 with 8 outliers at 20 std
    assert errors[0] > errors[1] > errors[2]  # tensor > channel > g256
    explorer.granularity.value = "tensor"
    explorer.outliers.value = 0.0
    calm = explorer.rmse
    explorer.outliers.value = 60.0
    assert explorer.rmse > 3 * calm
    explorer.outliers.value = 20.0
    explorer.granularity.value = 128


def test_fixed_block_formats_disable_the_granularity(explorer):
    explorer.family.value = "mxfp4"
    assert explorer.granularity.disabled and explorer.bits.disabled
    assert explorer.data["current"].scheme == "mxfp4"
    assert explorer.data["current"].bits_per_element == pytest.approx(4.25)
    assert len(explorer.data["gran_curve"]) == 1
    explorer.family.value = "nf4"
    assert not explorer.granularity.disabled and explorer.bits.disabled
    assert "nf4" in explorer.readout.value
    explorer.family.value = "int"
    assert not explorer.bits.disabled


def test_explorer_data_is_consistent():
    d = explorer_data("int_asym", 4, 128, 20.0)
    counts, edges = d["histogram"]
    assert int(counts.sum()) + d["n_beyond"] == 64 * 512
    assert d["n_beyond"] == 8 and d["weights_absmax"] == pytest.approx(0.4, rel=0.05)
    assert [m.bits for m in d["int_curves"]["int"]] == list(range(2, 9))
    errs = [m.rmse for m in d["int_curves"]["int"]]
    assert all(a > b for a, b in zip(errs, errs[1:], strict=False))  # more bits, less error
    assert d["current"].bits_per_element == pytest.approx(4 + 20 / 128)
    assert {m.family for m in d["formats"]} == set(FAMILIES.values()) - {"int", "int_asym"}


def test_format_diamonds_stay_at_their_own_granularity(explorer):
    # NF4 is drawn with its blocks of 64 (notebook 03), not at the slider's granularity
    by_gran = {}
    for g in ("tensor", 128, 16):
        d = explorer_data("int", 4, g, 20.0)
        by_gran[g] = {m.family: (m.bits_per_element, m.rmse) for m in d["formats"]}
    assert by_gran["tensor"] == by_gran[128] == by_gran[16]
    nf4 = measure(make_weights(20.0), "nf4", 4, 64)
    assert by_gran["tensor"]["nf4"] == (nf4.bits_per_element, nf4.rmse) == (4.5, nf4.rmse)
    fp8 = measure(make_weights(20.0), "fp8_e4m3", 8, "channel")
    assert by_gran[16]["fp8_e4m3"] == (fp8.bits_per_element, fp8.rmse)
    # and the legend says so
    assert format_label("nf4") == "NF4, block 64"
    assert format_label("fp8_e4m3") == "FP8 E4M3, per channel"
    assert format_label("nvfp4") == "NVFP4 (block 16)"
    legend = [t.get_text() for t in explorer._ax_err.get_legend().get_texts()]
    assert "NF4, block 64" in legend and "FP8 E5M2, per channel" in legend
    assert set(FORMAT_GRANULARITY) == set(FAMILIES.values()) - {"int", "int_asym"}


@pytest.mark.parametrize(
    "family,gran",
    [
        ("int", "tensor"),
        ("int", 64),
        ("int_asym", 32),
        ("nf4", 64),
        ("fp8_e4m3", "channel"),
        ("mxfp4", None),
        ("nvfp4", None),
    ],
)
def test_group_grid_holds_every_dequantized_value(family, gran):
    w = make_weights(20.0)
    qt = qlab.quantize(w, scheme_for(family, 4), gran)
    levels, g = group_grid(qt)
    w_hat = qt.dequantize()
    n_groups = qt.scales.numel()
    group_vals = w_hat.reshape(n_groups, -1)[g]  # shape: (group_size,)
    gap = (group_vals[:, None] - levels[None, :]).abs().min(dim=1).values
    assert float(gap.max()) <= 1e-6 * float(levels.abs().max())
    assert levels.numel() == formats.get(qt.scheme.element).values.numel()


def test_measure_matches_qlab():
    w = make_weights(10.0)
    m = measure(w, "nvfp4", 4, 128)
    qt = qlab.quantize(w, "nvfp4")
    assert m.rmse == pytest.approx(float(metrics.rmse(w, qt.dequantize())), rel=1e-12)
    assert m.sqnr_db == pytest.approx(float(metrics.sqnr_db(w, qt.dequantize())), rel=1e-12)
    assert m.bits_per_element == pytest.approx(float(qt.bits_per_element))


def test_widget_displays_headless(explorer):
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert "qlab-granularity-explorer" in explorer._dom_classes
    assert "qlab-readout" in explorer.readout._dom_classes


# ------------------------------------------------------------------ format explorer


def test_describe_value_e4m3():
    d = describe_value("fp8_e4m3fn", 0.3)
    assert d["code"] == 42 and d["bits"] == "0.0101.010"
    assert d["value"] == 0.3125 and d["below"] == 0.28125 and d["above"] == 0.34375
    assert d["fields"]["exponent"] == 5 and d["fields"]["mantissa"] == 2
    assert d["abs_error"] == pytest.approx(0.0125)
    sat = describe_value("fp8_e4m3fn", 1e4)
    assert sat["value"] == 448.0 and sat["above"] is None  # saturates at the largest value


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp8_e5m2", "fp6_e2m3fn", "fp4_e2m1fn", "nf4"])
def test_describe_value_on_every_representable_value(name):
    fmt = formats.get(name)
    values = fmt.values.tolist()
    for i, v in enumerate(values):
        d = describe_value(name, v)
        assert d["value"] == v
        assert d["code"] == int(fmt.encode(torch.tensor([v]))[0])
        assert float(fmt.decode(torch.tensor([d["code"]]))[0]) == v
        assert d["below"] == (values[i - 1] if i > 0 else None)
        assert d["above"] == (values[i + 1] if i + 1 < len(values) else None)


def test_describe_value_without_a_finite_code():
    d = describe_value("e8m0fnu", -1.0)  # E8M0 has no sign and no zero: NaN
    assert math.isnan(d["value"]) and d["below"] is None and d["abs_error"] is None
    assert describe_value("int4", -3.4)["code"] == -3


def test_zero_is_labelled_zero_not_minus_zero():
    # E4M3 lists zero as -0.0; as a grid point it is shown as "0"
    fe = FormatExplorer("fp8_e4m3fn", 0.001)
    labels = [t.get_text() for t in fe._labels]
    assert "0" in labels and "-0" not in labels
    for name in ("fp8_e4m3fn", "fp6_e2m3fn", "fp8_e5m2"):
        d = describe_value(name, 2.0**-12)
        assert all(math.copysign(1.0, v) > 0 for v in d["window"] if v == 0)
        assert d["below"] is None or d["below"] != 0 or math.copysign(1.0, d["below"]) > 0
    # the decoded value keeps its sign: -0.0 encodes to the negative-zero code
    d = describe_value("fp8_e4m3fn", -0.0)
    assert d["code"] == 0x80 and math.copysign(1.0, d["value"]) < 0


def test_format_explorer_widget():
    fe = FormatExplorer("fp8_e4m3fn", 0.3)
    first = fe.readout.value
    assert "0.0101.010" in first and "0.3125" in first
    fe.value.value = 300.0
    assert fe.data["value"] == 288.0 and fe.readout.value != first
    fe.format.value = "fp8_e5m2"
    assert fe.data["value"] == float(
        formats.get("fp8_e5m2").decode(formats.get("fp8_e5m2").encode(torch.tensor([300.0])))[0]
    )
    fe.value.value = float("nan")  # must not raise
    assert bytes(fe.image.value).startswith(PNG)


# ------------------------------------------------------------------ decode calculator


def test_decode_summary_uses_qlab_cost():
    s = decode_summary("Llama-3-70B", 4, 128, "H100 SXM", context_len=4096, kv_bits=16)
    bpw = cost.bits_per_weight(4, 128, scale_bits=16, zero_bits=4)
    assert s["bits_per_weight"] == bpw == 4.15625
    assert s["weight_bytes"] == cost.weight_bytes(70.6e9, bpw)
    assert s["tokens_per_s"] == cost.decode_ceiling_tokens_per_s(s["weight_bytes"], 3.35e12)
    assert s["kv_bytes_per_token"] == 80 * 8 * 128 * 2 * 2
    assert s["concurrent_sequences"] == cost.max_concurrent_sequences(
        "Llama-3-70B", bpw, "H100 SXM", 4096, kv_bits=16
    )
    assert s["n_devices"] == 1
    # every concurrent sequence decoding: each step reads the weights and all the caches
    n = s["concurrent_sequences"]
    assert s["tokens_per_s_each_full"] == cost.decode_ceiling_per_sequence(
        s["weight_bytes"], s["kv_bytes_per_sequence"], n, 3.35e12
    )
    assert s["tokens_per_s_total_full"] == n * s["tokens_per_s_each_full"]
    assert s["tokens_per_s_each_full"] < 0.6 * s["tokens_per_s"]
    assert "all of them decoding" in summary_html(s)
    none_fit = decode_summary("Llama-3-70B", 4, 128, "H100 SXM", context_len=1_000_000)
    assert none_fit["concurrent_sequences"] == 0 and none_fit["tokens_per_s_total_full"] is None


def test_decode_summary_devices_and_concurrency():
    s16 = decode_summary("Llama-2-70B", 16, None, "H100 SXM")
    s8 = decode_summary("Llama-2-70B", 8, None, "H100 SXM")
    s4 = decode_summary("Llama-2-70B", 4, 128, "H100 SXM")
    assert s16["n_devices"] == 2 and s8["n_devices"] == 1 and s4["n_devices"] == 1
    assert s8["memory_left_bytes"] == pytest.approx(11e9)
    assert s4["memory_left_bytes"] > 0.5 * 80e9
    assert s4["concurrent_sequences"] >= 4 * s8["concurrent_sequences"]
    # tensor parallel: two devices, twice the bandwidth
    assert s16["tokens_per_s"] == pytest.approx(2 * 3.35e12 / 138e9)
    assert (
        decode_summary("Llama-2-70B", 4, 128, "H100 SXM", kv_bits=8)["concurrent_sequences"]
        >= 2 * s4["concurrent_sequences"] - 1
    )


def test_decode_calculator_widget():
    c = DecodeCalculator()
    before = c.readout.value
    assert "tokens/s" in before and "concurrent sequences" in before
    c.weight_bits.value = 16
    assert c.group_size.disabled and c.readout.value != before
    assert c.data == decode_summary(
        c.model.value, 16, c.group_size.value, c.device.value, c.context_len.value, c.kv_bits.value
    )
    c.device.value = "B200"
    assert c.data["n_devices"] == 1 and "B200" in c.readout.value


# ------------------------------------------------------------------ predict, then check


def test_check_prediction(capsys):
    assert check_prediction(None, 0.2029, note="most people guess 0.2") is None
    out = capsys.readouterr().out
    assert "No prediction" in out and "0.2029" in out and "most people" in out
    assert check_prediction(0.2, 0.2029, rel_tol=0.05) is True
    assert check_prediction(0.1, 0.2029, rel_tol=0.05) is False
    assert "0.49x" in capsys.readouterr().out
    assert check_prediction(0, 0.0, abs_tol=1e-9) is True
    assert check_prediction(" B ", "b") is True and check_prediction("a", "b") is False
    assert check_prediction([1, -2, 4], [1, -2, 4], rel_tol=0) is True
    assert check_prediction([1, -2, 5], [1, -2, 4], rel_tol=0) is False
    assert check_prediction([1, -2], [1, -2, 4]) is False
    with pytest.raises(TypeError, match="number or a choice"):
        check_prediction([1, 2], 3.0)


# ------------------------------------------------------------------ KV-cache explorer


@pytest.fixture(scope="module")
def tinylm():
    from qlab.lm import quality

    return quality.load_model()


@pytest.fixture(scope="module")
def short_windows():
    """2 validation windows of 64 bytes: every scheme measured in well under a second."""
    from qlab.lm import quality

    return quality.validation_windows(2, 64)


@pytest.fixture(scope="module")
def kv_widget(tinylm, short_windows):
    return kv_explorer(model=tinylm, windows=short_windows)


def test_kv_explorer_shows_qlab_numbers(kv_widget, tinylm, short_windows):
    from qlab import kv
    from qlab.lm import quality

    ref = quality.logits(tinylm, short_windows)
    for name, decoded in (("int4", False), ("kivi2", True)):  # full forward, then decoding
        kv_widget.scheme.value = name
        d = kv_widget.data
        q_model = kv.quantize_cache(tinylm, name)
        q = kv.decode_logits(q_model, short_windows) if decoded else quality.logits(
            q_model, short_windows)
        kl = quality.kl_by_position(ref, q).double().numpy()
        assert d["scheme"] == name and d["decoded"] is decoded
        assert d["kl"] == pytest.approx(kl, rel=1e-12, abs=0)
        assert d["kl_blocks"] == pytest.approx(kl.reshape(-1, 16).mean(axis=1), rel=1e-12)
        attn = kv.attention_errors(tinylm, name, short_windows)["outputs"].numpy()
        assert d["attn"] == pytest.approx(attn, rel=1e-12, abs=0)
        bits = kv.bits_per_element(name, head_dim=64, seq_len=64)
        assert d["bits_per_element"] == bits
        flips = float(metrics.flip_rate(ref, q))
        shown = kv_widget.readout.value
        for number in (f"{bits:.3f} bits", f"{kl.mean():.3e}", f"{100 * flips:.2f} %",
                       f"{attn.mean():.3e}"):
            assert number in shown, (number, shown)
    assert "decoded token by token" in shown and "32 most recent tokens" in shown
    # kivi2 keeps the 32 most recent tokens in float: the first 32 queries see no error
    assert (d["attn"][:, :32] == 0).all() and (d["attn"][:, 32:] > 0).all()
    kv_widget.scheme.value = "int4"


def test_kv_explorer_full_forward_reads_what_decoding_reads(tinylm, short_windows):
    """Schemes without a float window are measured with one full forward: it gives what
    decoding gives, up to float32 summation order (decode and full forward differ by ~3e-5
    in a logit, which can move a value across a rounding boundary of the quantizer at a
    few entries: measured at most 0.2 % of the largest KL per position, 0.04 % of the mean)."""
    from qlab import kv
    from qlab.lm import quality
    from qlab.widgets.kv import KVErrors

    errors = KVErrors(tinylm, short_windows)
    for name in ("int4", "fp8_static_head", "hadamard_int4"):
        d = errors.get(name)
        assert not d["decoded"]
        q = kv.decode_logits(kv.quantize_cache(tinylm, name), short_windows)
        kl = quality.kl_by_position(errors.ref_logits, q).double().numpy()
        assert d["kl"] == pytest.approx(kl, rel=0, abs=0.01 * kl.max())
        assert d["kl_mean"] == pytest.approx(kl.mean(), rel=0.005)
    # a float window is not: a full forward reads positions older than T - 32 quantized even
    # for the earliest queries, so kivi2 is decoded and its first 32 positions are exact
    full = quality.kl_by_position(
        errors.ref_logits, quality.logits(kv.quantize_cache(tinylm, "kivi2"), short_windows))
    assert errors.get("kivi2")["decoded"] and float(full[:32].max()) > 1e-6
    assert errors.get("kivi2")["kl"][:32].max() < 1e-9


def test_every_kv_scheme_renders(kv_widget):
    from qlab import kv

    seen = {}
    for name in kv.KV_SCHEME_NAMES:
        kv_widget.scheme.value = name
        png = bytes(kv_widget.image.value)
        assert png.startswith(PNG) and f"<b>{name}</b>" in kv_widget.readout.value
        assert kv_widget.data["kl"].shape == (64,) and kv_widget.data["attn"].shape == (4, 64)
        seen[name] = (png, kv_widget.data["kl_mean"])
    assert len({png for png, _ in seen.values()}) == len(seen)  # each scheme its own picture
    # the rotation alone changes nothing but float32 rounding; 2 bits per token is far worse
    # than 8, and than KIVI's 2 bits with per-channel keys and a float window
    kl = {name: mean for name, (_, mean) in seen.items()}
    assert kl["hadamard"] < 1e-9 < kl["int8"] < kl["int4"] < kl["int2"]
    assert kl["kivi2"] < kl["int2"] / 100
    kv_widget.scheme.value = "int4"
    assert bytes(kv_widget.image.value) == seen["int4"][0]  # cached, and drawn the same again


def test_kv_explorer_rejects_what_it_cannot_show(tinylm, short_windows):
    from qlab.widgets.kv import KVErrors

    with pytest.raises(ValueError, match="unknown KV-cache scheme 'int3'; known: int8, int4"):
        kv_explorer("int3", model=tinylm, windows=short_windows)
    with pytest.raises(ValueError, match="unknown KV-cache scheme 'nf4'"):
        KVErrors(tinylm, short_windows).get("nf4")
    with pytest.raises(ValueError, match="windows of 50 positions .* multiple of 32"):
        KVErrors(tinylm, short_windows[:, :51])


def test_kv_explorer_default_and_display(tinylm):
    """No argument: the shipped TinyLM on 8 validation windows of 256 bytes."""
    from qlab import kv

    w = kv_explorer()
    assert w.scheme.value == "int4" and w.data["seq_len"] == 256 and w.data["n_windows"] == 8
    assert w.data["bits_per_element"] == kv.bits_per_element("int4", 64, 256) == 4.5
    assert [v for _, v in w.scheme.options] == list(kv.KV_SCHEME_NAMES)
    assert "kivi2 (4.24 bits)" in [label for label, _ in w.scheme.options]
    assert "application/vnd.jupyter.widget-view+json" in w._repr_mimebundle_()
    assert "qlab-kv-explorer" in w._dom_classes and "qlab-readout" in w.readout._dom_classes
    # what the site's caption of this state says (docs/site/qlab_static_widgets.py)
    w.scheme.value = "int2"
    blocks = w.data["kl_blocks"]
    assert w.data["kl"].min() > 0.05 and blocks[-4:].mean() > 1.3 * blocks[:4].mean()
