"""The table script ``scripts/which_attention.py`` (issue 27): the same model for every attention, the
data each task feeds it, and the tables it prints. Training itself runs in the gallery example at the
``ci`` size; accuracies and times are not checked here (docs/which_attention.rst)."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("which_attention", ROOT / "scripts" / "which_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["which_attention"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("which_attention", None)


@pytest.fixture(scope="module")
def size(script):
    return replace(script.SIZES["ci"], lm_bytes=60_000, test=8)


@pytest.mark.parametrize("task", ["lm", "listops", "pathfinder", "shapes"])
def test_every_variant_is_the_same_model_but_its_attention(script, size, task):
    """Outside the attention, every variant has the same parameters (names and shapes); the softmax
    model holds nn.MultiheadAttention, the others SlicedAttention with their options."""
    from slicedkern.nn.torch import SlicedAttention

    data = script.Data(task, size)
    x, padding, y = data.batch(__import__("numpy").random.default_rng(0), 3)
    outside = {}
    for variant, options in script.VARIANTS.items():
        model = script.Model(variant, data, size)
        attentions = [m for m in model.modules() if isinstance(m, (torch.nn.MultiheadAttention, SlicedAttention))]
        assert len(attentions) == size.layers
        if options is None:
            assert all(isinstance(m, torch.nn.MultiheadAttention) for m in attentions)
        else:
            assert all(isinstance(m, SlicedAttention) for m in attentions)
            assert attentions[0].config.kernel_name == options["kernel"]
            assert attentions[0].config.slices == options.get("slices", 1)
            assert attentions[0].config.score == options.get("score", "mlp")
            assert attentions[0].config.rope == (task != "shapes")
        outside[variant] = {name: tuple(p.shape) for name, p in model.named_parameters() if "self_attn" not in name}
        logits = model(x, padding)
        expected = (3, x.shape[1], data.classes) if task == "lm" else (3, data.classes)
        assert logits.shape == expected
        assert torch.isfinite(script.loss_of(model, (x, padding, y)))
    first = next(iter(outside.values()))
    assert all(shapes == first for shapes in outside.values())


def test_listops_batches_are_cut_to_their_longest_and_padded(script, size):
    data = script.Data("listops", size)
    x, padding, y = data.batch(__import__("numpy").random.default_rng(1), 16)
    lengths = (~padding).sum(1)
    assert x.shape[1] == int(lengths.max()) <= size.listops_lengths[1]
    assert int(lengths.min()) >= size.listops_lengths[0]
    assert torch.all(x[padding] == 0) and torch.all(x[~padding] != 0)
    assert torch.all((0 <= y) & (y < 10))


def test_padding_never_reaches_a_classifier_output(script, size):
    """The listops model's prediction for a sequence does not depend on the padding after it: random
    tokens in place of the padding, up to the longest length, change nothing."""
    data = script.Data("listops", size)
    x, padding, _ = data.batch(__import__("numpy").random.default_rng(2), 4)
    width = size.listops_lengths[1]
    keep = torch.zeros(4, width, dtype=torch.bool)
    keep[:, :x.shape[1]] = ~padding
    longer = torch.randint(1, 16, (4, width))
    longer[keep] = x[~padding]
    for variant in ("softmax", "relu-4-slices"):
        model = script.Model(variant, data, size).double().train()    # train: no fused fast path
        torch.testing.assert_close(model(longer, ~keep), model(x, padding), rtol=1e-9, atol=1e-12)


def test_tables_report_mean_std_and_step_time(script, tmp_path, capsys):
    def runs(values):
        return [{"metric": v, "step_seconds": 0.01 * (i + 1), "curve": [[1, v / 2], [2, v]]}
                for i, v in enumerate(values)]

    results = {"tasks": {"listops": {"softmax": runs([0.3, 0.5]), "relu": runs([0.4])},
                         "lm": {"softmax": runs([2.0, 2.2, 2.4])}}}
    text = script.table(results)
    assert "0.400 ± 0.141" in text and "2.200 ± 0.200" in text
    rst = script.rst_table(results)
    lines = rst.splitlines()
    assert lines[0] == lines[2] == lines[-1] and set(lines[0]) == {"=", " "}
    assert "0.400 ± 0.141, 15 ms" in rst and "2.200 ± 0.200, 20 ms" in rst
    assert lines[4].startswith("relu ") and lines[4].rstrip().endswith("0.400 ± 0.000, 10 ms")
    path = tmp_path / "listops.json"
    path.write_text(json.dumps({"tasks": {"listops": results["tasks"]["listops"]}}))
    script.main(["--report", str(path)])
    printed = capsys.readouterr().out
    assert "0.400 ± 0.141" in printed
    # the curves, the mean over seeds per checkpoint: softmax 0.2 then 0.4
    curves = script.curve_table(results, "listops").splitlines()
    assert curves[1].split() == ["variant", "step", "1", "step", "2"]
    assert curves[3].split() == ["softmax", "0.200", "0.400"]
    assert "\n".join(curves) in printed
    other = {"tasks": {"lm": {"softmax": runs([2.0, 2.2, 2.4]), "hat": runs([2.6, 2.8])}}}
    lm = script.curve_table(other, "lm").splitlines()
    assert lm[3].split() == ["softmax", "1.100", "2.200"]
    assert lm[4].split() == ["hat", "1.350", "(+0.250)", "2.700", "(+0.500)"]


def test_the_language_models_count_ngram_baseline():
    """``scripts/char_lm.py``'s scale for its bits per character: a count n-gram model scores a text
    that the previous character determines at ~0 bits from order 2 on (0.04: the add-0.1 smoothing of
    128 symbols against 500 counts) and, on uniform random characters, log2(128) = 7 bits at order 1
    (to the sampling error)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import char_lm
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    import numpy as np
    size = replace(char_lm.SIZES["ci"], context=32, val_windows=4)
    cycle = np.tile(np.arange(40, 60), 500)
    assert char_lm.ngram_bits(cycle, cycle[:400], size, 1) == pytest.approx(np.log2(20), abs=1e-2)
    assert char_lm.ngram_bits(cycle, cycle[:400], size, 2) < 0.05
    assert char_lm.ngram_bits(cycle, cycle[:400], size, 3) < 0.05
    rng = np.random.default_rng(0)
    uniform = rng.integers(0, char_lm.VOCAB, 200_000)
    size = replace(size, context=1000, val_windows=50)
    assert char_lm.ngram_bits(uniform, rng.integers(0, char_lm.VOCAB, 60_000), size, 1) == pytest.approx(7.0, abs=0.02)
