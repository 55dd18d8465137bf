"""In-process restart configuration (issue 11): restart_granularity, inprocess_timeout,
active_world_size, empty_cuda_cache through every flag spelling and the YAML,
LaunchConfig.active_nodes, and Megatron-Bridge's InProcessRestartConfig names (in
`fault_tolerance:` or an `inprocess_restart:` section) with one warning for those without a
meaning here. Values through the real command-line parsing and through a real `ft_launcher` run
whose rank writes the configuration it received; bad input as a one-line error (exit 2)."""
import json
import os

import pytest

from conftest import SCRIPTS
from harness import write
from ft_launcher.cli import UsageError, launch_config
from ft_launcher.flag_values import parse_nproc
from ft_launcher.rank_monitor.config import ConfigError, FaultToleranceConfig, MB_IGNORED, megatron_bridge_aliases

ENV_DUMP = f"{SCRIPTS}/env_dump.py"
CFG_DUMP = f"{SCRIPTS}/ft_cfg_dump.py"


def cfg_of(*argv):
    return launch_config([*map(str, argv), ENV_DUMP])


def ft_of(*argv):
    return cfg_of(*argv).ft


def one_line_error(res, message):
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ft_launcher: error:") and message in lines[0], res.stderr


# ---- our keys --------------------------------------------------------------------------------
def test_defaults():
    cfg = cfg_of("--standalone")
    ft = cfg.ft
    assert (ft.restart_granularity, ft.inprocess_timeout, ft.active_world_size, ft.empty_cuda_cache) == \
        ("auto", 10.0, None, True)
    assert cfg.active_nodes is None


FLAGS = [("restart-granularity", "node", "restart_granularity", "node"),
         ("inprocess-timeout", "2.5", "inprocess_timeout", 2.5),
         ("active-world-size", "1", "active_world_size", 1),
         ("empty-cuda-cache", "false", "empty_cuda_cache", False)]


@pytest.mark.parametrize("dashed,value,key,expected", FLAGS, ids=[f[0] for f in FLAGS])
@pytest.mark.parametrize("form", ["--ft-{d}", "--ft-{u}", "--ft-param-{u}", "--ft-param-{d}", "--ft-{d}="])
def test_every_spelling_of_the_new_flags(form, dashed, value, key, expected):
    flag = form.format(d=dashed, u=key)
    argv = [flag + value] if flag.endswith("=") else [flag, value]
    assert getattr(ft_of("--standalone", *argv), key) == expected


def test_pet_variable_of_a_new_flag(monkeypatch):
    monkeypatch.setenv("PET_FT_RESTART_GRANULARITY", "rank")
    assert ft_of("--standalone").restart_granularity == "rank"


@pytest.mark.parametrize("granularity", ["auto", "rank", "node", "job"])
def test_every_granularity(granularity):
    assert ft_of("--standalone", "--ft-restart-granularity", granularity).restart_granularity == granularity


def test_yaml_keys_and_the_command_line_wins(tmp_path):
    cfg = write(tmp_path, """
fault_tolerance:
  restart_granularity: job
  inprocess_timeout: 4
  active_world_size: null
  empty_cuda_cache: false
""")
    ft = ft_of("--standalone", "--ft-cfg-path", cfg)
    assert (ft.restart_granularity, ft.inprocess_timeout, ft.active_world_size, ft.empty_cuda_cache) == \
        ("job", 4.0, None, False)
    ft = ft_of("--standalone", "--ft-cfg-path", cfg, "--ft-restart-granularity", "rank", "--ft-inprocess-timeout", "7")
    assert (ft.restart_granularity, ft.inprocess_timeout, ft.empty_cuda_cache) == ("rank", 7.0, False)


def test_the_new_keys_travel_to_the_rank_and_back_through_json_and_yaml(tmp_path):
    ft = FaultToleranceConfig.from_kwargs(restart_granularity="node", inprocess_timeout=3, active_world_size=8,
                                          empty_cuda_cache=False)
    assert FaultToleranceConfig.from_json(ft.to_json()) == ft
    ft.to_yaml_file(str(tmp_path / "out.yaml"))
    back = FaultToleranceConfig.from_yaml_file(str(tmp_path / "out.yaml"))
    keys = ("restart_granularity", "inprocess_timeout", "active_world_size", "empty_cuda_cache")
    assert [getattr(back, k) for k in keys] == ["node", 3.0, 8, False]


# ---- active_world_size -> LaunchConfig.active_nodes -----------------------------------------------
@pytest.mark.parametrize("nnodes,nproc,aws,nodes", [("1", 1, 1, 1), ("1:3", 2, 4, 2), ("1:3", 2, 6, 3),
                                                  ("3", 4, 4, 1), ("2:4", 1, 3, 3)])
def test_active_nodes(nnodes, nproc, aws, nodes):
    cfg = cfg_of("--nnodes", nnodes, "--rdzv-endpoint", "127.0.0.1:29400", "--nproc-per-node", nproc,
                 "--ft-active-world-size", aws)
    assert cfg.active_nodes == nodes and cfg.ft.active_world_size == aws


@pytest.mark.parametrize("nproc", ["cpu", "auto"])
def test_active_nodes_with_a_resolved_nproc_per_node(nproc):
    per_node = parse_nproc(nproc)
    cfg = cfg_of("--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", "--nproc-per-node", nproc,
                 "--ft-active-world-size", 2 * per_node)
    assert cfg.nproc_per_node == per_node and cfg.active_nodes == 2
    with pytest.raises(UsageError, match=f"needs 3 nodes of {per_node} rank"):
        cfg_of("--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", "--nproc-per-node", nproc,
               "--ft-active-world-size", 3 * per_node)


def test_active_world_size_from_the_yaml_gives_active_nodes(tmp_path):
    cfg = write(tmp_path, "inprocess_restart:\n  active_world_size: 4\n")
    assert cfg_of("--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--nproc-per-node", "2",
                  "--ft-cfg-path", cfg).active_nodes == 2


# ---- Megatron-Bridge's InProcessRestartConfig names -----------------------------------------------
MB_FILE = """
{section}:
  enabled: true
  granularity: node
  barrier_timeout: 3.5
  termination_grace_time: 2
  active_world_size: 1
  empty_cuda_cache: false
"""


@pytest.mark.parametrize("section", ["fault_tolerance", "inprocess_restart"])
def test_megatron_bridge_names_map_to_ours(tmp_path, section):
    ft = ft_of("--standalone", "--ft-cfg-path", write(tmp_path, MB_FILE.format(section=section)))
    assert (ft.restart_granularity, ft.inprocess_timeout, ft.rank_termination_grace, ft.active_world_size,
            ft.empty_cuda_cache) == ("node", 3.5, 2.0, 1, False)


def test_inprocess_restart_section_found_when_nested_like_fault_tolerance(tmp_path):
    cfg = write(tmp_path, "model:\n  inprocess_restart:\n    granularity: rank\n")
    assert ft_of("--standalone", "--ft-cfg-path", cfg).restart_granularity == "rank"


def test_our_names_win_over_megatron_bridge_names_in_the_same_file(tmp_path):
    cfg = write(tmp_path, """
inprocess_restart:
  granularity: rank
  barrier_timeout: 9
  active_world_size: 2
fault_tolerance:
  granularity: node              # a Megatron-Bridge name in fault_tolerance: wins over inprocess_restart:
  restart_granularity: job       # our own name wins over both
  termination_grace_time: 1
  rank_termination_grace: 0.5
  barrier_timeout: 8
  active_world_size: 1           # the same name: fault_tolerance: wins
""")
    ft = ft_of("--standalone", "--ft-cfg-path", cfg)
    assert (ft.restart_granularity, ft.rank_termination_grace, ft.inprocess_timeout, ft.active_world_size) == \
        ("job", 0.5, 8.0, 1)


@pytest.mark.parametrize("text,granularity", [
    ("inprocess_restart:\n  enabled: false\n", "job"),
    ("inprocess_restart:\n  enabled: false\n  granularity: rank\n", "job"),
    ("inprocess_restart:\n  enabled: true\n", "auto"),
    ("inprocess_restart:\n  enabled: false\nfault_tolerance:\n  restart_granularity: node\n", "node"),
    ("fault_tolerance:\n  enabled: false\n  restart_granularity: rank\n", "rank"),
    ("fault_tolerance:\n  enabled: 'no'\n", "job"),
], ids=["disabled", "disabled-beats-granularity", "enabled-changes-nothing", "explicit-ours-wins",
        "explicit-ours-wins-same-section", "no-string"])
def test_enabled(tmp_path, text, granularity):
    assert ft_of("--standalone", "--ft-cfg-path", write(tmp_path, text)).restart_granularity == granularity


def test_the_command_line_wins_over_enabled_false(tmp_path):
    cfg = write(tmp_path, "inprocess_restart:\n  enabled: false\n")
    assert ft_of("--standalone", "--ft-cfg-path", cfg, "--ft-restart-granularity", "rank").restart_granularity == "rank"


def test_one_warning_for_every_name_without_a_meaning():
    warnings = []
    mapping = megatron_bridge_aliases({"soft_timeout": 1, "granularity": "rank", "max_iterations": 3},
                                      {name: 1 for name in MB_IGNORED}, "f.yaml", warnings.append)
    assert mapping == {"restart_granularity": "rank"}
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("f.yaml: Megatron-Bridge inprocess_restart keys with no meaning here, ignored: "
                                  + ", ".join(sorted(MB_IGNORED)) + " (")
    assert "--ft-rank-section-timeouts" in warnings[0] and "--max-restarts" in warnings[0]
    warnings.clear()
    megatron_bridge_aliases({"granularity": "rank"}, {"enabled": True}, "f.yaml", warnings.append)
    assert warnings == []
    megatron_bridge_aliases({}, {"soft_timeout": 60, "hard_timeout": 90}, "ft.yaml", warnings.append)
    assert warnings == ["ft.yaml: Megatron-Bridge inprocess_restart keys with no meaning here, ignored: "
                        "hard_timeout, soft_timeout (hang detection uses the section and heartbeat timeouts, "
                        "e.g. --ft-rank-section-timeouts)"]   # docs/flags-and-configuration.md's example


def test_unknown_inprocess_restart_key_warns_or_raises_without_warn():
    warnings = []
    megatron_bridge_aliases({}, {"granulairty": "rank"}, "f.yaml", warnings.append)
    assert warnings == ["f.yaml: unknown inprocess_restart key 'granulairty' (did you mean 'granularity'?); ignored"]
    with pytest.raises(ConfigError, match="unknown inprocess_restart key 'granulairty'"):
        megatron_bridge_aliases({}, {"granulairty": "rank"}, "f.yaml")


def test_a_megatron_bridge_file_through_a_real_run(launcher, tmp_path):
    """The configuration a rank receives, the one warning line (printed once, to stderr), and no
    unknown-key warning for Megatron-Bridge's names."""
    cfg = write(tmp_path, """
trainer:
  fault_tolerance:
    rank_section_timeouts: {step: 30}
    soft_timeout: 60
inprocess_restart:
  enabled: true
  granularity: node
  barrier_timeout: 4
  hard_timeout: 90
  heartbeat_interval: 30
  active_world_size: 1
  empty_cuda_cache: false
  monitor_process_logdir: /tmp/x
""")
    res = launcher.run(["--standalone", "--ft-cfg-path", cfg, "--ft-inprocess-timeout", "2.5",
                        CFG_DUMP, tmp_path], timeout=90)
    assert res.returncode == 0, res.stderr
    got = json.loads((tmp_path / "cfg_0.json").read_text())
    assert {k: got[k] for k in ("restart_granularity", "inprocess_timeout", "active_world_size",
                                "empty_cuda_cache", "rank_section_timeouts")} == {
        "restart_granularity": "node", "inprocess_timeout": 2.5, "active_world_size": 1,
        "empty_cuda_cache": False, "rank_section_timeouts": {"step": 30.0}}
    warnings = [line for line in res.stderr.splitlines() if "warning" in line]
    assert warnings == [
        f"ft_launcher: warning: {cfg}: Megatron-Bridge inprocess_restart keys with no meaning here, ignored: "
        "hard_timeout, heartbeat_interval, monitor_process_logdir, soft_timeout "
        "(hang detection uses the section and heartbeat timeouts, e.g. --ft-rank-section-timeouts; "
        "logs go to --log-dir)"], res.stderr


def test_help_lists_the_new_flags(launcher):
    res = launcher.run(["--help"], timeout=60)
    assert res.returncode == 0, res.stderr
    for flag in ("--ft-restart-granularity", "--ft-inprocess-timeout", "--ft-active-world-size",
                 "--ft-empty-cuda-cache"):
        assert flag in res.stdout


# ---- bad input: one line, exit 2 -------------------------------------------------------------------
BAD = [
    (["--ft-restart-granularity", "rnak"], "restart_granularity must be one of auto, rank, node, job, got 'rnak' "
                                           "(did you mean 'rank'?)"),
    (["--ft-restart-granularity", "pod"], "restart_granularity must be one of auto, rank, node, job, got 'pod'"),
    (["--ft-inprocess-timeout", "0"], "inprocess_timeout must be a positive number"),
    (["--ft-inprocess-timeout", "-1"], "inprocess_timeout must be a non-negative number"),
    (["--ft-inprocess-timeout", "soon"], "inprocess_timeout must be a number"),
    (["--ft-active-world-size", "0"], "active_world_size must be a positive integer or null, got '0'"),
    (["--ft-active-world-size", "1.5"], "active_world_size must be a positive integer or null"),
    (["--ft-active-world-size", "many"], "active_world_size must be a positive integer or null"),
    (["--ft-empty-cuda-cache", "maybe"], "empty_cuda_cache must be true or false"),
    (["--ft-restart-granularty", "rank"], "did you mean --ft-restart-granularity?"),
    (["--ft-active-world-size", "3", "--nproc-per-node", "2"],
     "active_world_size 3 must be a multiple of --nproc-per-node (2 ranks per node)"),
    (["--ft-active-world-size", "4", "--nproc-per-node", "2"],
     "active_world_size 4 needs 2 nodes of 2 ranks, but the job has at most 1 node (--nnodes)"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_values_are_one_line_errors(launcher, tmp_path, args, message):
    one_line_error(launcher.run(["--standalone", *args, ENV_DUMP, tmp_path], timeout=60), message)


def test_too_many_active_nodes_with_a_node_range(launcher, tmp_path):
    res = launcher.run(["--nnodes", "1:2", "--rdzv-endpoint", "127.0.0.1:29400", "--nproc-per-node", "2",
                        "--ft-active-world-size", "6", ENV_DUMP, tmp_path], timeout=60)
    one_line_error(res, "active_world_size 6 needs 3 nodes of 2 ranks, but the job has at most 2 nodes")


BAD_FILES = [
    ("inprocess_restart:\n  granularity: pod\n", "inprocess_restart.granularity must be one of auto, rank, node, job"),
    ("fault_tolerance:\n  barrier_timeout: 0\n", "fault_tolerance.barrier_timeout must be a positive number"),
    ("inprocess_restart:\n  termination_grace_time: -1\n", "inprocess_restart.termination_grace_time must be a non-negative"),
    ("inprocess_restart:\n  active_world_size: 0\n", "inprocess_restart.active_world_size must be a positive integer"),
    ("inprocess_restart:\n  enabled: sometimes\n", "inprocess_restart.enabled must be true or false"),
    ("inprocess_restart: [1]\n", "'inprocess_restart:' must be a mapping"),
    ("fault_tolerance:\n  restart_granularity: Rank\n", "restart_granularity must be one of auto, rank, node, job, "
                                                       "got 'Rank' (did you mean 'rank'?)"),
    ("model:\n  x: 1\n", "no 'fault_tolerance:' section found (nor 'inprocess_restart:')"),
]


@pytest.mark.parametrize("text,message", BAD_FILES, ids=[m.split(" must")[0] for _, m in BAD_FILES])
def test_bad_yaml_values_are_one_line_errors_naming_the_key(launcher, tmp_path, text, message):
    res = launcher.run(["--standalone", "--ft-cfg-path", write(tmp_path, text), ENV_DUMP, tmp_path], timeout=60)
    one_line_error(res, message)
