"""prefect.yaml against a real `prefect server start` on loopback: deploy all, trigger a run, see it done."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.support.paths import RAW, REPO
from tests.support.prefect_cli import API, PREFECT, run

pytestmark = pytest.mark.slow


def test_prefect_yaml_deploys_and_an_adhoc_build_runs_on_a_worker(prefect_server, tmp_path):
    api, env = prefect_server
    declared = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    assert API.post(f"{api}/work_pools/", json={"name": "trajforge", "type": "process"}).status_code == 201
    run([PREFECT, "--no-prompt", "deploy", "--all"], env)

    deployments = API.post(f"{api}/deployments/filter", json={}).json()
    flows = {f["id"]: f["name"] for f in API.post(f"{api}/flows/filter", json={}).json()}
    found = {f"{flows[d['flow_id']]}/{d['name']}": d for d in deployments}
    assert set(found) == {"synthesize/nightly", "synthesize/adhoc", "build-dataset/after-synthesis",
                          "release/after-build", "release/adhoc", "build-and-release/weekly", "build-dataset/adhoc"}
    assert len(declared) == 7
    crons = {name: [s["schedule"]["cron"] for s in d["schedules"]] for name, d in found.items()}
    assert crons == {"synthesize/nightly": ["0 2 * * *"], "build-and-release/weekly": ["0 4 * * 1"],
                     **{name: [] for name in found if name not in ("synthesize/nightly", "build-and-release/weekly")}}
    # Synthesis writes where the scheduled and the chained builds read; the release reads what the build wrote.
    assert found["synthesize/nightly"]["parameters"]["out"] == found["build-dataset/after-synthesis"]["parameters"][
        "synthetic"] == found["build-and-release/weekly"]["parameters"]["synthetic"]
    assert found["build-dataset/after-synthesis"]["parameters"]["out"] == found["release/after-build"]["parameters"][
        "folder"]
    # The triggers are automations on the server, one per chained step; each starts its deployment
    # on the folder the triggering run wrote (a template the server renders from that run).
    automations = {a["name"]: a for a in API.post(f"{api}/automations/filter", json={}, timeout=60).json()}
    assert {"trajforge: build after synthesis", "trajforge: release after build"} <= set(automations)
    assert automations["trajforge: build after synthesis"]["actions"][0]["parameters"] == {
        "synthetic": "{{ flow_run.parameters.out }}"}
    assert automations["trajforge: release after build"]["actions"][0]["parameters"] == {
        "folder": "{{ flow_run.parameters.out }}"}

    out = tmp_path / "adhoc"
    sources = json.dumps({"openmanus_rl": str(RAW / "openmanus_rl")})
    triggered = run([PREFECT, "deployment", "run", "build-dataset/adhoc", "-p", f"sources={sources}",
                     "-p", f"out={out}"], env)
    run_id = next(line.split()[-1] for line in triggered.stdout.splitlines() if "UUID" in line)
    # A worker picks the run up, runs it in a subprocess from the checkout, and exits.
    run([PREFECT, "worker", "start", "--pool", "trajforge", "--run-once"], env, timeout=240)

    state = API.get(f"{api}/flow_runs/{run_id}").json()["state"]
    assert state["type"] == "COMPLETED", state
    report = json.loads((out / "report.json").read_text())
    assert report["sources"]["openmanus_rl"]["read"] > 0
    assert (out / "manifest.json").exists() and (out / "README.md").exists()
