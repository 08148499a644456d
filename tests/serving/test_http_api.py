"""The OpenAI-compatible HTTP API, called with the official `openai` package, beside gRPC.

A real `lopa master` + 2 workers on the bundled model with master.http_port set: the completion's
text equals the gRPC answer to the same request, a stream concatenates to it, the model is listed,
bad values are 400 naming the parameter, chat answers the bundled tasks as completions do, and
16 HTTP requests beside 16 gRPC ones all complete or get 429 (none lost).
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lopa.bundled import tasks
from lopa.scheduling.request import RequestAborted, SchedulerStopped
from lopa.serving.client import LopaClient
from lopa.serving.launcher import LocalCluster
from lopa.serving.master.api.openai_body import body_field
from lopa.serving.master.api.openai_http import failure
from lopa.serving.master.group.links import WorkerLost
from lopa.serving.shared.config import ConfigError, parse_config

from .conftest import bundled_http_group, metric_samples

MODEL = "lopa-bundled"
PROMPTS = [e.prompt for e in tasks.held_out(16)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, int]]:
    with bundled_http_group(tmp_path_factory.mktemp("http"), {"queue_size": 4}) as group:
        yield group


@pytest.fixture(scope="module")
def api(served: tuple[LocalCluster, int]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{served[1]}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def grpc_client(served: tuple[LocalCluster, int]) -> Iterator[LopaClient]:
    with LopaClient(served[0].address) as client:
        yield client


def test_completion_equals_grpc_and_streams_the_same_text(
    api: openai.OpenAI, grpc_client: LopaClient
) -> None:
    reference = grpc_client.generate(PROMPTS[0], timeout=120, branches=3)
    done = api.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={"branches": 3})
    assert done.choices[0].text == reference.text and reference.text
    assert done.choices[0].finish_reason == ("length" if reference.finish_reason == "length" else "stop")
    assert done.usage.completion_tokens == len(reference.token_ids)
    lopa = done.model_extra["lopa"]
    assert lopa["forwards"] == reference.stats.forwards and lopa["mean_branches"] > 0
    assert lopa["verified_tokens"] == reference.stats.verified_tokens > lopa["tokens"]
    stream = api.completions.create(model=MODEL, prompt=PROMPTS[0], stream=True, extra_body={"branches": 3})
    pieces = list(stream)
    assert "".join(p.choices[0].text for p in pieces) == reference.text
    assert len(pieces) > 2 and pieces[-1].choices[0].finish_reason == done.choices[0].finish_reason
    # The branches granted, round by round, as gRPC's stream gives them (a lone request: all of them).
    granted = [b for p in pieces for b in p.model_extra["lopa"]["granted_branches"]]
    chunks = [c for c in grpc_client.stream(PROMPTS[0], timeout=120, branches=3) if not c.last]
    assert granted == [c.granted_branches for c in chunks] and len(granted) == reference.stats.forwards
    assert max(granted) == 3
    with_stop = api.completions.create(model=MODEL, prompt=PROMPTS[0], stop=["."], max_tokens=40)
    grpc_stop = grpc_client.generate(PROMPTS[0], timeout=120, stop=["."], max_new_tokens=40)
    assert with_stop.choices[0].text == grpc_stop.text


def test_latency_metrics_time_the_first_token_and_the_tokens_after_it(
    served: tuple[LocalCluster, int], grpc_client: LopaClient
) -> None:
    port = served[0].config.master.metrics_port
    before = metric_samples(port)
    reply = grpc_client.generate(PROMPTS[3], timeout=120, branches=3)
    after = metric_samples(port)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("lopa_time_to_first_token_seconds_count") == 1
    # the master's own TTFT, as the reply's stats give it
    assert delta("lopa_time_to_first_token_seconds_sum") == pytest.approx(reply.stats.ttft_s, abs=1e-4)
    assert reply.stats.tokens > 1 and delta("lopa_time_per_output_token_seconds_count") == 1
    latency = delta("lopa_request_seconds_sum")
    per_token = delta("lopa_time_per_output_token_seconds_sum")
    assert per_token * (reply.stats.tokens - 1) == pytest.approx(latency - reply.stats.ttft_s, rel=1e-3)


def test_models_and_health(api: openai.OpenAI, served: tuple[LocalCluster, int]) -> None:
    assert [m.id for m in api.models.list().data] == [MODEL]
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        api.models.retrieve("gpt-4")
    error = caught.value.body
    assert error["param"] == "model" and "this server serves 'lopa-bundled'" in error["message"]
    with urllib.request.urlopen(f"http://127.0.0.1:{served[1]}/health", timeout=5) as reply:
        assert reply.status == 200 and json.load(reply) == {"status": "SERVING"}


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"extra_body": {"tau_conf": 2.0}}, "tau_conf", "tau_conf: must be in"),
        ({"n": 0}, "n", "n: must be >= 1, got 0"),
        ({"prompt": ""}, "prompt", "prompt: is empty"),
        ({"max_tokens": 100000}, "max_tokens", "max_tokens: 100000 exceeds the server limit"),
        ({"extra_body": {"branches": "three"}}, "branches", "branches: must be an integer, got 'three'"),
        ({"extra_body": {"echo_back": 1}}, "echo_back", "echo_back: is not supported by this server"),
        ({"presence_penalty": 0.5}, "presence_penalty",
         "presence_penalty: is not supported by this server: only 0 (the default), got 0.5"),
        ({"logprobs": 21}, "logprobs", "logprobs: must be in [0, 20], got 21"),
        ({"extra_body": {"min_tokens": 4}}, "min_tokens", "min_tokens: is supported with ignore_eos only"),
    ],
)
def test_bad_values_are_400_naming_the_parameter(
    api: openai.OpenAI, kwargs: dict, param: str, message: str
) -> None:
    call = {"model": MODEL, "prompt": PROMPTS[1], **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(**call)
    error = caught.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"].startswith(message), error["message"]


def test_an_unknown_model_is_404_model_not_found(api: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="gpt-4", prompt=PROMPTS[1])
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["message"] == "the model 'gpt-4' does not exist; this server serves 'lopa-bundled'"


def test_a_batch_of_prompts_answers_each_as_alone(api: openai.OpenAI, grpc_client: LopaClient) -> None:
    """lm-evaluation-harness and others send several prompts in one body: choice i answers prompt i,
    decoded beside the others (continuous batching), token for token as when sent alone."""
    prompts = PROMPTS[4:7]
    alone = [grpc_client.generate(p, timeout=120, max_new_tokens=24) for p in prompts]
    done = api.completions.create(model=MODEL, prompt=prompts, max_tokens=24)
    assert [c.index for c in done.choices] == [0, 1, 2]
    assert [c.text for c in done.choices] == [a.text for a in alone]
    assert done.usage.completion_tokens == sum(len(a.token_ids) for a in alone)
    assert [c.model_extra["lopa"]["tokens"] for c in done.choices] == [a.stats.tokens for a in alone]
    # streamed: the choices' events interleave, each naming its choice; the totals come last
    *events, totals = api.completions.create(model=MODEL, prompt=prompts, max_tokens=24, stream=True,
                                             stream_options={"include_usage": True})
    texts = ["", "", ""]
    for event in events:
        (choice,) = event.choices
        texts[choice.index] += choice.text
    assert texts == [a.text for a in alone]
    assert {e.choices[0].index for e in events if e.choices[0].finish_reason} == {0, 1, 2}
    assert all(e.usage is None for e in events)  # with include_usage only the last chunk has it
    assert totals.choices == [] and totals.usage.completion_tokens == done.usage.completion_tokens


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"prompt": ["a", ""]}, "prompt[1]", "prompt[1]: is empty"),
        ({"prompt": ["a", [5, True]]}, "prompt[1]", "prompt[1]: is required"),
        ({"prompt": ["a"] * 5}, "prompt", "prompt: at most 4 prompts per request (limits.queue_size), got 5"),
        ({"prompt": ["a", "b c " * 400]}, "prompt[1]", "prompt[1]: "),  # the pipeline's length check
    ],
)
def test_a_bad_prompt_of_a_batch_is_named_and_nothing_is_queued(
    served: tuple[LocalCluster, int], body: dict, param: str, message: str
) -> None:
    port = served[0].config.master.metrics_port
    before = metric_samples(port)
    sent = json.dumps({"model": MODEL, "max_tokens": 8, **body}).encode()
    code, reply = post_raw(served[1], "/v1/completions", sent)
    error = reply["error"]
    assert code == 400 and error["param"] == param, error
    assert error["message"].startswith(message), error["message"]
    after = metric_samples(port)
    for never in ("lopa_queue_seconds_count", "lopa_request_seconds_count"):  # none was ever queued
        assert after[never] == before[never], never


def test_unsupported_features_at_their_defaults_change_nothing(
    api: openai.OpenAI, grpc_client: LopaClient
) -> None:
    """A body spelled out as benchmark clients send it (vLLM's, genai-perf's): features this server
    lacks, at their defaults or null, are accepted and the answer is the plain request's."""
    reference = grpc_client.generate(PROMPTS[2], timeout=120, max_new_tokens=24)
    spelled_out = api.completions.create(
        model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0.0, logprobs=None, best_of=1,
        echo=False, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": False, "repetition_penalty": 1.0, "min_tokens": 0},
    )
    *pieces, last = list(spelled_out)
    assert "".join(p.choices[0].text for p in pieces) == reference.text and reference.text
    # include_usage: OpenAI's extra last chunk, usage and no choices
    assert last.choices == [] and last.usage.completion_tokens == len(reference.token_ids)


def test_chat_answers_the_bundled_tasks_as_completions_do(api: openai.OpenAI) -> None:
    """The bundled model's chat template renders its one user turn as the bare task prompt: the SDK's
    chat call decodes the same tokens as a completion of that prompt, and its answers are correct."""
    for example in tasks.held_out(6):
        turn = {"role": "user", "content": example.prompt}
        chat = api.chat.completions.create(model=MODEL, messages=[turn], extra_body={"branches": 3})
        done = api.completions.create(model=MODEL, prompt=example.prompt, extra_body={"branches": 3})
        answer = chat.choices[0].message.content
        assert answer == done.choices[0].text and tasks.score(example, answer), (example, answer)
        assert chat.usage.prompt_tokens == done.usage.prompt_tokens == len(example.prompt)
    system = {"role": "system", "content": "You are a helpful assistant."}  # what SDK examples send
    chat = api.chat.completions.create(model=MODEL, messages=[system, turn], stream=True)
    assert tasks.score(example, "".join(c.choices[0].delta.content or "" for c in chat if c.choices))
    with pytest.raises(openai.BadRequestError) as caught:  # a conversation the model cannot answer
        api.chat.completions.create(model=MODEL, messages=[turn, {"role": "assistant", "content": "."}, turn])
    assert caught.value.body["param"] == "messages"
    assert "the bundled model answers one user turn" in caught.value.body["message"]


def test_http_beside_grpc_under_load_loses_nothing(api: openai.OpenAI, grpc_client: LopaClient) -> None:
    """8 slots + a queue of 4: of 32 concurrent requests some get 429 / RESOURCE_EXHAUSTED."""

    def over_http(i: int) -> str:
        try:
            return api.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=24).choices[0].text
        except openai.RateLimitError:
            return "429"

    def over_grpc(i: int) -> str:
        try:
            return grpc_client.generate(PROMPTS[i], timeout=120, max_new_tokens=24).text
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            return "429"

    with ThreadPoolExecutor(32) as pool:
        http = [pool.submit(over_http, i) for i in range(16)]
        rpc = [pool.submit(over_grpc, i) for i in range(16)]
        answers = [f.result() for f in http], [f.result() for f in rpc]
    refused = sum(a == "429" for side in answers for a in side)
    assert 0 < refused < 32
    for side in answers:  # whatever was answered is the same request's answer on either transport
        for i, text in enumerate(side):
            other = answers[1][i] if side is answers[0] else answers[0][i]
            assert text == "429" or other == "429" or text == other


def test_http_port_clashes_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^master: the ports of listen, metrics_port, health_port and h"):
        parse_config({"master": {"metrics_port": 9000, "http_port": 9000}})


def test_a_body_that_is_not_json_is_400(served: tuple[LocalCluster, int]) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{served[1]}/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 400 and json.load(caught.value)["error"]["param"] == "body"


def post_raw(port: int, path: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.load(reply)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.mark.parametrize(
    ("path", "body", "content_type", "param", "message"),
    [
        # JSON may escape a lone surrogate; no UTF-8 text holds one (before: 500 in plain text).
        ("/v1/completions", b'{"model": "lopa-bundled", "prompt": "a\\ud800"}', None, "prompt",
         "prompt: is not valid Unicode text: a lone surrogate \\ud800 at index 1"),
        ("/v1/completions", b'{"model": "lopa-bundled", "prompt": "a", "stop": ["x", "\\udc00"]}', None,
         "stop[1]", "stop[1]: is not valid Unicode text"),
        ("/v1/chat/completions",
         b'{"model": "lopa-bundled", "messages": [{"role": "user", "content": "\\ud800"}]}', None,
         "messages[0].content", "messages[0].content: is not valid Unicode text"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, None, "body", "body: nested too deeply"),
        ("/v1/completions", b'{"model": "lopa-bundled"}', "application/json; charset=klingon", "body",
         "body: unknown charset"),
        # A body field of its own name, not the one the shared pipeline would map it to (before: "prompt").
        ("/v1/completions", b'{"model": "lopa-bundled", "prompt": "a", "prompt_token_ids": [1]}', None,
         "prompt_token_ids", "prompt_token_ids: is not supported by this server"),
        ("/v1/chat/completions",
         b'{"model": "lopa-bundled", "messages": [{"role": "user", "content": "a"}], "max_tokens": 4, '
         b'"max_completion_tokens": 4}', None, "max_completion_tokens",
         "max_completion_tokens: send either it or max_tokens, not both"),
        # Outside the wire type (uint32 / uint64): before, protobuf's text twice ("is out of range:
        # N (Value out of range: N)").
        ("/v1/completions", b'{"model": "lopa-bundled", "prompt": "a", "max_tokens": 1000000000000}', None,
         "max_tokens", "max_tokens: is too large, got 1000000000000"),
        ("/v1/completions", b'{"model": "lopa-bundled", "prompt": "a", "seed": -5}', None,
         "seed", "seed: must be >= 0, got -5"),
    ],
)
def test_unusual_bodies_are_400_naming_the_field(
    served: tuple[LocalCluster, int], path: str, body: bytes, content_type: str | None, param: str,
    message: str,
) -> None:
    status, reply = post_raw(served[1], path, body, content_type or "application/json")
    assert status == 400 and reply["error"]["param"] == param, reply
    assert reply["error"]["message"].startswith(message), reply["error"]["message"]


def test_token_budget_errors_name_the_field_the_body_used() -> None:
    used = {"messages": [], "max_completion_tokens": 4}
    assert body_field("max_new_tokens", True, used) == "max_completion_tokens"
    assert body_field("max_new_tokens", True, {"messages": [], "max_tokens": 4}) == "max_tokens"
    assert body_field("prompt_token_ids", False) == "prompt"


def cancelled_count(cluster: LocalCluster) -> float:
    url = f"http://127.0.0.1:{cluster.config.master.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = text_string_to_metric_families(text)
    return sum(s.value for f in samples for s in f.samples
               if s.name == "lopa_requests_total" and s.labels.get("outcome") == "cancelled")


def test_a_client_that_disconnects_cancels_its_request(served: tuple[LocalCluster, int]) -> None:
    cluster, port = served
    before = cancelled_count(cluster)
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[2], "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")  # the stream began
    deadline = time.monotonic() + 10
    while cancelled_count(cluster) <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled_count(cluster) == before + 1


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (WorkerLost("worker rank 1 lost"), 503, "service_unavailable"),
        (SchedulerStopped("the server is stopping"), 503, "service_unavailable"),
        (RequestAborted("deadline passed", deadline=True), 504, "timeout"),
        (RuntimeError("bug"), 500, "server_error"),
    ],
)
def test_failures_map_to_openai_statuses(error: BaseException, status: int, kind: str) -> None:
    response = failure(error)
    body = json.loads(response.text)
    assert response.status == status and body["error"]["type"] == kind
    assert "bug" not in body["error"]["message"]  # internals stay in the master log
