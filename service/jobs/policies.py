"""RabbitMQ policies for the gateway's queues: what used to be queue arguments.

A queue argument is fixed at declaration: changing it (a new length cap, a dead-letter exchange)
makes every later declaration fail with PRECONDITION_FAILED until the queue is deleted. A policy
applies to live queues and can be changed at any time, so the queues are declared with their type
only and these policies carry the rest:

* ``<prefix>-work`` (the quorum queues workers consume: ``<prefix>.work`` and each model's
  ``<prefix>.work.<model>``): ``delivery-limit`` (a message that crashed or hung that many
  workers is dead-lettered with reason ``delivery_limit`` instead of being
  redelivered for ever) and ``dead-letter-exchange`` (``<prefix>.dead``);
* ``<prefix>-webhooks`` (the quorum queue of webhook deliveries): the same ``delivery-limit`` and
  ``dead-letter-exchange``, for a delivery that keeps crashing the workers that take it;
* ``<prefix>-results``: ``max-length`` with ``overflow: drop-head`` (a capped audit trail; the
  gateway also declares the queue with that cap as arguments, so it holds without the policy);
* ``<prefix>-ingest`` (each ``gateway ingest`` run's results queue): ``expires``, the time an
  interrupted run's queue is kept unused (also declared as an argument by the run itself; the
  policy covers the queues of earlier versions, declared without it);
* ``<prefix>-idempotency`` (the stream of idempotency claims): ``max-age``, the keys' TTL.

``gateway queues policies`` prints them as ``rabbitmqctl set_policy`` commands, or applies them
through the management HTTP API (``--apply URL``; idempotent, used by the compose file and the
Kubernetes worker's init container).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

import aiohttp

from service.jobs.topology import RESULTS_CAP, Names


@dataclass(frozen=True)
class Policy:
    name: str
    pattern: str
    apply_to: str
    definition: dict[str, Any] = field(hash=False)
    priority: int = 10


def gateway_policies(
    names: Names,
    delivery_limit: int,
    results_cap: int = RESULTS_CAP,
    idempotency_ttl: float = 86400.0,
    ingest_ttl: float = 7 * 86400.0,
) -> list[Policy]:
    prefix = re.escape(names.prefix)
    return [
        Policy(
            f"{names.prefix}-work",
            f"^{prefix}\\.work(\\.[a-z0-9][a-z0-9_.-]*)?$",  # <prefix>.work and <prefix>.work.<model>
            "queues",  # "quorum_queues" is RabbitMQ 3.12+; the pattern names work queues only
            {"delivery-limit": delivery_limit, "dead-letter-exchange": names.dead},
        ),
        Policy(
            f"{names.prefix}-webhooks",
            f"^{prefix}\\.webhooks$",
            "queues",
            {"delivery-limit": delivery_limit, "dead-letter-exchange": names.dead},
        ),
        Policy(
            f"{names.prefix}-results",
            f"^{prefix}\\.results$",
            "queues",
            {"max-length": results_cap, "overflow": "drop-head"},
        ),
        Policy(
            f"{names.prefix}-ingest",
            f"^{prefix}\\.ingest\\.[0-9a-f]{{16}}$",
            "queues",
            {"expires": max(1, round(ingest_ttl * 1000))},
        ),
        Policy(
            f"{names.prefix}-idempotency",
            f"^{prefix}\\.idempotency$",
            "queues",
            {"max-age": f"{max(1, int(idempotency_ttl))}s"},
        ),
    ]


def rabbitmqctl_commands(policies: list[Policy], vhost: str = "/") -> list[list[str]]:
    return [
        [
            "rabbitmqctl",
            "set_policy",
            "--vhost",
            vhost,
            "--priority",
            str(p.priority),
            "--apply-to",
            p.apply_to,
            p.name,
            p.pattern,
            json.dumps(p.definition, sort_keys=True),
        ]
        for p in policies
    ]


def shell_lines(policies: list[Policy], vhost: str = "/") -> str:
    return "\n".join(shlex.join(command) for command in rabbitmqctl_commands(policies, vhost))


async def apply(management_url: str, policies: list[Policy], vhost: str = "/") -> None:
    """PUT each policy through the management API (``http://user:pass@host:15672``)."""
    parts = urlsplit(management_url)
    auth = aiohttp.BasicAuth(parts.username or "guest", parts.password or "guest")
    base = f"{parts.scheme}://{parts.hostname}:{parts.port or 15672}{parts.path.rstrip('/')}"
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(auth=auth, timeout=timeout) as session:
        for p in policies:
            url = f"{base}/api/policies/{quote(vhost, safe='')}/{quote(p.name, safe='')}"
            body = {"pattern": p.pattern, "apply-to": p.apply_to, "definition": p.definition, "priority": p.priority}
            async with session.put(url, json=body) as response:
                if response.status not in (201, 204):
                    raise RuntimeError(
                        f"{p.name}: the management API answered {response.status}: {await response.text()}"
                    )
