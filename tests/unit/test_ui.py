from __future__ import annotations

import io

import pytest

from cloudtrain.ui import UI


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_node_lines_are_coloured_only_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    tty, pipe = FakeTTY(), io.StringIO()
    UI(out=tty, err=FakeTTY()).node_line(1, "hello")
    UI(out=pipe, err=io.StringIO()).node_line(1, "hello")
    assert "\x1b[" in tty.getvalue() and "hello" in tty.getvalue()
    assert pipe.getvalue() == "(node-1) hello\n"


def test_no_color_wins_over_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    out, err = FakeTTY(), FakeTTY()
    ui = UI(out=out, err=err)
    ui.node_line(0, "x")
    ui.ok("done")
    ui.error("bad [thing]")
    assert "\x1b" not in out.getvalue() + err.getvalue()
    assert "bad [thing]" in err.getvalue()  # markup-looking text is printed as is
