"""The draw tool: a fresh random integer on every call (bridge/tasks/tool_draw.py).

    draw(100)  # "57", then "3", ... : no two calls need agree

Its randomness comes from the operating system (`secrets`), not `random`: the sandbox
forks each call from one helper process, and every child would inherit, and repeat, the
helper's `random` state.
"""

import secrets


def draw(sides: int = 100) -> str:
    """A uniformly random integer in [1, sides]."""
    if type(sides) is not int or not 1 <= sides <= 1_000_000:
        raise ValueError("sides must be an integer in [1, 1000000]")
    return str(1 + secrets.randbelow(sides))
