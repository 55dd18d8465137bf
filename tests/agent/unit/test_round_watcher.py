"""The round watcher's loop (agent/rounds/round_watcher.py): one thread that every watcher of an
agent runs on. An error a handler did not expect is said in one line (once per kind) and the
loop goes on: a loop thread that died left its agent deaf to a lost store (CI: an agent at the
head of the order whose extra store connection could not be made in time never learned that the
store host had been killed, and waited for its rank). Real thread, no store."""
import threading

from ft_launcher.agent.rounds.round_watcher import WatchLoop


def test_an_unexpected_error_in_a_handler_is_said_once_and_the_loop_goes_on(capfd):
    loop = WatchLoop(name="ft-round-watcher-test")
    loop.start()
    try:
        done = threading.Event()

        def broken():
            raise ValueError("a bug in a handler")
        for _ in range(3):
            loop.call(broken)
        loop.call(done.set)
        assert done.wait(5) and loop.thread.is_alive()
    finally:
        loop.stop()
        loop.thread.join(5)
    assert not loop.thread.is_alive()
    err = capfd.readouterr().err
    assert err.count("the round watcher hit an unexpected error and goes on watching: ValueError: a bug in a "
                     "handler") == 1, err
    assert "Traceback" not in err
