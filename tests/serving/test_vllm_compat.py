"""What a vLLM user brings: `lopa serve MODEL --host --port --served-model-name a b --api-key K`,
driven with the `openai` SDK and raw HTTP.

Bearer keys (401 in OpenAI's shape without one; the probes, /version and /metrics open), both names
answering, 404 model_not_found for another, vLLM's /version, /ping, /tokenize and /detokenize, 415
for a body that is not JSON, stream_options only with stream, OpenAI's sampling (no seed: a fresh
draw per request; a seed: the same answer), and a line per request in the access log.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from lopa.bundled import bundled_model_dir, tasks
from lopa.cli import main
from lopa.serving.client import LopaClient
from lopa.serving.ports import free_ports

from .conftest import lopa_serve

KEY = "sk-test-key"
PROMPT = tasks.held_out(1)[0].prompt
# Every branch granted (pin_branches), as a lone local decode has them: answers comparable with it.
PINNED = {"model": "a", "prompt": PROMPT, "max_tokens": 32, "branches": 3, "pin_branches": True}


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    """(gRPC, HTTP) of the served group."""
    grpc_port, http_port = free_ports(2)
    return grpc_port, http_port


@pytest.fixture(scope="module")
def server(ports: tuple[int, int], tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    grpc_port, http_port = ports
    logs = tmp_path_factory.mktemp("vllm-logs")
    flags = [
        str(bundled_model_dir()),
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--listen",
        f"127.0.0.1:{grpc_port}",
        "--served-model-name",
        "a",
        "b",
        "--api-key",
        KEY,
        "--logs",
        str(logs),
    ]
    with lopa_serve(*flags) as (_, line):
        assert f"HTTP (OpenAI API) on 127.0.0.1:{http_port}" in line
        yield http_port, logs


def _call(
    port: int,
    method: str,
    path: str,
    body: object = None,
    key: str | None = KEY,
    content_type: str = "application/json",
) -> tuple[int, dict]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    headers = {"Content-Type": content_type} if data is not None else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def test_the_api_key_guards_the_api_and_leaves_the_probes_open(server: tuple[int, Path]) -> None:
    port, _ = server
    for key in (None, "sk-wrong"):
        status, body = _call(port, "GET", "/v1/models", key=key)
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        status, _ = _call(port, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT}, key=key)
        assert status == 401
    for path in ("/health", "/ping", "/version"):
        assert _call(port, "GET", path, key=None)[0] == 200, path
    assert _call(port, "POST", "/ping", {}, key=None)[0] == 200
    assert _call(port, "GET", "/version", key=None)[1]["version"]


def test_the_sdk_with_the_key_is_served_under_both_names(server: tuple[int, Path]) -> None:
    port, _ = server
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in api.models.list().data] == ["a", "b"]
    answers = {name: api.completions.create(model=name, prompt=PROMPT, max_tokens=32) for name in ("a", "b")}
    assert answers["a"].model == "a" and answers["b"].model == "b"
    assert answers["a"].choices[0].text == answers["b"].choices[0].text
    assert tasks.is_valid(tasks.held_out(1)[0].task, PROMPT, answers["a"].choices[0].text)
    with pytest.raises(openai.NotFoundError) as info:
        api.completions.create(model="c", prompt=PROMPT)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("c")
    assert api.models.retrieve("b").id == "b"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_tokenize_and_detokenize_are_the_completions_own(server: tuple[int, Path]) -> None:
    port, _ = server
    status, body = _call(port, "POST", "/tokenize", {"model": "a", "prompt": PROMPT})
    assert status == 200 and body["count"] == len(body["tokens"]) == len(PROMPT)  # one token per char
    assert body["max_model_len"] == 256
    status, back = _call(port, "POST", "/detokenize", {"model": "b", "tokens": body["tokens"]})
    assert status == 200 and back["prompt"] == PROMPT
    chat = _call(port, "POST", "/tokenize", {"messages": [{"role": "user", "content": PROMPT}]})[1]
    assert chat["tokens"] == body["tokens"]  # the bundled template: the bare prompt
    status, error = _call(port, "POST", "/detokenize", {"tokens": [1, "x"]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = _call(port, "POST", "/tokenize", {"model": "c", "prompt": "x"})
    assert status == 404 and error["error"]["code"] == "model_not_found"


def test_a_body_that_is_not_json_is_415_and_stream_options_need_stream(server: tuple[int, Path]) -> None:
    port, _ = server
    status, error = _call(
        port, "POST", "/v1/completions", b"model=a&prompt=x", content_type="application/x-www-form-urlencoded"
    )
    assert status == 415 and error["error"]["param"] == "body"
    status, error = _call(
        port,
        "POST",
        "/v1/completions",
        {"model": "a", "prompt": PROMPT, "stream_options": {"include_usage": True}},
    )
    assert status == 400 and error["error"]["param"] == "stream_options"
    status, error = _call(port, "POST", "/v1/completions", b'{"model": "a", "prompt": "x')
    assert status == 400 and "line 1, column" in error["error"]["message"]
    status, error = _call(port, "POST", "/v1/completions", b'{"prompt": "\xff"}')
    assert status == 400 and "not UTF-8" in error["error"]["message"]


def test_sampling_without_a_seed_draws_anew_and_with_one_repeats(server: tuple[int, Path]) -> None:
    port, _ = server
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)

    def sample(**seed: int) -> str:
        done = api.completions.create(model="a", prompt=PROMPT, max_tokens=32, temperature=1.5, **seed)
        return done.choices[0].text

    assert len({sample() for _ in range(4)}) > 1
    assert len({sample(seed=11) for _ in range(3)}) == 1


def test_each_request_has_a_line_in_the_access_log_without_its_prompt(server: tuple[int, Path]) -> None:
    port, logs = server
    _call(port, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 8})
    deadline = time.monotonic() + 10
    text = ""
    while time.monotonic() < deadline:
        text = (logs / "master.log").read_text()
        if '"POST /v1/completions HTTP/1.1" 200' in text:
            break
        time.sleep(0.2)
    assert '"POST /v1/completions HTTP/1.1" 200' in text and "lopa.access" in text
    assert PROMPT not in text


def test_n_samples_are_the_requests_of_their_seeds_alone(server: tuple[int, Path]) -> None:
    """n = 4 with seed s: choice j is what the same request with n = 1 and seed s + j answers."""
    port, _ = server
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0)
    common = {"model": "a", "prompt": PROMPT, "max_tokens": 32, "temperature": 1.5}
    together = api.completions.create(n=4, seed=40, **common)
    assert [c.index for c in together.choices] == [0, 1, 2, 3]
    alone = [api.completions.create(seed=40 + j, **common) for j in range(4)]
    assert [c.text for c in together.choices] == [done.choices[0].text for done in alone]
    assert len({done.choices[0].text for done in alone}) > 1
    assert together.usage.completion_tokens == sum(done.usage.completion_tokens for done in alone)
    fresh = api.completions.create(n=3, **common)
    assert len(fresh.choices) == 3
    chat = api.chat.completions.create(
        model="b", n=2, seed=7, temperature=1.5, max_tokens=32, messages=[{"role": "user", "content": PROMPT}]
    )
    seeded = [api.completions.create(seed=7 + j, **common).choices[0].text for j in range(2)]
    assert [c.message.content for c in chat.choices] == seeded  # the bundled template: the bare prompt


def test_echo_and_vllms_top_k_off(server: tuple[int, Path]) -> None:
    port, _ = server
    status, done = _call(
        port,
        "POST",
        "/v1/completions",
        {"model": "a", "prompt": PROMPT, "max_tokens": 32, "echo": True, "top_k": -1},
    )
    assert status == 200
    plain = _call(port, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 32})[1]
    assert done["choices"][0]["text"] == PROMPT + plain["choices"][0]["text"]
    status, error = _call(port, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT, "n": 0})
    assert status == 400 and error["error"]["param"] == "n"


def test_logprobs_are_the_fills_own(server: tuple[int, Path]) -> None:
    """Each returned token's logprob, and its alternatives, are those of the forward that filled
    it: what the local engine's decode of the same request reports (docs/decoding.md section 6),
    in OpenAI's shapes, from the served group's workers."""
    from lopa.engine import LocalEngine
    from lopa.model.decoding_defaults import model_defaults

    port, _ = server
    engine = LocalEngine.from_dirs(bundled_model_dir(), max_batch=1)
    try:
        params = model_defaults(bundled_model_dir()).with_overrides(branches=3)
        local = engine.generate(PROMPT, params, top_logprobs=3)
        piece = {t: engine.tokenizer.decode([t]) for t, _ in (a for alts in local.result.output_alternatives
                                                                for a in alts)}
    finally:
        engine.close()
    eos = 97  # the bundled tokenizer's <|endoftext|>
    kept = [i for i, t in enumerate(local.result.output_ids) if t != eos]
    expected = [local.result.output_logprobs[i] for i in kept]
    alternatives = [[(piece[t], lp) for t, lp in local.result.output_alternatives[i]] for i in kept]
    body = {**PINNED, "logprobs": 0}
    status, done = _call(port, "POST", "/v1/completions", body)
    assert status == 200, done
    logprobs = done["choices"][0]["logprobs"]
    assert "".join(logprobs["tokens"]) == done["choices"][0]["text"] == local.text
    assert logprobs["token_logprobs"] == pytest.approx(expected, abs=1e-6)
    assert all(lp <= 0 for lp in logprobs["token_logprobs"]) and logprobs["text_offset"][1] == 1
    assert logprobs["top_logprobs"] is None
    # logprobs 3: the 3 likeliest tokens of each position's filling forward, and the returned one.
    tops = _call(port, "POST", "/v1/completions", {**body, "logprobs": 3})[1]["choices"][0]["logprobs"]
    assert tops["token_logprobs"] == pytest.approx(expected, abs=1e-6)
    for token, value, listed, want in zip(tops["tokens"], expected, tops["top_logprobs"], alternatives,
                                          strict=True):
        assert listed == pytest.approx({**dict(want), token: value}, abs=1e-5)
    chat = _call(
        port,
        "POST",
        "/v1/chat/completions",
        {
            "model": "a",
            "max_tokens": 32,
            "branches": 3,
            "pin_branches": True,
            "logprobs": True,
            "messages": [{"role": "user", "content": PROMPT}],
        },
    )[1]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(expected, abs=1e-6)
    assert all(c["top_logprobs"] == [] for c in content)
    messages = [{"role": "user", "content": PROMPT}]
    chat = _call(port, "POST", "/v1/chat/completions", {
        "model": "a", "max_tokens": 32, "branches": 3, "pin_branches": True, "logprobs": True,
        "top_logprobs": 2, "messages": messages,
    })[1]
    for entry, want in zip(chat["choices"][0]["logprobs"]["content"], alternatives, strict=True):
        listed = entry["top_logprobs"]
        assert [a["token"] for a in listed] == [token for token, _ in want[:2]]
        assert [a["logprob"] for a in listed] == pytest.approx([lp for _, lp in want[:2]], abs=1e-5)
        assert all(bytes(a["bytes"]).decode() == a["token"] for a in listed)
    for path, refused, param in (
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": 0, "echo": True}, "echo"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        prompt = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": messages}
        status, error = _call(port, "POST", path, {"model": "a", **prompt, **refused})
        assert status == 400 and error["error"]["param"] == param, error


def test_what_stays_refused_says_why_and_min_p_is_served(server: tuple[int, Path]) -> None:
    port, _ = server
    for field, value, why in (
        ("frequency_penalty", 0.5, "fills positions in no left-to-right order"),
        ("best_of", 2, "ask n samples"),
    ):
        status, error = _call(port, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT, field: value})
        assert status == 400 and error["error"]["param"] == field and why in error["error"]["message"], error
    status, done = _call(
        port,
        "POST",
        "/v1/completions",
        {"model": "a", "prompt": PROMPT, "max_tokens": 32, "temperature": 1.5, "min_p": 0.9},
    )
    assert status == 200 and tasks.is_valid(tasks.held_out(1)[0].task, PROMPT, done["choices"][0]["text"])


def test_stop_token_ids_end_the_answer_and_a_stop_string_may_stay(server: tuple[int, Path]) -> None:
    port, _ = server
    c_id = _call(port, "POST", "/tokenize", {"prompt": "c"})[1]["tokens"][0]
    for stream in (False, True):
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 32, "stop_token_ids": [c_id], "stream": stream}
        text, finish = _answer(port, body)
        assert text.endswith("c") and "c" not in text[:-1] and finish == "stop", text
        plain, _ = _answer(port, {"model": "a", "prompt": PROMPT, "max_tokens": 32, "stream": stream})
        stop = plain.split(".")[2][:2]  # the start of the answer's second word
        body = {"model": "a", "prompt": PROMPT, "max_tokens": 32, "stop": [stop], "stream": stream}
        cut, _ = _answer(port, body)
        kept, finish = _answer(port, {**body, "include_stop_str_in_output": True})
        assert cut == plain[: plain.index(stop)] and kept == cut + stop and finish == "stop", (cut, kept)
    status, error = _call(
        port, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT, "stop_token_ids": [10**9]}
    )
    assert status == 400 and error["error"]["param"] == "stop_token_ids"


def _answer(port: int, body: dict) -> tuple[str, str]:
    """(the text, the finish reason) of a completion, streamed or not."""
    if not body.get("stream"):
        done = _call(port, "POST", "/v1/completions", body)[1]
        return done["choices"][0]["text"], done["choices"][0]["finish_reason"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    text, finish = "", ""
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text, finish = text + choice["text"], choice["finish_reason"] or finish
    return text, finish


def test_a_stream_carries_each_deltas_logprobs(server: tuple[int, Path]) -> None:
    """Streamed, the logprobs of every event's tokens concatenate to the unary reply's."""
    port, _ = server
    body = {**PINNED, "logprobs": 2}
    whole = _call(port, "POST", "/v1/completions", body)[1]["choices"][0]["logprobs"]
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    tokens, values, tops = [], [], []
    with urllib.request.urlopen(request, timeout=60) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                part = json.loads(line.removeprefix("data: "))["choices"][0]["logprobs"]
                tokens += part["tokens"]
                values += part["token_logprobs"]
                tops += part["top_logprobs"]
    assert tokens == whole["tokens"] and values == pytest.approx(whole["token_logprobs"], abs=1e-6)
    assert tops == whole["top_logprobs"] and all(2 <= len(listed) <= 3 for listed in tops)


def test_the_grpc_api_takes_the_same_key_and_vllms_fields(
    server: tuple[int, Path], ports: tuple[int, int], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One key locks both APIs (health stays open), and a gRPC request carries what an HTTP one
    does: stop_token_ids, include_stop_str_in_output, each token's logprob and alternatives."""
    port, _ = server
    address = f"127.0.0.1:{ports[0]}"
    with LopaClient(address) as anonymous:
        assert anonymous.health() == "SERVING"  # the probes send no key
        for call in (lambda: anonymous.generate(PROMPT, max_new_tokens=8), anonymous.model_info,
                     lambda: list(anonymous.stream(PROMPT, max_new_tokens=8))):
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in refused.value.details()
    with LopaClient(address, api_key="not-the-key") as wrong, pytest.raises(grpc.RpcError) as refused:
        wrong.model_info()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    body = PINNED
    http = _call(port, "POST", "/v1/completions", {**body, "logprobs": 2})[1]["choices"][0]
    same = {"max_new_tokens": 32, "branches": 3, "pin_branches": True}
    with LopaClient(address, api_key=KEY) as client:
        reply = client.generate(PROMPT, top_logprobs=2, **same)
        chunks = list(client.stream(PROMPT, top_logprobs=2, **same))
        assert reply.text == http["text"]
        assert len(reply.logprobs) == len(reply.token_ids) == len(reply.alternatives)
        kept = [i for i, t in enumerate(reply.token_ids) if t != 97]  # the end token is not text (HTTP)
        http_logprobs = http["logprobs"]["token_logprobs"]
        assert [reply.logprobs[i] for i in kept] == pytest.approx(http_logprobs, abs=1e-6)
        for i, listed in zip(kept, http["logprobs"]["top_logprobs"], strict=True):
            alternatives = reply.alternatives[i]
            assert len(alternatives.token_ids) == 2
            likeliest = sorted(listed.values(), reverse=True)[:2]
            assert list(alternatives.logprobs) == pytest.approx(likeliest, abs=1e-5)
        streamed = [t for chunk in chunks for t in chunk.token_ids]
        assert streamed == list(reply.token_ids)
        streamed_logprobs = [lp for chunk in chunks for lp in chunk.logprobs]
        assert streamed_logprobs == pytest.approx(list(reply.logprobs), abs=1e-6)
        assert [a for chunk in chunks for a in chunk.alternatives] == list(reply.alternatives)
        c_id = _call(port, "POST", "/tokenize", {"prompt": "c"})[1]["tokens"][0]
        ended = client.generate(PROMPT, max_new_tokens=32, stop_token_ids=[c_id])
        # It ends the answer as an end token does: gRPC's "eos" (OpenAI's "stop")
        assert ended.text.endswith("c") and "c" not in ended.text[:-1] and ended.finish_reason == "eos"
        stop = reply.text.split(".")[2][:2]
        kept_stop = client.generate(PROMPT, stop=[stop], include_stop_str_in_output=True, **same)
        assert kept_stop.text == reply.text[: reply.text.index(stop)] + stop
        with pytest.raises(grpc.RpcError) as invalid:
            client.generate(PROMPT, top_logprobs=21)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert invalid.value.details().startswith("top_logprobs: must be in [0, 20]")
    assert main(["client", "info", "--address", address, "--api-key", KEY]) == 0
    monkeypatch.setenv("LOPA_API_KEY", f"{KEY},another")  # the client sends the first, as documented
    assert main(["client", "info", "--address", address]) == 0
    monkeypatch.delenv("LOPA_API_KEY")
    assert main(["client", "info", "--address", address]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err


def test_grpc_n_samples_are_the_requests_of_their_seeds_alone(
    server: tuple[int, Path], ports: tuple[int, int]
) -> None:
    """GenerateRequest.n as HTTP's n: sample j is the request with seed s + j alone; a stream's
    chunks say their sample, each sample ends with its own last chunk."""
    sampled = {"max_new_tokens": 32, "branches": 3, "pin_branches": True, "temperature": 1.5}
    with LopaClient(f"127.0.0.1:{ports[0]}", api_key=KEY) as client:
        together = client.generate(PROMPT, n=3, seed=40, **sampled)
        alone = [client.generate(PROMPT, seed=40 + j, **sampled) for j in range(3)]
        assert [s.text for s in together.samples] == [a.text for a in alone]
        assert len({a.text for a in alone}) > 1
        assert together.text == alone[0].text and not together.samples[0].samples
        assert not client.generate(PROMPT, n=1, seed=40, **sampled).samples
        chunks = list(client.stream(PROMPT, n=3, seed=40, **sampled))
        for j in range(3):
            own = [c for c in chunks if c.index == j]
            assert "".join(c.text for c in own) == alone[j].text
            assert [c.last for c in own].count(True) == 1 and own[-1].last
        http = _call(server[0], "POST", "/v1/completions", {**PINNED, "n": 3, "seed": 40, "temperature": 1.5})
        assert [c["text"] for c in http[1]["choices"]] == [a.text for a in alone]
        with pytest.raises(grpc.RpcError) as invalid:
            client.generate(PROMPT, n=100_000)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert invalid.value.details().startswith("n: 100000 samples exceed the")
