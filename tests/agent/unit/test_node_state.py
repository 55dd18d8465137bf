"""The node's state diagram (agent/node_state.py): the changes the agent makes, and what an
unexpected one does (one warning line; under FT_LAUNCHER_STRICT_STATES=1, as in these tests'
agents, an error). No process: the diagram alone; every real-job test runs the agent strict."""
import pytest

from ft_launcher.agent.node_state import ENV_STRICT, NodeLife, NodeState as S, UnexpectedStateChange


def test_the_walks_an_agent_makes():
    for walk in (
        [S.JOINING, S.RUNNING, S.RESTARTING, S.JOINING, S.RUNNING, S.STOPPING, S.FINISHED],  # a kill, then done
        [S.JOINING, S.SPARE, S.RESTARTING, S.JOINING, S.RUNNING, S.STOPPING, S.FINISHED],    # a spare takes over
        [S.JOINING, S.RUNNING, S.RESTARTING, S.STOPPING, S.FINISHED],                         # excluded at the restart
        [S.JOINING, S.RESTARTING, S.JOINING, S.RUNNING, S.FINISHED],                          # store lost while joining; a crash
        [S.STOPPING, S.FINISHED],                                                             # a signal before any round
    ):
        seen, life = [], NodeLife(lambda line: pytest.fail(line))
        life.listeners.append(seen.append)
        for state in walk:
            life.to(state, "test")
            life.to(state, "again")   # staying is no change
        assert seen == walk and [h[1] for h in life.history] == ["starting"] + [s.value for s in walk]


def test_an_unexpected_change_is_one_warning_or_under_strict_an_error(monkeypatch):
    said = []
    monkeypatch.delenv(ENV_STRICT, raising=False)
    life = NodeLife(said.append)
    life.to(S.RUNNING, "cycle 0")   # never joined
    assert life.state == S.RUNNING
    assert said == ["warning: internal: node state starting -> running is not one the agent makes (cycle 0)"]
    monkeypatch.setenv(ENV_STRICT, "1")
    life = NodeLife(said.append)
    life.to(S.STOPPING)
    with pytest.raises(UnexpectedStateChange, match="stopping -> joining"):
        life.to(S.JOINING, "round 1")
