"""Gateway settings: environment variables with the ``GATEWAY_`` prefix, overridden by CLI flags.

The fields live by concern in ``service.settings.fields``, those one model may set for itself in
``service.settings.model``; ``Settings`` combines them, checks the
rules that span them and derives the values computed from several. Names and value parsers are in
``values``, API keys in ``keys``, the reference and the explanation of refusals in ``reference``."""

from __future__ import annotations

import ipaddress
import os
from urllib.parse import urlsplit

from pydantic import field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.host.cpus import available_cpus
from service.schemas import MAX_URL_LENGTH
from service.settings.declared import DeclaredModelFields
from service.settings.fields import LimitsFields, OfflineFields, ServerFields, ServingFields
from service.settings.keys import ApiKey, Quota, parse_keys, read_keys_file
from service.settings.model import ModelFields
from service.settings.values import (
    ENV_PREFIX,
    MAX_INT,
    parse_delays,
    parse_secret,
    setting_name,
)

BROKER_ADDRESSES_AT_MOST = 16
JSON_BYTES_PER_URL = MAX_URL_LENGTH + 64
"""Room per image in the default bound of a JSON body: a URL of the longest length and the JSON
around it."""


RENAMED = {
    "GATEWAY_MAX_IMAGE_PIXELS": "GATEWAY_MAX_IMAGE_BYTES (decoder memory per image: an 8-bit RGB PNG takes "
    "6 bytes per pixel, a JPEG far less)",
    "GATEWAY_JOBS_CACHE_SIZE": "GATEWAY_JOBS_CACHE_BYTES and GATEWAY_JOBS_TTL",
}
"""Settings of earlier versions: still set, they would be ignored without a word."""


class Settings(
    LimitsFields, OfflineFields, DeclaredModelFields, ServingFields, ModelFields, ServerFields, BaseSettings
):
    """Every setting of a gateway process. The groups are listed last-first: pydantic takes the
    fields of the last base first, so the settings keep their documented order."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="forbid",
        use_attribute_docstrings=True,
        hide_input_in_errors=True,  # an error must not print the API keys, secrets or broker password it was given
        allow_inf_nan=False,  # a size or a timeout of inf or nan is a mistake, refused by name, not a crash later
    )

    def load_api_keys(self) -> list[ApiKey]:
        """Every configured key with its quota (empty: no authentication)."""
        entries = []
        if self.api_keys is not None:
            entries += self.api_keys.get_secret_value().split(",")
        if self.api_keys_file is not None:
            entries += read_keys_file(self.api_keys_file).splitlines()
        return parse_keys(entries, Quota(self.key_rate, self.key_burst, self.key_concurrency))

    @property
    def max_buffered_body_bytes_effective(self) -> int:
        return self.max_buffered_body_bytes or self.max_concurrent_requests * self.max_body_bytes

    @property
    def max_json_body_bytes_effective(self) -> int:
        return self.max_json_body_bytes or self.max_images_per_request * JSON_BYTES_PER_URL

    @property
    def max_decode_bytes_effective(self) -> int:
        return self.max_decode_bytes or 2 * self.max_image_bytes

    @property
    def webhook_key(self) -> bytes | None:
        """The bytes of ``webhook_secret``."""
        if self.webhook_secret is None:
            return None
        return parse_secret(self.webhook_secret.get_secret_value())

    @property
    def webhook_retry_delays_ms(self) -> tuple[int, ...]:
        """``webhook_retry_delays`` in milliseconds, each at least 1 ms."""
        return parse_delays(self.webhook_retry_delays)

    @property
    def prefetch(self) -> int:
        return self.worker_prefetch or min(self.max_batch_size * self.max_inflight_batches * 2, self.max_queue_size)

    @property
    def embedded_threads_per_batch(self) -> int:
        if self.embedded_threads:
            return self.embedded_threads
        return max(1, available_cpus() // self.max_inflight_batches)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_in_64_bits(cls, value: object) -> object:
        """Every number is handed to C somewhere (sockets, timers, arrays): one over a signed 64-bit
        integer is refused here by name, not met later as an OverflowError."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise ValueError(f"{value} is too large (at most 2**63 - 1)")
        return value

    @field_validator("host", mode="after")
    @classmethod
    def _a_host(cls, value: str) -> str:
        """An empty host binds every interface (asyncio reads '' as all of them): a template's unset
        variable must not publish the gateway; say 0.0.0.0 or :: to mean it."""
        if not value.strip() or value != value.strip():
            raise ValueError(f"{value!r} is not an address or a host name (0.0.0.0 or :: for every interface)")
        return value

    @field_validator("broker_url", mode="after")
    @classmethod
    def _broker_addresses(cls, value: str | None) -> str | None:
        """Each comma-separated part an amqp:// or amqps:// URL with a host; empty means unset. A bad
        part is named by its position, never echoed (it may hold a password)."""
        if value is None or not value.strip():
            return None
        parts = [part.strip() for part in value.split(",")]
        if len(parts) > BROKER_ADDRESSES_AT_MOST:
            raise ValueError(f"{len(parts)} broker addresses; at most {BROKER_ADDRESSES_AT_MOST}")
        for position, part in enumerate(parts, 1):
            where = f"broker address {position} of {len(parts)}"
            if not part:
                raise ValueError(f"{where} is empty (a stray comma?)")
            try:
                url = urlsplit(part)
                url.port  # noqa: B018 (parsing the port is the check)
            except ValueError:
                raise ValueError(f"{where} is not a URL") from None
            if url.scheme not in ("amqp", "amqps"):
                raise ValueError(f"{where} is not an amqp:// or amqps:// URL")
            if not url.hostname or any(c.isspace() or ord(c) < 32 for c in part):
                raise ValueError(f"{where} has no host, or a space or control character in it")
        return ",".join(parts)

    @field_validator(
        "webhook_secret",
        "models_file",
        "model_path",
        "labels",
        "models_root",
        "input_size",
        "mean",
        "std",
        "admin_key",
        "worker_heartbeat_file",
        "api_keys",
        "api_keys_file",
        mode="before",
    )
    @classmethod
    def _unset_when_empty(cls, value: object) -> object:
        """``GATEWAY_WEBHOOK_SECRET=`` (compose's default for an unset variable) means no webhooks;
        ``GATEWAY_MODELS_FILE=`` means no models file (``GATEWAY_MODEL_PATH=`` and the declaring
        settings, none); ``GATEWAY_WORKER_HEARTBEAT_FILE=`` no heartbeat file (as a path, empty was
        the current directory); ``GATEWAY_API_KEYS=`` and ``GATEWAY_API_KEYS_FILE=`` no keys."""
        return None if isinstance(value, str) and not value.strip() else value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        """Cross-field rules; each error names the settings by their flags and variables."""
        stale = [f"{old} is replaced by {new}" for old, new in RENAMED.items() if old in os.environ]
        if stale:
            raise ValueError("; ".join(stale))

        for name in ("url_allowlist", "webhook_allowlist"):
            for network in filter(None, (part.strip() for part in getattr(self, name).split(","))):
                try:
                    ipaddress.ip_network(network, strict=False)
                except ValueError as exc:
                    raise ValueError(f"{setting_name(name)}: {exc}") from None
        if (self.api_keys is not None or self.api_keys_file is not None) and not self.load_api_keys():
            # an unreadable file or a bad entry fails at start, by name (in load_api_keys); keys set
            # that hold none would serve every route without authentication, without a word
            given = [setting_name(name) for name in ("api_keys", "api_keys_file") if getattr(self, name) is not None]
            raise ValueError(
                f"{' and '.join(given)} hold no API key (only separators, blank lines or comments): the gateway "
                "would serve every route without authentication; give at least one key, or unset them to "
                "serve without keys"
            )
        if self.webhook_secret is not None:
            try:  # a bad secret fails at start, not at first use
                parse_secret(self.webhook_secret.get_secret_value())
            except ValueError as exc:
                raise ValueError(f"{setting_name('webhook_secret')}: {exc}") from None
        try:
            parse_delays(self.webhook_retry_delays)
        except ValueError as exc:
            raise ValueError(f"{setting_name('webhook_retry_delays')}: {exc}") from None
        self._at_least("max_buffered_body_bytes", "max_body_bytes", "or 0: a whole body must fit")
        self._at_least("max_decode_bytes", "max_image_bytes", "or 0: one image must fit")
        self._at_least("max_queue_size", "worker_prefetch", "a worker's batcher must hold every message it takes")
        self._at_least("max_queue_size", "max_images_per_request", "the largest request must fit in the queue")
        if self.model_path is not None and (self.models_file is not None or self.models.strip()):
            other = "models_file" if self.models_file is not None else "models"
            raise ValueError(
                f"{setting_name('model_path')} serves one model of your own and {setting_name(other)} names the "
                "models served: give one (a models file declares a model of your own with path = ...)"
            )
        if self.decoder != "opencv" and not self.torch_device.startswith("cuda"):
            raise ValueError(
                f"{setting_name('decoder')} {self.decoder} decodes on a GPU, and {setting_name('torch_device')} "
                "is cpu: give a cuda device, or the opencv decoder"
            )
        return self

    def _at_least(self, field: str, floor: str, why: str) -> None:
        """``field`` is at least ``floor``, where both are set (0 leaves a bound unset)."""
        value, least = getattr(self, field), getattr(self, floor)
        if value and least and value < least:
            raise ValueError(f"{setting_name(field)} ({value}) must be at least {setting_name(floor)} ({least}): {why}")
