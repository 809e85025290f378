"""An automation that notifies when a trajforge flow run fails or crashes.

Deployment triggers in prefect.yaml can only start deployments, so the notification is an
automation of its own, sent through a notification block you create first (Slack, email, a
custom webhook, ... in the UI or with `prefect block create`):

    python -m trajforge.flows.notify slack-webhook/trajforge-alerts

creates (or replaces) the automation `trajforge: notify on failed run` on the server of
PREFECT_API_URL. It fires on every Failed or Crashed run of the trajforge flows, deployed or not.
To see it work on a real server, make a run fail, for example
`prefect deployment run synthesize/adhoc -p tasks=/nonexistent.json`: the notification names the flow
run, its state and message.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
from datetime import timedelta

from prefect import Flow, get_client
from prefect.events.actions import SendNotification
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

AUTOMATION = "trajforge: notify on failed run"
SUBJECT = "trajforge: {{ flow.name }} run {{ flow_run.name }} {{ flow_run.state.name }}"
BODY = ("Flow run {{ flow_run.name }} of {{ flow.name }} ended {{ flow_run.state.name }}: "
        "{{ flow_run.state.message }}\nFlow run id: {{ flow_run.id }}")


def trajforge_flows() -> list[str]:
    """The name of every flow defined in trajforge.flows: a new flow is covered without a list to keep."""
    import trajforge.flows

    names = set()
    for module in pkgutil.iter_modules(trajforge.flows.__path__):
        found = vars(importlib.import_module(f"trajforge.flows.{module.name}")).values()
        names.update(obj.name for obj in found if isinstance(obj, Flow))
    return sorted(names)


def failure_automation(block_document_id) -> AutomationCore:
    return AutomationCore(
        name=AUTOMATION,
        description="Notify when a trajforge flow run fails or crashes (flows/notify.py).",
        trigger=EventTrigger(
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={"prefect.resource.role": "flow", "prefect.resource.name": trajforge_flows()},
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[SendNotification(block_document_id=block_document_id, subject=SUBJECT, body=BODY)])


def install(block_slug: str) -> str:
    """Create the automation for the notification block `type-slug/name`, replacing an earlier one."""
    block_type, _, name = block_slug.partition("/")
    if not name:
        raise ValueError(f"give the block as TYPE/NAME (e.g. slack-webhook/alerts), not {block_slug!r}")
    with get_client(sync_client=True) as client:
        block = client.read_block_document_by_name(name, block_type)
        for old in client.read_automations_by_name(AUTOMATION):
            client.delete_automation(old.id)
        return str(client.create_automation(failure_automation(block.id)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("block", help="the notification block, TYPE/NAME (as `prefect block ls` shows it)")
    args = parser.parse_args()
    print(f"created automation {AUTOMATION!r} with id {install(args.block)}")


if __name__ == "__main__":
    main()
