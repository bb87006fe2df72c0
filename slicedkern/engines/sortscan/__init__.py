"""The sort-scan machinery every engine shares, written against the array API standard.

:mod:`.sums`: one stable sort of the keys with the prefix table of their weights, the queries'
rank searches and the gathered combinations (docs/mathematics.rst, "The kernel sum by sort-scan");
:mod:`.pullback`: their VJP (profile sums over the sorted queries, knot sums for the parameters);
:mod:`.wide`: the work arithmetic, float64 or double-float where the backend has none.
The scan engine is these and nothing else; the triton engine's host side, the sweep's column
bookkeeping and the sharded engine use them too.
"""
