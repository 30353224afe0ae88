"""The plain progress lines (stderr not a terminal): a short task still says it finished."""

from __future__ import annotations

import pytest

from moefleet.cli.common import PlainProgress


def test_a_short_task_prints_its_start_and_its_end_once(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    with PlainProgress(every_s=60.0) as bar:
        task = bar.add_task("building x", total=3)
        for _ in range(3):
            bar.advance(task)
        bar.update(task, completed=3)  # already reported as finished: no second line
    lines = capsys.readouterr().err.splitlines()
    assert [ln.split(" (")[0] for ln in lines] == ["building x: 0/3", "building x: 3/3"]
