"""The bundled model's chat template: a chat request asks what a completion of its task prompt asks.

The model knows one kind of prompt, a task line such as `tail:gcecjki.ZVvrtus.WVbuklw=`, with no
chat markup around it (it was trained on the bare prompts). So the template renders the one user
turn as written and adds nothing: /v1/chat/completions (and an OpenAI SDK's chat call) decodes the
same token ids as /v1/completions with that prompt, and gets the same answer. A system turn is
left out (the model takes no instructions); anything but one user turn is refused, naming what it
got, rather than decoded into noise.
"""

from __future__ import annotations

CHAT_TEMPLATE = (
    "{%- set turns = messages | rejectattr('role', 'equalto', 'system') | list -%}"
    "{%- if turns | length != 1 or turns[0]['role'] != 'user' -%}"
    "{{- raise_exception('the bundled model answers one user turn, a task prompt such as "
    "tail:gcecjki.ZVvrtus.WVbuklw= (a system turn is ignored); got the roles: ' "
    "~ (messages | map(attribute='role') | join(', '))) -}}"
    "{%- endif -%}"
    "{{- turns[0]['content'] -}}"
)
