"""Fresh processes: where a configuration runs with nothing of another in its allocator.

On CUDA each measured row (``compare``), each plan compiled ahead (``autoplan``'s compile stage)
and each probe of a memory cap (``fit``) runs in a new spawned process: allocator caches, cuDNN
workspaces and CUDA graph pools of one cannot count in the next.

- ``copies.py``: how a model travels to such a process (a factory, or copies of an instance) and
  how a plan's model is built there.
- ``sendable.py``: whether a process can start at all (what it is sent must pickle; the main
  script, which it runs again, must let it).
- ``settings.py``: the compiler settings a process takes on, so that its work lands in the caches
  its parent reads.
- ``fresh.py``: a row's process, started when asked (or ahead, and primed), and how one is ended.
- ``ahead.py``: plans compiled side by side, each in a process of its own, then measured there.
"""

from .ahead import compile_ahead
from .copies import model_maker
from .fresh import PROCESS_MARGIN, FreshProcesses
from .settings import compile_settings, take_settings

__all__ = ["FreshProcesses", "PROCESS_MARGIN", "compile_ahead", "compile_settings", "model_maker", "take_settings"]
