"""The release flow: publish a build folder to a Hub dataset repo (see pipeline/publish/release.py).

One task, retried: the push is a single atomic commit planned against the remote head, so a retry
after a network failure replans and either finds the release already there or pushes it whole.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task

from trajforge.flows.artifacts import release_artifacts
from trajforge.flows.build import build_dataset
from trajforge.flows.names import build_run_name, release_run_name
from trajforge.pipeline.publish.release import ReleaseError, ReleasePlan, ReleaseResult, release


def _transient(task, task_run, state) -> bool:
    """Retry network failures; never a refused release or one whose verification failed."""
    try:
        state.result()
    except ReleaseError:
        return False
    except Exception:
        return True
    return False


@task(name="push-to-hub", retries=2, retry_delay_seconds=10, retry_condition_fn=_transient)
def push_task(folder: str, repo: str, revision: str, tag: str | None, private: bool,
              dry_run: bool) -> ReleasePlan | ReleaseResult:
    return release(Path(folder), repo, revision=revision, tag=tag, private=private, dry_run=dry_run)


@flow(name="release", log_prints=True, flow_run_name=release_run_name)
def release_dataset(folder: str, repo: str, revision: str = "main", tag: str | None = None,
                    private: bool = False, dry_run: bool = False) -> dict:
    """Push `folder` (the output of the build flow) to the dataset repo `repo`, tag it and verify it."""
    logger = get_run_logger()
    outcome = push_task(folder, repo, revision, tag, private, dry_run)
    plan = outcome if isinstance(outcome, ReleasePlan) else outcome.plan
    for line in plan.lines():
        logger.info(line)
    if isinstance(outcome, ReleasePlan):
        result = {"dry_run": True, "added": plan.added, "changed": plan.changed, "deleted": plan.deleted}
    else:
        logger.info("released %s@%s as commit %s%s; %d files verified against the manifest", repo, revision,
                    outcome.commit, f" (tag {tag})" if tag else "", outcome.verified)
        result = {"dry_run": False, "commit": outcome.commit, "tag": outcome.tag, "added": plan.added,
                  "changed": plan.changed, "deleted": plan.deleted, "verified": outcome.verified,
                  "files": sorted(plan.added + plan.changed + plan.unchanged)}
    release_artifacts(result, repo, revision)
    return result


@flow(name="build-and-release", log_prints=True, flow_run_name=build_run_name)
def build_and_release(repo: str, out: str = "build", sources: dict[str, str | None] | None = None,
                      rendering: str | None = None, runner: str | None = None, address: str | None = None,
                      revision: str = "main", tag: str | None = None, private: bool = False,
                      synthetic: str | None = None) -> dict:
    """Build (with the synthesis output folder `synthetic` as one more source), then release the build.
    Rerunning an unchanged build pushes nothing (empty plan). `rendering` and `runner` left None keep
    the build's defaults (flows/config.py)."""
    build_dataset(sources=sources, out=out, rendering=rendering, runner=runner, address=address, synthetic=synthetic)
    return release_dataset(folder=out, repo=repo, revision=revision, tag=tag, private=private)
