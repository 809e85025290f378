"""What the `processes` runner's fork server loads before it forks a worker (flows/workers.py): the
build's tasks and the stages they call, Prefect's task engine, and the compiled loops of the dedup
keys (tokens, MinHash) and of the near-dedup screen with their machine code loaded (numba's import
and the loops from its cache: ~0.7 s of CPU a process for the screen's, ~0.55 s for the keys'), so
that every worker starts with them, their pages shared rather than loaded per worker. Importing
this module is what loads them.

Then every object the fork server holds is frozen (`gc.freeze`): a worker's cyclic collections
would otherwise walk them all, writing to their pages and so copying them into the worker. Forked
from the command, the fork server holds the command's objects too (~0.1 GiB more PSS in a 100k
build's workers, unfrozen)."""
import gc

import prefect.task_engine  # noqa: F401

import trajforge.flows.build  # noqa: F401
from trajforge.pipeline.quality import dedup, sketch_screen

dedup.warm()
sketch_screen.warm()
gc.freeze()
