"""Answers as long as asked, through the HTTP and the gRPC API, as benchmark clients measure them.

A real `lopa master` + 2 workers on the bundled model (block size 8). `ignore_eos` answers exactly
`max_tokens` tokens, none of them an end token; any `max_tokens` is honoured exactly, the answer
being the first tokens of the one decoded in whole blocks; /metrics on the HTTP port shows lopa's
names and vLLM's, agreeing; a full queue answers 429 with Retry-After.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lopa.bundled import tasks
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster

from .conftest import bundled_http_group

MODEL = "lopa-bundled"
BLOCK = 8
PROMPTS = [e.prompt for e in tasks.held_out(8)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, int]]:
    with bundled_http_group(tmp_path_factory.mktemp("length"), {"queue_size": 2, "max_batch": 2}) as group:
        yield group


@pytest.fixture(scope="module")
def api(served: tuple[LocalCluster, int]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def client(served: tuple[LocalCluster, int]) -> Iterator[LopaClient]:
    with LopaClient(served[0].address) as grpc_client:
        yield grpc_client


def whole_blocks(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


def test_ignore_eos_answers_exactly_max_tokens(api: openai.OpenAI, client: LopaClient) -> None:
    info = client.model_info()
    eos = client.generate(PROMPTS[0], timeout=60).token_ids[-1]  # the bundled answers end with it
    prompt_tokens = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1).usage.prompt_tokens
    most = (info.max_length - prompt_tokens) // BLOCK * BLOCK  # the model's maximum for this prompt
    for n in (1, 7, 8, 50, most):
        reply = client.generate(PROMPTS[0], timeout=120, max_new_tokens=n, ignore_eos=True)
        assert len(reply.token_ids) == n and eos not in reply.token_ids, n
        assert reply.finish_reason == "length" and reply.stats.tokens == n
        done = api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=n,
                                      extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == n and done.choices[0].finish_reason == "length"
        assert done.choices[0].text == reply.text
    chunks = list(client.stream(PROMPTS[1], timeout=120, max_new_tokens=50, ignore_eos=True))
    assert sum(len(c.token_ids) for c in chunks) == 50 and chunks[-1].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as refused:  # one token beyond what fits
        api.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=most + 1,
                               extra_body={"ignore_eos": True})
    assert refused.value.body["param"] == "max_tokens"
    assert f"at most {most}" in refused.value.body["message"]


def test_ignore_eos_false_changes_nothing(api: openai.OpenAI, client: LopaClient) -> None:
    for prompt in PROMPTS[:3]:
        plain = client.generate(prompt, timeout=60, branches=3)
        assert client.generate(prompt, timeout=60, branches=3, ignore_eos=False).token_ids == plain.token_ids
        body = {"model": MODEL, "prompt": prompt, "extra_body": {"branches": 3}}
        spelled = {"model": MODEL, "prompt": prompt, "extra_body": {"branches": 3, "ignore_eos": False,
                                                                     "min_tokens": 0}}
        assert api.completions.create(**body).choices[0].text == plain.text
        assert api.completions.create(**spelled).choices[0].text == plain.text


def test_every_max_tokens_is_honoured_exactly(api: openai.OpenAI, client: LopaClient) -> None:
    prompt = PROMPTS[2]
    references = {k: client.generate(prompt, timeout=60, max_new_tokens=k, branches=2).token_ids
                  for k in (8, 16, 24)}
    for n in range(1, 18):
        reference = list(references[whole_blocks(n)])[:n]
        reply = client.generate(prompt, timeout=60, max_new_tokens=n, branches=2)
        assert list(reply.token_ids) == reference, n
        streamed = [t for c in client.stream(prompt, timeout=60, max_new_tokens=n, branches=2)
                    for t in c.token_ids]
        assert streamed == reference, n
        done = api.completions.create(model=MODEL, prompt=prompt, max_tokens=n, extra_body={"branches": 2})
        assert done.usage.completion_tokens == len(reference) and done.choices[0].text == reply.text, n
        assert done.choices[0].finish_reason == ("length" if len(reference) == n else "stop")


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {sample.name + json.dumps(sample.labels, sort_keys=True): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_metrics_on_the_http_port_under_both_names(served: tuple[LocalCluster, int]) -> None:
    cluster, port = served
    label = json.dumps({"model_name": MODEL})
    twins = [("lopa_queue_depth{}", f"vllm:num_requests_waiting{label}"),
             ("lopa_requests_running{}", f"vllm:num_requests_running{label}"),
             ("lopa_kv_slot_usage{}", f"vllm:kv_cache_usage_perc{label}")]

    def load() -> None:
        with LopaClient(cluster.address) as one:
            one.generate(PROMPTS[3], timeout=120, branches=3, max_new_tokens=56)

    seen_busy = False
    with ThreadPoolExecutor(2) as pool:
        running = [pool.submit(load) for _ in range(2)]
        while not all(f.done() for f in running):
            samples = scrape(port)
            for lopa_name, vllm_name in twins:
                assert samples[lopa_name] == samples[vllm_name], (lopa_name, samples)
            seen_busy = seen_busy or samples["lopa_requests_running{}"] > 0
        for f in running:
            f.result()
    assert seen_busy
    samples = scrape(port)
    assert samples == scrape(cluster.config.master.metrics_port) | {}  # the same registry on both ports
    for lopa_name, vllm_name in [
        ("lopa_time_to_first_token_seconds_count{}", f"vllm:time_to_first_token_seconds_count{label}"),
        ("lopa_time_to_first_token_seconds_sum{}", f"vllm:time_to_first_token_seconds_sum{label}"),
        ("lopa_time_per_output_token_seconds_sum{}", f"vllm:time_per_output_token_seconds_sum{label}"),
        ("lopa_generated_tokens_total{}", f"vllm:generation_tokens_total{label}"),
    ]:
        assert samples[lopa_name] == samples[vllm_name] > 0, lopa_name


def test_a_full_queue_answers_429_with_retry_after(served: tuple[LocalCluster, int]) -> None:
    """2 decoding, 2 queued: a fifth request at once finds the queue full."""
    port = served[1]
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 200,
                       "ignore_eos": True}).encode()

    def post() -> tuple[int, str | None]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=300) as reply:
                return reply.status, None
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("Retry-After")

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: post(), range(8)))
    refused = [retry for status, retry in answers if status == 429]
    assert refused and all(retry == "1" for retry in refused), answers
    assert all(status in (200, 429) for status, _ in answers), answers
