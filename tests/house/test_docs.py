"""The docs stay true to the code (README.md and docs/*.md; no job runs here):

- every flag the command-line parser defines is documented in docs/, and every fault-tolerance key
  with its flag and its real default; NVRx's own flags count as documented in docs/nvrx-flags.md
  (skipped until that page is here); every `--ft-*` flag the docs name is one the parser takes;
- every `ft_launcher ...` command in a code block (or inline code) parses with the real parser and
  its value parsers (nothing runs), every script a `python`/`bash`/`sbatch` command runs exists,
  and so does every examples/, tests/, bench/ or docs/ path a command names; YAML examples load;
- every relative link between the docs resolves, to a file and to a heading in it;
- every event kind the agent writes is listed in docs/operations.md;
- the README's first two commands are what .ci/run runs and what tests/jobs/test_first_hour.py runs.
"""
import glob
import io
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr

import pytest

from conftest import ROOT

sys.path.insert(0, ROOT)
from ft_launcher import cli, flag_values, flags  # noqa: E402
from ft_launcher.rendezvous_endpoint import DEFAULT_C10D_PORT  # noqa: E402
from ft_launcher.rank_monitor.config import FIELD_NAMES, FaultToleranceConfig  # noqa: E402

DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
PAGES = [os.path.join(ROOT, "README.md")] + DOCS
# Pages other branches write; a link to one is checked once it is here.
PENDING = {"docs/live-state.md", "docs/nvrx-flags.md"}
NVRX_FLAGS_DOC = os.path.join(ROOT, "docs", "nvrx-flags.md")


def _rel(path):
    return os.path.relpath(path, ROOT)


def _read(path):
    with open(path) as fh:
        return fh.read()


def _blocks(text):
    """(language, lines) of each fenced code block."""
    out, lang, lines = [], None, None
    for line in text.splitlines():
        fence = re.match(r"^\s*```(\S*)\s*$", line)
        if fence and lines is None:
            lang, lines = fence.group(1), []
        elif fence:
            out.append((lang, lines))
            lines = None
        elif lines is not None:
            lines.append(line)
    return out


def _prose(text):
    """The text outside code blocks."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
        elif not inside:
            out.append(line)
    return "\n".join(out)


COMMAND_WORDS = ("ft_launcher", "python", "python3", "bash", "sbatch", "srun")


def _command_lines(page):
    """Every line of a bash block, the `$ ` lines of an untyped one, and inline code that starts
    with a command (`ft_launcher ...`, `python ...`, `sbatch ...`)."""
    text = _read(page)
    for lang, lines in _blocks(text):
        if lang not in ("bash", "sh", ""):
            continue
        for line in "\n".join(lines).replace("\\\n", " ").splitlines():
            line = line.strip()
            if lang == "" and not line.startswith("$ "):
                continue
            yield (line[2:] if lang == "" else line), False
    for span in re.findall(r"`([^`]+)`", _prose(text)):   # a span may wrap onto the next line
        span = " ".join(span.split())
        if span.split(" ", 1)[0] in COMMAND_WORDS and " " in span:
            yield span, True


def _commands(page):
    """Every simple command of _command_lines, as a list of words, with the line it came from and
    whether it is inline code in a sentence."""
    out = []
    for line, inline in _command_lines(page):
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words = []
        for token in list(lexer) + [";"]:
            if token in ("&&", "||", ";", "&", "|", "(", ")"):
                if words:
                    out.append((words, line, inline))
                words = []
            else:
                words.append(token)
    return out


def _documented(text, flag):
    return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text) is not None


def _docs_text():
    return "\n".join(_read(p) for p in DOCS)


# ---- every flag and key documented -------------------------------------------------------------
def _mechanical(spelling):
    """The spelling a documented flag stands for: underscores as dashes, NVRx's --ft-param- and
    --ft-ft- prefixes folded (docs/flags-and-configuration.md states these rules once)."""
    s = spelling.lstrip("-").replace("_", "-")
    if s.startswith("ft-param-"):
        s = "ft-" + s[len("ft-param-"):]
    if s.startswith("ft-ft-"):
        s = "ft-" + s[len("ft-ft-"):]
    return s


def _flags_by_dest():
    """dest -> (visible spellings, hidden spellings) of the real parser."""
    import argparse

    out = {}
    for action in flags.build_parser()._actions:
        if not action.option_strings:
            continue
        shown, hidden = out.setdefault(action.dest, ([], []))
        (hidden if action.help == argparse.SUPPRESS else shown).extend(action.option_strings)
    return out


def test_every_flag_the_parser_defines_is_in_the_docs():
    text = _docs_text()
    missing = []
    for dest, (shown, hidden) in _flags_by_dest().items():
        if not shown:
            continue   # NVRx's own flags and keys with no meaning here: the next test
        documented = {_mechanical(s) for s in shown + hidden if _documented(text, s)}
        missing += [s for s in shown if not _documented(text, s)]
        # a spelling that is not a mechanical variant of a shown one (NVRx's --fault-tol-cfg-path)
        missing += [s for s in hidden if _mechanical(s) not in documented and not _documented(text, s)]
    assert not missing, f"flags not in docs/: {missing}"


def test_every_nvrx_only_flag_is_in_the_docs():
    if not os.path.exists(NVRX_FLAGS_DOC):
        pytest.skip("docs/nvrx-flags.md (the per-flag NVRx table) is written on another branch and not "
                    "here yet; NVRx's own flags are checked once it is merged")
    text = _docs_text()
    missing = []
    for dest, (shown, hidden) in _flags_by_dest().items():
        if shown:
            continue
        documented = {_mechanical(s) for s in hidden if _documented(text, s)}
        missing += sorted({"--" + _mechanical(s) for s in hidden if _mechanical(s) not in documented})
    assert not missing, f"NVRx flags in no page of docs/ (docs/nvrx-flags.md is where they go): {missing}"


def test_every_ft_flag_the_docs_name_is_a_flag():
    options = {o for a in flags.build_parser()._actions for o in a.option_strings}
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"(?<![\w-])(--ft[-_][a-z0-9_-]*[a-z0-9])(?![\w<-])", _read(page)))
    assert len(named) > 20
    assert not sorted(named - options), "--ft-* flags the docs name that the parser does not take"


def test_every_flag_in_the_flags_table_is_a_flag():
    options = {o for a in flags.build_parser()._actions for o in a.option_strings}
    text = _read(os.path.join(ROOT, "docs", "flags-and-configuration.md")).split("## Flags", 1)[1]
    named = set()
    for cell in re.findall(r"^\| ((?:`-[^`]*`(?:, )?)+) \|", text.split("\n## ", 1)[0], re.M):
        for code in re.findall(r"`([^`]*)`", cell):
            named |= {w for w in code.split(" ")[0].split("/") if w.startswith("-")}
    named.discard("--ft-<key>")
    assert len(named) > 30 and not sorted(named - options), sorted(named - options)


def _key_table():
    """key -> (flag, default) from docs/flags-and-configuration.md's table of keys."""
    rows = {}
    for line in _read(os.path.join(ROOT, "docs", "flags-and-configuration.md")).splitlines():
        m = re.match(r"^\| `([a-z_]+)` \| `(--[a-z-]+)` \| ([^|]*) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


# defaults the table says in words
WORDED_DEFAULTS = {"ft_state_path": "`<log dir>/ft_state.json`, else `./ft_state.json`",
                   "simulated_fault_rank": "drawn from the seed", "rank_termination_signal": "SIGKILL",
                   "log_level": "INFO"}


def test_every_key_is_in_the_table_with_its_flag_and_its_real_default():
    import signal

    rows = _key_table()
    assert sorted(rows) == sorted(FIELD_NAMES)
    defaults = FaultToleranceConfig()
    parser = flags.build_parser()
    for key in FIELD_NAMES:
        flag, shown = rows[key]
        assert parser.parse_args([flag, "1", "x.py"]) is not None   # the flag is the key's
        assert any(a.dest == f"ft__{key}" and flag in a.option_strings for a in parser._actions), (key, flag)
        value = getattr(defaults, key)
        if key in WORDED_DEFAULTS:
            assert shown == WORDED_DEFAULTS[key], key
            if key == "rank_termination_signal":
                assert signal.Signals(value).name == shown
        elif isinstance(value, bool):
            assert shown == str(value).lower(), key
        elif value is None:
            assert shown in ("null", "none"), key
        elif isinstance(value, (dict, list)):
            assert shown == f"`{value!r}`".replace("'", ""), key
        elif isinstance(value, (int, float)):
            assert float(shown) == value, key
        else:
            assert shown == value, key


def test_numeric_flag_defaults_in_the_table_are_the_parsers():
    parser = flags.build_parser()
    defaults = {o: a.default for a in parser._actions for o in a.option_strings}
    text = _read(os.path.join(ROOT, "docs", "flags-and-configuration.md"))
    checked = 0
    for line in text.splitlines():
        m = re.match(r"^\| `(--[a-z-]+)[^`]*` \| (\d+(?:\.\d+)?) \|", line)
        if m and m.group(1) in defaults:
            assert float(defaults[m.group(1)]) == float(m.group(2)), line
            checked += 1
    assert checked >= 5


def test_rdzv_conf_keys_are_documented():
    from ft_launcher.agent.launch_config import RDZV_CONF_DEFAULTS

    text = _read(os.path.join(ROOT, "docs", "flags-and-configuration.md"))
    for key, value in RDZV_CONF_DEFAULTS.items():
        assert f"`{key}` ({value:g}" in text, key
    assert "`is_host`" in text


# ---- every command parses, every path exists -------------------------------------------------
class _Parsed(Exception):
    pass


def _check_ft_launcher(argv, monkeypatch):
    """Parse `ft_launcher argv` as the launcher would, without running anything."""
    if argv and argv[0] in cli.SUBCOMMANDS:   # report/status build their parser in main: take it there
        import importlib

        def parse_only(self, args=None, namespace=None):
            raise _Parsed(super(flags._Parser, self).parse_args(args, namespace))

        monkeypatch.setattr(flags._Parser, "parse_args", parse_only)
        with pytest.raises(_Parsed):
            importlib.import_module(cli.SUBCOMMANDS[argv[0]]).main(argv[1:])
        monkeypatch.undo()
        return
    args = flags.build_parser().parse_args(argv)   # a UsageError fails the test
    said = io.StringIO()
    with redirect_stderr(said):
        if args.nnodes:
            flag_values.parse_nnodes(args.nnodes)
        flag_values.parse_backend(args.rdzv_backend)
        flag_values.parse_signals(args.signals_to_handle)
        flag_values.parse_rdzv_conf(args.rdzv_conf)
        if args.rdzv_endpoint:
            flag_values.parse_endpoint(args.rdzv_endpoint, DEFAULT_C10D_PORT)
        nproc = int(args.nproc_per_node) if args.nproc_per_node.isdigit() else 8   # gpu/auto need a GPU here
        flag_values.parse_stream_map("--redirects", args.redirects, nproc)
        flag_values.parse_stream_map("--tee", args.tee, nproc)
        from ft_launcher.ft_config_loading import build_ft_config

        ft_cli = {k[4:]: v for k, v in vars(args).items() if k.startswith("ft__") and v is not None}
        build_ft_config(None, ft_cli, warn=lambda m: print(m, file=sys.stderr))   # a ConfigError fails
    assert not said.getvalue(), said.getvalue()   # nor a warning (an unknown --rdzv-conf key)
    if args.training_script.startswith(("examples/", "tests/", "bench/")):
        assert os.path.isfile(os.path.join(ROOT, args.training_script)), args.training_script


def _all_commands():
    return [(page, words, line) for page in PAGES for words, line, _ in _commands(page)]


def test_the_docs_have_commands_to_check():
    kinds = [words[0] for _, words, _ in _all_commands()]
    assert kinds.count("ft_launcher") >= 10 and "python" in kinds


@pytest.mark.parametrize("page", [_rel(p) for p in PAGES])
def test_every_command_in_the_docs_parses_and_names_files_that_exist(page, monkeypatch):
    import importlib.util

    for words, line, inline in _commands(os.path.join(ROOT, page)):
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):   # FT_LAUNCHER=... sbatch ...
            words = words[1:]
        if not words:
            continue
        for word in words:   # any repository path a command names
            if word.startswith(("examples/", "tests/", "bench/", "docs/")):
                assert os.path.exists(os.path.join(ROOT, word.rstrip(".,;:"))), f"{page}: {word} in `{line}`"
        if "ft_launcher" in words:   # ft_launcher ..., srun ... ft_launcher ...
            rest = words[words.index("ft_launcher") + 1:]
            if inline and (not rest or rest in (["report"], ["status"])):
                continue   # a sentence naming the command (`ft_launcher report` writes ...)
            try:
                _check_ft_launcher(rest, monkeypatch)
            except (flags.UsageError, Exception) as exc:
                if isinstance(exc, AssertionError):
                    raise
                pytest.fail(f"{page}: `{line}` does not parse: {type(exc).__name__}: {exc}")
        elif words[0] in ("python", "python3"):
            if "-m" in words[:2] and len(words) > 2:
                module = words[words.index("-m") + 1]
                assert importlib.util.find_spec(module.split(".")[0]), f"{page}: no module {module}"
            elif not inline:   # (a sentence may say how a script is run: `python -u script.py args`)
                assert os.path.isfile(os.path.join(ROOT, words[1])), f"{page}: {words[1]} in `{line}`"
        elif words[0] in ("bash", "sbatch"):
            script = next(w for w in words[1:] if not w.startswith("-"))
            assert os.path.isfile(os.path.join(ROOT, script)), f"{page}: {script} in `{line}`"


def test_every_yaml_example_loads_without_a_warning(tmp_path):
    found = 0
    for page in PAGES:
        for lang, lines in _blocks(_read(page)):
            if lang == "yaml" and any(l.startswith("fault_tolerance:") for l in lines):
                path = tmp_path / "ft.yaml"
                path.write_text("\n".join(lines) + "\n")
                warnings = []
                from ft_launcher.ft_config_loading import build_ft_config

                build_ft_config(str(path), {}, warn=warnings.append)
                assert not warnings, (_rel(page), warnings)
                found += 1
    assert found


# ---- links --------------------------------------------------------------------------------------
def _slugs(text):
    """The anchors GitHub gives the page's headings."""
    seen, out = {}, set()
    for line in _prose(text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_resolves_to_a_file_and_a_heading():
    broken, pending = [], []
    for page in PAGES:
        text = _prose(_read(page))
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue   # http(s), mailto
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full):
                (pending if _rel(full) in PENDING else broken).append(f"{_rel(page)}: {target}")
                continue
            if anchor and full.endswith(".md") and anchor not in _slugs(_read(full)):
                broken.append(f"{_rel(page)}: {target} (no such heading)")
    assert not broken, broken
    # pending: pages another branch writes (docs/live-state.md, docs/nvrx-flags.md), linked ahead


def test_the_readme_glossary_has_every_term():
    glossary = _read(os.path.join(ROOT, "README.md")).split("## Glossary", 1)[1].split("\n## ", 1)[0]
    for term in ("section", "cycle", "round", "rung", "slot", "reserve", "spare", "incident"):
        assert f"- **{term}**" in glossary, term


def test_every_page_in_docs_is_linked_from_the_readme():
    readme = _read(os.path.join(ROOT, "README.md"))
    for page in DOCS:
        assert f"]({_rel(page)}" in readme, _rel(page)
    for page in PENDING:
        assert f"]({page}" in readme, page


# ---- events ---------------------------------------------------------------------------------
def test_every_event_kind_the_agent_writes_is_in_operations_with_its_meaning():
    kinds = set()
    for path in (glob.glob(os.path.join(ROOT, "agent", "**", "*.py"), recursive=True)
                 + glob.glob(os.path.join(ROOT, "ft_launcher", "**", "*.py"), recursive=True)):
        kinds |= set(re.findall(r"\.event\(\s*\"([a-z_]+)\"", _read(path)))
        kinds |= set(re.findall(r"\.event\(\s*kind or \"([a-z_]+)\"", _read(path)))   # a monitor's other reports
        kinds |= set(re.findall(r"args = \(\"([a-z_]+)\",", _read(path)))   # the restart event's arguments
    assert {"hang", "restart", "cycle_start", "job_complete", "straggler", "monitor_report"} <= kinds
    text = _read(os.path.join(ROOT, "docs", "operations.md"))
    section = text.split("## events.jsonl", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", section, re.M))   # | `kind` | meaning |
    assert not sorted(kinds - set(rows)), "event kinds without a row in docs/operations.md's events.jsonl table"
    assert not [k for k, meaning in rows.items() if len(meaning.split()) < 4], "a row without a meaning"
    assert not sorted(set(rows) - kinds), "rows for kinds the agent does not write"


# ---- the README's first two commands ------------------------------------------------------------
def test_the_readme_first_commands_are_what_ci_and_the_first_hour_test_run():
    readme = _read(os.path.join(ROOT, "README.md"))
    ci = _read(os.path.join(ROOT, ".ci", "run"))
    # .ci/run reads them with awk from the first bash block: run its own extraction
    extraction = re.search(r"mapfile -t commands < <\((.*)\)\s*$", ci, re.M).group(1)
    assert "README.md" in extraction
    from_ci = subprocess.run(["bash", "-c", extraction], cwd=ROOT, capture_output=True, text=True,
                             timeout=30).stdout.splitlines()
    assert 'bash -eo pipefail -c "$command"' in ci   # and runs each
    first_block = next(lines for lang, lines in _blocks(readme) if lang == "bash")
    assert from_ci == first_block[:2], (from_ci, first_block[:2])
    # tests/jobs/test_first_hour.py runs the first line's ft_launcher command (the part after its last &&)
    first_hour = readme.split("```bash\n", 1)[1].splitlines()[0]
    assert first_hour == from_ci[0]
    run, test = from_ci
    for line in (run, test):
        assert line.startswith("pip install torch==2.13.0 && pip install ")
    launch = shlex.split(run.rsplit("&& ", 1)[1])
    assert launch[0] == "ft_launcher" and "examples/ddp_train.py" in launch and "--hang-in" in launch
    flags.build_parser().parse_args(launch[1:])
    assert test.endswith("&& python -m pytest -q") and '".[test]"' in test


def test_status_help_says_it_finds_jobs_with_or_without_a_log_dir(capsys):
    """`ft_launcher status` with no LOGDIR finds this user's running jobs, --log-dir or not: its
    help used to say the job must run with --log-dir."""
    from ft_launcher import status

    with pytest.raises(SystemExit):
        status.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "must run with --log-dir" not in text
    assert "every job this user runs on this machine (with or without --log-dir)" in text
