"""One run end to end: the venvs, `lopa serve`, the probes, each client, the comparison, the report."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lopa_bench.clients import guidellm, inference_perf, probe, toolchain, vllm_metrics
from lopa_bench.clients.compare import (
    TOLERANCE,
    Check,
    client_checks,
    metrics_checks,
    passed,
    probe_checks,
    table,
)
from lopa_bench.clients.results import ClientRun, Load, Target
from lopa_bench.clients.served import LopaCounters, ServedLopa, ServeOptions

# The clients must find every file locally: no Hugging Face hub (the tokenizer is a directory).
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
SETTLE_S = 1.0  # after a client exits, for the requests it cancelled to be counted by the master
START_MARGIN_S = 300.0  # a client's run may take this long beyond its load (imports, tokenizer, drain)


@dataclass(frozen=True)
class Plan:
    out: Path
    clients: tuple[str, ...] = toolchain.CLIENTS
    load: Load = field(default_factory=Load)
    serve: ServeOptions = field(default_factory=ServeOptions)
    compat: bool = False  # the knobs that make the clients run against today's server (ignore_eos off)
    guidellm_endpoint: str = "chat"  # guidellm's own default; or "completions"
    inference_perf_streaming: bool = True  # inference-perf's default is False (no TTFT / TPOT)
    tolerance: float = TOLERANCE
    build: bool = True  # build missing venvs (else only locate them)


def settings(plan: Plan) -> set[str]:
    """The client settings this plan runs, named as the probes name theirs."""
    chosen = {"guidellm": f"guidellm:{plan.guidellm_endpoint}",
              "inference-perf": "inference-perf:" + ("streamed" if plan.inference_perf_streaming
                                                      else "unstreamed")}
    return {chosen[c] for c in plan.clients}


def tokenizer_dir(model: str | None) -> Path:
    if model:
        return Path(model)
    from lopa.engine import bundled_model_dir

    return Path(bundled_model_dir())


def client_env(work: Path) -> dict[str, str]:
    """This environment without lopa's venv and path, offline, with its own Hugging Face home."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return {**env, **OFFLINE, "HF_HOME": str(work / "hf-home")}


def run_client(name: str, venv: Path, target: Target, plan: Plan, work: Path) -> ClientRun:
    work.mkdir(parents=True, exist_ok=True)
    if name == guidellm.NAME:
        argv = guidellm.prepare(venv, target, plan.load, work, plan.guidellm_endpoint, plan.compat)
        parse = guidellm.parse
    else:
        argv = inference_perf.prepare(venv, target, plan.load, work, plan.inference_perf_streaming,
                                      plan.compat)
        parse = inference_perf.parse
    log = work / f"{name}.log"
    print(f"[bench clients] {name}: {' '.join(argv)} (log: {log})", flush=True)
    with log.open("wb") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=client_env(work),
                                  timeout=plan.load.seconds + START_MARGIN_S, check=False)
            status: int | None = done.returncode
        except subprocess.TimeoutExpired:
            status = None
    try:
        run = parse(work)
    except (OSError, ValueError, KeyError, TypeError) as error:
        run = ClientRun(name, error=f"no readable report ({type(error).__name__}: {error})")
    run.log, run.exit_status = str(log), status
    return run


def execute(plan: Plan) -> dict[str, Any]:
    """Runs the plan; returns the report (also written to plan.out/clients.json)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    venvs = toolchain.venvs(plan.clients, build=plan.build)  # before the server: a build takes minutes
    runs: list[ClientRun] = []
    deltas: dict[str, LopaCounters] = {}
    checks: list[Check] = []
    with ServedLopa(plan.serve, plan.out / "serve") as lopa:
        model = lopa.models()[0]
        target = Target(lopa.base_url, model, tokenizer_dir(plan.serve.model), plan.serve.api_key)
        probes = probe.default_probes(model, plan.load.output_tokens)
        answers = [probe.send(lopa.base_url, p, api_key=plan.serve.api_key) for p in probes]
        checks += probe_checks(answers, settings(plan))
        for name in plan.clients:
            before = lopa.counters()
            run = run_client(name, venvs[name], target, plan, plan.out / name)
            time.sleep(SETTLE_S)
            deltas[name] = lopa.counters().minus(before)
            runs.append(run)
            checks += client_checks(run, deltas[name], plan.tolerance, fixed_length=not plan.compat)
        served_metrics = vllm_metrics.check(lopa.base_url, model)
        checks += metrics_checks(served_metrics, model)
    report = {
        "plan": _plan_dict(plan), "model": model, "venvs": {k: str(v) for k, v in venvs.items()},
        "probes": [a.to_dict() for a in answers],
        "runs": [r.to_dict() for r in runs],
        "lopa": {name: {**asdict(d), "ttft_mean_s": d.ttft_mean_s, "tpot_mean_s": d.tpot_mean_s}
                 for name, d in deltas.items()},
        "metrics": {"url": served_metrics.url, "status": served_metrics.status,
                    "series": [asdict(s) for s in served_metrics.series]},
        "checks": [c.to_dict() for c in checks],
        "passed": passed(checks),
        "failed_checks": sum(1 for c in checks if c.required and not c.ok),
    }
    (plan.out / "clients.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(checks), flush=True)
    return report


def _plan_dict(plan: Plan) -> dict[str, Any]:
    out = asdict(plan)
    out["out"] = str(plan.out)
    return out
