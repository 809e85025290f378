"""What the `processes` runner's fork server loads before it forks a worker (flows/workers.py): the
build's tasks and the stages they call, Prefect's task engine and its installed collections, and the
compiled loops of the dedup keys (tokens, MinHash) and of the near-dedup screen with their machine
code loaded (numba's import and the loops from its cache: ~0.75 s of CPU a process, most of it
numba's set-up for the first loop), so that every worker starts with them, their pages shared
rather than loaded per worker. Importing this module is what loads them, and freezes what it loaded (below)."""
import gc

# No cyclic collection while it loads: the imports and numba's loading make ~0.44M objects and next to
# no garbage, and each collection they set off walks all of them again (~0.4 s of the fork server's
# ~2.4 s of CPU, at a build's start, where the command and the temporary server load on the same cores).
gc.disable()

import prefect.task_engine  # noqa: E402, F401
from prefect.plugins import load_prefect_collections  # noqa: E402

import trajforge.flows.build  # noqa: E402, F401
from trajforge.pipeline.quality import dedup, sketch_screen  # noqa: E402

dedup.warm()
sketch_screen.warm()
# A worker loads Prefect's installed collections (prefect-dask, prefect-ray: ~290 modules, ~0.16 s
# of CPU) at its first task, where the task's context names its result storage and Prefect looks up
# the block's class: loaded once here instead, not in each worker at the map's start.
load_prefect_collections()

# What the fork server loaded lives as long as it and every worker: frozen (moved out of the
# cyclic collector's generations), a worker's full collections never walk it. Walking it writes to
# every object's header, which copied ~72 MiB of the fork server's pages into each worker at its
# first full collection (a worker's private memory 2.6 -> 75 MiB, ~160 ms); frozen, 3 MiB and no time.
gc.freeze()
gc.enable()
