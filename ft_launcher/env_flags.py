"""torchrun's environment contract: every launcher flag can also come from `PET_<FLAG>`.

Owns reading `PET_*` variables into the parsed flags, and remembering where each value came from.
This is what Kubeflow's PyTorchJob and Trainer set in every pod (`PET_NNODES`,
`PET_NPROC_PER_NODE`, `PET_RDZV_ENDPOINT`, `PET_RDZV_BACKEND`, `PET_RDZV_ID`, `PET_NODE_RANK`,
`PET_MASTER_ADDR`, `PET_MASTER_PORT`, `PET_MAX_RESTARTS`, ...), so `ft_launcher train.py` in a
pod's command forms the same job `torchrun train.py` would.

The rule is torchrun's (torch/distributed/argparse_util.py): the variable is `PET_` + the flag's
destination in upper case (`--nproc-per-node` -> `PET_NPROC_PER_NODE`, `-r/--redirects` ->
`PET_REDIRECTS`), and it stands in for the flag when the flag is not on the command line.
Precedence: command line > `PET_*` > SLURM-derived defaults > built-in defaults. Our own flags
follow the same rule (`PET_TERM_TIMEOUT`, `PET_FT_CFG_PATH`); a fault-tolerance key `--ft-<key>`
is `PET_FT_<KEY>` (`PET_FT_RANK_SECTION_TIMEOUTS`; `--ft-state-path` is `PET_FT_STATE_PATH`).

Where we differ from torchrun, we are stricter or more forgiving, never silently different:
- a malformed value is a one-line error naming the variable (torchrun raises a traceback, or for
  a bad choice such as `PET_RDZV_BACKEND` passes it on unchecked);
- a switch (`PET_STANDALONE`, `PET_MODULE`, ...) is on for a non-zero integer or
  true/yes/on, off for 0 or false/no/off, and on when set but empty (the training operator sets
  `PET_STANDALONE=""` to mean on; torchrun fails on it);
- an empty value of any other variable counts as not set;
- a `PET_*` variable that names no flag of ours gets one warning line (a typo would otherwise
  silently run a one-node job).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

PREFIX = "PET_"
_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")
# torchrun flags ft_launcher does not have: their variables are ignored with a warning that says so.
# None since every torchrun 2.13 flag is one of ours (ft_launcher.flag_notes.TORCHRUN_NOTES says how some differ).
TORCHRUN_ONLY: Tuple[str, ...] = ()


class EnvFlagError(ValueError):
    """A `PET_*` value that does not parse; the message names the variable."""


def _env_name(action: argparse.Action) -> str:
    dest = action.dest
    if dest.startswith("ft__"):  # fault-tolerance keys: --ft-<key> -> PET_FT_<KEY>
        key = dest[4:]
        return PREFIX + (key if key.startswith("ft_") else "ft_" + key).upper()
    return PREFIX + dest.upper()


def _flag(action: argparse.Action) -> str:
    """The spelling messages use: the first long option (`--nproc-per-node`)."""
    longs = [o for o in action.option_strings if o.startswith("--")]
    return (longs or action.option_strings)[0]


def _env_actions(parser: argparse.ArgumentParser) -> List[argparse.Action]:
    return [a for a in parser._actions  # noqa: SLF001 - argparse keeps no public list
            if a.option_strings and a.dest != "help" and not isinstance(a, argparse._VersionAction)]


def _convert(action: argparse.Action, var: str, text: str):
    """A variable's text as the flag's value, checked as the command line would check it."""
    if isinstance(action, argparse._StoreTrueAction):
        low = text.strip().lower()
        if low == "" or low in _TRUE:
            return True
        if low in _FALSE:
            return False
        try:
            return int(low) != 0
        except ValueError:
            raise EnvFlagError(f"{var}: expected 1 or 0 (true or false) for {_flag(action)}, got {text!r}") from None
    if action.dest.startswith("ft__"):
        from ft_launcher.rank_monitor.config import ConfigError, parse_value

        try:
            parse_value(action.dest[4:], text, var)
        except ConfigError as exc:
            raise EnvFlagError(str(exc)) from None
        return text
    value = text
    if action.type is not None:
        try:
            value = action.type(text)
        except argparse.ArgumentTypeError as exc:  # a type check with its own message
            raise EnvFlagError(f"{var} (for {_flag(action)}): {exc}") from None
        except (TypeError, ValueError):
            kind = {int: "an integer", float: "a number"}.get(action.type, "a valid value")
            raise EnvFlagError(f"{var}: expected {kind} for {_flag(action)}, got {text!r}") from None
    if action.choices is not None and value not in action.choices:
        raise EnvFlagError(f"{var}: expected one of {', '.join(map(str, action.choices))} for "
                           f"{_flag(action)}, got {text!r}")
    return value


class Origins:
    """Where each flag's value came from: the command line, a `PET_*` variable, or neither."""

    def __init__(self) -> None:
        self._flags: Dict[str, str] = {}     # dest -> its flag spelling
        self.from_command_line: set = set()  # dests given on the command line
        self.from_env: Dict[str, str] = {}   # dest -> PET_* variable it came from

    def of(self, dest: str) -> Optional[str]:
        """`--flag` or `PET_FLAG` for a value that was given, None for a built-in default."""
        if dest in self.from_command_line:
            return self._flags[dest]
        return self.from_env.get(dest)

    def blame(self, message: str) -> str:
        """Name the variable in an error about a flag whose value came from one."""
        mentioned = []
        for dest, var in self.from_env.items():
            flag = self._flags[dest]
            if message.startswith(flag + ":"):
                return f"{var} (for {flag}):{message[len(flag) + 1:]}"
            if re.search(re.escape(flag) + r"(?![\w-])", message):
                mentioned.append(f"{flag} from {var}")
        return message + (f" ({', '.join(mentioned)})" if mentioned else "")

    def describe(self, args, slurm) -> Dict[str, str]:
        """Where the node count and the rendezvous endpoint came from, for the agent's first line.
        Mirrors the choice `ft_launcher.rendezvous_endpoint.resolve_rendezvous` makes."""
        if args.standalone:
            here = self.of("standalone") or "--standalone"
            return {"nnodes": here, "endpoint": here}
        nnodes = self.of("nnodes") or ("SLURM_NNODES" if slurm else "default")
        if args.rdzv_endpoint:
            endpoint = self.of("rdzv_endpoint")
        elif slurm and args.rdzv_backend != "static":
            endpoint = "the SLURM node list"
        else:
            endpoint = ", ".join(filter(None, (self.of("master_addr"), self.of("master_port")))) or "default"
        return {"nnodes": nnodes, "endpoint": endpoint}


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str],
               environ: Mapping[str, str] = os.environ,
               warn: Optional[Callable[[str], None]] = None) -> Tuple[argparse.Namespace, Origins]:
    """Parse `argv` with `parser`, taking each flag not on the command line from its `PET_*`
    variable, else from the parser's default. Raises EnvFlagError for a malformed variable."""
    actions = _env_actions(parser)
    origins = Origins()
    defaults = {}
    for action in actions:
        origins._flags.setdefault(action.dest, _flag(action))
        defaults.setdefault(action.dest, (action, action.default))
        action.default = argparse.SUPPRESS  # absent from the namespace unless given
    try:
        args = parser.parse_args(argv)
    finally:
        for action in actions:
            action.default = defaults[action.dest][1]
    origins.from_command_line = {d for d in defaults if hasattr(args, d)}

    by_var = {}
    for action in actions:
        by_var.setdefault(_env_name(action), action)
    for var, action in by_var.items():
        text = environ.get(var)
        if text is None or action.dest in origins.from_command_line:
            continue
        if text.strip() == "" and not isinstance(action, argparse._StoreTrueAction):
            continue
        setattr(args, action.dest, _convert(action, var, text.strip()))
        origins.from_env[action.dest] = var
    for dest, (action, default) in defaults.items():
        if not hasattr(args, dest):
            if isinstance(default, str) and action.type is not None:
                default = action.type(default)  # as argparse treats a string default
            setattr(args, dest, default)

    if warn is not None:
        for var in sorted(v for v in environ if v.startswith(PREFIX) and v not in by_var):
            if var[len(PREFIX):] in TORCHRUN_ONLY:
                warn(f"{var}: torchrun's flag is not supported by ft_launcher; ignored")
                continue
            hint = difflib.get_close_matches(var, list(by_var), n=1, cutoff=0.8)
            warn(f"{var} is not a launcher flag; ignored" + (f" (did you mean {hint[0]}?)" if hint else ""))
    return args, origins
