"""The whole build in this process, without Prefect (the CLI's choice for a small input)."""
from __future__ import annotations

import logging
from pathlib import Path

from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.build.resume import resume_unit, staging_folder
from trajforge.pipeline.build.second_half import finalize
from trajforge.pipeline.build.units import unit_bar, units_done
from trajforge.sources import get_source

log = logging.getLogger("trajforge.build")


def build_in_process(sources: dict[str, str | None], out: Path, config: BuildConfig = BuildConfig()) -> dict:
    """The whole build in this process, without Prefect: for inputs so small that starting a Prefect
    server and worker processes would take longer than the work. The same steps as the build flow
    (flows/build.py) in the same order, so the same bytes, resumed the same way after a stop.
    Returns the report."""
    staging = staging_folder(out)
    files = [(name, f) for name, location in sources.items() for f in get_source(name).files(location)]
    units = []
    with unit_bar(len(files)) as bar:
        for name, file in files:
            unit, earlier = resume_unit(name, file, staging, config)
            if earlier:
                log.info("%s/%s: done in an earlier run, skipped", name, file.label)
            units.append(unit)
            bar.update()
            log.info(units_done(len(units), len(files), unit))
    return finalize(units, out, config)
