"""Tolerances for "two float32 computations of the same thing agree", from the arithmetic.

Two programs that compute the same sums in another order (another mesh, packed rows,
micro-batches, another CPU's vector width or thread count) differ by rounding only. A
float32 result built from terms of magnitude `scale` through a computation of modest depth
(a few layers, sums of a few hundred terms, whose rounding errors mostly cancel) lands
within a few hundred ulps of `scale`:

    |a - b| <= ulps * EPS32 * scale

`scale` is the magnitude of what was summed, not of the result: a row sum of log-probs
near log(1/V) = -4.6 that nearly cancels still carries the rounding of its terms. A leaf of
a gradient tree is compared at its own largest magnitude, so small leaves get small
tolerances. The optimizer is compared before it divides: Adam's first update is
lr * g / (|g| + eps), which turns the rounding of a tiny gradient entry into a difference of
order lr, so parameters after Adam are compared only where |g| >> the gradient tolerance
(see `well_conditioned`).
"""

from __future__ import annotations

import jax
import numpy as np
import optax

EPS32 = float(np.finfo(np.float32).eps)  # 1.19e-7
# A forward + backward pass of the tiny 2-layer model over a few hundred tokens: gradients
# (8 vs 1 devices, micro-batched vs full, packed vs not, remat vs plain) measured within
# 9 ulps of their leaf's scale; 256 leaves a wide margin for other CPUs (vector widths,
# thread counts, XLA versions) and still fails a gradient wrong by 1e-4 of its scale.
ULPS = 256


def atol_for(scale, ulps: float = ULPS) -> float:
    return ulps * EPS32 * float(np.max(np.abs(scale), initial=0.0))


def assert_close_at_scale(got, want, scale=None, ulps: float = ULPS, err_msg: str = ""):
    """`got` == `want` within `ulps` float32 ulps of `scale` (default: max |want|)."""
    want = np.asarray(want, np.float64)
    got = np.asarray(got, np.float64)
    atol = atol_for(want if scale is None else scale, ulps)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=err_msg)


def assert_trees_close_at_scale(got, want, ulps: float = ULPS):
    """Leaf by leaf, each at its own scale (a leaf's max |want|)."""
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        assert_close_at_scale(x, y, ulps=ulps, err_msg=jax.tree_util.keystr(path))


def gradient_recorder() -> optax.GradientTransformation:
    """An "optimizer" that keeps the step's raw gradient as its state and moves nothing:
    the jitted step, with its real shardings, then hands back the gradient it computed."""

    def init(params):
        return jax.tree.map(lambda p: p * 0, params)

    def update(grads, state, params=None):
        del state, params
        return jax.tree.map(lambda g: g * 0, grads), grads

    return optax.GradientTransformation(init, update)


def well_conditioned(grad, ulps: float = ULPS, margin: float = 1e3) -> np.ndarray:
    """Entries of a gradient leaf that Adam's division does not amplify: |g| at least
    `margin` times the leaf's rounding tolerance, so the direction g / (|g| + eps) moves by
    at most ~1/margin of its size between two roundings of g."""
    grad = np.asarray(grad)
    return np.abs(grad) >= margin * atol_for(grad, ulps)
