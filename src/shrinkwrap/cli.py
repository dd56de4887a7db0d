"""The ``shrinkwrap`` command: ``demo``, ``profile``, ``fit`` and ``estimate``.

``shrinkwrap demo`` measures a plan on the built-in EfficientNet-style model (no downloads; seconds
on a laptop CPU, CUDA when present). ``shrinkwrap profile`` measures a plan on a model named as
``torchvision:NAME``, ``timm:NAME``, ``transformers:CONFIGCLASS`` (random init from the config) or
``package.module:factory`` (with ``--tokens``, a language model: a batch of token ids); without
``--plan`` it profiles the model as it is (the baseline and the modules that keep the most). Bad
input, and a model factory that raises, get one line on stderr and exit status 2.

``shrinkwrap profile ... --nproc N --fsdp`` (or ``--ddp``) measures on N ranks of this machine: it
starts them through ``torch.distributed.run``, each applies the plan, then shards its model with
FSDP2 (each block, then the root) or wraps it in DDP, and measures; rank 0 prints the report, a
column per rank. The same command started under ``torchrun`` (without ``--nproc``) is one rank.

``shrinkwrap estimate MODEL --batch N [--plan ...]`` predicts the CUDA peak on the CPU, in
seconds (:func:`shrinkwrap.estimate`); ``shrinkwrap fit`` finds the plan for a budget (autoplan).

Example::

    shrinkwrap demo
    shrinkwrap profile torchvision:resnet18 --batch 128
    shrinkwrap profile torchvision:resnet18 --batch 128 --plan "checkpoint('layer[1-4]'), autocast(torch.bfloat16)" \\
        --json report.json --plot memory.png
    shrinkwrap profile torchvision:resnet18 --batch 64 --plan "checkpoint('layer[1-4]')" --nproc 2 --fsdp
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import os
import re
import sys
import traceback
from typing import Any, Callable, NoReturn

import torch
import torch.nn as nn

from . import parallel
from .cli_models import CliError, load_model, matching_torchvision, need
from .compare import Parallelize, plan_report
from .measuring.ranks import rank_and_world
from .measuring.step import resolve_device
from .plan import Plan
from .step import step_class

__all__ = ["CliError", "demo_plan", "load_model", "main", "matching_torchvision"]

# What matplotlib's savefig writes (its default canvases); any other ending is refused before measuring.
_PLOT_FORMATS = ("png", "pdf", "svg", "svgz", "eps", "ps", "jpg", "jpeg", "tif", "tiff", "webp", "pgf", "raw", "rgba")
_OUTPUTS = (("json", "report.json"), ("plot", "memory.png"), ("snapshot", "memory.pickle"))


def _writable(path: str | None, option: str, example: str) -> None:
    """Raise if ``path`` cannot be written (no name, a folder, its folder missing or read-only):
    before minutes of measuring. ``-`` is standard output, for ``--json`` only."""
    if path is None or (path == "-" and option == "--json"):
        return
    if not path.strip() or path == "-":
        stdout = " ('-': print it)" if option == "--json" else ""
        raise CliError(f"{option} needs a file name, e.g. {option} {example}{stdout}")
    if os.path.isdir(path):
        raise CliError(f"{option} {path} is a folder; name a file in it, e.g. {option} {os.path.join(path, example)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise CliError(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        which = "the file" if os.path.exists(path) else f"the folder {folder}"
        raise CliError(f"{option} {path}: {which} is not writable")


# -- running ------------------------------------------------------------------------------


def _device(text: str | None) -> str:
    """``--device`` read now: cpu or cuda (the GPU it names present), not a device met after minutes."""
    try:
        device = resolve_device(text)
    except RuntimeError as exc:
        if text and text.startswith("cuda") and not torch.cuda.is_available():
            raise CliError(f"--device {text} asked, but this torch ({torch.__version__}) sees no CUDA GPU; "
                           "use --device cpu, or install a CUDA build of torch") from None
        raise CliError(f"unknown device {text!r}; use cpu or cuda") from exc
    if device.type not in ("cpu", "cuda"):
        raise CliError(f"--device {text}: shrinkwrap measures on cpu or cuda")
    if device.type == "cuda" and ":" in (text or "") and device.index >= torch.cuda.device_count():
        raise CliError(f"--device {text}: this machine has {torch.cuda.device_count()} GPU(s), cuda:0 to "
                       f"cuda:{torch.cuda.device_count() - 1}")
    return str(device)


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes such as 3,224,224, got {text!r}") from None
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return shape


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def _slowdown(text: str) -> float:
    """``--max-slowdown``: a multiple of the baseline's step time, a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected the step time allowed as a multiple of the baseline's, a number "
                                         f"above 0 such as 1.2 (at most 20% slower), got {text!r}")
    return value


def _vocabulary(text: str) -> int:
    """``--tokens V``: the vocabulary size, a positive whole number."""
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        hint = "; a model named after --tokens is read as its value: put the model first" if ":" in text else ""
        raise argparse.ArgumentTypeError(f"expected the vocabulary size, a positive whole number such as 32000 "
                                         f"(--tokens alone: the model's config.vocab_size), got {text!r}{hint}") from None


def _compile_text(text: str) -> str:
    """``--compile STEP``: one compile step's text, read now, not after the baseline is measured."""
    try:
        plan = Plan.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("shrinkwrap: ")) from None
    if len(plan) != 1 or plan.steps[0].name != "compile":
        raise argparse.ArgumentTypeError(f"expected a compile step such as \"compile(mode='max-autotune')\", "
                                         f"got {text!r}")
    return text


def _check_outputs(args: argparse.Namespace, device: str) -> None:
    """What can be checked of the outputs before minutes of measuring: their names and folders,
    the plot's format and matplotlib, a snapshot's GPU, options that would be dropped."""
    if args.snapshot and not device.startswith("cuda"):
        raise CliError("--snapshot records the CUDA allocator; it needs a GPU (--device cuda)")
    if args.json == "-" and args.markdown:
        raise CliError("--json - prints JSON in place of the table, and --markdown prints the table as markdown: "
                       "give one (--json FILE --markdown writes the JSON and prints markdown)")
    for name, example in _OUTPUTS:
        _writable(getattr(args, name), f"--{name}", example)
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        raise CliError(f"--json and --plot both name {args.plot}; give each its own file")
    if args.plot:
        if os.path.splitext(args.plot)[1].lstrip(".").lower() not in _PLOT_FORMATS:
            raise CliError(f"--plot {args.plot}: end the name in a format matplotlib writes "
                           f"({', '.join(_PLOT_FORMATS)}), e.g. memory.png")
        need("matplotlib")


def _run(args: argparse.Namespace, factory: Callable[[], nn.Module], batch: Any, plan: Plan, name: str,
         parallelize: Parallelize | None = None, device: str | None = None) -> int:
    device = device or _device(args.device)
    _check_outputs(args, device)
    rank = (rank_and_world() or (0, 1))[0]
    fit = True if getattr(args, "fit", False) else None
    if fit and not device.startswith("cuda"):
        raise CliError("--fit trains each row under memory caps on the GPU; it needs --device cuda")
    report = plan_report(plan, factory, batch, iterations=args.iterations, device=device, snapshot=args.snapshot,
                         progress=not args.quiet, name=name, parallelize=parallelize, fit=fit)
    return _emit(args, report) if rank == 0 else 0


def _emit(args: argparse.Namespace, report: Any) -> int:
    if args.json == "-":
        print(report.to_json())
    else:
        print(report.to_markdown() if args.markdown else report.to_text(notes=None if args.verbose else 6))
        if args.json:
            with open(args.json, "w") as f:
                f.write(report.to_json() + "\n")
    if args.plot:
        report.plot(args.plot)
    return 0


def demo_plan() -> Plan:
    """The demo's plan (swish, bn_act, checkpoint each block, bfloat16 autocast), keeping the steps
    this install has."""
    from .models import DEMO_PLAN

    calls = ast.parse(f"[{DEMO_PLAN}]", mode="eval").body.elts  # type: ignore[attr-defined]
    return Plan.parse(", ".join(ast.unparse(c) for c in calls if step_class(c.func.id)))


def _demo(args: argparse.Namespace) -> int:
    from .models import tiny_efficientnet

    size = args.batch or (128 if _device(args.device).startswith("cuda") else 8)  # seconds either way
    batch = torch.randn(size, *tiny_efficientnet.input_shape, generator=torch.Generator().manual_seed(0))
    return _run(args, tiny_efficientnet, batch, demo_plan(), "shrinkwrap.models:tiny_efficientnet (naive Swish)")


def _profile(args: argparse.Namespace) -> int:
    plan = Plan.parse(args.plan)  # no --plan: the model as it is, its baseline and per-module table
    factory, batch = load_model(args.model, args.input, args.batch, args.tokens)
    if parallel.launched() and (args.fsdp or args.ddp):  # a rank this command started (torchrun's
        return _rank(args, factory, batch, plan)           # variables alone may be inherited)
    if args.fsdp or args.ddp or args.nproc:
        return _launch(args)
    return _run(args, factory, batch, plan, args.model)


def _launch(args: argparse.Namespace) -> int:
    """Check what can be checked here, then start ``--nproc`` ranks of this same command."""
    if not args.nproc:
        raise CliError(f"--{'fsdp' if args.fsdp else 'ddp'} measures on several ranks: add --nproc N, "
                       "or start the command under torchrun")
    if not (args.fsdp or args.ddp):
        raise CliError("--nproc needs --fsdp or --ddp: how each rank's model is sharded or replicated after the plan")
    device = _device(args.device)
    if device.startswith("cuda") and args.nproc > torch.cuda.device_count():
        raise CliError(f"--nproc {args.nproc} needs a GPU per rank; this machine has {torch.cuda.device_count()}")
    _check_outputs(args, device)
    return parallel.launch(args.nproc, _without_nproc(args.argv))


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc N`` (or ``--nproc=N``, or argparse's abbreviation ``--np N``): a rank
    does not start ranks, and torch.distributed.run would read ``--nproc`` as its own."""
    out, skip = [], False
    for tok in argv:
        name = tok.partition("=")[0]
        if skip:
            skip = False
        elif len(name) > 3 and "--nproc".startswith(name):
            skip = "=" not in tok
        else:
            out.append(tok)
    return out


def _rank(args: argparse.Namespace, factory: Callable[[], nn.Module], batch: Any, plan: Plan) -> int:
    """One rank under torchrun: join the group, measure every row with every rank, rank 0 prints."""
    device = parallel.init(_device(args.device).partition(":")[0])  # each rank its own GPU
    try:
        wrap = parallel.fsdp if args.fsdp else parallel.ddp if args.ddp else None
        parallelize = functools.partial(wrap, device=device) if wrap else None
        status = _run(args, factory, batch, plan, args.model, parallelize, str(device))
        # Every rank leaves the group together: a gloo rank that tore its group down while rank 0
        # was still printing died at exit with SIGABRT ("terminate called without an active
        # exception", a clean-clone CI run; not reproduced on demand).
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if getattr(spec, "name", None) == "shrinkwrap.__main__":
        # The process is this command alone (``python -m shrinkwrap``, as profile --nproc starts
        # its ranks): it leaves without the interpreter's teardown, where gloo's worker threads
        # may release tensors after the interpreter is gone and abort the process (torch PR
        # 179291 describes it). The SIGABRT above came once more after the barrier, at exit.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _budget(text: str) -> str:
    """The budget's text, checked now (autoplan reads it: a fraction in (0, 1] of the baseline, or
    bytes with a unit), not after the baseline is measured."""
    from .autoplan import parse_budget

    try:
        parse_budget(text, 1.0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("shrinkwrap: ")) from None
    return text


def _estimate(args: argparse.Namespace) -> int:
    from .measuring.estimate import estimate

    plan = Plan.parse(args.plan)
    _writable(args.json, "--json", "estimate.json")
    factory, batch = load_model(args.model, args.input, args.batch, args.tokens)
    est = estimate(factory, batch, plan)
    if args.json:
        data = {"schema": "shrinkwrap.estimate/2", "model": args.model, "plan": str(plan), "batch": args.batch,
                "torch_version": torch.__version__, "peak_mib": round(est.peak / 2**20, 1),
                **{f"{k}_mib": round(v / 2**20, 1) for k, v in est.breakdown().items()},
                "peak_at": est.moment, "peak_phase": est.phase, "peak_module": est.module, "holds": est.holds(),
                "seconds": round(est.seconds, 1), "notes": list(est.notes)}
        text = json.dumps(data, indent=2)
        if args.json == "-":
            print(text)
            return 0
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(f"{args.model}, batch {args.batch}, plan: {plan or '(none)'}")
    print(est)
    return 0


def _fit(args: argparse.Namespace) -> int:
    from .autoplan import autoplan

    device = _device(args.device)
    if args.snapshot:
        raise CliError("fit takes no --snapshot; profile the plan it prints to get one")
    if args.budget is None and args.max_slowdown is None:
        raise CliError("fit needs --budget (e.g. 8GiB, or 0.5 of the baseline), --max-slowdown (e.g. 1.2), or both")
    if args.maximize == "batch" and args.budget is None:
        raise CliError("--maximize batch finds the largest batch within a budget: add --budget (e.g. 8GiB)")
    _check_outputs(args, device)
    factory, batch = load_model(args.model, args.input, args.batch, args.tokens)
    plan, report = autoplan(factory, batch, budget=args.budget, max_slowdown=args.max_slowdown,
                            allow_lossy=args.allow_lossy, maximize=args.maximize, iterations=args.iterations,
                            device=device, progress=not args.quiet, compile=args.compile or False)
    report.model = args.model
    _emit(args, report)
    if args.json != "-":
        print(f"\nplan: {plan or '(none: the model as it is)'}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's errors as the command's others: one ``shrinkwrap: error:`` line naming where the
    help is, exit status 2 (argparse's own prints the usage block first)."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"shrinkwrap: error: {message} (see: {self.prog} --help)\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    from ._version import __version__

    parser = _Parser(prog="shrinkwrap", description="Measure what each step of a memory plan saves and costs.")
    parser.add_argument("--version", action="version", version=f"shrinkwrap {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def outputs(p: argparse.ArgumentParser, iterations: int) -> None:
        p.add_argument("--quiet", action="store_true", help="no progress on stderr")
        p.add_argument("--verbose", action="store_true", help="every note of the report (by default the first six)")
        p.add_argument("--debug", action="store_true", help="on an error, the whole traceback, not one line")
        p.add_argument("--device", help="cpu or cuda (default: cuda when present)")
        p.add_argument("--iterations", "--steps", type=_positive, default=iterations,
                       help=f"timed training iterations per row (default {iterations})")
        p.add_argument("--json", metavar="FILE", help="write the report as JSON ('-': print it instead of the table)")
        p.add_argument("--markdown", action="store_true", help="print a markdown table instead of the aligned one")
        p.add_argument("--plot", metavar="FILE.png",
                       help="write a plot of memory over one step: .png, .pdf, .svg, ... (needs matplotlib)")
        p.add_argument("--snapshot", metavar="FILE", help="CUDA: write a memory snapshot per row (pytorch.org/memory_viz)")

    demo = sub.add_parser("demo", help="measure a plan on the built-in EfficientNet-style model (no downloads)")
    demo.add_argument("--batch", type=_positive, help="batch size (default 128 on CUDA, 8 on a CPU)")
    outputs(demo, iterations=3)
    demo.set_defaults(func=_demo)

    def model_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="torchvision:NAME, timm:NAME, transformers:CONFIGCLASS or package.module:factory")
        p.add_argument("--batch", type=_positive, required=True, help="batch size")
        p.add_argument("--input", type=_shape, help="one sample's shape, e.g. 3,224,224 (token models: the sequence length)")
        p.add_argument("--tokens", type=_vocabulary, nargs="?", const=True, metavar="V",
                       help="your own model is a language model: a batch of input_ids and labels, vocabulary V "
                            "(alone: the model's config.vocab_size), --input the sequence length")

    prof = sub.add_parser("profile", help="measure a plan on a torchvision, timm, transformers or your own model")
    model_args(prof)
    prof.add_argument("--plan", default="", help="the plan's text, e.g. \"checkpoint('layer[12]'), swish()\" "
                      "(default: none: the model as it is)")
    prof.add_argument("--fit", action="store_true", help="CUDA: also find each row's smallest memory cap by training it "
                      "under caps in fresh processes (minutes a row): what a card must hold")
    prof.add_argument("--nproc", type=_positive, help="measure on N ranks of this machine, started through "
                      "torch.distributed.run (with --fsdp or --ddp); rank 0 prints the report, a column per rank")
    wrap = prof.add_mutually_exclusive_group()
    wrap.add_argument("--fsdp", action="store_true",
                      help="after the plan, shard each rank's model with FSDP2: fully_shard each block, then the root")
    wrap.add_argument("--ddp", action="store_true", help="after the plan, wrap each rank's model in DistributedDataParallel")
    outputs(prof, iterations=5)
    prof.set_defaults(func=_profile)

    est = sub.add_parser("estimate", help="predict a plan's CUDA peak on the CPU, in seconds, without a GPU")
    model_args(est)
    est.add_argument("--plan", default="", help="the plan's text (default: none: the model as it is)")
    est.add_argument("--json", metavar="FILE", help="write the estimate as JSON ('-': print it instead)")
    est.add_argument("--debug", action="store_true", help="on an error, the whole traceback, not one line")
    est.set_defaults(func=_estimate)

    fit = sub.add_parser("fit", help="find, by measuring, the plan that fits a memory budget at the highest speed")
    model_args(fit)
    fit.add_argument("--budget", type=_budget, help="e.g. 4GiB, 500MB, or 0.5 (a fraction of the baseline)")
    fit.add_argument("--max-slowdown", type=_slowdown,
                     help="the most step time allowed, as a multiple of the baseline's (above 0; 1.2: at most 20%% slower)")
    fit.add_argument("--allow-lossy", action="store_true", help="also try lossy steps (bfloat16 autocast)")
    fit.add_argument("--compile", type=_compile_text, nargs="?", const=True, metavar="STEP",
                     help="also try the plans compiled (with compile(), or the compile step given, "
                          "e.g. \"compile(mode='max-autotune')\")")
    fit.add_argument("--maximize", choices=("speed", "batch"), default="speed",
                     help="speed: least slowdown within the budget; batch: the largest batch that fits")
    outputs(fit, iterations=3)
    fit.set_defaults(func=_fit)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shrinkwrap`` command; returns the exit status: 0, or 2 after one
    ``shrinkwrap: error:`` line on stderr (the whole traceback with ``--debug``)."""
    argv = _joined(list(sys.argv[1:] if argv is None else argv))
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or argparse's error line: their status
        return int(exc.code or 0)
    args.argv = argv  # what --nproc starts on each rank
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("shrinkwrap: error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - shrinkwrap's own errors and the user's model's alike: one line
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"shrinkwrap: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _joined(argv: list[str]) -> list[str]:
    """``--input -3,32,32`` as ``--input=-3,32,32``: argparse takes a value that starts with ``-``
    for an option unless it reads as a plain negative number, and answers "expected one argument"
    where the option's own check would name what is wrong. No option of the command starts ``-<digit>``."""
    out: list[str] = []
    for tok in argv:
        option = out[-1] if out else ""
        valued = option.startswith("--") and option != "--" and "=" not in option
        if valued and re.match(r"-(\.?\d|inf|nan)", tok, re.I):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _one_line(exc: BaseException) -> str:
    """What went wrong, on one line: shrinkwrap's message as it is; another exception (the user's
    model failing on the batch, a package that breaks) by its type and first line, and where the
    whole traceback is."""
    text = " ".join(str(exc).split())
    if isinstance(exc, CliError) or text.startswith("shrinkwrap: "):
        return text.removeprefix("shrinkwrap: ")
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return f"{type(exc).__name__}: {first} (the whole traceback: add --debug)"
