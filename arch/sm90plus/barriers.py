"""Named barriers (`bar.sync` ids) as one `IntEnum` per kernel, checked once where declared."""

import enum

# Named barriers per CTA; id 0 is the one `sync_threads` uses.
NUM_NAMED_BARRIERS = 16


def named_barriers(cls):
    """Class decorator for a kernel's IntEnum of named barrier ids: each id is used once and
    lies in 1..15 (0 is `sync_threads`')."""
    enum.unique(cls)
    bad = [m.name for m in cls if not 0 < m.value < NUM_NAMED_BARRIERS]
    if bad:
        raise ValueError(f"{cls.__name__}: named barrier ids must lie in 1..15: {bad}")
    return cls
