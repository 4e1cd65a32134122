"""Checkpoints: sharded save and load at any world size (``sharded``), their files and atomic
folders (``files``, ``folders``), the caller's ``client_state`` kept with them
(``client_state``), consolidation and Hugging Face export (``hf_export``, ``hf_files``; a peft
model's adapters or merged model: ``peft_export``), the weights streamed out unit by unit for an
inference engine (``stream``), and the command line (``python -m zfunc.checkpoint``, ``cli``).

It reads and writes states; a step never imports it. Pretrained weights coming *in* are a step's
init, so they live below the step, in ``zfunc.weights``.
"""
from .cli import main
from .files import DamagedCheckpointError
from .hf_export import save_hf
from .sharded import Saved, consolidate, export_hf, load, model_layout, resolve, save
from .stream import iter_weights

__all__ = ["DamagedCheckpointError", "Saved", "consolidate", "export_hf", "iter_weights", "load", "main",
           "model_layout", "resolve", "save", "save_hf"]
