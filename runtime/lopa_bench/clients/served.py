"""`lopa serve` as a subprocess for the clients, and the master's own counters read around a run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from lopa.serving.ports import free_ports

TTFT = "lopa_time_to_first_token_seconds"
TPOT = "lopa_time_per_output_token_seconds"


@dataclass(frozen=True)
class ServeOptions:
    workers: int = 2
    branches: int = 3
    model: str | None = None  # checkpoint directory (default: the bundled model)
    api_key: str | None = None  # `lopa serve --api-key`: the clients send it as a Bearer token
    start_timeout_s: float = 600.0


@dataclass
class LopaCounters:
    """The master's totals at one moment; a run's numbers are the difference of two."""

    requests: dict[str, float] = field(default_factory=dict)  # lopa_requests_total by outcome
    generated_tokens: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0

    def minus(self, before: LopaCounters) -> LopaCounters:
        outcomes = set(self.requests) | set(before.requests)
        return LopaCounters(
            requests={o: self.requests.get(o, 0.0) - before.requests.get(o, 0.0) for o in sorted(outcomes)},
            generated_tokens=self.generated_tokens - before.generated_tokens,
            ttft_sum=self.ttft_sum - before.ttft_sum, ttft_count=self.ttft_count - before.ttft_count,
            tpot_sum=self.tpot_sum - before.tpot_sum, tpot_count=self.tpot_count - before.tpot_count,
        )

    @property
    def ttft_mean_s(self) -> float | None:
        return self.ttft_sum / self.ttft_count if self.ttft_count else None

    @property
    def tpot_mean_s(self) -> float | None:
        return self.tpot_sum / self.tpot_count if self.tpot_count else None


def parse_counters(text: str) -> LopaCounters:
    counters = LopaCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "lopa_requests_total":
                counters.requests[sample.labels.get("outcome", "")] = sample.value
            elif sample.name == "lopa_generated_tokens_total":
                counters.generated_tokens = sample.value
            elif sample.name in (f"{TTFT}_sum", f"{TTFT}_count", f"{TPOT}_sum", f"{TPOT}_count"):
                kind = "ttft" if sample.name.startswith(TTFT) else "tpot"
                setattr(counters, f"{kind}_{sample.name.rsplit('_', 1)[1]}", sample.value)
    return counters


class ServedLopa:
    """`lopa serve --workers N --branches K --http-port P --metrics-port M` on free loopback ports,
    stopped (SIGTERM, then SIGKILL after 30 s) on exit; its output goes to `log_dir`/serve.log."""

    def __init__(self, options: ServeOptions, log_dir: Path) -> None:
        self.options, self.log_dir = options, log_dir
        self.http_port, self.metrics_port, grpc_port = free_ports(3)
        self.listen = f"127.0.0.1:{grpc_port}"
        self.process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def command(self) -> list[str]:
        o = self.options
        command = [sys.executable, "-m", "lopa", "serve", "--workers", str(o.workers), "--branches",
                   str(o.branches), "--http-port", str(self.http_port), "--metrics-port",
                   str(self.metrics_port), "--listen", self.listen, "--logs", str(self.log_dir)]
        command += ["--model", o.model] if o.model else []
        return command + (["--api-key", o.api_key] if o.api_key else [])

    def __enter__(self) -> ServedLopa:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = (self.log_dir / "serve.log").open("ab")
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        try:
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + self.options.start_timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"lopa serve exited with status {self.process.returncode} before serving; "
                                   f"see {self.log_dir / 'serve.log'}")
            if self.health() == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"lopa serve did not serve within {self.options.start_timeout_s:.0f} s; "
                           f"see {self.log_dir / 'serve.log'}")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as reply:
                return reply.status
        except urllib.error.HTTPError as error:
            return error.code
        except OSError:
            return None

    def models(self) -> list[str]:
        request = urllib.request.Request(f"{self.base_url}/v1/models", headers=auth(self.options.api_key))
        with urllib.request.urlopen(request, timeout=5) as reply:
            return [entry["id"] for entry in json.load(reply)["data"]]

    def counters(self) -> LopaCounters:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return parse_counters(reply.read().decode())

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)  # lopa serve stops its master and workers on SIGTERM
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def auth(api_key: str | None) -> dict[str, str]:
    """The header that carries the server's API key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
