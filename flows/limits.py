"""Limits on the model API shared by every run on a Prefect server (global concurrency and rate limits).

`LLMConfig.concurrency` bounds the requests in flight of one synthesis job. Two jobs (a scheduled
run and an ad-hoc one, or runs on several workers) against one endpoint would each use their full
bound; a Prefect global concurrency limit named in the flow's parameters is held around every
request instead, so together they never exceed it. Create the limits once per server:

    prefect global-concurrency-limit create model-api --limit 32
    prefect global-concurrency-limit create model-api-rate --limit 60 --slot-decay-per-second 1

A name that does not exist on the server is reported once as a warning and the run goes on with
only its own bound (Prefect itself would skip a missing limit on every request, silently but for a
log line each time); `strict` turns that into an error before any request is made.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from prefect import get_client, get_run_logger
from prefect.concurrency.asyncio import concurrency, rate_limit
from prefect.exceptions import ObjectNotFound


class ModelAPILimit:
    """The request gate of `LLMConfig`: a slot of the concurrency limit (and one of the rate limit).

    A plain class, not a dataclass: `dataclasses.asdict` copies an LLMConfig, and would turn a
    dataclass field into a dict.
    """

    def __init__(self, concurrency_limit: str | None = None, rate_limit_name: str | None = None,
                 timeout_s: float | None = None):
        self.concurrency_limit = concurrency_limit
        self.rate_limit_name = rate_limit_name
        self.timeout_s = timeout_s

    @asynccontextmanager
    async def __call__(self) -> AsyncIterator[None]:
        if self.rate_limit_name:
            await rate_limit(self.rate_limit_name, timeout_seconds=self.timeout_s)
        if self.concurrency_limit:
            async with concurrency(self.concurrency_limit, timeout_seconds=self.timeout_s):
                yield
        else:
            yield


def model_api_limit(concurrency_limit: str | None, rate_limit_name: str | None = None, strict: bool = False,
                    timeout_s: float | None = None) -> ModelAPILimit | None:
    """The gate for the limits that exist on the server; None when no limit is named or none exists."""
    if not (concurrency_limit or rate_limit_name):
        return None
    logger = get_run_logger()
    found: dict[str, str | None] = {}
    with get_client(sync_client=True) as client:
        for role, name in (("concurrency", concurrency_limit), ("rate", rate_limit_name)):
            if not name:
                found[role] = None
                continue
            try:
                limit = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                message = (f"global concurrency limit {name!r} does not exist on this Prefect server; "
                           f"create it with `prefect global-concurrency-limit create {name} --limit N`")
                if strict:
                    raise ValueError(message) from None
                logger.warning("%s. Running with this run's own bound only.", message)
                found[role] = None
                continue
            if role == "rate" and not limit.slot_decay_per_second:
                raise ValueError(f"rate limit {name!r} has no slot decay; create it with --slot-decay-per-second")
            logger.info("model API requests share the %s limit %r (%d slots)", role, name, limit.limit)
            found[role] = name
    if not any(found.values()):
        return None
    return ModelAPILimit(found["concurrency"], found["rate"], timeout_s)
