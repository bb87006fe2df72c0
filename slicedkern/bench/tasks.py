"""Two synthetic Long Range Arena tasks, generated in NumPy: ListOps and a Pathfinder-style task.

Sources: Y. Tay et al., "Long Range Arena: A Benchmark for Efficient Transformers", ICLR 2021 (LRA);
N. Nangia and S. R. Bowman, "ListOps: A Diagnostic Dataset for Latent Tree Learning", NAACL SRW 2018;
D. Linsley et al., "Learning long-range spatial dependencies with horizontal gated recurrent units",
NeurIPS 2018 (Pathfinder). Written from the published rules; nothing is downloaded, every draw comes
from the caller's ``numpy.random.Generator``. Differences from the originals:

* ListOps. The operators, digits, token form (``[MAX 2 9 [MIN 4 7 ] 0 ]``) and limits (depth 10,
  10 arguments, 500 to 2000 tokens) are LRA's; the tree growth is not. LRA draws trees recursively
  and keeps those whose length is in range. Here a target length ``T`` is drawn uniformly in
  ``[min_length, max_length]`` and a tree grown to it: the root gets ``k`` digit arguments, then a
  digit leaf chosen uniformly among those above the depth limit becomes an operator with ``k`` digit
  arguments, ``k`` uniform in ``[2, max_args]`` (capped so as not to pass ``T``), until fewer than
  three tokens are missing; then operators with room get extra digits. So lengths are (nearly)
  uniform on the range, the depth grows like the logarithm of the size (at LRA's sizes most trees
  reach the limit), and a draw is rejected only when every operator is full short of
  ``min_length`` (rare). Operators and digits are uniform. ``MED`` of an even count is
  ``int(numpy.median(args))``, the floor of the mean of the two middle values, as in LRA. Labels
  are not balanced (``MAX`` favours 9, ``MIN`` 0).
* Pathfinder. Images are binary (0 background, 255 strokes and markers) instead of anti-aliased
  grey, paths are random walks of unit steps whose heading turns by at most ``turn`` per step,
  rounded to pixels and drawn as ``dash`` pixels on, ``gap`` off; the two markers are ``marker`` x
  ``marker`` squares instead of discs. All paths, marked or distractors, have the same length; no
  path comes within a one-pixel ring of any path's end (marked or not, its own far end included),
  so markers never touch a foreign stroke; bodies may cross, as in the original. Labels are
  balanced exactly: half of an even batch is 1, in a random order.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["LISTOPS_TOKENS", "LISTOPS_VOCAB", "LISTOPS_CLASSES", "PATHFINDER_CLASSES", "listops", "listops_evaluate",
           "listops_text", "listops_encode", "PathfinderSample", "pathfinder_sample", "pathfinder"]

LISTOPS_TOKENS = ("<pad>", *"0123456789", "[MAX", "[MIN", "[MED", "[SM", "]")
LISTOPS_VOCAB = len(LISTOPS_TOKENS)
LISTOPS_CLASSES, PATHFINDER_CLASSES = 10, 2
_DIGIT0, _OPEN0, _CLOSE = 1, 11, 15   # ids of "0", "[MAX" (then MIN, MED, SM) and "]"
_RETRIES = 200


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def _capacity(depth: int, args: int, stop: int) -> int:
    """Tokens of the full tree (every operator ``args`` wide, ``depth`` deep), or a number > stop."""
    cap = args + 2
    while depth > 1 and cap <= stop:
        cap, depth = 2 + args * cap, depth - 1
    return cap


def _grow(rng: np.random.Generator, target: int, max_depth: int, max_args: int) -> list[list[int]]:
    """A tree of ``target`` tokens or a little less: ``ops[o]`` lists operator ``o``'s children (an
    operator index >= 0, or -1 for a digit leaf); children are created after their parent."""
    ops, depth = [[-1] * min(max_args, target - 2, int(rng.integers(2, max_args + 1)))], [1]
    length = len(ops[0]) + 2
    slots = [(0, j) for j in range(len(ops[0]))] if max_depth > 1 else []   # leaves that may expand
    while length < target:
        missing = target - length
        if missing >= 3 and slots:
            i = int(rng.random() * len(slots))
            slots[i], slots[-1] = slots[-1], slots[i]      # O(1) removal of a uniform choice
            o, j = slots.pop()
            k = int(rng.integers(2, min(max_args, missing - 1) + 1))
            ops[o][j] = len(ops)
            ops.append([-1] * k)
            depth.append(depth[o] + 1)
            length += k + 1                                  # a digit became "[OP", k digits, "]"
            if depth[-1] < max_depth:
                slots.extend((len(ops) - 1, c) for c in range(k))
        else:                                                # top up one token at a time
            room = [o for o, ch in enumerate(ops) if len(ch) < max_args]
            if not room:
                break
            o = room[int(rng.random() * len(room))]
            ops[o].append(-1)
            length += 1
            if depth[o] < max_depth:
                slots.append((o, len(ops[o]) - 1))
    return ops


# MAX, MIN, MED (the floor of the mean of the two middle values for an even count) and SM
_APPLY = (max, min, lambda a: (sorted(a)[(len(a) - 1) // 2] + sorted(a)[len(a) // 2]) // 2, lambda a: sum(a) % 10)


def _serialise(rng: np.random.Generator, ops: list[list[int]]) -> tuple[list[int], int]:
    """Token ids of the tree with random operators and digits (leaf -1 becomes -1 - digit), and its value."""
    kinds = rng.integers(0, 4, size=len(ops)).tolist()
    digits = iter(rng.integers(0, 10, size=sum(ch.count(-1) for ch in ops)).tolist())
    for ch in ops:
        ch[:] = [c if c >= 0 else -1 - next(digits) for c in ch]
    out, todo = [], [0]        # left to write, last first: an operator, a leaf or a "]" (None); no recursion
    while todo:
        c = todo.pop()
        if c is None or c < 0:
            out.append(_CLOSE if c is None else _DIGIT0 - 1 - c)
        else:
            out.append(_OPEN0 + kinds[c])
            todo += [None, *ops[c][::-1]]
    value = [0] * len(ops)
    for o in range(len(ops) - 1, -1, -1):          # children have larger indices than parents
        value[o] = _APPLY[kinds[o]]([value[c] if c >= 0 else -1 - c for c in ops[o]])
    return out, value[0]


def listops(rng: np.random.Generator, batch: int, *, min_length: int = 500, max_length: int = 2000,
            max_depth: int = 10, max_args: int = 10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A batch of ListOps expressions (LRA's ListOps), their lengths and their values.

    Parameters
    ----------
    rng : numpy.random.Generator
        The source of every draw.
    batch : int
        Number of expressions (>= 0).
    min_length, max_length : int
        Token counts allowed, ``4 <= min_length <= max_length``; each expression's target length is
        uniform on the range (capped at the largest tree the limits allow).
    max_depth, max_args : int
        Most operators nested (>= 1; the root is at depth 1); most arguments of one operator (>= 2).

    Returns
    -------
    tokens, lengths, labels : numpy.ndarray
        int64: ``(batch, max_length)`` ids into ``LISTOPS_TOKENS`` right-padded with 0,
        ``(batch,)`` token counts, ``(batch,)`` values 0-9. A ValueError names the argument out of
        range, or ``min_length`` when no tree within the limits reaches it.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> tokens, lengths, labels = listops(rng, 4, min_length=20, max_length=64, max_depth=4)
    >>> tokens.shape, bool(((lengths >= 20) & (lengths <= 64)).all())
    ((4, 64), True)
    >>> [listops_evaluate(row) for row in tokens] == labels.tolist()
    True
    """
    batch, min_length, max_length, max_depth, max_args = (_check_int(*a) for a in (
        ("batch", batch, 0), ("min_length", min_length, 4), ("max_length", max_length, 4),
        ("max_depth", max_depth, 1), ("max_args", max_args, 2)))
    if min_length > max_length:
        raise ValueError(f"min_length ({min_length}) must be <= max_length ({max_length})")
    high = min(max_length, _capacity(max_depth, max_args, max_length))
    if min_length > high:
        raise ValueError(f"min_length ({min_length}) exceeds the {high} tokens of the largest tree with "
                         f"max_depth={max_depth}, max_args={max_args}")
    tokens = np.zeros((batch, max_length), dtype=np.int64)
    lengths, labels = np.zeros(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
    for b in range(batch):
        for _ in range(_RETRIES):
            ops = _grow(rng, int(rng.integers(min_length, high + 1)), max_depth, max_args)
            row, value = _serialise(rng, ops)
            if len(row) >= min_length:
                break
        else:
            raise ValueError(f"min_length: no tree of {min_length} to {max_length} tokens found with "
                             f"max_depth={max_depth}, max_args={max_args}; widen the range")
        tokens[b, :len(row)] = row
        lengths[b], labels[b] = len(row), value
    return tokens, lengths, labels


def listops_evaluate(tokens_row: ArrayLike) -> int:
    """The value of one ListOps expression, parsed from its token ids with a stack.

    Independent of :func:`listops`'s own evaluation (which walks the tree it grew). ``MED`` of an
    even count is ``int(numpy.median(args))``.

    Parameters
    ----------
    tokens_row : array_like of int
        ``(length,)`` ids into ``LISTOPS_TOKENS``, possibly followed by padding (0); a ValueError
        if they are not one well-bracketed expression.

    Examples
    --------
    >>> listops_evaluate(listops_encode("[MAX 2 9 [MIN 4 7 ] 0 ]"))
    9
    >>> listops_evaluate(listops_encode("[MED 1 4 7 8 ]"))   # median 5.5 -> 5
    5
    """
    ids = np.asarray(tokens_row, dtype=np.int64).ravel().tolist()
    while ids and ids[-1] == 0:
        ids.pop()
    stack: list[tuple[str, list[int]]] = []
    result: int | None = None       # the value once the outermost expression has closed
    for t in ids:
        if result is not None or not 0 < t < LISTOPS_VOCAB:
            raise ValueError(f"token id {t} at a place where none can stand")
        name = LISTOPS_TOKENS[t]
        if name.startswith("["):
            stack.append((name[1:], []))
            continue
        if name == "]":
            if not stack or not stack[-1][1]:
                raise ValueError("']' closes no operator with arguments")
            op, args = stack.pop()
            value = {"MAX": max, "MIN": min, "SM": lambda a: sum(a) % 10,
                     "MED": lambda a: int(np.median(a))}[op](args)
        else:
            value = int(name)
        if stack:
            stack[-1][1].append(value)
        else:
            result = value
    if result is None or stack:
        raise ValueError("incomplete expression")
    return result


def listops_text(tokens_row: ArrayLike) -> str:
    """The expression as text, padding left out: ``listops_text([13, 3, 6, 15, 0]) == "[MED 2 5 ]"``."""
    return " ".join(LISTOPS_TOKENS[t] for t in np.asarray(tokens_row).ravel().tolist() if t != 0)


def listops_encode(text: str) -> np.ndarray:
    """Token ids (int64, ``(length,)``) of a space-separated expression: ``"[SM 5 7 ]"`` -> 14, 6, 8, 15."""
    try:
        return np.array([LISTOPS_TOKENS.index(w) for w in text.split()], dtype=np.int64)
    except ValueError:
        raise ValueError(f"text: unknown token in {text!r}") from None


class PathfinderSample(NamedTuple):
    """One Pathfinder image with what it was drawn from (pixel coordinates are ``(row, col)``).

    ``image`` ``(size, size)`` uint8; ``label`` 1 if both markers end one path; ``curves`` one
    ``(n, 2)`` int64 centre line per path, 8-connected, in drawing order (its ends are rows 0 and
    -1); ``strokes`` the ``(m, 2)`` pixels of each path actually drawn (the dashes); ``markers``
    ``(2, 2)`` the centres of the two markers.
    """

    image: np.ndarray
    label: int
    curves: list[np.ndarray]
    strokes: list[np.ndarray]
    markers: np.ndarray


def _near(a: np.ndarray, b: np.ndarray, ring: int) -> bool:
    """Whether a row of ``a`` (n, 2) is within Chebyshev distance ``ring`` of a row of ``b`` (m, 2)."""
    return bool(np.abs(a[:, None, :] - b[None, :, :]).max(axis=2).min() <= ring)


def _curves(rng, count: int, size: int, points: int, turn: float, margin: int, ring: int) -> np.ndarray:
    """Those of ``count`` random-walk centre lines that stay inside the margins and keep away from
    their own ends: ``(k, points, 2)`` int64, ``k <= count``. Drawn in blocks (most leave the image)."""
    heading = rng.uniform(0, 2 * np.pi, (count, 1)) + np.cumsum(rng.uniform(-turn, turn, (count, points - 1)), 1)
    steps = np.stack([np.sin(heading), np.cos(heading)], axis=2)
    xy = rng.uniform(margin, size - 1 - margin, (count, 1, 2)) + np.cumsum(steps, 1)
    xy = np.concatenate([xy[:, :1] - steps[:, :1], xy], axis=1)       # the start, one step back
    pix = np.floor(xy + 0.5).astype(np.int64)     # floor(x + 1/2): unit steps stay 8-connected
    keep = (pix.min(axis=(1, 2)) >= margin) & (pix.max(axis=(1, 2)) <= size - 1 - margin)
    far = 2 * ring + 1                            # points this far along must have left an end's ring
    if points > far:
        keep &= np.abs(pix[:, far:] - pix[:, :1]).max(2).min(1) > ring
        keep &= np.abs(pix[:, :-far] - pix[:, -1:]).max(2).min(1) > ring
    return pix[keep]


def pathfinder_sample(rng: np.random.Generator, label: int, *, size: int = 32, paths: int = 3, dash: int = 2,
                      gap: int = 1, path_length: int | None = None, turn: float = np.pi / 8,
                      marker: int = 3) -> PathfinderSample:
    """One Pathfinder image of the given label, with its paths and markers: a ``PathfinderSample``.

    ``paths`` curves of the same length are placed one by one (each redrawn until it stays in the
    image and out of the one-pixel ring around every end, its own included, and no earlier path
    enters the ring around its ends). Two distinct paths are chosen at random; for label 1 both
    markers sit on the ends of the first, for label 0 one on a random end of each. The image is
    ``(size, size)`` uint8: 0 background, 255 strokes and markers.

    Parameters
    ----------
    rng : numpy.random.Generator
        The source of every draw.
    label : int
        1 (markers on one path) or 0 (on two paths).
    size, paths : int
        Side of the image in pixels (>= 8); number of paths, distractors included (>= 2).
    dash, gap : int
        Pixels of centre line drawn (>= 1), then skipped (>= 0), in turn.
    path_length : int, optional
        Steps of each path (default ``3 * size // 4``), rounded to whole dash-gap periods ending on a
        dash. ValueError names it when the paths do not fit.
    turn : float
        Largest change of heading per step, radians, in ``[0, pi]``.
    marker : int
        Side of the square markers in pixels (``1 <= marker <= size // 2``).

    Examples
    --------
    >>> s = pathfinder_sample(np.random.default_rng(0), 1, size=16, paths=2, path_length=8)
    >>> s.image.shape, s.label, len(s.curves)
    ((16, 16), 1, 2)
    >>> ends = [tuple(c[i]) for c in s.curves for i in (0, -1)]
    >>> sorted(map(tuple, s.markers.tolist())) in (sorted(ends[:2]), sorted(ends[2:]))
    True
    """
    if label not in (0, 1):
        raise ValueError(f"label must be 0 or 1, got {label!r}")
    return _sample(rng, int(label), *_path_config(size, paths, dash, gap, path_length, turn, marker))


def _path_config(size, paths, dash, gap, path_length, turn, marker) -> tuple:
    """The checked arguments of :func:`pathfinder_sample`, with the number of centre-line points."""
    size, paths, dash, gap, marker = (_check_int(*a) for a in (
        ("size", size, 8), ("paths", paths, 2), ("dash", dash, 1), ("gap", gap, 0), ("marker", marker, 1)))
    path_length = _check_int("path_length", 3 * size // 4 if path_length is None else path_length, 1)
    if not 0 <= turn <= np.pi:
        raise ValueError(f"turn must be in [0, pi], got {turn!r}")
    if marker > size // 2:
        raise ValueError(f"marker ({marker}) must be <= size // 2 ({size // 2})")
    period = dash + gap
    points = max(1, round((path_length - dash + 1) / period)) * period + dash   # last index ends a dash
    return size, paths, dash, period, points, float(turn), marker


def _sample(rng, label, size, paths, dash, period, points, turn, marker) -> PathfinderSample:
    # Paths are placed in turn, each the next candidate that does not enter the rings of the ends
    # placed so far, nor puts its own ends in reach of an earlier path.
    margin, ring = marker // 2, marker // 2 + 1
    curves: list[np.ndarray] = []
    pool: list[np.ndarray] = []         # candidates that passed _curves' own checks, last one next
    for attempt in range(1, 10 * _RETRIES):
        if len(curves) == paths:
            break
        if attempt % _RETRIES == 0:              # the paths placed so far leave no room: start again
            curves = []
        if not pool:
            pool = list(_curves(rng, 16, size, points, turn, margin, ring))[::-1]
        elif not curves or not (_near(pool[-1], np.concatenate([c[[0, -1]] for c in curves]), ring)
                                or _near(np.concatenate(curves), pool[-1][[0, -1]], ring)):
            curves.append(pool.pop())
        else:
            pool.pop()
    if len(curves) < paths:
        raise ValueError(f"path_length: {paths} paths of {points - 1} steps do not fit a {size} x {size} image")
    on = np.arange(points) % period < dash
    strokes = [np.unique(c[on], axis=0) for c in curves]
    first, second = rng.choice(paths, size=2, replace=False)
    ends = (0, -1) if label else -rng.integers(0, 2, size=2)     # label 0: a random end of each path
    markers = np.stack([curves[first][ends[0]], curves[first if label else second][ends[1]]])
    image = np.zeros((size, size), dtype=np.uint8)
    image[tuple(np.concatenate(strokes).T)] = 255
    low = (marker - 1) // 2
    for r, c in markers:
        image[r - low:r - low + marker, c - low:c - low + marker] = 255
    return PathfinderSample(image, int(label), curves, strokes, markers)


def pathfinder(rng: np.random.Generator, batch: int, *, size: int = 32, paths: int = 3, dash: int = 2, gap: int = 1,
               path_length: int | None = None, turn: float = np.pi / 8, marker: int = 3,
               return_samples: bool = False,
               ) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, list[PathfinderSample]]:
    """A batch of Pathfinder images (by :func:`pathfinder_sample`), flattened to pixel tokens, and labels.

    Half of an even batch has label 1, half 0, in a random order (an odd batch's extra one: a coin).

    Parameters
    ----------
    rng : numpy.random.Generator
        The source of every draw.
    batch : int
        Number of images (>= 0).
    size, paths, dash, gap, path_length, turn, marker
        As in :func:`pathfinder_sample`.
    return_samples : bool
        Also return what each image was drawn from (for checks and plots).

    Returns
    -------
    images, labels : numpy.ndarray
        ``(batch, size * size)`` uint8 pixel tokens (a vocabulary of 256), the image's rows in turn;
        ``(batch,)`` int64, 1 where both markers end the same path. With ``return_samples=True``,
        the list of the ``PathfinderSample`` of each image follows.

    Examples
    --------
    >>> images, labels = pathfinder(np.random.default_rng(0), 8)
    >>> images.shape, images.dtype, int(labels.sum())
    ((8, 1024), dtype('uint8'), 4)
    """
    batch = _check_int("batch", batch, 0)
    config = _path_config(size, paths, dash, gap, path_length, turn, marker)
    ones = batch // 2 + batch % 2 * int(rng.integers(0, 2))     # exact balance; a coin for an odd one out
    labels = rng.permutation(np.arange(batch) < ones).astype(np.int64)
    samples = [_sample(rng, int(label), *config) for label in labels]
    images = np.stack([s.image.ravel() for s in samples]) if samples else np.zeros((0, config[0] ** 2), np.uint8)
    return (images, labels, samples) if return_samples else (images, labels)
