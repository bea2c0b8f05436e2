"""Imported last by the fork server (tests/support/forked.py, PRELOAD): what the imports built
is exempted from the garbage collector, so each fork's own collections (a broker collects once
as it starts serving, app/collector.py) do not walk it again, nor copy its memory by touching it."""

import gc

gc.collect()
gc.freeze()
