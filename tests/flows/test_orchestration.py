"""The deployed pipeline on a real `prefect server` with a real worker: synthesis -> build -> release.

The chain is started the way the schedule starts it (a run of synthesize/nightly); the build and the
release are started by the server's deployment triggers. The model API is the loopback
OpenAI-compatible server, the Hub the loopback Hub. A one-off synthesis (synthesize/adhoc) runs at
the same time; both share one global concurrency limit, counted at the model server. A failing
one-off run must reach the failure notification's webhook.
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow.parquet as pq
import pytest
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.client.orchestration import SyncPrefectClient
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
from prefect.settings import PREFECT_API_URL, temporary_settings

from tests.support.hub_server import HubServer
from tests.support.openai_server import CriticalStepPolicy, Server, fixture_policy
from tests.support.paths import FIXTURES, RAW, REPO
from tests.support.prefect_cli import API, PREFECT, run
from trajforge.flows.notify import install

pytestmark = pytest.mark.slow
DB_FILE = FIXTURES / "tasks" / "agentbench" / "db" / "dev.jsonl"
TOKEN = "hf_loopbackTestToken_orchestration"
HUB_REPO = "trajforge-test/chained"
LIMIT = "model-api"
RATE_LIMIT = "model-api-rate"
SLOTS = 2


class Webhook(ThreadingHTTPServer):
    """Collects the JSON bodies POSTed to it (the notification block's target)."""

    def __init__(self):
        received: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format, *args):  # noqa: A002 - quiet
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.received = received
        self.url = f"http://127.0.0.1:{self.server_address[1]}/hook"
        threading.Thread(target=self.serve_forever, daemon=True).start()


def deployment_id(api: str, flow: str, name: str) -> str:
    return API.get(f"{api}/deployments/name/{flow}/{name}").json()["id"]


def runs_of(api: str, deployment: str) -> list[dict]:
    return API.post(f"{api}/flow_runs/filter",
                      json={"flow_runs": {"deployment_id": {"any_": [deployment]}}}).json()


def wait_for(check, what: str, timeout: float, worker: subprocess.Popen, log_path) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert worker.poll() is None and time.monotonic() < deadline, \
            f"timed out waiting for {what}\n{log_path.read_text()[-4000:]}"
        time.sleep(1)


def run_id(triggered: subprocess.CompletedProcess) -> str:
    return next(line.split()[-1] for line in triggered.stdout.splitlines() if "UUID" in line)


def terminal(flow_run: dict) -> dict | None:
    return flow_run if flow_run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") else None


def finished(api: str, deployment: str) -> dict | None:
    """The deployment's run once it has ended (for deployments with no schedule: their one run)."""
    runs = runs_of(api, deployment)
    return terminal(runs[0]) if runs else None


def run_finished(api: str, flow_run_id: str) -> dict | None:
    return terminal(API.get(f"{api}/flow_runs/{flow_run_id}").json())


def artifacts(client: SyncPrefectClient, *flow_run_ids: str) -> dict:
    found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
        any_=list(flow_run_ids))))
    return {a.key: a.data for a in found}


def table(data) -> list[dict]:
    return json.loads(data) if isinstance(data, str) else data


def test_deployed_chain_artifacts_shared_limit_and_failure_notification(prefect_server, tmp_path):
    api, env = prefect_server
    assert API.post(f"{api}/work_pools/", json={"name": "trajforge", "type": "process"}).status_code == 201
    run([PREFECT, "--no-prompt", "deploy", "--all"], env)
    run([PREFECT, "global-concurrency-limit", "create", LIMIT, "--limit", str(SLOTS)], env)
    run([PREFECT, "global-concurrency-limit", "create", RATE_LIMIT, "--limit", "100", "--slot-decay-per-second", "50"],
        env)

    # Four tasks, two of them solvable by the fixture policy (the reference SQL), two samples each.
    lines = DB_FILE.read_text().splitlines(keepends=True)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(lines[i] for i in (3, 7, 8, 13)))
    synth, synth2, build = tmp_path / "synth", tmp_path / "synth2", tmp_path / "build"
    # The failure notification: a webhook block pointing here, and the automation flows/notify.py installs.
    webhook = Webhook()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        CustomWebhookNotificationBlock(name="trajforge", url=webhook.url,
                                       json_data={"text": "{{subject}}\n{{body}}"}).save("trajforge-alerts")
        install("custom-webhook/trajforge-alerts")
    with Server(fixture_policy(db_files=[DB_FILE]), latency_s=0.05, overlap=True) as model, HubServer(token=TOKEN) as hub:
        worker_env = {**env, "HF_ENDPOINT": hub.endpoint, "HF_HUB_OFFLINE": "0", "HF_TOKEN": TOKEN,
                      "PREFECT_WORKER_QUERY_SECONDS": "1"}
        # What the chained deployments build and where to in this test. The folders they read are not
        # set (their defaults, synth/ and build/, are removed): the triggers take them from the
        # completed run that started them.
        after_synthesis = deployment_id(api, "build-dataset", "after-synthesis")
        after_build = deployment_id(api, "release", "after-build")
        # The tasks are DBBench dev tasks, which every build holds out as an eval split by default;
        # this chain trains on them on purpose, so its build spares that split.
        for dep, params in [(after_synthesis, {"sources": {"openmanus_rl": str(RAW / "openmanus_rl")},
                                               "out": str(build), "stages": {"decontaminate_splits": False}}),
                            (after_build, {"repo": HUB_REPO, "tag": "v1"})]:
            assert API.patch(f"{api}/deployments/{dep}", json={"parameters": params}).status_code == 204

        synth_params = ["-p", f"tasks={tasks}", "-p", "env=db", "-p", "n=2", "-p", "concurrency=8",
                        "-p", f"base_url={model.base_url}", "-p", f"out={synth}", "-p", f"api_limit={LIMIT}"]
        # The nightly deployment's cron schedule also has the server's scheduler add future runs of it,
        # so the chain's first run is followed by its id, not picked out of the deployment's runs.
        nightly = run_id(run([PREFECT, "deployment", "run", "synthesize/nightly", "-p",
                              "model=deepseek-ai/DeepSeek-R1", *synth_params], env))
        # A one-off synthesis at the same time, against the same limit and endpoint; it starts no build.
        adhoc = run_id(run([PREFECT, "deployment", "run", "synthesize/adhoc", "-p",
                            "model=deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", *synth_params, "-p", f"out={synth2}",
                            "-p", f"api_rate_limit={RATE_LIMIT}"], env))
        # A one-off that fails (no task file; a limit that does not exist): it must start no build,
        # say what is missing, and reach the webhook.
        failing = run_id(run([PREFECT, "deployment", "run", "synthesize/adhoc", "-p",
                              f"tasks={tmp_path / 'missing.jsonl'}", "-p", f"out={tmp_path / 'failed'}",
                              "-p", "api_limit=no-such-limit"], env))
        log_path = tmp_path / "worker.log"
        with open(log_path, "wb") as log:
            worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "trajforge"], env=worker_env, cwd=REPO,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            synth_run = wait_for(lambda: run_finished(api, nightly), "the nightly synthesis", 240, worker, log_path)
            build_run = wait_for(lambda: finished(api, after_synthesis), "the triggered build", 240, worker, log_path)
            release_run = wait_for(lambda: finished(api, after_build), "the triggered release", 240, worker, log_path)
            adhoc_run = wait_for(lambda: run_finished(api, adhoc), "the one-off synthesis",
                                 60, worker, log_path)
            for flow_run in (synth_run, adhoc_run, build_run, release_run):
                assert flow_run["state"]["type"] == "COMPLETED", (flow_run["name"], flow_run["state"])
            wait_for(lambda: webhook.received, "the failure notification", 120, worker, log_path)
        finally:
            os.killpg(worker.pid, 15)
            worker.wait(timeout=30)

        # Readable names, and the build and release were started by the triggers (not by this test).
        assert synth_run["name"].startswith("synth db DeepSeek-R1 ")
        assert build_run["name"].startswith("build openmanus_rl+synthetic ")
        assert build_run["idempotency_key"] and release_run["idempotency_key"]
        assert build_run["parameters"]["synthetic"] == str(synth) and release_run["parameters"]["folder"] == str(build)
        assert len(runs_of(api, after_synthesis)) == len(runs_of(api, after_build)) == 1
        logs = {run: " ".join(entry["message"] for entry in API.post(f"{api}/logs/filter", json={
            "logs": {"flow_run_id": {"any_": [run]}}}).json()) for run in (synth_run["id"], adhoc, failing)}
        assert f"share the concurrency limit '{LIMIT}' ({SLOTS} slots)" in logs[synth_run["id"]]
        assert f"share the rate limit '{RATE_LIMIT}'" in logs[adhoc]
        assert "global concurrency limit 'no-such-limit' does not exist" in logs[failing]

        # The shared limit held across both runs, which overlapped in time (the model server holds the
        # first request until the other run's first one arrives, however far apart the worker starts them).
        # (Each run alone would have up to 8 in flight: its own `concurrency`.)
        assert model.max_in_flight == SLOTS, model.max_in_flight
        spans = {m: [s for s in model.spans if s[2] == m] for m in {s[2] for s in model.spans}}
        assert len(spans) == 2, spans.keys()
        (a_start, a_end), (b_start, b_end) = [(min(s[0] for s in v), max(s[1] for s in v)) for v in spans.values()]
        assert a_start < b_end and b_start < a_end

        # The release holds the synthetic records the nightly run wrote (less the ones dedup removed).
        synthetic = {r["id"] for r in pq.read_table(synth / "data" / "synthetic" / "db.parquet").to_pylist()}
        removed = {r["id"] for r in pq.read_table(build / "duplicates.parquet").to_pylist()}
        head = hub.state.repos[HUB_REPO].resolve("v1")
        released = [row for path, content in head.files.items() if path.startswith("data/sft/")
                    for row in pq.read_table(io.BytesIO(content)).to_pylist()]
        assert synthetic and {r["id"] for r in released if r["source"] == "synthetic"} == synthetic - removed

    with SyncPrefectClient(api) as client:
        synth_report = json.loads((synth / "report.json").read_text())["db"]
        got = artifacts(client, synth_run["id"])
        assert {"synth-summary", "synth-outcomes", "synth-success", "synth-tokens", "synth-progress"} <= set(got)
        outcomes = {r["outcome"]: r["episodes"] for r in table(got["synth-outcomes"])}
        assert sum(outcomes.values()) == synth_report["episodes"] == 4 * 2
        assert outcomes["record"] == synth_report["records"] > 0
        [success] = table(got["synth-success"])
        assert success["tasks_with_record"] == synth_report["tasks_with_record"]
        [tokens] = table(got["synth-tokens"])
        assert tokens["total_tokens"] == synth_report["usage"]["total_tokens"] > 0
        assert tokens["calls"] == synth_report["llm"]["calls"] > 0
        assert float(got["synth-progress"]) == 100.0

        report = json.loads((build / "report.json").read_text())
        children = [r["id"] for r in API.post(f"{api}/flow_runs/filter", json={
            "flow_runs": {"parent_flow_run_id": {"any_": [build_run["id"]]}}}).json()]
        got = artifacts(client, build_run["id"], *children)
        sources = {r["source"]: r for r in table(got["build-sources"])}
        assert set(sources) == {"openmanus_rl", "synthetic", "total"}
        for name, entry in [*report["sources"].items(), ("total", report["total"])]:
            assert {k: sources[name][k] for k in ("read", "written", "quarantined", "duplicates")} == \
                   {k: entry[k] for k in ("read", "written", "quarantined", "duplicates")}
        assert sources["synthetic"]["read"] == len(synthetic)
        reasons = table(got["build-quarantine"])
        assert sum(r["records"] for r in reasons if r["reason"] != "-") == report["total"]["quarantined"]
        assert {r["source"]: r["duplicates"] for r in table(got["build-duplicates"]) if r["source"] != "-"} == \
               report["duplicates"]["by_source"]
        assert {r["negative_type"]: r["records"] for r in table(got["build-negatives"]) if r["negative_type"] != "-"} \
               == report["negatives"]["by_type"]
        assert (build / "report.html").as_uri() in got["build-report"]
        assert float(got["build-progress"]) == 100.0
        assert f"**{report['total']['written']}** records written" in got["build-summary"]

        got = artifacts(client, release_run["id"])
        assert head.oid in got["release-summary"] and "tag `v1`" in got["release-summary"]
        files = [r["path"] for r in table(got["release-files"])]
        assert files and set(files) <= set(head.files)

    # The notification names the failed run.
    text = webhook.received[0]["text"]
    assert "synthesize" in text and ("Failed" in text or "Crashed" in text), text


def test_select_steps_salvage_and_rft_share_the_model_api_limit_and_notify_on_failure(prefect_server, fixtures_build,
                                                                                      tmp_path):
    """The flows that call a model besides synthesis hold the same global limit, and their failures
    reach the notification (run in-process against the server, as `trajforge select-steps` runs them)."""
    from trajforge.flows.rft import rft
    from trajforge.flows.salvage import salvage
    from trajforge.flows.select_steps import select_steps

    api, env = prefect_server
    run([PREFECT, "global-concurrency-limit", "create", LIMIT, "--limit", "1"], env)
    shard = sorted((fixtures_build / "data" / "sft").glob("*.parquet"))[0]
    missing = str(tmp_path / "missing.jsonl")
    webhook = Webhook()
    with temporary_settings(updates={PREFECT_API_URL: api}):
        CustomWebhookNotificationBlock(name="trajforge", url=webhook.url,
                                       json_data={"text": "{{subject}}\n{{body}}"}).save("trajforge-alerts")
        install("custom-webhook/trajforge-alerts")
        with Server(CriticalStepPolicy(), shapes=("reasoning_content", "think"), latency_s=0.05) as model:
            report = select_steps(inputs=str(shard), out=str(tmp_path / "selected"), model="DeepSeek-R1",
                                  base_url=model.base_url, concurrency=8, api_limit=LIMIT)
        # Eight requests in flight of this run's own, one through the shared limit.
        assert report["judged"] == model.calls > 4 and model.max_in_flight == 1
        salvaged = salvage(failures=[missing], tasks=missing, out=str(tmp_path / "salvaged"), model="m",
                           base_url=model.base_url, api_limit=LIMIT, return_state=True)
        looped = rft(sources={}, tasks=missing, env="db", base_model="m", out=str(tmp_path / "rft"),
                     api_limit="no-such-limit", api_limit_strict=True, return_state=True)
        assert salvaged.is_failed() and looped.is_failed()
        assert "global concurrency limit 'no-such-limit' does not exist" in looped.message
    logs = " ".join(entry["message"] for entry in API.post(f"{api}/logs/filter", json={
        "logs": {"flow_run_id": {"any_": [str(salvaged.state_details.flow_run_id)]}}}).json())
    assert f"share the concurrency limit '{LIMIT}' (1 slots)" in logs
    deadline = time.monotonic() + 120
    while len(webhook.received) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    texts = [m["text"] for m in webhook.received]
    assert {t.split()[1] for t in texts} == {"salvage", "rft"}, texts
