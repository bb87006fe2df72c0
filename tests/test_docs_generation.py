"""The generation snippets of the README and the getting-started page run as printed, and what they
claim holds: the prompt's rows equal the full causal forward, and the cache counts every token."""

from __future__ import annotations

import pathlib
import re
import textwrap

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def _rst_blocks(name: str) -> list[str]:
    text = (ROOT / "docs" / name).read_text()
    blocks = re.findall(r"\.\. code-block:: python\n\n((?:(?:   .*)?\n)+)", text)
    return [textwrap.dedent(block) for block in blocks]


def _snippet(blocks: list[str], framework: str) -> str:
    found = [block for block in blocks if f"slicedkern.nn.{framework}" in block and "init_cache" in block]
    assert len(found) == 1, f"expected one {framework} generation snippet, found {len(found)}"
    return found[0]


def _run(source: str) -> dict:
    namespace: dict = {}
    exec(compile(source, "<snippet>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("where", ["README", "getting_started"])
def test_the_torch_generation_snippet_runs_and_matches_the_full_forward(where, capsys):
    torch = pytest.importorskip("torch")
    blocks = _readme_blocks() if where == "README" else _rst_blocks("getting_started.rst")
    ns = _run(_snippet(blocks, "torch"))
    assert capsys.readouterr().out.split() == ["15"]
    layer, prompt = ns["layer"], ns["prompt"]
    with torch.no_grad():
        full, _ = layer(prompt, prompt, prompt, is_causal=True)
    torch.testing.assert_close(ns["out"], full, rtol=1e-5, atol=1e-5)
    assert ns["token"].shape == (2, 1, 64)


def test_the_flax_generation_snippet_runs_and_matches_the_full_forward():
    pytest.importorskip("flax")
    ns = _run(_snippet(_rst_blocks("getting_started.rst"), "flax"))
    layer, prompt = ns["layer"], ns["prompt"]
    full, _ = layer(prompt, prompt, prompt, is_causal=True)
    np.testing.assert_allclose(np.asarray(ns["out"]), np.asarray(full), rtol=1e-5, atol=1e-5)
    assert ns["token"].shape == (2, 1, 64)
    assert layer.cache.length == 15


def _prose_lines(text: str) -> list[str]:
    """The lines of an reST page that render as prose: literal and code blocks (the indented lines
    after a ``::`` or a directive) and inline literals left out."""
    lines, literal_indent = [], None
    for line in text.splitlines():
        indent = len(line) - len(line.lstrip())
        if literal_indent is not None:
            if not line.strip() or indent > literal_indent:
                continue
            literal_indent = None
        if line.rstrip().endswith("::") or line.lstrip().startswith(".. "):
            literal_indent = indent
            continue
        lines.append(re.sub(r"``.*?``", "", line))
    return lines


@pytest.mark.parametrize("page", sorted(path.name for path in (ROOT / "docs").glob("*.rst")))
def test_pages_link_other_pages_rather_than_naming_their_files(page):
    """A page refers to another with ``:doc:`` (a link in the rendered site), not as ``docs/x.rst``
    (issue 49, item 15: three such mentions had reached the changelog and the architecture page)."""
    raw = [line for line in _prose_lines((ROOT / "docs" / page).read_text()) if re.search(r"docs/\w+\.rst", line)]
    assert raw == []


def test_the_packed_snippet_runs_and_its_claims_hold(capsys):
    blocks = [b for b in _rst_blocks("getting_started.rst") if "segment_ids_from_cu_seqlens" in b]
    assert len(blocks) == 1
    ns = _run(blocks[0])
    assert capsys.readouterr().out.split() == ["True"]
    import slicedkern
    from slicedkern import reference
    q, k, v = ns["q"], ns["k"], ns["v"]
    np.testing.assert_allclose(ns["local"], reference.relu_attention(q, k, v, window=(3, 0)), atol=1e-12)
    np.testing.assert_allclose(ns["older"], reference.relu_attention(q, k, v, window=(-1, -5)), atol=1e-12)
    for start, stop in [(0, 5), (12, 20)]:
        alone = slicedkern.relu_attention(q[:, start:stop], k[:, start:stop], v[:, start:stop], causal=True)
        np.testing.assert_allclose(ns["packed"][:, start:stop], alone, atol=1e-12)
