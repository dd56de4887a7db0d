"""Which submodules a transform acts on: the one selection function of shrinkwrap.

A pattern is one of:

- a string: a full-match regular expression (the ``regex`` package) on the dotted module name,
  e.g. ``r"layer[12]"`` matches ``layer1`` and ``layer2`` but not ``layer1.0``;
- a module type or a tuple of types: every module that is an instance;
- a list (or tuple) of exact dotted names;
- a predicate ``fn(module, name) -> bool``.

The root module (name ``""``) is never selected. Shrinkwrap's own wrappers are seen through: a
checkpointed ``BasicBlock`` still matches ``BasicBlock``.

This module also holds the argument checks every public function shares (:func:`require_module`,
:func:`wrong`; a count, a positive number, a flag, a function, a byte count): it is the bottom of
the imports, so every layer above can use the one check.
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import reprlib
from typing import Any, Callable, Sequence, Union

import regex
import torch.nn as nn

from ._wrapper import unwrap

Pattern = Union[str, type, tuple, Sequence[str], Callable[[nn.Module, str], bool]]


_repr = reprlib.Repr()
_repr.maxother = 60  # room for a step's fields: Swish(pattern=None, include_silu=False)


class SelectionError(ValueError):
    """A pattern is invalid or matches no module of the model."""


def got(obj: Any) -> str:
    """What an argument is, as an error message names it: ``the class Swish — call it: swish()``,
    ``str 'resnet'``, ``None``. A class gets the call to make (a plan step's class carries the
    name users call it by in ``name``), since passing ``sw.swish`` for ``sw.swish()`` is common."""
    if isinstance(obj, type):
        call = getattr(obj, "name", None)
        call = call if isinstance(call, str) and call else obj.__name__
        try:
            needs_args = any(p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                             for p in inspect.signature(obj).parameters.values())
        except (TypeError, ValueError):  # no signature to read (some builtins)
            needs_args = True
        return f"the class {obj.__name__} — call it: {call}({'...' if needs_args else ''})"
    if inspect.isroutine(obj):
        return f"the function {getattr(obj, '__name__', obj)}"
    if obj is None:
        return "None"
    text = " ".join(_repr.repr(obj).split())  # a module's repr spans lines
    return text if text.startswith(type(obj).__name__) else f"{type(obj).__name__} {text}"


def wrong(where: str, takes: str, obj: Any, hint: str = "") -> str:
    """The one message for an argument of the wrong type: what ``where`` takes and what it got."""
    return f"shrinkwrap: {where} takes {takes}; got {got(obj)}{hint}"


def require_module(obj: Any, where: str) -> nn.Module:
    """``obj`` if it is an ``nn.Module``; else a ``TypeError`` saying what ``where`` got.

    Every public function that takes a model checks it here first, so a wrong argument is one
    clear message instead of an AttributeError from deep inside.

    Example::

        >>> require_module("resnet", "apply()")
        TypeError: shrinkwrap: apply() takes a model (an nn.Module); got str 'resnet'
    """
    if not isinstance(obj, nn.Module):
        raise TypeError(wrong(where, "a model (an nn.Module)", obj))
    return obj


# The checks of numbers and flags. A bool is refused wherever a number is meant (True would read
# as 1), a float wherever an int is (2.5 iterations would be truncated, or fail deep inside), and
# nan and inf wherever a limit is (every comparison with nan is false: a limit that never holds).
# A wrong type is a TypeError, a number out of range a ValueError; both name the argument.


def count(value: Any, where: str, name: str, least: int = 1, none: bool = False) -> int | None:
    """``value``, an int of at least ``least`` (``None`` too where ``none``), or raise.

    Example::

        >>> count(1.5, "measure()", "iterations")
        TypeError: shrinkwrap: measure() takes iterations= an int of at least 1; got float 1.5
    """
    if value is None and none:
        return None
    takes = f"{name}= an int of at least {least}" + (" or None" if none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(wrong(where, takes, value))
    if value < least:
        raise ValueError(wrong(where, takes, value))
    return int(value)


def positive(value: Any, where: str, name: str, zero: bool = False, none: bool = False, below: float | None = None,
             what: str = "") -> float | None:
    """``value``, a finite number above 0 (or at least 0 where ``zero``; under ``below`` where
    given; ``None`` too where ``none``), as a float, or raise. ``what`` says what the number
    means, for the message."""
    if value is None and none:
        return None
    bounds = ("of 0 or more" if zero else "above 0") + (f" and below {below:g}" if below is not None else "")
    takes = f"{name}= a finite number {bounds}{what}" + (" or None" if none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(wrong(where, takes, value))
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero) or (below is not None and value >= below):
        raise ValueError(wrong(where, takes, value))
    return float(value)


def flag(value: Any, where: str, name: str, none: bool = False) -> bool | None:
    """``value``, True or False (``None`` too where ``none``), or raise: ``"no"`` or ``1`` would
    read as True."""
    if not (isinstance(value, bool) or (value is None and none)):
        raise TypeError(wrong(where, f"{name}= " + ("True, False or None" if none else "True or False"), value))
    return value


def text(value: Any, where: str, name: str, what: str = "a str") -> str | None:
    """``value``, a str or ``None``, or raise."""
    if value is not None and not isinstance(value, str):
        raise TypeError(wrong(where, f"{name}= {what} or None", value))
    return value


def function(value: Any, where: str, name: str, takes: str) -> Any:
    """``value``, a callable or ``None``, or raise: an optimizer made already, not a factory, say."""
    if value is not None and not callable(value):
        raise TypeError(wrong(where, f"{name}= {takes} or None", value))
    return value


MIB = 2**20


def byte_count(value: Any, where: str, name: str, as_text: bool = False, other: str = "") -> int:
    """``value``, a number of bytes (an int of at least 1 MiB), or raise. An int under 1 MiB is
    surely not meant as bytes (``budget=2``: 2 GiB meant); the message names what to write: the
    size as text where ``as_text`` (the argument reads ``'2GiB'``), and ``other`` readings it has
    (``", or a fraction of the baseline such as 0.5"``)."""
    count(value, where, name)
    if value < MIB:
        ways = ([f"{name}='{value}GiB'"] * as_text + [f"{value} * 2**30"] if value < 2**10 else
                [f"the size with its unit, {name}='4GiB'"] * as_text + ["4 * 2**30 for 4 GiB"])
        raise ValueError(f"shrinkwrap: {where} {name}={value} reads as {value} byte{'s' * (value != 1)}, less than "
                         f"1 MiB: write {', '.join(ways)}{other}")
    return int(value)


def describe(pattern: Pattern) -> str:
    """A short human-readable form of a pattern, for messages and reports."""
    if isinstance(pattern, str):
        return repr(pattern)
    if isinstance(pattern, type):
        return pattern.__name__
    if isinstance(pattern, (list, tuple)):
        return "[" + ", ".join(describe(p) for p in pattern) + "]"
    return getattr(pattern, "__qualname__", repr(pattern))


def _matcher(pattern: Pattern) -> Callable[[nn.Module, str], bool]:
    if isinstance(pattern, str):
        try:
            rx = regex.compile(pattern)
        except regex.error as exc:
            raise SelectionError(f"shrinkwrap: invalid regular expression {pattern!r}: {exc}") from None
        return lambda module, name: rx.fullmatch(name) is not None
    if isinstance(pattern, type) or (
        isinstance(pattern, tuple) and pattern and all(isinstance(p, type) for p in pattern)
    ):
        return lambda module, name: isinstance(module, pattern)
    if isinstance(pattern, (list, tuple)):
        if not all(isinstance(p, str) for p in pattern):
            raise SelectionError(
                f"shrinkwrap: a list pattern must hold module names (strings), got {describe(pattern)}"
            )
        wanted = set(pattern)
        return lambda module, name: name in wanted
    if callable(pattern):
        return lambda module, name: bool(pattern(module, name))
    raise SelectionError(
        f"shrinkwrap: cannot select modules with {pattern!r}; use a regex string, a module type, "
        "a list of names or a predicate fn(module, name) -> bool"
    )


def check_pattern(pattern: Pattern) -> None:
    """Raise :class:`SelectionError` for a pattern no model could be selected with (a wrong type, an
    invalid regex), before a model is at hand: a step made with one fails where it is written."""
    _matcher(pattern)


def _close_names(pattern: Pattern, names: list[str], n: int = 5) -> list[str]:
    key = pattern if isinstance(pattern, str) else describe(pattern)
    close = difflib.get_close_matches(key, names, n=n, cutoff=0.3)
    return close or names[:n]


def select(
    model: nn.Module, pattern: Pattern, *, outermost: bool = False, allow_empty: bool = False
) -> list[str]:
    """Return the dotted names of the submodules of ``model`` that ``pattern`` selects.

    Names come in ``model.named_modules()`` order. With ``outermost=True`` a match inside another
    match is dropped (``layer1`` and ``layer1.0`` both match: only ``layer1`` is returned).

    Raises :class:`SelectionError` for an invalid pattern, and for a pattern that matches nothing
    (unless ``allow_empty``), naming the pattern and a few of the model's real names close to it.

    Example::

        >>> select(torchvision.models.resnet18(), r"layer[12]")
        ['layer1', 'layer2']
    """
    require_module(model, "select()")
    flag(outermost, "select()", "outermost")
    flag(allow_empty, "select()", "allow_empty")
    match = _matcher(pattern)
    names: list[str] = []
    chosen: list[str] = []
    for name, module in model.named_modules():
        if not name:
            continue
        names.append(name)
        if outermost and any(name.startswith(c + ".") for c in chosen):
            continue
        if match(unwrap(module), name):
            chosen.append(name)
    if isinstance(pattern, (list, tuple)) and pattern and all(isinstance(p, str) for p in pattern):
        missing = [p for p in pattern if p not in names]
        if missing:
            raise SelectionError(
                f"shrinkwrap: no module named {', '.join(map(repr, missing))} in "
                f"{type(model).__name__}; close names: {', '.join(_close_names(missing[0], names))}"
            )
    if not chosen and not allow_empty:
        raise SelectionError(
            f"shrinkwrap: pattern {describe(pattern)} matches no module of {type(model).__name__} "
            f"(a string pattern must match the whole dotted name). Close names: "
            f"{', '.join(_close_names(pattern, names)) or '(the model has no submodules)'}"
        )
    return chosen


def _digit_class(digits: list[int]) -> str:
    """A regex for one digit out of ``digits``: ``\\d``, ``7``, ``[0-7]``, ``[239]``."""
    if len(digits) == 10:
        return r"\d"
    runs: list[list[int]] = []
    for d in sorted(digits):
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    body = "".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else "".join(map(str, r)) for r in runs)
    return body if len(digits) == 1 else f"[{body}]"


def _numbers(numbers: list[int]) -> str:
    """A regex that matches exactly ``numbers`` (no leading zeros): ``[0-5]``, ``9|1[0-7]``,
    ``[1-3]\\d``; tens with the same last digits share one class."""
    by_tens: dict[int, list[int]] = {}
    for n in sorted(set(numbers)):
        by_tens.setdefault(n // 10, []).append(n % 10)
    small = by_tens.pop(0, None)
    same_ends: dict[str, list[int]] = {}
    for tens, ends in by_tens.items():
        same_ends.setdefault(_digit_class(ends), []).append(tens)
    parts = [_digit_class(small)] if small else []
    for ends, tens in same_ends.items():
        head = _digit_class(tens) if max(tens) < 10 else _numbers(tens)
        parts.append((f"(?:{head})" if "|" in head else head) + ends)
    return "|".join(parts)


def _part(parent: str, children: str) -> str:
    """``parent\\.children`` (children an alternation in a group), or ``children`` at the root."""
    if not parent:
        return children
    return parent + r"\." + (f"(?:{children})" if "|" in children else children)


def pattern_for(model: nn.Module, names: Sequence[str]) -> str:
    """A full-match regex that selects exactly ``names`` among ``model``'s modules, as short as
    reads well: the numbered children of one parent as ``layer3\\.\\d+`` when they are all of
    them, some of them as numbers (``layer3\\.(?:9|1[0-7])``); parents that differ by their number
    alone and hold the same children as one (``layer[1-3]\\.\\d+``); the names themselves,
    escaped, when nothing shorter selects exactly them.

    Example::

        >>> pattern_for(resnet, ["layer2.0", "layer2.1", "layer3.0", "layer3.1", "layer4.0"])
        'layer[23]\\.\\d+|layer4\\.0'
    """
    groups: dict[str, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    children: dict[str, str] = {}  # parent -> the regex of its chosen children
    for parent, leaves in groups.items():
        siblings = [k for k in model.get_submodule(parent)._modules] if parent or not names else list(model._modules)
        if all(k.isdigit() for k in siblings) and sorted(leaves) == sorted(siblings):
            children[parent] = r"\d+"
        elif all(k.isdigit() and (k == "0" or not k.startswith("0")) for k in leaves):
            children[parent] = _numbers([int(k) for k in leaves])
        else:
            children[parent] = "|".join(regex.escape(k) for k in leaves)
    # Parents that differ by a trailing number alone (layer1, layer2) and hold the same children: one part.
    numbered: dict[tuple[str, str], list[int]] = {}
    parts: list[str] = []
    for parent, kids in children.items():
        m = regex.fullmatch(r"(.*?\D)?(0|[1-9]\d*)", parent)
        if m:
            numbered.setdefault((m.group(1) or "", kids), []).append(int(m.group(2)))
        else:
            parts.append(_part(regex.escape(parent), kids))
    for (stem, kids), numbers in numbered.items():
        digits = _numbers(numbers)
        parts.append(_part(regex.escape(stem) + (f"(?:{digits})" if "|" in digits else digits), kids))
    text = "|".join(parts)
    wanted = sorted(names)
    if sorted(select(model, text, allow_empty=True)) == wanted:
        return text
    return "|".join(regex.escape(n) for n in names)


def compiled_how(m: nn.Module) -> str | None:
    """How ``m`` runs compiled, for messages: in place (``nn.Module.compile``, or shrinkwrap's
    ``compile()`` step), as ``torch.compile``'s wrapper (``OptimizedModule``), or not (None)."""
    if type(m).__name__ == "OptimizedModule":
        return "by torch.compile (an OptimizedModule wrapper)"
    if m.__dict__.get("_compiled_call_impl") is not None:
        return "in place (nn.Module.compile)"
    return None


def has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)  # what holds a stack of blocks


def block_groups(model: nn.Module) -> list[tuple[str, list[str], bool]]:
    """``(container, [block names], nested)`` for every Sequential, ModuleList or ModuleDict (a
    DenseNet's dense block) holding two or more blocks (modules with children and parameters) of
    one type, and for every other module holding two or more layers (:func:`_layer`) of one type,
    a group a type: its own forward calls them by name (GoogLeNet's Inception modules and aux
    heads, Inception-v3's Inception modules; not their conv-bn pairs). Not where those hold
    stacks of layers themselves (a T5 model's encoder and decoder, two ResNet towers): the layers
    are the blocks. Groups inside a block that is not itself a plain container (inside a residual
    block or a transformer layer) are left out: their parts are too small to be worth a
    measurement, as are those inside a container's lone block; not those inside a stage of a class
    of its own (:func:`_is_stage`). ``nested``: the group lies
    inside another group's block (an EfficientNet stage inside ``features``). Types are read
    through shrinkwrap's wrappers: a stack with some blocks checkpointed is still one stack."""
    out: list[tuple[str, list[str], bool]] = []
    real_blocks: list[str] = []
    known = dict(model.named_modules())  # a module shared under a second name is known by its first only
    for name, c in known.items():
        if any(lies_inside(name, b) for b in real_blocks):
            continue
        kids = [(f"{name}.{k}" if name else k, unwrap(m)) for k, m in c.named_children()]
        kids = [(n, m) for n, m in kids if n in known and has_params(m) and any(True for _ in m.children())]
        if isinstance(unwrap(c), CONTAINERS):
            types = [type(m) for _, m in kids]
            found = [[(n, m) for n, m in kids if types.count(type(m)) >= 2]]
        else:
            by_type: dict[type, list] = {}
            for n, m in kids:
                if not isinstance(m, CONTAINERS) and _layer(m):  # a container child is a stack of its own
                    by_type.setdefault(type(m), []).append((n, m))
            found = [blocks for blocks in by_type.values() if not any(_holds_layers(m) for _, m in blocks)]
        for blocks in found:
            if len(blocks) < 2:
                continue
            nested = any(lies_inside(name, b) for _, bs, _ in out for b in bs)
            out.append((name, [n for n, _ in blocks], nested))
            # A stage of a class of its own (timm's ConvNeXt and MetaFormer stages) holds its stack
            # of layers in a container: looked inside, as a plain container is.
            # A container of one block (a GhostNet stage of one bottleneck) is that block.
            lone = [(n, m) if not isinstance(m, CONTAINERS) else _lone(n, m) for n, m in blocks]
            real_blocks += [n for n, m in lone if m is not None and not isinstance(m, CONTAINERS) and not _is_stage(m)]
    return out


def _lone(name: str, container: nn.Module) -> tuple[str, nn.Module | None]:
    """The one child with parameters of ``container``, by name, or ``(name, None)``."""
    kids = [(f"{name}.{k}", unwrap(m)) for k, m in container.named_children() if has_params(m)]
    return kids[0] if len(kids) == 1 else (name, None)


def _layer(m: nn.Module) -> bool:
    """Whether ``m`` is more than a conv-norm pair: three or more modules with parameters of their own."""
    return sum(any(True for _ in x.parameters(recurse=False)) for x in m.modules()) >= 3


def _stacked_layers(block: nn.Module, kinds: tuple[type, ...] = (nn.Module,)) -> list[str]:
    """The blocks of ``block``'s own stacks (:func:`block_groups`) that are layers, of the stacks
    held in a module of one of ``kinds`` (every stack by default)."""
    return [n for c, names, _ in block_groups(block) if isinstance(unwrap(block.get_submodule(c)), kinds)
            for n in names if _layer(block.get_submodule(n))]


def _side_layers(model: nn.Module, block: str, stacks: list[str]) -> list[str]:
    """The children of the module ``block`` of a layer's size that hold none of the blocks
    ``stacks``: a stage's downsample or patch embedding beside its stack."""
    kids = ((f"{block}.{k}" if block else k, m) for k, m in model.get_submodule(block).named_children())
    return [n for n, m in kids if _layer(unwrap(m)) and not any(lies_inside(s, n) for s in stacks)]


def _is_stage(block: nn.Module) -> bool:
    """Whether ``block`` is a stage: it holds a stack of layers in a container, and beside the stack
    nothing of a layer's size but, where the stack is a Sequential (run whole, in order), children
    that are layers of their own (a FastViT stage's patch embedding: a block of its own in the
    finer grain, :func:`blocks_by_depth`). Not a transformer layer with experts in a ModuleList
    beside its attention (each expert called as its router says), nor a block whose forward calls
    two layers by name (GhostNet's two Ghost modules): those are blocks."""
    stacks = _stacked_layers(block, CONTAINERS)
    sides = _side_layers(block, "", stacks) if stacks == _stacked_layers(block, (nn.Sequential,)) else []
    return bool(stacks) and not any(_layer(m) for n, m in block.named_modules() if n and not any(
        lies_inside(n, s) or lies_inside(s, n) for s in stacks + sides))


def _holds_layers(block: nn.Module) -> bool:
    """Whether ``block`` holds a stack of layers of its own (a ResNet's stage, a transformer's
    layers, a GoogLeNet's Inception modules), not only of small parts (an Inception branch's
    conv-bn pairs)."""
    return bool(_stacked_layers(block))


def innermost_blocks(model: nn.Module, within: str = "") -> list[str]:
    """The blocks of the model's stacks (:func:`block_groups`) inside the module named ``within``
    (the whole model by default) that hold no stack themselves: a stage's blocks rather than the
    stage, and the blocks of a stage of stages.

    Example::

        >>> innermost_blocks(convnext, "features.1")   # ['features.1.0', 'features.1.1', 'features.1.2']
    """
    grains = blocks_by_depth(model)
    return [b for b in (grains[-1] if grains else []) if b != within and lies_inside(b, within)]


def blocks_by_depth(model: nn.Module) -> list[list[str]]:
    """The model's blocks (:func:`block_groups`) a grain at each depth of its stacks: the
    outermost stacks' blocks first (a ConvNeXt's stages), each next list with every block that
    holds a stack replaced by that stack's blocks and the layers beside them (a FastViT stage's
    patch embedding), down to the blocks that hold none (:func:`innermost_blocks`). A model of
    one stack has one grain.

    Example::

        >>> blocks_by_depth(convnext)[0][:2]    # ['features.1', 'features.2']: a stage, a downsample
        >>> blocks_by_depth(convnext)[-1][:2]   # ['features.1.0', 'features.1.1']: the stage's blocks
    """
    groups = block_groups(model)
    # A stack's depth: how many blocks of other stacks hold it (a stage is a block of the stack of stages).
    depth = {container: sum(lies_inside(container, b) for _, names, _ in groups for b in names)
             for container, _, _ in groups}
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    out: list[list[str]] = []
    for d in sorted(set(depth.values())):
        stages = [c for c, _, _ in groups if depth[c] <= d]
        blocks = [b for c, names, _ in groups if depth[c] <= d for b in names]
        inner = [b for b in blocks if not any(lies_inside(s, b) for s in stages)]
        # A block opened into its stack's blocks keeps what is of a layer's size beside the stack.
        sides = [s for b in blocks if b not in inner for s in _side_layers(model, b, blocks)]
        grain = sorted(set(inner + sides), key=lambda b: order.get(b, len(order)))
        if grain and grain not in out:
            out.append(grain)
    return out


def lies_inside(name: str, region: str) -> bool:
    """Whether the module ``name`` is ``region`` or lies inside it (``""``, the root, holds all)."""
    return not region or name == region or name.startswith(region + ".")
