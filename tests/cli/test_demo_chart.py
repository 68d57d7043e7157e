"""The demo chart marks what good looks like (issue 30): the reward's best and worst values and why it
starts below 0, and the KL where its penalty costs one vowel and where it costs a missing EOS."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from rapidfire_hf.cli.main import main
from rapidfire_hf.demo.chart import chart_marks


def test_marks_follow_the_reward_definition_and_kl_coef():
    marks = chart_marks(kl_coef=0.05, missing_eos_penalty=0.5, target=8)
    assert [m.y for m in marks["objective/scores"]] == [1.0, 0.0, -0.5]
    assert "best possible" in marks["objective/scores"][0].label
    assert "miss EOS" in marks["objective/scores"][1].label  # why the curve starts below 0
    # kl_coef x KL = 1/8 (one vowel) at KL 2.5; = 0.5 (a missing EOS) at KL 10
    assert [m.y for m in marks["objective/kl"]] == pytest.approx([2.5, 10.0])
    assert chart_marks(kl_coef=0.0, missing_eos_penalty=None)["objective/kl"] == []


@pytest.fixture()
def saved_figures(monkeypatch):
    """The figures saved while the test runs, as {panel title: [(y of each dashed line, label)]}."""
    panels: dict[str, list[tuple[float, str]]] = {}
    savefig = Figure.savefig

    def record(fig, *args, **kwargs):
        for ax in fig.axes:
            lines = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
            panels[ax.get_title()] = [(ln.get_ydata()[0], ln.get_label()) for ln in lines]
            panels[ax.get_title() + " ylim"] = [(ax.get_ylim()[1], "top")]
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return panels


@pytest.mark.usefixtures("single_thread")
def test_the_demo_draws_the_marks_on_its_chart(tmp_path, saved_figures):
    argv = ["demo", "--steps", "1", "--batch-size", "4", "--response-length", "4", "--cpu"]
    assert main([*argv, "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "demo_curves.png").is_file()
    expected = chart_marks(kl_coef=0.05, missing_eos_penalty=0.5)
    reward = saved_figures["reward"]
    assert [(m.y, m.label) for m in expected["objective/scores"]] == reward
    assert saved_figures["reward ylim"][0][0] >= 1.0  # the best possible reward is in view
    assert [(m.y, m.label) for m in expected["objective/kl"]] == saved_figures["KL (nats per response)"]
