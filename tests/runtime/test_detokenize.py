"""Incremental decoding (lopa.detokenize): the text of a growing answer, decoded a few ids at a time,
is the text of the whole answer, for tokenizers whose decoding depends on context."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lopa.decoding.decoder import GenerationResult
from lopa.detokenize import Decode, IncrementalText, text_of
from lopa.engine import bundled_model_dir
from lopa.model.tokenizer import load_tokenizer
from lopa.serving.master.streaming import DeltaTracker
from lopa.stops import StopPolicy, cut_at_stop

CORPUS = [
    "Diffusion models fill masked tokens in parallel: déjà vu, naïve café, señor.",
    "並列に埋める。拡散言語モデル 🚀🧪 emoji and CJK split over several byte tokens",
    "def add(a, b):\n    return a + b  # ≤ ≥ → ∑ ∫",
]
SPECIALS = ["<|endoftext|>", "<|mask|>"]


def trained(pre_tokenizer: object, decoder: object) -> PreTrainedTokenizerFast:
    """A small BPE trained here: with byte-level pieces many characters take several ids."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoder
    byte_level = isinstance(pre_tokenizer, pre_tokenizers.ByteLevel)
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=SPECIALS[0])


@pytest.fixture(scope="module", params=["byte-level", "metaspace", "bundled"])
def tokenizer(request: pytest.FixtureRequest) -> object:
    if request.param == "byte-level":
        return trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    if request.param == "metaspace":  # SentencePiece's convention: the first word's space is dropped
        return trained(pre_tokenizers.Metaspace(), decoders.Metaspace())
    return load_tokenizer(bundled_model_dir())


def decoder_of(tokenizer: object) -> Decode:
    return lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True)


def test_the_text_grown_an_id_at_a_time_is_the_whole_text(tokenizer: object) -> None:
    decode = decoder_of(tokenizer)
    eos = tokenizer.convert_tokens_to_ids(SPECIALS[0]) if "<|endoftext|>" in tokenizer.get_vocab() else None
    for text in CORPUS:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if eos is not None:
            ids = [*ids[:5], eos, *ids[5:]]  # a special token in the middle decodes to nothing
        grown = IncrementalText(decode)
        rng = random.Random(len(text))
        while len(grown.ids) < len(ids):  # in uneven steps, as rounds make ids contiguous
            grown.extend(ids[len(grown.ids) : len(grown.ids) + rng.randint(1, 5)])
        assert grown.text == decode(ids)
        assert len(grown) == len(grown.text) and grown.ends[-1] == len(grown.text)


def test_ends_place_every_complete_character(tokenizer: object) -> None:
    """After n ids the text is that of the n ids, less the text of the ids that end inside a
    character (an id may hold a character's end and the next one's start: both wait)."""
    decode = decoder_of(tokenizer)
    for text in CORPUS:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        grown = text_of(decode, ids)
        whole = grown.text
        for n in range(1, len(ids) + 1):
            prefix = decode(ids[:n])
            assert prefix.startswith(whole[: grown.ends[n - 1]])
            if not prefix.endswith("\ufffd"):
                assert grown.ends[n - 1] == len(prefix)


def test_byte_level_characters_span_several_ids() -> None:
    """The case the windows are for: an emoji split over ids adds nothing until its last byte."""
    tokenizer = trained(pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel())
    decode = decoder_of(tokenizer)
    ids = list(tokenizer.encode("🚀", add_special_tokens=False))
    assert len(ids) > 1  # the rocket is 4 bytes; the trained merges do not make it one id
    grown = text_of(decode, ids)
    assert grown.ends == [0] * (len(ids) - 1) + [1] and grown.text == "🚀"


def test_covering_gives_the_fewest_ids_for_a_length_and_tail_slices() -> None:
    vocab = {1: "ab", 2: "", 3: "cde", 4: "f"}
    grown = text_of(lambda ids: "".join(vocab[i] for i in ids), [1, 2, 3, 4])
    assert grown.ends == [2, 2, 5, 6]
    assert [grown.covering(n) for n in range(8)] == [0, 1, 1, 3, 3, 3, 4, 4]
    assert [grown.tail(n) for n in (0, 1, 2, 4, 6, 9)] == ["abcdef", "bcdef", "cdef", "ef", "", ""]
    assert IncrementalText(str).tail(0) == "" and IncrementalText(str).covering(3) == 0


@pytest.mark.parametrize("include", [False, True])
def test_a_stream_sends_exactly_the_cut_answer(tokenizer: object, include: bool) -> None:
    """Deltas streamed round by round (lopa.serving.master.streaming) concatenate to the final answer
    cut at its stop string (lopa.stops.cut_at_stop), ids included, wherever the stop falls."""
    decode = decoder_of(tokenizer)
    mask = -1
    for text in CORPUS:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        whole = decode(ids)
        rng = random.Random(text)
        for stop in {whole[at : at + rng.randint(1, 4)] for at in rng.sample(range(len(whole) - 4), 6)}:
            result = GenerationResult(prompt_ids=[0], generated_ids=ids, output_ids=ids, forwards=1, wall_s=1)
            final_text, final = cut_at_stop(result, decode, [stop], include)
            tracker = DeltaTracker(decode, frozenset(), StopPolicy((stop,), include), begin=1)
            sent_text, sent_ids, filled = "", [], 0
            while filled < len(ids):
                filled = min(len(ids), filled + rng.randint(1, 6))
                offset, new, delta = tracker.step([0, *ids[:filled], *[mask] * (len(ids) - filled)], mask)
                assert offset == len(sent_ids)
                sent_text, sent_ids = sent_text + delta, sent_ids + new
            _, new, delta = tracker.finish(final_text, list(final.output_ids))
            assert sent_text + delta == final_text and sent_ids + new == final.output_ids
