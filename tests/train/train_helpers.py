"""Comparisons shared by the train tests: relative error of arrays and of whole pytrees."""

import jax
import numpy as np


def rel(a, b):
    """`|a - b| / |b|` (Frobenius norms, float64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def max_rel(tree_a, tree_b):
    """The largest `rel` over matching leaves of two pytrees."""
    return max(jax.tree.leaves(jax.tree.map(rel, tree_a, tree_b)))
