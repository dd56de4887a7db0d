"""The transforms, one module per family (a file, or a package where a family has several
concerns). Importing a family registers its plan steps; its ``__all__`` is what the package
exports. A new family is a file here and its name below."""

import importlib

FAMILIES = ("checkpoint", "activations", "swiglu", "precision", "layout", "offload", "lm_head", "optimizer", "compile")

__all__: list[str] = []
for _family in FAMILIES:
    _module = importlib.import_module(f".{_family}", __name__)
    globals().update({_name: getattr(_module, _name) for _name in _module.__all__})
    __all__ += _module.__all__
