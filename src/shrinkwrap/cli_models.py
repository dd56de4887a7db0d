"""The models the ``shrinkwrap`` command names: a spec such as ``torchvision:resnet18`` read into a
picklable factory and a random batch for it.

A spec is ``torchvision:NAME``, ``timm:NAME``, ``transformers:CONFIGCLASS`` (random weights from the
config) or the user's own ``package.module:factory`` / ``path/to/file.py:factory``. The user's own
model gets a float batch of one sample's shape (``--input``, or the factory's ``input_shape``), or,
asked with ``--tokens`` (or a factory's ``vocab_size``), token ids as a Hugging Face language model
takes them: ``{"input_ids": ..., "labels": ...}``. What cannot be read is a :class:`CliError`, the
one line the user sees.

Example::

    >>> make, batch = load_model("shrinkwrap.models:tiny_efficientnet", None, 8)  # batch: 8x3x32x32
    >>> make, batch = load_model("mymodel.py:make", (128,), 4, tokens=32000)      # input_ids 4x128
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import os
import re
import sys
from typing import Any, Callable

import torch
import torch.nn as nn

from .select import got

_PIP = {"timm": "timm", "transformers": "transformers", "matplotlib": "matplotlib"}
_FORMS = "torchvision:NAME, timm:NAME, transformers:CONFIGCLASS, package.module:factory or path/to/file.py:factory"


class CliError(Exception):
    """Bad command-line input; the message is the one line the user sees."""


def matching_torchvision(torch_version: str | None = None) -> str:
    """The pip requirement for the torchvision built for a torch: 2.X pairs with 0.(X+15).

    A torchvision built for another torch does not import beside it (its compiled operators are
    missing), and an unpinned ``pip install torchvision`` may bring the newest one, or a new torch
    with it. Outside torch 2.x the rule does not reach: the plain name is returned.

    Args:
        torch_version: a torch version such as ``"2.4.1+cu121"``; by default the installed one.

    Returns:
        A requirement such as ``"torchvision==0.19.*"``.

    Example::

        >>> matching_torchvision("2.13.0+cpu")
        'torchvision==0.28.*'
    """
    m = re.match(r"2\.(\d+)(?:\D|$)", torch_version or torch.__version__)
    return f"torchvision==0.{int(m.group(1)) + 15}.*" if m else "torchvision"


def _torchvision_pip() -> str:
    """The command that installs the matching torchvision from the index this torch came from (a
    build with a local version, ``+cpu`` or ``+cu126``, comes from download.pytorch.org)."""
    local = torch.__version__.partition("+")[2]
    index = f" --index-url https://download.pytorch.org/whl/{local}" if local else ""
    return f"pip install '{matching_torchvision()}'{index}"


def _install(package: str) -> str:
    """How to install ``package`` beside this torch: timm brings torchvision, so the matching one first."""
    if package == "torchvision":
        return f"install the torchvision built for torch {torch.__version__}: {_torchvision_pip()}"
    if package == "timm":
        return (f"install the torchvision built for torch {torch.__version__}, then timm: {_torchvision_pip()} "
                "&& pip install timm")
    return f"install it with: pip install {_PIP.get(package, package)}"


def need(package: str) -> Any:
    """``package`` imported, or a :class:`CliError` saying how to install it beside this torch.

    Args:
        package: an optional package's import name (``"torchvision"``, ``"matplotlib"``).

    Returns:
        The imported module.
    """
    if importlib.util.find_spec(package) is None:
        raise CliError(f"{package} is not installed; {_install(package)}")
    try:
        return importlib.import_module(package)
    except Exception as exc:  # noqa: BLE001 - a broken install (torchvision built for another torch) is one line
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CliError(f"{package} is installed but cannot be imported ({type(exc).__name__}: {first}); built for "
                       f"another torch than {torch.__version__}? {_install(package)}") from exc


def _unknown(kind: str, name: str, known: list[str]) -> CliError:
    close = difflib.get_close_matches(name, known, n=4, cutoff=0.5)
    return CliError(f"unknown {kind} {name!r}" + (f"; close names: {', '.join(close)}" if close else ""))


# -- model families: module-level functions, so a row can be sent to a subprocess -----------


def _torchvision(name: str) -> nn.Module:
    return importlib.import_module("torchvision").models.get_model(name, weights=None)


def _timm(name: str) -> nn.Module:
    return importlib.import_module("timm").create_model(name, pretrained=False)


def _hf_config(name: str) -> Any:
    transformers = importlib.import_module("transformers")
    return getattr(transformers, name)()


def _hf_model_class(config: Any) -> Any:
    """GPT-style decoders get their LM head; encoders (BERT) a sequence-classification head."""
    transformers = importlib.import_module("transformers")
    auto = transformers.models.auto.modeling_auto
    kind = config.model_type
    if kind in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and kind not in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    if kind in auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModel


def _transformers(name: str) -> nn.Module:
    config = _hf_config(name)
    return _hf_model_class(config).from_config(config)


class _Built:
    """The model factory of a spec. What goes wrong inside it is the user's model, not shrinkwrap:
    it reaches the user as one line naming the spec and the exception, not as a traceback through
    the measuring code. Picklable, so a row can be sent to a subprocess."""

    def __init__(self, spec: str, factory: Callable[[], nn.Module]) -> None:
        self.spec, self.factory = spec, factory
        self.__name__ = getattr(factory, "__name__", spec)

    def __call__(self) -> nn.Module:
        try:
            model = self.factory()
        except Exception as exc:
            raise CliError(f"model {self.spec} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(model, nn.Module):
            raise CliError(f"model {self.spec} returned {got(model)}, not an nn.Module")
        return model


def load_model(spec: str, input_shape: tuple[int, ...] | None, batch_size: int,
               tokens: int | bool | None = None) -> tuple[Callable[[], nn.Module], Any]:
    """A picklable factory for ``spec`` and a random batch for it (on the CPU, seeded).

    Args:
        spec: the model, as the command takes it (``torchvision:resnet18``, ``file.py:factory``, ...).
        input_shape: one sample's shape (``--input``); for token models the sequence length alone.
        batch_size: the batch's first dimension.
        tokens: for the user's own model, token ids of this vocabulary size (``--tokens V``);
            ``True`` reads it from the model (``--tokens`` alone).

    Returns:
        ``(factory, batch)``: a tensor of images or samples, or a dict of ``input_ids`` and ``labels``.

    Example::

        >>> make, batch = load_model("torchvision:resnet18", None, 8)   # batch: 8x3x224x224
    """
    factory, batch = _factory_and_batch(spec, input_shape, batch_size, tokens)
    return _Built(spec, factory), batch


def _factory_and_batch(spec: str, input_shape: tuple[int, ...] | None, batch_size: int,
                       tokens: int | bool | None) -> tuple[Callable[[], nn.Module], Any]:
    family, sep, name = spec.partition(":")
    if not sep or not name or not family:
        raise CliError(f"cannot read model {spec!r}; write {_FORMS}")
    if tokens and family in ("torchvision", "timm", "transformers"):
        raise CliError(f"--tokens is for your own model (package.module:factory or file.py:factory); {spec} "
                       + ("reads its vocabulary from the config: leave out --tokens" if family == "transformers"
                          else "takes images: leave out --tokens"))
    gen = torch.Generator().manual_seed(0)
    images = lambda shape: torch.randn(batch_size, *(input_shape or shape), generator=gen)  # noqa: E731
    if family == "torchvision":
        tv = need("torchvision")
        if name not in tv.models.list_models():
            raise _unknown("torchvision model", name, tv.models.list_models())
        return functools.partial(_torchvision, name), images((3, 224, 224))
    if family == "timm":
        timm = need("timm")
        if not timm.is_model(name):
            raise _unknown("timm model", name, timm.list_models())
        cfg = getattr(timm.models, "get_pretrained_cfg", lambda n: None)(name)  # older timm: 3x224x224
        return functools.partial(_timm, name), images(tuple(getattr(cfg, "input_size", None) or (3, 224, 224)))
    if family == "transformers":
        return _transformers_and_batch(spec, name, input_shape, batch_size, gen)
    module = _user_module(family, spec)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise CliError(f"{family} has no callable {name!r} to build the model")
    if tokens or getattr(factory, "vocab_size", None):
        return factory, _user_tokens(spec, factory, input_shape, batch_size, tokens, gen)
    shape = input_shape or getattr(factory, "input_shape", None)
    if shape is None:
        raise CliError(f"give one sample's shape for {spec}, e.g. --input 3,224,224 (a language model: "
                       "--tokens, and --input the sequence length)")
    return factory, images(tuple(shape))


def _transformers_and_batch(spec: str, name: str, input_shape: tuple[int, ...] | None, batch_size: int,
                            gen: torch.Generator) -> tuple[Callable[[], nn.Module], Any]:
    transformers = need("transformers")
    if importlib.util.find_spec("torchvision") is not None:
        try:  # transformers imports an installed torchvision, and its models fail to import with a broken one
            need("torchvision")
        except CliError as exc:
            raise CliError(f"{exc} (transformers models import it where it is installed and fail with it; "
                           "or: pip uninstall torchvision)") from exc
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PretrainedConfig)):
        known = [n for n in dir(transformers) if n.endswith("Config")]
        raise _unknown("transformers config class", name, known)
    if not getattr(cls, "model_type", ""):
        raise CliError(f"transformers:{name} is the base of every config: name a model's, such as GPT2Config")
    config = _hf_config(name)
    if not getattr(config, "vocab_size", None):
        raise CliError(f"transformers:{name} has no vocab_size, and the transformers: family feeds token ids: for "
                       "this model write a factory (file.py:factory) and give --input one sample's shape")
    longest = _positions(config)
    length = _sequence_length(spec, input_shape, min(longest or 512, 512), longest)
    ids = torch.randint(0, config.vocab_size, (batch_size, length), generator=gen)
    seq_cls = _hf_model_class(config) is transformers.AutoModelForSequenceClassification
    labels = torch.randint(0, config.num_labels, (batch_size,), generator=gen) if seq_cls else ids
    return functools.partial(_transformers, name), {"input_ids": ids, "labels": labels}


def _positions(config: Any) -> int | None:
    """The longest sequence a Hugging Face-style config holds, where it says."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def _sequence_length(spec: str, input_shape: tuple[int, ...] | None, default: int | None, longest: int | None) -> int:
    """``--input`` read as a sequence length: one number, within the model's positions."""
    if input_shape and len(input_shape) != 1:
        shape = ",".join(map(str, input_shape))
        raise CliError(f"{spec} takes token ids: --input is the sequence length, one number (e.g. --input 128), "
                       f"not {shape}")
    length = input_shape[0] if input_shape else default
    if length is None:
        raise CliError(f"give the sequence length for {spec}, e.g. --input 128")
    if longest and length > longest:
        raise CliError(f"{spec} holds {longest} positions, and --input {length} is longer: give --input {longest} "
                       "or less")
    return length


def _user_tokens(spec: str, factory: Callable[[], nn.Module], input_shape: tuple[int, ...] | None,
                 batch_size: int, tokens: int | bool | None, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Token ids for the user's own language model, as a Hugging Face model takes them (its loss
    is its own ``.loss`` from ``labels``). The vocabulary is ``--tokens V``, else the factory's
    ``vocab_size``, else the model's ``config.vocab_size``; the length ``--input L``, else the
    factory's ``input_shape``, else the config's positions up to 512."""
    vocab = getattr(factory, "vocab_size", None) if tokens is None or tokens is True else tokens
    declared = getattr(factory, "input_shape", None)
    config = None
    if not vocab or not (input_shape or declared):
        config = getattr(_read_model(spec, factory), "config", None)
        vocab = vocab or getattr(config, "vocab_size", None)
    if not vocab:
        raise CliError(f"--tokens without a number reads config.vocab_size from the model, and {spec}'s model "
                       "has none: give the vocabulary size, e.g. --tokens 32000")
    longest = _positions(config)
    length = _sequence_length(spec, input_shape or (tuple(declared) if declared else None),
                              min(longest, 512) if longest else None, longest)
    ids = torch.randint(0, int(vocab), (batch_size, length), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _read_model(spec: str, factory: Callable[[], nn.Module]) -> nn.Module:
    """The model built here once, to read its config: each row builds its own in a fresh process,
    so this one is built on the meta device, where it takes no memory and no time to initialise;
    a factory that cannot build there (it loads weights, say) is built as it is."""
    built = _Built(spec, factory)
    try:
        with torch.device("meta"):
            return built()
    except CliError:
        return built()


def _user_module(where: str, spec: str) -> Any:
    """The module a ``package.module:factory`` or ``path/to/file.py:factory`` spec names. The
    current folder is searched first, as ``python -m`` does; a file's folder is added to the path,
    so that its module imports by name in the fresh processes that measure each row."""
    path = None
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = os.path.abspath(where if where.endswith(".py") else where + ".py")
        if not os.path.isfile(path):
            raise CliError(f"no file {where!r} for model {spec!r}")
        folder, name = os.path.split(path)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        where = name.removesuffix(".py")
    elif os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(where)
    except ImportError as exc:
        raise CliError(f"cannot import {where!r} for model {spec!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised on import: one line, not a traceback
        raise CliError(f"importing {where!r} for model {spec!r} raised {type(exc).__name__}: {exc}") from exc
    found = getattr(module, "__file__", None)
    if path and (not found or os.path.realpath(found) != os.path.realpath(path)):
        # The name is taken (json.py, test.py): the rows import the module by name, so the file is
        # renamed, not loaded by path here alone.
        raise CliError(f"model {spec!r}: the module name {where!r} is taken by {found or 'a built-in module'}, so "
                       f"{path} cannot be imported by it; rename the file")
    return module
