"""Where a state's first values come from: pretrained safetensors files read unit by unit
(``pretrained``, ``safetensors_reader``, ``hf_keys``), or transformers' own initialization of a
model built on the meta device (``hf_init``); a peft model's base read from its base model's folder
(``peft_keys``) and its adapters made by peft's own init (``peft_init``).

Both are part of ``Step.init``, so this package sits below the step; checkpoints written by
zfunc (and Hugging Face export) are ``zfunc.checkpoint``.
"""
from .pretrained import IncompatibleKeys, Weights, WeightsMismatch

__all__ = ["IncompatibleKeys", "Weights", "WeightsMismatch"]
