"""What an environment lacks for a set of requirements: every requirement in their closure (each
installed distribution's own requirements, extras followed) that no installed distribution
satisfies, missing or at the wrong version. All of them at once, where pip stops at the first.

    python scripts/requirements_gap.py 'vllm==0.26.0'            # exit 1 and the list if any
    python scripts/requirements_gap.py --json 'qla-serving[vllm]'

The GPU machine's image plus the engine bundles is not the engine's Docker image (the bundles
carry what vLLM imports, not everything its metadata asks for); docker_replay.sh prints this list
there before it decides how to install.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # an image without packaging: pip's copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name


def _installed() -> dict[str, md.Distribution]:
    """The first distribution of each name on sys.path (the one that imports)."""
    found: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


def gaps(requirements: list[str], installed: dict[str, md.Distribution] | None = None, *,
         direct: bool = False) -> list[dict]:
    """Requirements in the closure of ``requirements`` that the environment does not satisfy.

    requirements: PEP 508 strings (extras and markers allowed).
    installed: canonical name -> distribution (default: this interpreter's).
    direct: follow only the roots' own requirements (what installing the roots asks of the
        environment), not theirs in turn.
    Returns one dict per unsatisfied requirement: ``requirement`` (as written), ``needed_by``
    (the distribution that asks, or ``""`` for a root), ``installed`` (the version found, or None).
    Only satisfied requirements are followed further.
    """
    installed = _installed() if installed is None else installed
    todo = [(Requirement(r), "", frozenset([""]), 0) for r in requirements]
    seen: set[tuple] = set()
    missing: list[dict] = []
    while todo:
        req, parent, parent_extras, depth = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in parent_extras):
            continue
        name = canonicalize_name(req.name)
        key = (name, str(req.specifier), tuple(sorted(req.extras)))
        if key in seen:
            continue
        seen.add(key)
        dist = installed.get(name)
        version = dist.version if dist is not None else None
        if version is None or not req.specifier.contains(version, prereleases=True):
            missing.append({"requirement": str(req), "needed_by": parent, "installed": version})
            continue
        if direct and depth == 1:
            continue
        extras = frozenset([""] + sorted(req.extras))
        for sub in dist.requires or []:
            todo.append((Requirement(sub), f"{dist.metadata['Name']} {version}", extras, depth + 1))
    return sorted(missing, key=lambda m: m["requirement"].lower())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("requirements", nargs="+")
    p.add_argument("--json", action="store_true", help="the list as JSON")
    p.add_argument("--direct", action="store_true", help="only the requirements' own requirements")
    args = p.parse_args(argv)
    found = gaps(args.requirements, direct=args.direct)
    if args.json:
        print(json.dumps(found, indent=1))
    else:
        for m in found:
            have = f"has {m['installed']}" if m["installed"] else "missing"
            print(f"{m['requirement']}  ({have}; needed by {m['needed_by'] or 'the request'})")
        print(f"{len(found)} requirement(s) of {' '.join(args.requirements)} not satisfied here")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
