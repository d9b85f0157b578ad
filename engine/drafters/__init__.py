from .base import Drafter, Proposal
from .model import ModelDrafter, TokenizerMismatchError
from .ngram import NgramDrafter

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "Proposal", "TokenizerMismatchError"]
