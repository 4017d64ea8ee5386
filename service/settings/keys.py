"""API keys and their quotas, as the settings give them (``GATEWAY_API_KEYS``, ``GATEWAY_API_KEYS_FILE``):
``KEY [rate=R] [burst=B] [concurrency=C] [models=A|B] [rate@MODEL=R]`` entries."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from service.settings.values import MODEL_NAME, read_regular_file, setting_name

OPTIONS = ("rate", "burst", "concurrency", "models")
MODEL_RATE = "rate@"
"""``rate@MODEL=R``: the key's own rate on one model, within its overall ``rate``."""
MAX_CONCURRENCY = 256
"""The most requests a key may be allowed in progress (its slots; 0 means unlimited): refusing a
request at the limit asks about every slot, a few microseconds each (``python -m loadtests.quota_cost``)."""


@dataclass(frozen=True)
class Quota:
    rate: float = 0.0
    """Images per second (0: unlimited)."""
    burst: float = 0.0
    """Images a key may send at once after being idle (0: one second's worth, and at least one
    request's most images)."""
    concurrency: int = 0
    """Requests in progress at once (0: unlimited)."""

    models: frozenset[str] | None = None
    """The models the key may use (None: every one)."""
    model_rates: tuple[tuple[str, float], ...] = ()
    """Images per second on a model, within ``rate`` (``rate@MODEL=R``)."""

    @property
    def limited(self) -> bool:
        return self.rate > 0 or self.concurrency > 0 or bool(self.model_rates)


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    quota: Quota = Quota()

    @property
    def id(self) -> str:
        return hashlib.sha256(self.secret).hexdigest()[:12]


def parse_keys(entries: Iterable[str], default: Quota) -> list[ApiKey]:
    """``KEY [rate=R] [burst=B] [concurrency=C] [models=A|B] [rate@MODEL=R]`` entries; blank ones
    and ``#`` comments skipped."""
    keys = []
    for entry in entries:
        words = entry.split()
        if not words or words[0].startswith("#"):
            continue
        secret, options = words[0], words[1:]
        values: dict[str, object] = {}
        rates: dict[str, float] = {}
        for option in options:
            name, sep, value = option.partition("=")
            if sep and name == "models":
                allowed = frozenset(value.split("|"))
                if not value or not all(MODEL_NAME.fullmatch(model) for model in allowed):
                    raise ValueError(f"API key entry option {option!r}: models=NAME|NAME..., model names")
                values["models"] = allowed
                continue
            if sep and name.startswith(MODEL_RATE) and MODEL_NAME.fullmatch(name.removeprefix(MODEL_RATE)):
                try:
                    rate = float(value)
                except ValueError:
                    raise ValueError(f"API key entry option {option!r} is not a number") from None
                if not 0 < rate < float("inf"):
                    raise ValueError(f"API key entry option {option!r} must be a rate above 0")
                rates[name.removeprefix(MODEL_RATE)] = rate
                continue
            if not sep or name not in OPTIONS:
                raise ValueError(
                    f"API key entry option {option!r}: expected rate=, burst=, concurrency=, models= or "
                    f"rate@MODEL= (key {ApiKey(secret.encode()).id})"
                )
            try:
                number = int(value) if name == "concurrency" else float(value)
            except ValueError:
                raise ValueError(f"API key entry option {option!r} is not a number") from None
            if not 0 <= number < float("inf"):
                raise ValueError(f"API key entry option {option!r} is negative, or not finite")
            values[name] = number
        values["model_rates"] = tuple(sorted(rates.items()))
        key = ApiKey(secret.encode(), replace(default, **values))  # type: ignore[arg-type]
        if key.quota.concurrency > MAX_CONCURRENCY:
            raise ValueError(
                f"API key {key.id}: concurrency {key.quota.concurrency} is over {MAX_CONCURRENCY}, the most; "
                "0 means unlimited"
            )
        keys.append(key)
    return keys


MAX_KEYS_FILE_BYTES = 64 * 1024 * 1024
"""The largest ``api_keys_file`` read (about 800,000 keys with quotas)."""


def read_keys_file(path: Path) -> str:
    """The text of ``api_keys_file``: a regular file (not a FIFO, a device or a directory, which
    would block the start or fill the memory) of at most MAX_KEYS_FILE_BYTES of UTF-8."""
    return read_regular_file(path, MAX_KEYS_FILE_BYTES, setting_name("api_keys_file"))
