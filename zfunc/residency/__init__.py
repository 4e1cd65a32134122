"""Where a training state lives between phases: ``zf.offload_states`` moves its parts off the
compute device (host memory or files) and ``zf.reload_states`` brings them back (``offload``), the
parts and their DeepSpeed names (``parts``), the host buffers kept across cycles (``host``), the
files (``files``). docs/rl.md says what each call does and costs."""
from .host import HostBuffers, host_buffers
from .offload import DEVICES, OffloadedState, StateOffloaded, offload_states, reload_states
from .parts import DEEPSPEED_NAMES, PARTS

__all__ = ["DEEPSPEED_NAMES", "DEVICES", "HostBuffers", "OffloadedState", "PARTS", "StateOffloaded",
           "host_buffers", "offload_states", "reload_states"]
