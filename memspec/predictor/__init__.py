"""Acceptance predictor: α per draft from prompt features and generation context."""

from memspec.predictor.model import (
    AcceptancePredictor,
    PredictorError,
    load_or_fallback,
    load_predictor,
)

__all__ = ["AcceptancePredictor", "PredictorError", "load_or_fallback", "load_predictor"]
