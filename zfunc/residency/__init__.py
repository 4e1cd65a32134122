"""A training state between steps: ``zf.bind`` runs the model on its current weights, for
generation and evaluation (``binding``); ``zf.offload_states`` moves its parts off the compute
device (host memory or files) and ``zf.reload_states`` brings them back (``offload``), the parts
and their DeepSpeed names (``parts``), the host buffers kept across cycles (``host``), the files
(``files``). docs/rl.md says what each call does and costs."""
from .binding import Bound, bind
from .host import HostBuffers, host_buffers
from .offload import DEVICES, OffloadedState, StateOffloaded, offload_states, reload_states
from .parts import DEEPSPEED_NAMES, PARTS

__all__ = ["Bound", "DEEPSPEED_NAMES", "DEVICES", "HostBuffers", "OffloadedState", "PARTS", "StateOffloaded",
           "bind", "host_buffers", "offload_states", "reload_states"]
