"""Stop strings: the answer, its token ids and its counts all end where the kept text ends."""

from __future__ import annotations

import pytest

from lopa.bundled import tasks
from lopa.decoding.decoder import GenerationResult
from lopa.engine import LocalEngine, bundled_model_dir
from lopa.model.decoding_defaults import model_defaults
from lopa.params import InvalidParameter
from lopa.stops import StopPolicy, check_stop_strings, check_stop_token_ids, cut_at_stop, stop_check

VOCAB = {1: "ab", 2: "c", 3: "</", 4: "s>", 5: "x</"}


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def result_of(ids: list[int]) -> GenerationResult:
    return GenerationResult(prompt_ids=[9], generated_ids=[*ids, 0, 0], output_ids=ids, forwards=2, wall_s=1)


def test_the_cut_keeps_only_the_tokens_of_the_kept_text() -> None:
    text, kept = cut_at_stop(result_of([1, 2, 3, 4, 2]), decode, ["</s>"])
    assert text == "abc" and kept.output_ids == [1, 2] and kept.tokens == 2 and kept.tpf == 1.0
    assert kept.generated_ids == [1, 2, 3, 4, 2, 0, 0]  # what was decoded stays on record (padded TPF)


def test_a_token_holding_the_start_of_the_stop_is_kept() -> None:
    text, kept = cut_at_stop(result_of([1, 5, 4]), decode, ["</s>"])
    assert text == "abx" and kept.output_ids == [1, 5]


def test_the_earliest_stop_wins_and_no_stop_means_no_cut() -> None:
    text, kept = cut_at_stop(result_of([1, 2, 3, 4]), decode, ["</s>", "bc"])
    assert text == "a" and kept.output_ids == [1]
    assert cut_at_stop(result_of([1, 2]), decode, ["</s>"]) is None
    text, kept = cut_at_stop(result_of([3, 4]), decode, ["</"])
    assert text == "" and kept.output_ids == [] and kept.tokens == 0


def test_stop_check() -> None:
    assert stop_check(decode, []) is None
    check = stop_check(decode, ["c</"])
    assert check is not None and not check([1, 2]) and check([1, 2, 3])


def test_the_stop_policy_is_what_every_part_asks() -> None:
    """Admission's checks, the decoder's early stop, a stream's search and the final cut all come
    from one StopPolicy."""
    policy = StopPolicy(("</s>",), include=True, token_ids=(7,))
    assert policy.end_ids({0}) == {0, 7}
    check = policy.check(decode)
    assert check is not None and not check([1, 3]) and check([1, 3, 4])
    text, kept = policy.cut(result_of([1, 2, 3, 4, 2]), decode)
    assert text == "abc</s>" and kept.output_ids == [1, 2, 3, 4]  # the stop string stays (include)
    search = policy.search()
    assert (search.stop, search.include) == (("</s>",), True)
    assert StopPolicy().check(decode) is None and StopPolicy().cut(result_of([1]), decode) is None
    assert check_stop_strings(["a", "bc"], 10) == ("a", "bc") and check_stop_strings(None, 10) == ()
    assert check_stop_token_ids([3, 5], vocab_size=8, mask_id=6) == (3, 5)
    for bad, field in (([""], "stop[0]"), (["x" * 11], "stop[0]"), ("a", "stop"), (["\ud800"], "stop[0]")):
        with pytest.raises(InvalidParameter) as refused:
            check_stop_strings(bad, 10)
        assert refused.value.field == field
    for bad in ([6], [8], [-1], [True], "3"):
        with pytest.raises(InvalidParameter) as refused:
            check_stop_token_ids(bad, vocab_size=8, mask_id=6)
        assert refused.value.field == "stop_token_ids"


def test_generate_with_a_stop_string_counts_what_it_returns(bundled_engine: LocalEngine) -> None:
    params = model_defaults(bundled_model_dir()).with_overrides(branches=2)
    prompt = tasks.held_out(1)[0].prompt
    full = bundled_engine.generate(prompt, params)
    stop = full.text[9:13]  # inside the answer (every answer is 12 groups of '.xyz', then a mark)
    cut = bundled_engine.generate(prompt, params, stop=[stop])
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    ids = cut.result.output_ids
    assert ids == full.result.output_ids[: len(ids)] and bundled_engine.decode(ids).startswith(cut.text)
    assert cut.result.tokens == len(ids) < full.result.tokens
    assert len(bundled_engine.decode(ids[:-1])) < len(cut.text)  # no token more than the text needs


def test_generate_refuses_more_tokens_than_the_model_holds(bundled_engine: LocalEngine) -> None:
    params = model_defaults(bundled_model_dir()).with_overrides(max_new_tokens=1000)
    with pytest.raises(InvalidParameter) as error:
        bundled_engine.generate(tasks.held_out(1)[0].prompt, params)
    assert error.value.field == "max_new_tokens" and "exceed max_length 256" in str(error.value)


def test_a_stop_string_is_kept_when_asked() -> None:
    """vLLM's include_stop_str_in_output: the answer ends after the stop string, not before it."""
    from lopa.stops import first_stop

    assert first_stop("abc.ZVx.ZV", ["ZV", "."]) == 3
    assert first_stop("abc.ZVx.ZV", ["ZV", "."], include=True) == 4
    assert first_stop("abcZV.", ["ZV", "."], include=True) == 5
    assert first_stop("abc", ["ZV"], include=True) is None
