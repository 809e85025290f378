"""The sha256 of every file a build published, to state that two builds are byte-identical.

Usage: python bench/build_digest.py OUT > digest.json
       python bench/build_digest.py OUT --against digest.json   (exit 1 when a file differs)

Files come from the build's manifest. The dataset card (README.md) names the code version (a hash
of the pipeline's code) and the build id (which includes it): both are replaced by a placeholder
before hashing, so a build by changed code compares on its data. The manifest itself is left out:
it is the list of these files' digests.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trajforge.pipeline.publish.manifest import read_manifest  # noqa: E402

CARD = "README.md"


def digests(out: Path) -> dict[str, str]:
    manifest = read_manifest(out)
    found = {}
    for rel in sorted(manifest["files"]):
        data = (out / rel).read_bytes()
        if rel == CARD:
            text = data.decode()
            for version in {line.split("`")[1] for line in text.splitlines() if "code version" in line.lower()
                            and line.count("`") >= 2}:
                text = text.replace(version, "<code version>")
            data = text.replace(manifest["build_id"], "<build id>").encode()
        found[rel] = hashlib.sha256(data).hexdigest()
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--against", type=Path, default=None, help="a digest printed earlier by this script")
    args = p.parse_args()
    found = digests(args.out)
    if args.against is None:
        print(json.dumps(found, indent=1, sort_keys=True))
        return
    earlier = json.loads(args.against.read_text())
    differ = sorted(rel for rel in found.keys() | earlier.keys() if found.get(rel) != earlier.get(rel))
    for rel in differ:
        print(f"differs: {rel} ({earlier.get(rel, 'absent')[:12]} -> {found.get(rel, 'absent')[:12]})")
    print(f"{len(found) - len(differ)} of {len(found | earlier)} files identical")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
