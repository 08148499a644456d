"""The bundled model's chat template: a chat turn encodes to its task prompt, nothing around it."""

from __future__ import annotations

import json

import pytest

from lopa.bundled import bundled_model_dir, tasks
from lopa.bundled.chat import CHAT_TEMPLATE
from lopa.model.tokenizer import chat_ids, load_tokenizer
from lopa.params import InvalidParameter


def test_the_committed_tokenizer_carries_the_template_training_writes() -> None:
    config = json.loads((bundled_model_dir() / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE


def test_a_user_turn_encodes_to_the_bare_task_prompt() -> None:
    tokenizer = load_tokenizer(bundled_model_dir())
    for example in tasks.held_out(4):
        bare = list(tokenizer.encode(example.prompt, add_special_tokens=False))
        turn = {"role": "user", "content": example.prompt}
        assert chat_ids(tokenizer, [turn]) == bare
        assert chat_ids(tokenizer, [{"role": "system", "content": "Be brief."}, turn]) == bare
    for roles in (("user", "assistant", "user"), ("system",), ("user", "user")):
        refusal = "answers one user turn.*got the roles: " + ", ".join(roles)
        with pytest.raises(InvalidParameter, match=refusal):
            chat_ids(tokenizer, [{"role": role, "content": "x"} for role in roles])
