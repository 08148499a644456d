"""The bundled model and its task suite (see bundled/model/MODEL_CARD.md)."""
