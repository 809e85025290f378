"""The sha256 of every file a build published, to state that two builds are byte-identical.

Usage: python bench/build_digest.py OUT > digest.json
       python bench/build_digest.py OUT --against digest.json   (exit 1 when a file differs)

Files come from the build's manifest. The dataset card (README.md) names the code version (a hash
of the pipeline's code) and the build id (which includes it): both are replaced by a placeholder
before hashing, so a build by changed code compares on its data. The manifest itself is left out:
it is the list of these files' digests.

The digests of the builds the benches make are kept in the repository, so that any checkout on any
machine can state its builds byte-identical to the last ones whose bytes changed on purpose:
`bench/digests/generated-N.json` for `bench/bench_build.py N`'s corpus (the default fixtures; the bench
compares its build with it), `generated-N-seedS.json` for the corpus of its `--seed S`, and
`tests/build/fixtures_build_digest.json` for the fixture build (a test compares the suite's fixture
build with it). A change that alters the published bytes on purpose writes them again: `python
bench/build_digest.py OUT > FILE`, where OUT is the bench's build (`--work DIR --keep`: DIR/build) or
`python bench/profile_build.py fixtures --work DIR`'s (DIR/build).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
REFERENCES = REPO / "bench" / "digests"

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


def differing(found: dict[str, str], earlier: dict[str, str]) -> list[str]:
    """The files whose digest differs between two builds, or that only one of them published."""
    return sorted(rel for rel in found.keys() | earlier.keys() if found.get(rel) != earlier.get(rel))


def comparison(found: dict[str, str], earlier: dict[str, str]) -> list[str]:
    """Lines that say how `found` compares with `earlier`: each file that differs, then the count."""
    differ, files = differing(found, earlier), len(found.keys() | earlier.keys())
    return ([f"differs: {rel} ({earlier.get(rel, 'absent')[:12]} -> {found.get(rel, 'absent')[:12]})" for rel in differ]
            + [f"{files - len(differ)} of {files} files identical"])


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
    print("\n".join(comparison(found, earlier)))
    sys.exit(1 if differing(found, earlier) else 0)


if __name__ == "__main__":
    main()
