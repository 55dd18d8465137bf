"""ft_launcher.flag_checks (flags that are each well-formed but do not fit together) and
ft_launcher.flag_values' parsers that the docs' commands do not reach."""
import pytest

from ft_launcher.flag_checks import check_restart_timings, training_nodes
from ft_launcher.flag_values import check_metrics_port, parse_ranks_filter
from ft_launcher.flags import UsageError, build_parser
from ft_launcher.rank_monitor.config import FaultToleranceConfig


def args(*flags):
    return build_parser().parse_args([*flags, "train.py"])


def test_restart_timings_are_not_negative_and_the_polling_period_is_positive():
    check_restart_timings(args("--max-restarts", "0", "--term-timeout", "0", "--monitor-interval", "0.01"))
    for flags, line in ((("--max-restarts", "-1"), "--max-restarts must not be negative, got -1"),
                        (("--term-timeout", "-2.5"), "--term-timeout must not be negative, got -2.5"),
                        (("--workers-stop-timeout", "-1"), "--workers-stop-timeout must not be negative, got -1"),
                        (("--monitor-interval", "0"), "--monitor-interval must be positive, got 0")):
        with pytest.raises(UsageError) as raised:
            check_restart_timings(args(*flags))
        assert str(raised.value) == line


def test_training_nodes_are_whole_nodes_and_whole_segments():
    assert training_nodes(FaultToleranceConfig(), nproc=2, min_nodes=2, max_nodes=4) is None
    assert training_nodes(FaultToleranceConfig(active_world_size=4), nproc=2, min_nodes=3, max_nodes=4) == 2
    assert training_nodes(FaultToleranceConfig(active_world_size=4, segment=2), nproc=2, min_nodes=3, max_nodes=4) == 2
    with pytest.raises(UsageError, match=r"^active_world_size 3 must be a multiple of --nproc-per-node \(2 ranks"):
        training_nodes(FaultToleranceConfig(active_world_size=3), nproc=2, min_nodes=1, max_nodes=4)
    with pytest.raises(UsageError, match=r"^active_world_size 10 needs 5 nodes of 2 ranks, but the job has at most "
                                         r"4 nodes \(--nnodes\)$"):
        training_nodes(FaultToleranceConfig(active_world_size=10), nproc=2, min_nodes=1, max_nodes=4)
    with pytest.raises(UsageError, match=r"^--ft-segment 2: the 3 training node\(s\) \(MIN of --nnodes\) must be a "
                                         r"multiple of it"):
        training_nodes(FaultToleranceConfig(segment=2), nproc=8, min_nodes=3, max_nodes=4)


def test_ranks_filter_and_metrics_port():
    assert parse_ranks_filter("") is None
    assert parse_ranks_filter("0, 2,") == {0, 2}
    with pytest.raises(UsageError, match=r"^--local-ranks-filter: expected e.g. 0,1, got 'a,b'$"):
        parse_ranks_filter("a,b")
    check_metrics_port(None)
    check_metrics_port(9400)
    for port in (0, 65536):
        with pytest.raises(UsageError, match=f"^--metrics-port: expected a port 1-65535, got {port}$"):
            check_metrics_port(port)
