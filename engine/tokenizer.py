"""A model's tokenizer, without torch: text <-> token ids and the chat template.

Encoding and decoding are the Hugging Face ``tokenizers`` library's own (the ``tokenizer.json``
that a fast HF tokenizer saves); the chat template is rendered by transformers' own jinja
renderer (``transformers.utils.chat_template_utils``). This thin wrapper replaces
``transformers.AutoTokenizer`` because importing that loads torch, and the gateway process,
which tokenizes every request, must never load torch (docs/architecture.md). The offline
engine uses the same class, so a prompt is tokenized by one rule everywhere.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer

Message = dict[str, str]
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_ROLE = re.compile(r"[A-Za-z0-9_-]{1,32}")


class Tokenizer:
    """Encodes prompts, renders chats, decodes ids, for one model.

    Args:
        backend: the ``tokenizers.Tokenizer`` (from ``tokenizer.json``).
        chat_template: the jinja chat template, or ``None`` when the model has none.
        special_tokens: ``bos_token``/``eos_token``/... name → token text, as the template sees
            them.

    Attributes:
        backend: the ``tokenizers.Tokenizer`` (``IncrementalDetokenizer`` decodes with it).
        eos_token_id: the id of ``special_tokens["eos_token"]``, or ``None``.
        pad_token_id: the id of ``special_tokens["pad_token"]``, or ``None``.
        split_special_tokens: :meth:`apply_chat_template`'s default: message content cannot
            produce special tokens (True unless the owner, e.g. the gateway's settings, says).
    """

    def __init__(self, backend: BackendTokenizer, chat_template: str | None,
                 special_tokens: dict[str, str]) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.eos_token_id = self._token_id("eos_token")
        self.pad_token_id = self._token_id("pad_token")
        self.split_special_tokens = True
        self._plain: BackendTokenizer | None = None

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer | None:
        """The tokenizer saved in HF directory ``path`` (``tokenizer.json``, ``tokenizer_config.json``
        and the chat template, inline or in ``chat_template.jinja``), or ``None`` without
        ``tokenizer.json``."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            return None
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        special = {key: _token_text(config[key]) for key in _SPECIAL_TOKEN_KEYS if config.get(key)}
        return cls(BackendTokenizer.from_file(str(path / "tokenizer.json")), template, special)

    def _token_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return self.backend.token_to_id(text) if text else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the model's post-processor adds
        (e.g. BOS for Llama 3). The served and the offline prompt are encoded this way."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens dropped unless ``skip_special_tokens`` is false)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[Message]) -> str:
        """``messages`` rendered by the chat template, ending with the assistant's generation prompt.

        Raises:
            ValueError: the model has no chat template, or the template refuses the conversation
                (its ``raise_exception``, a missing field); the message says which.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        from jinja2 import TemplateError
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, _ = render_jinja_template(
                [messages], chat_template=self.chat_template, add_generation_prompt=True, **self.special_tokens)
        except (TemplateError, TypeError, KeyError) as exc:
            raise ValueError(f"the chat template refused it: {exc}") from exc
        return rendered[0]

    def apply_chat_template(self, messages: list[Message], split_special_tokens: bool | None = None) -> list[int]:
        """Token ids of :meth:`render_chat`.

        With ``split_special_tokens`` (``None``: the attribute of that name, true unless the
        owner turned it off) only the template writes special tokens: the
        chat is rendered with a placeholder for each message's content, the template's text is
        encoded as usual and each content with special tokens encoded as plain text, so a user
        who writes ``<|im_start|>system`` gets those characters, not a control token. Without it
        the rendered text is encoded whole (content can then produce any special token).

        Raises:
            ValueError: as :meth:`render_chat`; a role that is not a plain name (letters, digits,
                ``_`` and ``-``, at most 32); with ``split_special_tokens``, a template that
                changes a message's content rather than inserting it.
        """
        if not (self.split_special_tokens if split_special_tokens is None else split_special_tokens):
            return self.encode(self.render_chat(messages), add_special_tokens=False)
        for i, message in enumerate(messages):
            if not _ROLE.fullmatch(message["role"]):
                raise ValueError(f"messages[{i}].role must be a plain name (letters, digits, _ and -, at most 32)")
        marker = f"\x00{secrets.token_hex(8)}\x00"
        placeholders = [f"{marker}{i}{marker}" for i in range(len(messages))]
        rendered = self.render_chat([{**m, "content": p} for m, p in zip(messages, placeholders)])
        pieces = re.split(f"{re.escape(marker)}(\\d+){re.escape(marker)}", rendered)
        if sorted(int(i) for i in pieces[1::2]) != list(range(len(messages))):
            raise ValueError("the chat template changes message content; it cannot be tokenized apart from the "
                             "template's special tokens")
        ids: list[int] = []
        for j, piece in enumerate(pieces):
            if j % 2:
                ids.extend(self._plain_backend().encode(messages[int(piece)]["content"], add_special_tokens=False).ids)
            elif piece:
                ids.extend(self.encode(piece, add_special_tokens=False))
        return ids

    def _plain_backend(self) -> BackendTokenizer:
        """A copy of the backend that encodes special tokens' text as plain text (a copy: the
        flag is the backend's state, and other threads encode with the original)."""
        if self._plain is None:
            self._plain = BackendTokenizer.from_str(self.backend.to_str())
            self._plain.encode_special_tokens = True
        return self._plain


def _token_text(value: str | dict) -> str:
    """A special token as ``tokenizer_config.json`` stores it: its text, or an AddedToken dict."""
    return value["content"] if isinstance(value, dict) else value
