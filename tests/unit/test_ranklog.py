"""What the terminal shows of a train job's lines (pipeline/ranklog.py), with a real LogSink
writing the local log files: a job that succeeds shows every line, in order and without
torchrun's rank prefix; once a worker fails, the lines not shown yet go to the files only and
the report has that rank's own last lines."""

from __future__ import annotations

import io
import time
from pathlib import Path

from cloudtrain.context import Env
from cloudtrain.pipeline.ranklog import RankSink, message
from cloudtrain.pipeline.remote_job import LogSink
from cloudtrain.state import State
from cloudtrain.ui import UI


def _sink(tmp_path: Path, verbose: bool = False, hold: float = 0.3,
          start: float = 0.3) -> tuple[RankSink, io.StringIO]:
    out = io.StringIO()
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = Env(home=home, state=State(home / "state.db"), ui=UI(out=out, err=io.StringIO()))
    inner = LogSink(env, tmp_path / "logs", "", echo=True)
    return RankSink(inner, verbose=verbose, hold=hold, start=start), out


def test_success_shows_every_line_in_order_without_prefix(tmp_path: Path) -> None:
    sink, out = _sink(tmp_path)
    sink(0, "[ct-rank 0 0] rank 0/4 ok")
    sink(1, "[ct-rank 2 0] rank 2/4 ok")
    sink(0, "torchrun's own line")
    sink.close()
    assert out.getvalue().splitlines() == ["(node-0) rank 0/4 ok", "(node-1) rank 2/4 ok",
                                           "(node-0) torchrun's own line"]
    assert (tmp_path / "logs" / "node-1.log").read_text() == "rank 2/4 ok\n"


def test_a_failed_worker_silences_the_other_ranks_echoes(tmp_path: Path) -> None:
    sink, out = _sink(tmp_path)
    sink(0, "[ct-rank 0 0] started")
    time.sleep(0.8)   # shown: older than the hold
    for node, rank in ((1, 2), (0, 0), (1, 3)):
        sink(node, f"[ct-rank {rank} {rank % 2}] usage: train.py [-h]")
        sink(node, f"[ct-rank {rank} {rank % 2}] train.py: error: unrecognized arguments: --x")
    sink(1, "[ct-rank 2 0] ::ctworker exit 2")
    sink(1, "Traceback (most recent call last):")
    sink.close()
    assert out.getvalue().splitlines() == ["(node-0) started"]
    assert "Traceback" in (tmp_path / "logs" / "node-1.log").read_text()
    failed = sink.failure(0, 0, 1)   # the first marker wins over what the node recorded later
    assert (failed.node, failed.rank, failed.local_rank, failed.code) == (1, 2, 0, 2)
    assert failed.last == ("usage: train.py [-h]", "train.py: error: unrecognized arguments: --x")
    assert message(failed).splitlines() == [
        "The job failed: rank 2 (node 1, local rank 0) exited with code 2; the other ranks were "
        "stopped. Its last lines:",
        "  | usage: train.py [-h]",
        "  | train.py: error: unrecognized arguments: --x"]


def test_verbose_shows_everything_at_once(tmp_path: Path) -> None:
    sink, out = _sink(tmp_path, verbose=True, hold=60, start=60)
    sink(1, "[ct-rank 2 0] usage")
    sink(1, "[ct-rank 2 0] ::ctworker exit 2")
    sink(1, "Traceback (most recent call last):")
    assert out.getvalue().splitlines() == ["(node-1) usage",
                                           "(node-1) Traceback (most recent call last):"]
    sink.close()


def test_a_node_that_fails_without_a_marker_silences_too(tmp_path: Path) -> None:
    sink, out = _sink(tmp_path, hold=60, start=60)
    sink(0, "line held")
    assert sink.fail(0) is None   # no worker said who: the caller names the node
    sink.close()
    assert out.getvalue() == ""


def test_a_job_the_user_stops_shows_what_its_ranks_say_while_they_stop(tmp_path: Path) -> None:
    """Ctrl-C (or the budget) stops the workers with SIGTERM: each one exits non-zero after
    writing and uploading its checkpoint. That is not a failure to hide: the held lines and
    every later one reach the terminal, in order."""
    sink, out = _sink(tmp_path, hold=30, start=30)
    sink(0, "[ct-rank 0 0] step 8/1000")
    sink.stopped()
    assert out.getvalue().splitlines() == ["(node-0) step 8/1000"]    # not 30 s later
    sink(0, "[ct-rank 0 0] [store] Uploaded checkpoint step-000008")
    sink(0, "[ct-rank 0 0] ::ctworker exit 143")
    sink(1, "[ct-rank 1 0] stopped at step 8")
    sink.close()
    assert out.getvalue().splitlines() == [
        "(node-0) step 8/1000", "(node-0) [store] Uploaded checkpoint step-000008",
        "(node-1) stopped at step 8"]
