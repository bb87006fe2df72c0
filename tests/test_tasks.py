"""The synthetic LRA tasks (slicedkern.bench.tasks): ListOps and Pathfinder, NumPy only.

Labels are checked against what the tests recompute themselves: ListOps rows by the stack evaluator
and by hand-written expressions, Pathfinder images against the paths and markers they were drawn
from (which path each marker ends, what the image shows).
"""

from __future__ import annotations

import numpy as np
import pytest

from slicedkern.bench.tasks import (
    LISTOPS_CLASSES,
    LISTOPS_TOKENS,
    LISTOPS_VOCAB,
    PATHFINDER_CLASSES,
    listops,
    listops_encode,
    listops_evaluate,
    listops_text,
    pathfinder,
    pathfinder_sample,
)

SMALL = dict(min_length=20, max_length=64, max_depth=4)
OPEN = {LISTOPS_TOKENS.index(t) for t in ("[MAX", "[MIN", "[MED", "[SM")}
CLOSE = LISTOPS_TOKENS.index("]")


def _nesting(row) -> int:
    depth = deepest = 0
    for t in np.asarray(row).tolist():
        depth += (t in OPEN) - (t == CLOSE)
        deepest = max(deepest, depth)
    return deepest


def _widest(row) -> int:
    """Most arguments of one operator (a digit or a bracketed sub-expression each)."""
    counts, widest = [], 0
    for t in np.asarray(row).tolist():
        if counts and t != CLOSE and t != 0:
            counts[-1] += 1                      # an argument of the innermost open operator
        if t in OPEN:
            counts.append(0)
        elif t == CLOSE:
            widest = max(widest, counts.pop())
    return widest


# ---------------------------------------------------------------------------------------------- ListOps

@pytest.mark.parametrize("text, value", [
    ("[MAX 2 9 [MIN 4 7 ] 0 ]", 9),
    ("[SM 5 7 ]", 2),
    ("[MED 1 4 7 8 ]", 5),                       # even count: floor((4 + 7) / 2)
    ("[MED 2 3 ]", 2),
    ("[MED 9 1 5 ]", 5),
    ("[MIN [SM 9 9 9 ] [MAX 1 [MED 6 0 8 8 ] 3 ] 7 ]", 7),
    ("[SM [MIN 3 8 ] [MAX 0 4 ] 5 ]", 2),
])
def test_listops_evaluate_hand_written(text, value):
    ids = listops_encode(text)
    assert listops_evaluate(ids) == value
    assert listops_evaluate(np.concatenate([ids, np.zeros(5, np.int64)])) == value   # padding is ignored
    assert listops_text(ids) == text


@pytest.mark.parametrize("text", ["[MAX 1 2", "]", "[MAX ]", "1 2", "[SM 1 ] 3", "[MAX 1 <pad> 2 ]"])
def test_listops_evaluate_rejects_malformed(text):
    with pytest.raises(ValueError):
        listops_evaluate(listops_encode(text))


def test_listops_vocabulary():
    assert LISTOPS_TOKENS[0] == "<pad>" and LISTOPS_VOCAB == len(LISTOPS_TOKENS) == 16
    assert LISTOPS_CLASSES == 10
    with pytest.raises(ValueError, match="text"):
        listops_encode("[AVG 1 2 ]")


@pytest.mark.parametrize("kwargs", [SMALL, {}], ids=["small", "lra"])
def test_listops_rows(kwargs):
    batch = 200 if kwargs else 8
    tokens, lengths, labels = listops(np.random.default_rng(3), batch, **kwargs)
    lo, hi = kwargs.get("min_length", 500), kwargs.get("max_length", 2000)
    assert tokens.shape == (batch, hi) and tokens.dtype == lengths.dtype == labels.dtype == np.int64
    assert lengths.shape == labels.shape == (batch,)
    assert ((lengths >= lo) & (lengths <= hi)).all()
    assert tokens.min() >= 0 and tokens.max() < LISTOPS_VOCAB
    for row, n, label in zip(tokens, lengths, labels):
        assert (row[:n] != 0).all() and (row[n:] == 0).all()
        assert listops_evaluate(row) == label
        assert listops_encode(listops_text(row)).tolist() == row[:n].tolist()
        assert 1 <= _nesting(row) <= kwargs.get("max_depth", 10)
        assert 2 <= _widest(row) <= 10


def test_listops_shape_of_the_trees():
    """Depth and width limits held and reached; lengths spread over the range (target uniform)."""
    tokens, lengths, labels = listops(np.random.default_rng(4), 400, min_length=30, max_length=90, max_depth=3,
                                      max_args=4)
    depths = [_nesting(row) for row in tokens]
    widths = [_widest(row) for row in tokens]
    assert max(depths) == 3 and max(widths) == 4 and min(widths) >= 2
    assert lengths.min() < 36 and lengths.max() > 84
    assert abs(lengths.mean() - 60) < 4             # uniform on [30, 90]: mean 60, sd of the mean ~0.9


def test_listops_every_class():
    _, _, labels = listops(np.random.default_rng(5), 2000, min_length=4, max_length=24, max_depth=3)
    counts = np.bincount(labels, minlength=LISTOPS_CLASSES)
    assert counts.size == LISTOPS_CLASSES and counts.min() > 0.03 * labels.size, counts


def test_listops_seeded():
    a = listops(np.random.default_rng(7), 6, **SMALL)
    b = listops(np.random.default_rng(7), 6, **SMALL)
    c = listops(np.random.default_rng(8), 6, **SMALL)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


def test_listops_small_limits():
    """Tight limits: one level of 2 to 3 arguments is 4 or 5 tokens long."""
    tokens, lengths, labels = listops(np.random.default_rng(0), 50, min_length=4, max_length=5, max_depth=1,
                                      max_args=3)
    assert set(lengths.tolist()) == {4, 5}
    assert [listops_evaluate(row) for row in tokens] == labels.tolist()
    assert listops(np.random.default_rng(0), 0)[0].shape == (0, 2000)


@pytest.mark.parametrize("kwargs, name", [
    (dict(min_length=70, max_length=64), "min_length"),
    (dict(min_length=3), "min_length"),
    (dict(max_length=2.5), "max_length"),
    (dict(max_args=1), "max_args"),
    (dict(max_depth=0), "max_depth"),
    (dict(batch=-1), "batch"),
    (dict(min_length=10, max_depth=1, max_args=3), "min_length"),      # the largest tree has 5 tokens
    (dict(min_length=5, max_length=6, max_depth=2, max_args=2), "min_length"),  # only 4, 7, 10 reachable
])
def test_listops_bad_arguments(kwargs, name):
    kwargs = {"batch": 2, "min_length": 20, "max_length": 64, **kwargs}
    with pytest.raises(ValueError, match=name):
        listops(np.random.default_rng(0), **kwargs)


# ------------------------------------------------------------------------------------------- Pathfinder

def _square(center, marker):
    low = (marker - 1) // 2
    return {(center[0] - low + i, center[1] - low + j) for i in range(marker) for j in range(marker)}


def _check_sample(s, size=32, marker=3):
    """What a PathfinderSample claims, recomputed: curves, strokes, image, markers and label."""
    assert s.image.shape == (size, size) and s.image.dtype == np.uint8
    assert set(np.unique(s.image).tolist()) == {0, 255}
    assert len({len(c) for c in s.curves}) == 1                       # distractors as long as the rest
    for curve, stroke in zip(s.curves, s.strokes):
        assert (np.abs(np.diff(curve, axis=0)).max(axis=1) <= 1).all()  # 8-connected centre line
        assert curve.min() >= 0 and curve.max() < size
        assert set(map(tuple, stroke.tolist())) <= set(map(tuple, curve.tolist()))
        assert {tuple(curve[0]), tuple(curve[-1])} <= set(map(tuple, stroke.tolist()))  # ends drawn
        assert len(stroke) < len(set(map(tuple, curve.tolist())))      # dashed: gaps left out
    lit = set().union(*(set(map(tuple, st.tolist())) for st in s.strokes))
    markers = [tuple(m) for m in s.markers.tolist()]
    squares = [_square(m, marker) for m in markers]
    assert all(s.image[p] == 255 for sq in squares for p in sq)       # both markers fully drawn
    assert set(zip(*np.nonzero(s.image))) == lit | squares[0] | squares[1]
    owners = []
    for m in markers:
        ends = [i for i, c in enumerate(s.curves) if m in (tuple(c[0]), tuple(c[-1]))]
        assert len(ends) == 1                                         # an end of exactly one path
        owners.append(ends[0])
        for i, c in enumerate(s.curves):                              # no foreign path near a marker
            if i != ends[0]:
                assert np.abs(c - np.array(m)).max(axis=1).min() > marker // 2 + 1
    assert markers[0] != markers[1]
    assert s.label == int(owners[0] == owners[1])


@pytest.mark.parametrize("label", [0, 1])
def test_pathfinder_sample_label(label):
    rng = np.random.default_rng(10 + label)
    for _ in range(20):
        s = pathfinder_sample(rng, label)
        _check_sample(s)
        assert s.label == label and len(s.curves) == 3


def test_pathfinder_batch():
    images, labels, samples = pathfinder(np.random.default_rng(11), 64, return_samples=True)
    assert PATHFINDER_CLASSES == 2
    assert images.shape == (64, 1024) and images.dtype == np.uint8
    assert labels.shape == (64,) and labels.dtype == np.int64 and labels.sum() == 32
    for image, label, s in zip(images, labels, samples):
        assert np.array_equal(image, s.image.ravel()) and label == s.label
        _check_sample(s)
    assert 0 < labels[:32].sum() < 32                                   # shuffled, not sorted


def test_pathfinder_markers_look_alike():
    """The classes differ only in where the markers sit: same squares, about as much ink."""
    images, labels = pathfinder(np.random.default_rng(12), 200)
    ink = (images > 0).sum(axis=1)
    assert abs(ink[labels == 1].mean() - ink[labels == 0].mean()) < 0.05 * ink.mean()


def test_pathfinder_options():
    images, labels, samples = pathfinder(np.random.default_rng(13), 9, size=16, paths=2, dash=1, gap=1,
                                         path_length=10, marker=2, return_samples=True)
    assert images.shape == (9, 256) and labels.sum() in (4, 5)
    for s in samples:
        _check_sample(s, size=16, marker=2)
        assert len(s.curves[0]) == 11                                  # 5 periods of 2, ending on a dash
    assert pathfinder(np.random.default_rng(0), 0)[0].shape == (0, 1024)


def test_pathfinder_seeded():
    a = pathfinder(np.random.default_rng(14), 8)
    b = pathfinder(np.random.default_rng(14), 8)
    c = pathfinder(np.random.default_rng(15), 8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])


@pytest.mark.parametrize("kwargs, name", [
    (dict(paths=1), "paths"), (dict(size=4), "size"), (dict(dash=0), "dash"), (dict(gap=-1), "gap"),
    (dict(marker=0), "marker"), (dict(marker=9, size=16), "marker"), (dict(turn=4.0), "turn"),
    (dict(path_length=0), "path_length"), (dict(size=8, paths=4, path_length=30), "path_length"),
    (dict(batch=-1), "batch"),
])
def test_pathfinder_bad_arguments(kwargs, name):
    kwargs = {"batch": 2, **kwargs}
    with pytest.raises(ValueError, match=name):
        pathfinder(np.random.default_rng(0), **kwargs)


def test_pathfinder_sample_bad_label():
    with pytest.raises(ValueError, match="label"):
        pathfinder_sample(np.random.default_rng(0), 2)
