"""learner_jax/reporting/compiles.py counts XLA compiles, which the learner reports as cold
windows."""

import jax
import jax.numpy as jnp

from learner_jax.reporting import compiles


def test_a_new_compile_moves_the_count_and_a_cached_call_does_not():
    f = jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0)
    before = compiles.count()
    f(jnp.ones(7)).block_until_ready()  # a shape never compiled in this process
    compiled = compiles.count()
    assert compiled > before
    f(jnp.zeros(7)).block_until_ready()  # same shape and dtype: the cached executable
    assert compiles.count() == compiled
    f(jnp.ones(9)).block_until_ready()  # a new shape compiles again
    assert compiles.count() > compiled
