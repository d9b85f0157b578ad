from engine.drafters.base import Drafter, Proposal
from engine.drafters.model import ModelDrafter, TokenizerMismatchError
from engine.drafters.ngram import NgramDrafter

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "Proposal", "TokenizerMismatchError"]
