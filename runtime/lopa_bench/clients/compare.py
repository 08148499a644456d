"""A client's report against lopa's own numbers over the same window, as pass/fail checks."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lopa_bench.clients.probe import ProbeAnswer
from lopa_bench.clients.results import ClientRun
from lopa_bench.clients.served import LopaCounters
from lopa_bench.clients.vllm_metrics import MetricsAnswer

TOLERANCE = 0.10  # TTFT / TPOT: |client - lopa| / lopa


@dataclass(frozen=True)
class Check:
    subject: str  # a client, "probe" or "/metrics"
    name: str
    measured: str  # the client's (or the probe's) value
    expected: str  # lopa's value, or what the check wants
    ok: bool
    detail: str = ""
    required: bool = True  # False: shown for diagnosis, not part of the verdict

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(value: float | None, unit: str = "") -> str:
    if value is None:
        return "-"
    if unit == "ms":
        return f"{1000 * value:.2f} ms"
    return f"{value:g}"


def _within(client: float | None, lopa: float | None, tolerance: float) -> tuple[bool, str]:
    if client is None or lopa is None or lopa <= 0:
        return False, "not measured" if client is None else "lopa recorded none"
    off = (client - lopa) / lopa
    return abs(off) <= tolerance, f"{100 * off:+.1f} % (limit ±{100 * tolerance:.0f} %)"


def client_checks(run: ClientRun, lopa: LopaCounters, tolerance: float = TOLERANCE,
                  fixed_length: bool = True) -> list[Check]:
    """`fixed_length`: the run asked exact lengths (ignore_eos), so a shorter answer fails; without
    it an answer may end at EOS, and the lengths are shown only."""
    name = run.client
    status = "timed out" if run.exit_status is None else f"exit status {run.exit_status}"
    ran = Check(name, "client exit", status, "exit status 0", run.exit_status == 0, f"log: {run.log}")
    if run.error:
        return [ran, Check(name, "client report", run.error, "a readable report", False, run.report)]
    outcomes = ", ".join(f"{k} {v:g}" for k, v in lopa.requests.items() if v) or "none"
    failures = "; ".join(f"{label}: {f.count} ({' | '.join(f.messages[:2])})"
                         for label, f in run.failures.items())
    checks = [
        ran,
        Check(name, "failed requests", str(run.failed), "0", run.failed == 0, failures),
        Check(name, "successful requests", str(run.ok), f"{lopa.requests.get('ok', 0):g} ok",
              run.ok > 0 and run.ok == lopa.requests.get("ok", 0),
              f"lopa outcomes: {outcomes}; client-cancelled at the end: {run.incomplete}"),
        Check(name, "output tokens (client total)", _num(run.output_tokens),
              f"{lopa.generated_tokens:g} (lopa_generated_tokens_total)",
              run.ok > 0 and run.output_tokens == lopa.generated_tokens),
    ]
    if run.output_tokens_client is not None:
        # Text drops special tokens (an EOS that ends an answer, those generated past it under
        # ignore_eos) that usage counts: shown, not judged. inference-perf divides its TPOT by this.
        checks.append(Check(name, "output tokens re-tokenized by the client", _num(run.output_tokens_client),
                            f"{_num(run.usage_output_tokens)} (usage)",
                            run.ok > 0 and run.output_tokens_client == run.usage_output_tokens,
                            "the client's TPOT divides by this count", required=False))
    checks.append(Check(name, "requests not given exactly max_tokens", str(run.not_exact), "0",
                        run.ok > 0 and run.not_exact == 0 and run.asked_tokens is not None,
                        f"asked {_num(run.asked_tokens)} tokens in all, got {_num(run.usage_output_tokens)}",
                        required=fixed_length))
    ok, detail = _within(run.ttft_s, lopa.ttft_mean_s, tolerance)
    checks.append(Check(name, "TTFT mean", _num(run.ttft_s, "ms"),
                        f"{_num(lopa.ttft_mean_s, 'ms')} (lopa_time_to_first_token_seconds)", ok, detail))
    ok, detail = _within(run.tpot_s, lopa.tpot_mean_s, tolerance)
    checks.append(Check(name, "TPOT mean", _num(run.tpot_s, "ms"),
                        f"{_num(lopa.tpot_mean_s, 'ms')} (lopa_time_per_output_token_seconds)", ok, detail))
    return checks


def probe_checks(answers: Sequence[ProbeAnswer], used: Collection[str]) -> list[Check]:
    """Judged: the client's own bodies for the settings the run uses (`used`: "<client>:<setting>");
    the rest are shown."""
    out = []
    for a in answers:
        got = f"HTTP {a.status}" + (f", {a.completion_tokens} tokens ({a.finish_reason})"
                                    if a.completion_tokens is not None else "")
        out.append(Check("probe", a.name, got, f"HTTP 200, {a.max_tokens} tokens",
                         a.status == 200 and a.error is None and a.exact is not False, a.error or "",
                         required=a.default and a.setting in used))
    return out


def metrics_checks(answer: MetricsAnswer, model: str) -> list[Check]:
    if answer.status != 200:
        got = f"HTTP {answer.status}" if answer.status else "no answer"
        return [Check("/metrics", f"GET {answer.url}", got, "HTTP 200 with vLLM's names", False)]
    return [Check("/metrics", s.name, "labelled" if s.labelled else ("unlabelled" if s.present else "absent"),
                  f'model_name="{model}"', s.labelled, f"{s.kind}, read by {s.readers}", required=s.required)
            for s in answer.series]


def passed(checks: Sequence[Check]) -> bool:
    return all(c.ok for c in checks if c.required)


def table(checks: Sequence[Check]) -> str:
    header = ("", "subject", "check", "measured", "expected", "detail")
    rows = [header] + [("ok" if c.ok else "FAIL" if c.required else "info", c.subject, c.name, c.measured,
                        c.expected, c.detail) for c in checks]
    widths = [min(60, max(len(r[i]) for r in rows)) for i in range(len(header) - 1)]
    lines = []
    for r in rows:
        cells = [r[i][:60].ljust(widths[i]) for i in range(len(widths))] + [r[-1][:400]]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "-" * min(160, sum(widths) + 2 * len(widths)))
    return "\n".join(lines)
