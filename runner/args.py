"""Flags as typed: each command is a plain, typed, documented function, and this module reads its
signature so that fire (the dispatcher) hands it exactly what was typed.

- :func:`typed` attaches fire parse functions built from the annotations: a `str` flag stays the exact
  string given (fire would turn `"Hello, world"` into a tuple and `None` into None); a `bool` flag takes
  true/false/yes/no/1/0 in any case and nothing else; `int` / `float` flags must parse, and
  ``Annotated[int, Range(1)]`` or ``Annotated[str, OneOf(...)]`` bounds them; every error names the flag.
- :func:`check_argv` refuses unknown flags (with the closest valid name), flags without a value and
  missing required flags before the command runs, since fire only notices leftovers afterwards.
- :func:`help_text` is each command's `--help`: one line per flag with its type, default and meaning,
  from the signature and the docstring's `Args:` section.
- A parameter typed as a dataclass whose fields are :func:`flag` fields (runner.config.EngineConfig) stands
  for all of them: each field is a flag of its own (its help from the field), and :func:`flat` gathers them
  back into the dataclass before the command runs. Such a dataclass validates itself with :func:`check_fields`.

List-valued flags are strings here (e.g. `--dump_steps 0,1,39`), parsed with :func:`int_list`.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Annotated, Any, Callable, Optional, Sequence

from runner.errors import PmxError
from runner.parallel.launch import COMM_BACKENDS

TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")


@dataclass(frozen=True)
class Range:
    """A number flag's bounds: lo <= x (lo < x when lo_open) and x <= hi."""
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False

    def check(self, flag: str, x) -> None:
        ok = not (isinstance(x, float) and math.isnan(x))
        if self.lo is not None:
            ok = ok and (x > self.lo if self.lo_open else x >= self.lo)
        if self.hi is not None:
            ok = ok and x <= self.hi
        if not ok:
            raise PmxError(f"--{flag} must be {self.describe()}, got {x}")

    def describe(self) -> str:
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.hi is None:
            return lo or "a number"
        if self.lo is None:
            return f"<= {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"


@dataclass(frozen=True)
class OneOf:
    """An enum flag: one of `values` (compared as typed, e.g. ints for --cache_layout)."""
    values: tuple

    def __init__(self, *values):
        object.__setattr__(self, "values", tuple(values))

    def check(self, flag: str, x) -> None:
        if x not in self.values:
            raise PmxError(f"--{flag} must be {self.describe()}, got {x!r}")

    def describe(self) -> str:
        names = [str(v) for v in self.values]
        return "one of " + ", ".join(names)


# -- value parsers -------------------------------------------------------------------------------------
def parse_bool(flag: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise PmxError(f"--{flag} takes true/false, yes/no or 1/0, got {value!r}")


def parse_int(flag: str, value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?\d+", text):
        raise PmxError(f"--{flag} must be an integer, got {value!r}")
    return int(text)


def parse_float(flag: str, value) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        raise PmxError(f"--{flag} must be a number, got {value!r}") from None


PARSERS = {bool: parse_bool, int: parse_int, float: parse_float}
TYPE_NAMES = {bool: "bool", int: "int", float: "float", str: "str"}


@dataclass(frozen=True)
class Flag:
    name: str
    kind: type                   # bool, int, float or str (lists and unions are read as str)
    default: Any                 # inspect.Parameter.empty when required
    help: str
    check: Any = None            # Range / OneOf / None
    shared: bool = False         # defined once for every command that takes it (a Help type or a dataclass field)

    @property
    def required(self) -> bool:
        """No default; may also be given in order without its --name (e.g. compare's dir_a dir_b)."""
        return self.default is inspect.Parameter.empty

    def parse(self, value):
        """The typed value of one command-line string; an error naming the flag otherwise."""
        x = value if self.kind is str else PARSERS[self.kind](self.name, value)
        if self.kind is str and not isinstance(x, str):
            x = str(x)
        if self.check is not None:
            self.check.check(self.name, x)
        return x

    def type_text(self) -> str:
        if isinstance(self.check, OneOf):
            return "{" + ",".join(str(v) for v in self.check.values) + "}"
        if isinstance(self.check, Range):
            return f"{TYPE_NAMES[self.kind]} {self.check.describe()}"
        return TYPE_NAMES[self.kind]

    def default_text(self) -> str:
        if self.required:
            return "required"
        return f"default {'none' if self.default in (None, '') else self.default}"


@dataclass(frozen=True)
class Help:
    """A flag's one line of help, in its type: ``Annotated[bool, Help("...")]`` defines a flag every command that
    takes it shares."""
    text: str


def _extras(annotation) -> tuple[type, list]:
    """(bool | int | float | str, the Annotated extras) of an annotation; Optional[...] and unions of several
    types (list flags) are read as their one type, or as str."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *extras = typing.get_args(annotation)
        kind, more = _extras(inner)
        return kind, extras + more
    if origin is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _extras(args[0]) if len(args) == 1 else (str, [])
    return (annotation if annotation in PARSERS else str), []


def _kind(annotation) -> tuple[type, Any]:
    """(bool | int | float | str, Range / OneOf / None) of an annotation."""
    kind, extras = _extras(annotation)
    return kind, next((e for e in extras if isinstance(e, (Range, OneOf))), None)


def _flag(name: str, annotation, default, doc_help: str = "") -> Flag:
    kind, extras = _extras(annotation)
    check = next((e for e in extras if isinstance(e, (Range, OneOf))), None)
    shared = next((e.text for e in extras if isinstance(e, Help)), None)
    return Flag(name, kind, default, shared or doc_help, check, shared is not None)


# the flag types the commands share
Count = Annotated[int, Range(0)]
PositiveInt = Annotated[int, Range(1)]
Seconds = Annotated[float, Range(0, lo_open=True)]
Device = Annotated[str, OneOf("auto", "cpu", "cuda")]
Dtype = Annotated[str, OneOf("auto", "float32", "float16", "bfloat16")]
Kernels = Annotated[str, OneOf("auto", "triton", "torch", "reference")]
Compile = Annotated[str, OneOf("auto", "on", "off")]
CommBackend = Annotated[str, OneOf(*COMM_BACKENDS)]
CacheLayout = Annotated[int, OneOf(0, 1, 2, 3)]
CacheMode = Annotated[int, OneOf(0, 1)]
# flags several commands take, each defined here once
Overwrite = Annotated[bool, Help("replace a non-empty output_dir")]
Progress = Annotated[bool, Help("progress on stderr (rank 0): loading, converting, generating")]
CkptDir = Annotated[str, Help("PMX directory split into as many shards as ranks are started (mpirun -np N / "
                              "torchrun --nproc_per_node N)")]
TokenizerPath = Annotated[Optional[str], Help("tokenizer.model or tokenizer.json, or their directory (default: "
                                              "ckpt_dir's); its tokenizer_config.json gives the chat template")]
ChatTemplateFile = Annotated[Optional[str], Help("a jinja chat template for the chat API (as vLLM's --chat-template; "
                                                 "default: the tokenizer's own; examples/chat_template.jinja is one "
                                                 "with tool calls)")]
QuantMethod = Annotated[str, OneOf("int8", "int4"), Help("weight-only quantisation: int8 (per output channel) or int4 "
                                                          "(groups along the input dim)")]
GroupSize = Annotated[int, Range(1), Help("int4 input columns per scale (a divisor of every input dim)")]
QuantizeOutput = Annotated[bool, Help("quantise the lm head (output.weight) too (default: True with --quantize)")]
QuantizeEmbedding = Annotated[bool, Help("store the token embedding quantised too, dequantised as its rows are "
                                         "gathered (default: True with --quantize)")]
# the replays' (runner.engine.replay, runner.onnx.replay)
DumpDir = Annotated[str, Help("the --dump_tensor_path of the run; rank r reads dump_dir/rank_r")]
ReplayStep = Annotated[int, Range(0), Help("the step to replay")]
ReplayOutputDir = Annotated[str, Help("each rank writes its logits (float32 .bin) to output_dir/rank_r")]
Warmup = Annotated[int, Range(0), Help("untimed iterations before profiling")]
MinProfilingSeconds = Annotated[float, Range(0), Help("profile for at least this long (at least one iteration)")]


def doc_lines(fn: Callable) -> tuple[str, dict[str, str]]:
    """(summary, {arg: one-line help}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    summary = " ".join(doc.split("\n\n")[0].split())
    helps: dict[str, str] = {}
    m = re.search(r"^Args:\n(.*?)(?:\n\S|\Z)", doc, re.S | re.M)
    if m:
        current = None
        for line in m.group(1).splitlines():
            hit = re.match(r"\s{4}(\w+):\s*(.*)", line)
            if hit:
                current = hit.group(1)
                helps[current] = hit.group(2).strip()
            elif current and line.strip():
                helps[current] += " " + line.strip()
    return summary, helps


def flag(default, help: str):
    """A dataclass field that is a command-line flag: its default and one line of help."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Fields:
    """``Annotated[SomeConfig, Fields("a", "b")]``: a command takes only these fields of the dataclass as flags."""
    names: tuple

    def __init__(self, *names):
        object.__setattr__(self, "names", tuple(names))


def _groups(fn: Callable) -> dict[str, tuple]:
    """{parameter: (dataclass, its fields that are flags)} of the parameters of `fn` that stand for flags."""
    out = {}
    for name, hint in typing.get_type_hints(fn, include_extras=True).items():
        extras = ()
        if typing.get_origin(hint) is typing.Annotated:
            hint, *extras = typing.get_args(hint)
        if is_dataclass(hint):
            only = next((e.names for e in extras if isinstance(e, Fields)), None)
            out[name] = (hint, [f for f in fields(hint) if only is None or f.name in only])
    return out


def flags_of(fn: Callable) -> list[Flag]:
    """The flags of command `fn`, in signature order (a dataclass parameter: its fields, in place)."""
    hints, groups = typing.get_type_hints(fn, include_extras=True), _groups(fn)
    _, helps = doc_lines(fn)
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in groups:
            cls, chosen = groups[p.name]
            sub = typing.get_type_hints(cls, include_extras=True)
            out += [_flag(f.name, Annotated[sub[f.name], Help(f.metadata.get("help", ""))], getattr(p.default, f.name))
                    for f in chosen]
            continue
        out.append(_flag(p.name, hints.get(p.name, str), p.default, helps.get(p.name, "")))
    return out


def flat(fn: Callable) -> Callable:
    """`fn` with each dataclass parameter spread into its fields: the flags fire hands over, gathered back into
    the dataclass when it is called. The parameter's default instance gives the command's defaults."""
    groups = _groups(fn)
    if not groups:
        return fn
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        if p.name in groups:
            params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=getattr(p.default, f.name))
                       for f in groups[p.name][1]]
        else:
            params.append(p)
    params.sort(key=lambda p: p.kind)  # (keyword-only ones last, as a signature wants them)
    flat_sig = sig.replace(parameters=params)

    def call(*args, **kwargs):
        given = flat_sig.bind(*args, **kwargs).arguments
        for name, (_, chosen) in groups.items():
            given[name] = replace(sig.parameters[name].default,
                                  **{f.name: given.pop(f.name) for f in chosen if f.name in given})
        return fn(**given)
    call.__signature__, call.__doc__, call.__name__ = flat_sig, fn.__doc__, fn.__name__
    return call


def check_fields(obj) -> None:
    """Every field of the dataclass `obj` has its flag's type and bounds; PmxError naming the flag otherwise."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in fields(obj):
        value, (kind, check) = getattr(obj, f.name), _kind(hints[f.name])
        if value is None and f.default is None:
            continue
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            what = check.describe() if isinstance(check, OneOf) else \
                TYPE_NAMES[kind] + (f" {check.describe()}" if check is not None else "")
            raise PmxError(f"--{f.name} must be {what}, got {value!r}")
        if check is not None:
            check.check(f.name, value)


def typed(fn: Callable) -> Callable:
    """`fn` with fire parse functions for each of its flags (see the module docstring); returns `fn`."""
    import fire
    return fire.decorators.SetParseFns(**{f.name: f.parse for f in flags_of(fn)})(flat(fn))


def _is_flag(tok: str) -> bool:
    """fire's rule: `--anything`, or `-` and a letter (so `-1` and `-.5` are values)."""
    return tok.startswith("--") or re.match(r"-[a-zA-Z]", tok) is not None


def _tokens(argv: Sequence[str]):
    """(name, value or None, is_flag) for each command-line token, with fire's rules: `--name=value`,
    `--name value`, and a bare `--name` (value None) when it is last or followed by another flag."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if _is_flag(tok):
            key = tok.lstrip("-")
            if "=" in key:
                key, value = key.split("=", 1)
                yield key.replace("-", "_"), value, tok
            elif i + 1 < len(argv) and not _is_flag(argv[i + 1]):
                yield key.replace("-", "_"), argv[i + 1], tok
                i += 1
            else:
                yield key.replace("-", "_"), None, tok
        else:
            yield None, tok, tok
        i += 1


def check_argv(fn: Callable, argv: Sequence[str], prog: str) -> None:
    """Refuses, before `fn` runs, what fire would only complain about afterwards (or take silently)."""
    flags = {f.name: f for f in flags_of(fn)}
    given, positionals = set(), []
    for key, value, tok in _tokens(argv):
        if key is None:
            positionals.append(value)
            continue
        name = key[2:] if key.startswith("no") and key[2:] in flags and flags[key[2:]].kind is bool \
            and key not in flags else key
        if name not in flags or not tok.startswith("--"):
            close = difflib.get_close_matches(name, list(flags), n=1, cutoff=0.5)
            hint = f"; did you mean --{close[0]}?" if close else f"; see {prog} --help"
            raise PmxError(f"{prog}: unknown flag {tok.split('=', 1)[0]}{hint}")
        flag = flags[name]
        if name in given:
            raise PmxError(f"{prog}: --{name} is given twice")
        if value is None and flag.kind is not bool:
            raise PmxError(f"{prog}: --{name} needs a value ({flag.type_text()})")
        if name != key and value is not None:
            raise PmxError(f"{prog}: {tok} takes no value; write --{name} false")
        flag.parse("true" if value is None else value)
        given.add(name)
    free = [f for f in flags.values() if f.required and f.name not in given]
    if len(positionals) > len(free):
        raise PmxError(f"{prog}: unexpected argument(s) {positionals[len(free):]}; see {prog} --help")
    for f, value in zip(free, positionals):
        f.parse(value)
        given.add(f.name)
    missing = [f"--{f.name}" for f in flags.values() if f.required and f.name not in given]
    if missing:
        raise PmxError(f"{prog}: missing required flag(s) {', '.join(missing)}; see {prog} --help")


def help_text(fn: Callable, prog: str) -> str:
    """`prog --help`: the summary, then each flag with its type, default and one line of help."""
    summary, _ = doc_lines(fn)
    flags = flags_of(fn)
    required = " ".join(f"--{f.name} {TYPE_NAMES[f.kind].upper()}" for f in flags if f.required)
    lines = [f"usage: {prog} {required} [--flag value ...]".replace("  ", " "), "", summary, "", "flags:"]
    rows = [(f"--{f.name} {f.type_text()}", f.default_text(), f.help) for f in flags]
    w1, w2 = min(max(len(r[0]) for r in rows), 34), max(len(r[1]) for r in rows)
    lines += [f"  {a:<{w1}}  {b:<{w2}}  {c}".rstrip() for a, b, c in rows]
    lines += ["", "Required flags may also be given in order without their names. bool flags take true/false, "
              "yes/no or 1/0 (a bare --flag is true); --name and --name-with-dashes are the same flag."]
    return "\n".join(lines)


# -- list-valued flags -------------------------------------------------------------------------------
def items(value) -> list:
    """None / "" -> []; "a,b" / "a b" -> ["a", "b"]; a scalar -> [it]; a sequence -> list(it)."""
    if value is None:
        return []
    if isinstance(value, str):
        return value.replace(",", " ").split()
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def int_list(value, flag: str, minimum: int = 0, allow_empty: bool = True) -> list[int]:
    """The integers of a list flag, each >= minimum; a clear error naming `--flag` otherwise."""
    kind = "positive integers" if minimum == 1 else f"integers >= {minimum}"
    try:
        out = [int(x) for x in items(value)]
    except (TypeError, ValueError):
        out = None
    if out is None or any(x < minimum for x in out) or (not out and not allow_empty):
        raise PmxError(f"--{flag} must be {kind} separated by commas or spaces, got {value!r}")
    return out
