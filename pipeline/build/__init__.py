"""A build: sources -> per-file units (the map) -> global stages -> outputs, report, card, manifest.

- config.py: `BuildConfig`, the settings of every stage and output.
- units.py: the map half: one unit per (source, file), each row through the map stages (read,
  normalize, validate, stage), staged with its key table and quarantine entries.
- resume.py: the units' completion markers; the staging folder.
- global_stages.py: the global stages (decontaminate, exact dedup, near dedup), declared objects
  that each return their tally and dropped rows, run in the order of `GLOBAL_STAGES`.
- outputs.py: the outputs (sft, negatives, preference, grpo, grpo_env, step_labels, step_pairs,
  step_values), a registry of schema, card note and row maker each.
- assemble.py: the parts the second half runs on: key tables, the staged records as dedup reads
  them, per-unit pools and the per-unit writer of the outputs.
- second_half.py: `finalize`, the second half as a short sequence of those parts; report.py: report.json from
  the tallies; in_process.py: the whole build without Prefect.

The names below are the build's interface (flows/build.py, flows/cli.py, the tests).
"""
from trajforge.pipeline.build.config import BuildConfig
from trajforge.pipeline.build.in_process import build_in_process
from trajforge.pipeline.build.report import summary_lines
from trajforge.pipeline.build.resume import resume_unit, staging_folder
from trajforge.pipeline.build.second_half import finalize
from trajforge.pipeline.build.units import UnitResult, process_unit, unit_bar, unit_key, units_done

__all__ = ["BuildConfig", "UnitResult", "build_in_process", "finalize", "process_unit", "resume_unit",
           "staging_folder", "summary_lines", "unit_bar", "unit_key", "units_done"]
