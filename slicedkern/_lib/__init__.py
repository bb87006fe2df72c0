"""The bottom layer: namespace, device, dtype and shape helpers, typing. Imports no framework and
nothing else of the package."""
