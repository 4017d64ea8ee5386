"""Models found in Triton's repository index, added to a models file's (its ``[triton]`` table):
each served on Triton under its name, as the built-in profile the table names."""

from __future__ import annotations

from typing import Any

from service.backends.capabilities import capabilities_of
from service.serving.catalog import MAX_MODELS, MAX_VERSIONS, NAME, VERSION, Catalog, parse_catalog
from service.settings import Settings


def with_discovered(
    catalog: Catalog, found: list[tuple[str, str, str]], settings: Settings
) -> tuple[Catalog, list[str]]:
    """``catalog`` with the models of Triton's index ``found`` ((name, version, state); version ""
    when Triton lists a model without one) that the file does not serve already (by name, or as a
    file model's ``triton_model``): each served on Triton under its name, every version it has
    (the highest 8), the traffic on the highest READY one (else the highest). Also the names not
    served: not a valid model name, or beyond the 32 models."""
    assert catalog.discovery is not None
    discovery = catalog.discovery
    named = set(catalog.table.get("models", {}))
    served_there = {
        v.settings.triton_model for m in catalog.models for v in m.versions if capabilities_of(v.settings).on_triton
    }
    versions: dict[str, dict[str, str]] = {}
    skipped = []
    for name, version, state in found:
        if not NAME.fullmatch(name):
            skipped.append(name)
        elif name not in named and name not in served_there:
            known = versions.setdefault(name, {})
            if VERSION.fullmatch(version):
                known[version] = state
    room = MAX_MODELS - len(named)
    skipped += sorted(versions)[room:]
    made: dict[str, Any] = {}
    for name, states in sorted(versions.items())[:room]:
        entry: dict[str, Any] = {
            "profile": discovery.profile,
            "backend": "triton",
            "triton_url": discovery.url,
            "triton_protocol": discovery.protocol,
            "triton_shared_memory": False,
            "share": discovery.share,
        }
        if states:
            chosen = sorted(states, key=int)[-MAX_VERSIONS:]
            ready = [v for v in chosen if states[v] == "READY"]
            taking = (ready or chosen)[-1]
            entry["versions"] = {v: {"traffic": 1 if v == taking else 0} for v in chosen}
        made[name] = entry
    if not made:
        return catalog, skipped
    table = {**catalog.table, "models": {**catalog.table.get("models", {}), **made}}
    fresh = parse_catalog(table, settings, f"Triton at {discovery.url}", base=catalog.base)
    return Catalog(fresh.models, fresh.default, fresh.discovery, catalog.table, made, catalog.base), skipped
