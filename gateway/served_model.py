"""What the gateway itself knows of the served model: its id and its tokenizer (never the
weights, never torch)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.model_source import resolve_model
from engine.tokenizer import Tokenizer
from gateway.settings import GatewaySettings


@dataclass(frozen=True)
class ServedModel:
    """The served model's id and its tokenizer (``None`` for a model without one: then only
    token-id prompts are served, with no text)."""

    model_id: str
    tokenizer: Tokenizer | None


def load_served_model(settings: GatewaySettings) -> ServedModel:
    """Resolve ``settings.model`` to its id and tokenizer (no weights, no torch).

    Raises:
        ValueError: the model cannot be found (naming ``model``).
    """
    source = resolve_model(settings.model or None)
    tokenizer = source.tokenizer()
    if tokenizer is not None:
        tokenizer.split_special_tokens = settings.chat_split_special_tokens
    return ServedModel(source.model_id, tokenizer)
