"""Driving wrk (a C load generator, so the client's own cost does not distort a ratio) and reading
its output: what ``loadtests.serving_path`` and ``loadtests.gpu_figures`` share."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

POST_BODIES = r"""
-- POST /classify with each body file of $GW_BODIES (comma-separated) in turn, as $GW_CTYPE;
-- done() prints "refused STATUS N" per thread for answers other than 200, and one such body.
local reqs = {}
local i = 0
init = function(args)
  local ctype = os.getenv("GW_CTYPE")
  for path in string.gmatch(os.getenv("GW_BODIES"), "[^,]+") do
    local f = assert(io.open(path, "rb"))
    local body = f:read("*a")
    f:close()
    table.insert(reqs, wrk.format("POST", "/classify", {["Content-Type"] = ctype}, body))
  end
end
request = function()
  i = i % #reqs + 1
  return reqs[i]
end
refused = {}
sample = nil
response = function(status, headers, body)
  if status ~= 200 then
    refused[status] = (refused[status] or 0) + 1
    sample = sample or body
  end
end
local threads = {}
setup = function(thread)
  table.insert(threads, thread)
end
done = function(summary, latency, requests)
  for _, thread in ipairs(threads) do
    for status, n in pairs(thread:get("refused")) do
      io.write(string.format("refused %d %d\n", status, n))
    end
    local body = thread:get("sample")
    if body then
      io.write("sample " .. string.sub(body, 1, 300) .. "\n")
    end
  end
end
"""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    """Answers received (whatever their status)."""
    seconds: float
    latency_ms: dict[int, float]
    """Latency percentiles (50, 75, 90, 99) from ``--latency``."""
    non_2xx: int
    timeouts: int
    refused: dict[str, int] = field(default_factory=dict)
    """Answers other than 200 by status, as ``POST_BODIES`` counts them."""
    refused_sample: str | None = None

    @property
    def failed(self) -> int:
        return self.non_2xx + self.timeouts

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def duration(text: str) -> float:
    """Seconds in one of wrk's durations (``850.00us``, ``1.56s``, ``2.1m``)."""
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}[unit]


def parse(out: str) -> WrkResult:
    """What ``wrk --latency`` printed (and ``POST_BODIES``'s counts of refusals, if it ran)."""
    match = re.search(r"(\d+) requests in ([\d.]+(?:us|ms|s|m)),", out)
    if match is None:
        raise ValueError(f"not wrk's output: {out[-500:]}")
    percentiles = re.findall(r"^\s+(50|75|90|99)(?:\.000)?%\s+(\S+)", out, re.M)
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    timeouts = re.search(r"Socket errors: connect \d+, read \d+, write \d+, timeout (\d+)", out)
    refused: dict[str, int] = {}
    for status, n in re.findall(r"^refused (\d+) (\d+)$", out, re.M):
        refused[status] = refused.get(status, 0) + int(n)
    sample = re.search(r"^sample (.*)$", out, re.M)
    return WrkResult(
        requests=int(match.group(1)),
        seconds=duration(match.group(2)),
        latency_ms={int(q): 1000 * duration(v) for q, v in percentiles},
        non_2xx=int(non_2xx.group(1)) if non_2xx else 0,
        timeouts=int(timeouts.group(1)) if timeouts else 0,
        refused=refused,
        refused_sample=sample.group(1) if sample else None,
    )
