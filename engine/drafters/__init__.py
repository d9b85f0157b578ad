from .base import Drafter, Proposal
from .ngram import NgramDrafter
from .model import ModelDrafter, TokenizerMismatchError

__all__ = ["Drafter", "Proposal", "NgramDrafter", "ModelDrafter", "TokenizerMismatchError"]
